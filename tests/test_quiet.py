"""Quiet when idle: what a peer puts on the wire between syncs.

* Background reads of the progress records come from the node's own DHT storage when it is one of
  the key's nearest nodes (no network call), and a client's (``status``) reads still find every
  record; an expired record leaves the local view.
* On the emulated WAN, with no sync due, each peer sends and receives no more per progress period
  than one signed record to (and from) each other DHT node with its answer: a byte count over a
  window of many periods against what the configured period allows, not a timing. The hivemind
  store this replaced moved 3-5x that (every store downloaded every peer's record from every node).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from p2pdiloco.swarm.formation import draw
from p2pdiloco.swarm.keys import ready_key
from p2pdiloco.swarm.node import SwarmNode
from p2pdiloco.swarm.swarm import HISTORY_PERIODS, Swarm

LOOP = ["/ip4/127.0.0.1/tcp/0"]
_runs = iter(range(10**6))


@pytest.fixture
def nodes():
    first = SwarmNode([], host_maddrs=LOOP)
    ns = [first]
    try:
        for _ in range(3):
            ns.append(SwarmNode(first.visible_maddrs(), host_maddrs=LOOP))
        ns.append(SwarmNode(first.visible_maddrs(), host_maddrs=LOOP, client_mode=True))  # like `status`
        yield ns
    finally:
        for n in ns:
            n.shutdown()


@pytest.mark.timeout(120)
def test_background_reads_are_local_and_complete(nodes):
    boot, peers, client = nodes[0], nodes[1:4], nodes[4]
    run = f"quiet{next(_runs)}"
    key = f"{run}:progress"
    swarms = [Swarm(n, run, matchmaking_timeout=2, allreduce_timeout=5, progress_period=1.0) for n in peers]
    for i, s in enumerate(swarms):
        s.check_fingerprint("fp", {"a": 1})
        s.update_progress(step=10 + i)
        s.publish_progress(wait=True)
    want = {n.peer_id_str: 10 + i for i, n in enumerate(peers)}

    def no_network(*args, **kwargs):
        raise AssertionError("a background read of a node holding the key went to the network")

    for n in [boot, *peers]:  # 5 DHT nodes, 5 replicas: every full node holds the key
        get, n.dht.get = n.dht.get, no_network
        try:
            seen = n.read_near(key)
        finally:
            n.dht.get = get
        assert {p: v["step"] for p, v in seen.items()} == want, seen
    # a DHT client holds nothing: it reads over the network, and so does hivemind's full read (status)
    assert client.read_near(key, network=False) is None
    assert {p: v["step"] for p, v in client.read_near(key).items()} == want
    assert {p: v["step"] for p, v in client.get_subkeys(key).items()} == want
    # a newer record replaces the older one everywhere; the goodbye is seen by everyone
    swarms[0].update_progress(step=99)
    swarms[0].publish_progress(wait=True)
    assert peers[2].read_near(key)[peers[0].peer_id_str]["step"] == 99
    swarms[1].shutdown()
    assert peers[2].read_near(key)[peers[1].peer_id_str].get("gone") is True
    # an expired record leaves the local view (the reader's own memory of it too: RecordBook)
    other = f"{run}:short:progress"
    assert peers[0].store_near(other, {"step": 1}, ttl=1.5) >= 4  # us and the other 4 full nodes
    assert peers[1].peer_id_str not in peers[1].read_near(other) and peers[0].peer_id_str in peers[1].read_near(other)
    time.sleep(2.0)
    assert peers[1].read_near(other) == {}


@pytest.mark.timeout(120)
def test_the_history_is_a_record_of_its_own(nodes):
    """Recent losses and failed rounds go to ``<run>:history``, stored when they change and not before
    it would expire; the progress record, which matchmaking reads at every poll, stays without them."""
    from p2pdiloco.swarm.keys import history_key

    peers, client = nodes[1:4], nodes[4]
    run = f"quiethist{next(_runs)}"
    swarm = Swarm(peers[0], run, matchmaking_timeout=2, allreduce_timeout=5, progress_period=1.0)
    swarm.check_fingerprint("fp", {"a": 1})
    assert not swarm.publish_history()  # nothing to say yet
    for step in range(20):
        swarm.note_val_loss(step, 5.0 - step / 10)
    swarm.note_failure(19, 2, "owner left")
    swarm.update_progress(step=200, val_loss=3.1)
    swarm.publish_progress(wait=True)
    assert swarm.publish_history()
    assert not swarm.publish_history()  # unchanged and fresh: not stored again
    deadline = time.time() + 10
    while not (hist := client.get_subkeys(history_key(run))) and time.time() < deadline:
        time.sleep(0.2)
    mine = hist[peers[0].peer_id_str]
    assert mine["vr"] == list(range(4, 20)) and mine["fw"] == ["owner left"] and mine["ff"] == [2]
    progress = client.get_subkeys(f"{run}:progress")[peers[0].peer_id_str]
    assert progress["step"] == 200 and not {"vr", "vl", "fr", "ff", "ft", "fw"} & set(progress), progress
    swarm.note_val_loss(20, 2.9)  # a new loss waits HISTORY_PERIODS progress periods after the last store
    assert not swarm.publish_history()
    swarm._history_stored -= (HISTORY_PERIODS - 0.5) * swarm.progress_period
    assert not swarm.publish_history()
    swarm._history_stored -= 0.5 * swarm.progress_period
    assert swarm.publish_history()
    swarm.note_failure(21, 1, "owner left")  # a failed round goes out at the next publish
    assert swarm.publish_history()
    assert not swarm.publish_history()
    swarm._history_stored -= swarm.history_lifetime / 2  # half its lifetime later: stored again
    assert swarm.publish_history()
    swarm.shutdown()


@pytest.mark.timeout(120)
def test_a_peer_waiting_for_its_group_backs_off_its_polls(nodes):
    """A peer waiting for a late one polls the round's records less and less often (each poll asks
    several nodes for every signed record of the round: at a steady 0.1 s that was ~100 KB per sync
    and peer in bench.run's "long" matrix), and the group still forms with everyone once the late
    peer comes: its join request wakes the leader at once."""
    import threading

    from p2pdiloco.swarm.matchmaking import Matchmaker

    peers = nodes[1:4]
    run = f"quietmm{next(_runs)}"
    mms = [Matchmaker(n, run, matchmaking_timeout=30) for n in peers]
    reads = {n.peer_id_str: 0 for n in peers}
    lock = threading.Lock()
    saved = []
    for n in peers:
        def counting_get(*a, _get=n.dht.get, _pid=n.peer_id_str, **k):
            with lock:
                reads[_pid] += 1
            return _get(*a, **k)

        saved.append((n, n.dht.get))
        n.dht.get = counting_get
    late = 4.0
    try:
        futs = [n.submit(m.form_group(0, 1, 3)) for n, m in zip(peers[:2], mms[:2])]
        time.sleep(late)  # the first two wait for the third meanwhile
        with lock:
            waiting = [reads[n.peer_id_str] for n in peers[:2]]
        futs.append(peers[2].submit(mms[2].form_group(0, 1, 3)))
        groups = [f.result(60) for f in futs]
    finally:
        for n, get in saved:
            n.dht.get = get
    assert len({g.members for g in groups}) == 1 and len(groups[0].members) == 3, groups
    # two reads per poll (ready and group records) and one on entering. Polling every 0.1 s (and a round
    # trip of a few ms here), each waiting peer read ~70 times in these 4 s; backing off (0.1, 0.2, 0.4,
    # then every POLL_MAX_S = 0.8 s) about 17 times
    print(f"\nnetwork reads of each of the two waiting peers in {late:.0f} s: {waiting}")
    assert all(2 <= w <= 24 for w in waiting), waiting


# ---- on the emulated WAN ------------------------------------------------------------------------------
_missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
needs_root = pytest.mark.skipif(os.geteuid() != 0 or bool(_missing),
                                reason="the emulated WAN needs root and iproute2 (ip, tc)")

#: a peer (or, with no initial peer, the bootstrap node) in its namespace: prints "up" (or its address)
_PEER = r"""
import sys, time
from p2pdiloco.swarm.formation import draw
from p2pdiloco.swarm.keys import ready_key
from p2pdiloco.swarm.node import SwarmNode
from p2pdiloco.swarm.swarm import Swarm
addr, maddr, run, period = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
node = SwarmNode([maddr] if maddr != "-" else [], host_maddrs=[f"/ip4/{addr}/tcp/0"], reachability="public")
if maddr == "-":
    print(node.visible_maddrs()[0], flush=True)
    time.sleep(3600)
swarm = Swarm(node, run, matchmaking_timeout=5, allreduce_timeout=5, progress_period=period)
swarm.check_fingerprint("fp", {"model.n_layers": 2, "inner.sync_every": 50})
step = 0
# a record of the usual size: counters, speeds, losses, digest (the history is a record of its own)
fields = dict(round=7, next_sync=10**6, synced_step=350, sent=123456789, recv=123456789, sps=1.2345678,
              rate=9.8765432, share=0.25, loss=3.2123456, val_loss=3.2512345, last_sync=time.time(),
              digest="ccee96861844e352", gid="0123456789abcdef")
swarm.update_progress(step=step, samples=0, **fields)
swarm.publish_progress(wait=True)
swarm.start_publishing()
print("up", flush=True)
while True:
    time.sleep(0.2)
    step += 1
    swarm.update_progress(step=step, samples=8 * step)
"""


def _iface(pid: int) -> tuple:
    """(sent, received) bytes of eth0 in the namespace of process ``pid``."""
    with open(f"/proc/{pid}/net/dev") as f:
        for line in f.readlines()[2:]:
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                fields = rest.split()
                return int(fields[8]), int(fields[0])
    raise AssertionError("no eth0")


@needs_root
@pytest.mark.netem
@pytest.mark.timeout(180)
def test_idle_bytes_per_period_on_the_wire():
    from p2pdiloco.bench.wan import EmulatedWAN, LinkSpec

    peers, period, periods = 3, 1.0, 15
    nodes = peers + 1  # the bootstrap node is a DHT node (a replica) too
    run = f"quietwan{os.getpid()}"
    env = dict(os.environ, PYTHONUNBUFFERED="1", HIVEMIND_LOGLEVEL="WARNING")
    with EmulatedWAN(nodes, LinkSpec(rate_mbit=100)) as wan:
        boot = wan.hosts[peers].popen([sys.executable, "-c", _PEER, wan.hosts[peers].address, "-", run, "0"],
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        maddr = boot.stdout.readline().strip()
        assert "/p2p/" in maddr, "the bootstrap node did not start"
        procs = [wan.hosts[i].popen([sys.executable, "-c", _PEER, wan.hosts[i].address, maddr, run, str(period)],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
                 for i in range(peers)]
        for p in procs:
            assert p.stdout.readline().strip() == "up", "a peer did not start"
        anchors = [h.popen(["sleep", "600"]) for h in wan.hosts]
        time.sleep(3 * period)  # past the first publications and reads
        before = [_iface(a.pid) for a in anchors]
        t0 = time.monotonic()
        time.sleep(periods * period)
        after = [_iface(a.pid) for a in anchors]
        n_periods = (time.monotonic() - t0) / period
        assert all(p.poll() is None for p in procs)
    sent = [after[i][0] - before[i][0] for i in range(peers)]
    recv = [after[i][1] - before[i][1] for i in range(peers)]
    # Per period a peer stores one signed record (~1.2 KB: the owner's public key, the signature, the
    # fields) on each other DHT node and answers each other peer's store: ~1.9 KB sent per store and
    # ~0.8 KB per answer on the wire (libp2p stream, TCP). Allowed: 3.5 KB per other node each way.
    allowed = (n_periods + 1) * (nodes - 1) * 3500
    assert max(sent) <= allowed and max(recv) <= allowed, (sent, recv, allowed)
    # and something was published: at least a store to each other node per period
    assert min(sent) >= (n_periods - 1) * (nodes - 1) * 1000, (sent, n_periods)


@pytest.mark.timeout(120)
def test_a_waiting_formation_rereads_the_live_peers_less_often_while_nothing_changes(nodes):
    """While a formation waits for a peer that does not come, each re-read of the live peers' progress
    records (every record, from several nodes: the control traffic that grows with the swarm) comes
    twice as long after the last, up to REEVAL_MAX_S; a read that changes whom we wait for (a joiner
    appears) brings the next one back to reevaluate_period."""
    peers = nodes[1:4]
    run = f"quiet{next(_runs)}"
    swarms = [Swarm(n, run, matchmaking_timeout=7, allreduce_timeout=5, progress_period=1.0) for n in peers]
    # we draw first in the round, so we are the presumable leader and poll ourselves (a peer that asked a
    # presumable leader reads nothing while it holds the request)
    me, due, joiner = sorted(swarms, key=lambda s: draw(ready_key(run, 0, 0), s.peer_id))
    for s in (me, due):  # B is due at step 40 but never gets ready
        s.check_fingerprint("fp", {"a": 1})
        s.update_progress(step=30, next_sync=40, synced_step=0)
        s.publish_progress(wait=True)
    mm = me.matchmaker
    period = mm.reevaluate_period
    evaluations = []  # (is the joiner waited for, the pause to the next re-read)
    evaluate = mm._evaluate

    def recorded(a, read):
        evaluate(a, read)
        evaluations.append((joiner.peer_id in a.waiting_for, a.reeval_gap))
        if len(evaluations) == 3:  # C announces itself, due at the same step: a joiner to wait for
            joiner.check_fingerprint("fp", {"a": 1})
            joiner.update_progress(step=30, next_sync=40, synced_step=0)
            joiner.publish_progress()

    mm._evaluate = recorded

    async def wait_alone():
        a = await mm._enter(0, 0, 3, 40)
        try:
            return await mm._poll(a)
        finally:
            a.hang_up()

    assert me.node.call(wait_alone(), timeout=60) is None  # nobody came: the poll ran to its deadline
    seen = [i for i, (waited, _) in enumerate(evaluations) if waited]
    assert seen, f"the joiner's record never showed: {evaluations}"
    first = seen[0]
    gaps = [g for _, g in evaluations]
    assert gaps[:3] == [period, 2 * period, min(4 * period, quiet_cap(period))], evaluations
    assert gaps[first] == period and first >= 3, evaluations  # the read that saw the joiner
    for i in range(1, len(gaps)):
        if i != first:
            assert gaps[i] == min(2 * gaps[i - 1], quiet_cap(period)), evaluations
    # 7 s of waiting: about 6 re-reads instead of 14 at a steady reevaluate_period
    assert len(evaluations) <= 8, evaluations


def quiet_cap(period):
    from p2pdiloco.swarm.matchmaking import REEVAL_MAX_S
    return max(REEVAL_MAX_S, period)


@pytest.mark.timeout(120)
def test_the_periodic_store_is_left_out_while_syncs_keep_the_record_fresh(nodes):
    """A sync stores our progress record (as its formation starts and when its result lands); the periodic
    publisher stores it only when no store went out in the last half period, so frequent syncs do not add
    a store per period on top of theirs, and it stores every period again once they stop."""
    from p2pdiloco.swarm.keys import progress_key

    peer = nodes[1]
    run = f"quietskip{next(_runs)}"
    # a 2 s period: a sync's store every 0.25 s stays 0.75 s inside the half period on a loaded machine
    swarm = Swarm(peer, run, matchmaking_timeout=2, allreduce_timeout=5, progress_period=2.0)
    swarm.check_fingerprint("fp", {"a": 1})
    stores = []
    store = peer.astore_near

    async def counting(key, value, ttl):
        if key == progress_key(run):
            stores.append(value["step"])
        return await store(key, value, ttl)

    peer.astore_near = counting
    try:
        swarm.start_publishing()
        for step in range(32):  # a sync's store every 0.25 s for 8 s: 4 periods
            swarm.update_progress(step=step)
            swarm.publish_progress()
            time.sleep(0.25)
        assert stores == list(range(32)), stores  # each of ours, nothing periodic in between
        time.sleep(6.6)  # no sync: the periodic publisher stores the record every period again
        assert stores[32:] and len(stores[32:]) >= 2 and set(stores[32:]) == {31}, stores
    finally:
        peer.astore_near = store
        swarm.shutdown()
