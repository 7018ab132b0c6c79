"""The group protocol under every asyncio this package supports (Python 3.11 to 3.13).

Python 3.12 rewrote ``asyncio.wait_for`` on ``asyncio.timeout``: the awaited coroutine now runs in the
calling task at once instead of in a new task one scheduling step later. Code that cancels a task
reading a stream and reads the stream itself right after worked on 3.11 only by that step: on 3.12 the
read raises "readexactly() called while another coroutine is already waiting". The join handler did
exactly this before the link check: on 3.12 every joiner would fail its leader's link check and every
group with a joiner would fall apart. Here the 3.12 ``wait_for`` runs on whatever Python runs the tests,
and groups must still form whole.

And on every version the loop holds its tasks only weakly: a coroutine submitted to the network thread
and left to run (a record's store) that awaits a future nothing else holds must not be collected.
"""
from __future__ import annotations

import asyncio
import gc
import sys
import threading
import types
import weakref

import pytest

from p2pdiloco.swarm.matchmaking import Matchmaker
from p2pdiloco.swarm.node import SwarmNode

LOOP = ["/ip4/127.0.0.1/tcp/0"]


@pytest.fixture
def wait_for_312(monkeypatch):
    """``asyncio.wait_for`` as Python >= 3.12 has it (the awaited coroutine runs in the calling task);
    counts its calls so the test can show the code under test went through it."""
    calls = {"n": 0}
    if sys.version_info >= (3, 12):
        real = asyncio.wait_for

        async def counted(fut, timeout):
            calls["n"] += 1
            return await real(fut, timeout)
    else:
        async def counted(fut, timeout):
            calls["n"] += 1
            if timeout is not None and timeout <= 0:
                fut = asyncio.ensure_future(fut)
                if fut.done():
                    return fut.result()
                fut.cancel()
                raise asyncio.TimeoutError()
            async with asyncio.timeout(timeout):
                return await fut
    monkeypatch.setattr(asyncio, "wait_for", counted)
    return calls


@pytest.mark.timeout(120)
def test_groups_form_whole_with_python_312s_wait_for(wait_for_312):
    first = SwarmNode([], host_maddrs=LOOP)
    nodes = [first] + [SwarmNode(first.visible_maddrs(), host_maddrs=LOOP) for _ in range(2)]
    try:
        mms = [Matchmaker(n, "py312", matchmaking_timeout=20) for n in nodes]
        for rnd in (1, 2):  # two rounds: the second one on links the first one warmed
            before = wait_for_312["n"]
            futs = [n.submit(m.form_group(0, rnd, 3)) for n, m in zip(nodes, mms)]
            groups = [f.result(60) for f in futs]
            assert len({(g.gid, g.members) for g in groups}) == 1, groups
            assert sorted(groups[0].members) == sorted(n.peer_id_str for n in nodes), groups[0].members
            assert wait_for_312["n"] > before  # the link check went through the 3.12 wait_for
    finally:
        for n in nodes:
            n.shutdown()


def _orphan_waiter(refs, done):
    """A coroutine awaiting a future that only it holds (as one awaiting hivemind's MPFuture does)."""
    async def waits():
        fut = asyncio.get_running_loop().create_future()
        refs.append(weakref.ref(fut))
        done.append(await fut)
    return waits()


def test_a_submitted_coroutine_survives_a_garbage_collection_while_it_waits():
    """The event loop holds its tasks weakly: a fire-and-forget task waiting on a future nothing else
    references is garbage with it. SwarmNode.submit holds its tasks until done, so such a coroutine
    still finishes."""
    loop = asyncio.new_event_loop()
    reports = []  # the loop's reports of destroyed tasks (messages only: a reference would keep the task)
    loop.set_exception_handler(lambda _loop, context: reports.append(context["message"]))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def settle():
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(5)

    try:
        # not held, its concurrent future dropped (as a fire-and-forget store's): destroyed while pending
        lost, lost_done = [], []
        asyncio.run_coroutine_threadsafe(_orphan_waiter(lost, lost_done), loop)
        settle()
        gc.collect()
        settle()
        assert reports == ["Task was destroyed but it is pending!"] and len(lost) == 1 and lost[0]() is None

        # through SwarmNode.submit, its concurrent future dropped too: held, so the result arrives
        node = types.SimpleNamespace(loop=loop, _tasks=set())
        kept, kept_done = [], []
        SwarmNode.submit(node, _orphan_waiter(kept, kept_done))
        settle()
        gc.collect()
        settle()
        assert len(reports) == 1 and len(kept) == 1 and kept[0]() is not None and len(node._tasks) == 1
        loop.call_soon_threadsafe(lambda: kept[0]().set_result(7))
        settle()
        settle()
        assert kept_done == [7] and not node._tasks and len(reports) == 1  # finished, then released
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
