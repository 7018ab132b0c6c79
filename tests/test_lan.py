"""Two volunteers on one LAN, following the README as written, train together.

Three network namespaces on one bridge, no NAT anywhere: a bootstrap peer started as bootstrap/README.md
says (``--host-maddrs /ip4/0.0.0.0/tcp/31337``) and two volunteers running the README's ``join`` line
(``--initial-peers <the bootstrap's address> --config <a shipped profile>``, nothing about addresses or
reachability). A volunteer whose initial peer is on another machine listens on every interface
(addresses.listen_maddrs), so the other volunteer and the helpers can dial it: both are detected
public and every round is a group of the two, with one digest after every sync.
"""
from __future__ import annotations

import os
import subprocess

import pytest

from elastic_support import NsPeers, assert_agree, ok_syncs, read_events, wait_for

pytestmark = [pytest.mark.netem]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_missing = [tool for tool in ("ip",) if subprocess.run(["which", tool], capture_output=True).returncode]


@pytest.mark.timeout(300)
@pytest.mark.skipif(os.geteuid() != 0 or bool(_missing), reason="needs root and iproute2 (ip netns) for the LAN")
def test_two_volunteers_on_one_lan_following_the_readme_train_together(tmp_path):
    from p2pdiloco.bench.wan import EmulatedWAN, LinkSpec

    peers = NsPeers(tmp_path)
    with EmulatedWAN(3, LinkSpec(rate_mbit=1000)) as wan:
        h0, h1, h2 = wan.hosts
        peers.start(h0, "boot", "bootstrap", "--identity", str(tmp_path / "boot.key"),
                    "--host-maddrs", "/ip4/0.0.0.0/tcp/31337")
        addr = wait_for(lambda: next((l.strip() for l in (tmp_path / "boot.out").read_text().splitlines()
                                      if f"/ip4/{h0.address}/tcp/31337/p2p/" in l), None), 90,
                        "the bootstrap's LAN address", peers, ["boot"])
        for host, name in ((h1, "a"), (h2, "b")):
            # the README's line, plus where to write and when to stop (so that the test ends)
            peers.start(host, name, "join", "--initial-peers", addr,
                        "--config", os.path.join(ROOT, "peers", "tiny-cpu.toml"),
                        "--set", f"train.run_dir={tmp_path / name}", "--set", "train.max_outer_steps=3",
                        "--set", "train.progress_bar=false")
        for name in ("a", "b"):
            assert peers.wait(peers.procs[name], 240) == 0, peers.err(name)[-3000:]
        for name in ("a", "b"):
            err = peers.err(name)
            assert "reachability: public" in err, err[-2000:]
            syncs = ok_syncs(tmp_path / name)
            assert syncs and all(r["group_size"] == 2 for r in syncs), [(r["step"], r["group_size"]) for r in syncs]
            fails = [r.get("error") for r in read_events(tmp_path / name, "sync") if not r["ok"]]
            assert not fails, fails
        assert assert_agree([tmp_path / "a", tmp_path / "b"], min_common=3) >= 3
