"""Real NATs in network namespaces, for tests/test_nat.py and tests/test_relay.py.

Topology: the public side is an :class:`~p2pdiloco.bench.wan.EmulatedWAN` (hosts on one bridge,
``10.x.y.0/24``); its last host is the *router*. Behind it, a private LAN ``192.168.77.0/24`` on a
bridge ``lan0`` inside the router namespace, one namespace per private host::

    public hosts h0..h(n-1) ── br0 ── router eth0 (10.x.y.R)
                                       │  nftables: masquerade out of eth0; forward policy drop,
                                       │  only LAN → WAN and connection-tracked replies pass;
                                       │  nothing unsolicited from eth0 reaches the router itself
                                      lan0 192.168.77.1 ── p0 .2, p1 .3, p2 .4 ...

The public hosts have a route to 192.168.77.0/24 *via the router*: without the firewall they could
open connections to the private hosts, so it is the NAT alone (masquerading with connection
tracking, inbound dropped) that keeps them out, as on a home router. The outside port of a mapping is
the LAN socket's own when free (``ports="kept"``, Linux's and most home routers' way: hole punching
works) or a random one per mapping (``ports="random"``: it cannot). Every namespace belongs to the
EmulatedWAN: its teardown (also on SIGTERM / atexit) kills every process in them and deletes them.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import List

from p2pdiloco.bench.wan import EmulatedWAN, Host, LinkSpec, _prep_netns, _sh

RULES = """
table ip nat {
  chain postrouting {
    type nat hook postrouting priority 100; policy accept;
    oifname "eth0" masquerade MAPPING
  }
}
table inet filter {
  chain input {
    type filter hook input priority 0; policy accept;
    iifname "eth0" ct state established,related accept
    iifname "eth0" drop
  }
  chain forward {
    type filter hook forward priority 0; policy drop;
    ct state established,related accept
    iifname "lan0" oifname "eth0" accept
  }
}
"""

PROBE = r'''
import socket, sys, time
mode = sys.argv[1]
if mode == "listen":          # print the port, then the source address of every connection
    srv = socket.create_server((sys.argv[2], 0))
    print("PORT", srv.getsockname()[1], flush=True)
    srv.settimeout(120)
    while True:
        try:
            conn, addr = srv.accept()
        except socket.timeout:
            break
        print("FROM", addr[0], flush=True)
        conn.close()
else:                          # connect ip port timeout: exit 0 when the connection opens
    try:
        socket.create_connection((sys.argv[2], int(sys.argv[3])), timeout=float(sys.argv[4])).close()
    except OSError as e:
        print(type(e).__name__, e, flush=True)
        sys.exit(1)
'''


def ensure_nft() -> str:
    """Path of ``nft``; installs nftables with apt-get when missing (we are root here)."""
    path = shutil.which("nft")
    if path:
        return path
    if shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "install", "-y", "-q", "nftables"], env=env, capture_output=True, timeout=300)
        if not shutil.which("nft"):
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=300)
            subprocess.run(["apt-get", "install", "-y", "-q", "nftables"], env=env, capture_output=True, timeout=300)
    path = shutil.which("nft")
    if not path:
        raise RuntimeError("nftables (nft) is missing and could not be installed with apt-get; install it")
    return path


class NatNet:
    """``n_public`` public hosts, ``routers`` NAT routers, ``n_private`` hosts behind them (private host k
    behind router k % routers, on LAN ``192.168.(77 + r).0/24``); a context manager."""

    def __init__(self, n_public: int, n_private: int, routers: int = 1, ports: str = "kept"):
        if ports not in ("kept", "random"):
            raise ValueError("ports must be 'kept' or 'random'")
        self.nft = ensure_nft()
        #: how the routers pick a mapping's outside port: ``kept`` (the LAN socket's port when free, as
        #: Linux and most home routers do) or ``random`` (a new port per mapping: hole punching fails)
        self.ports = ports
        self.wan = EmulatedWAN(n_public + routers, LinkSpec(rate_mbit=1000))
        self.n_public, self.n_private, self.n_routers = n_public, n_private, routers
        self.public: List[Host] = []
        self.private: List[Host] = []
        self.routers: List[Host] = []
        self.router: Host = None  # type: ignore[assignment]  # the first router
        self.behind: List[Host] = []  # the router of each private host

    def __enter__(self) -> "NatNet":
        wan = self.wan.start()
        try:
            self._build()
        except BaseException:
            wan.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.wan.close()

    @staticmethod
    def lan(r: int) -> str:
        return f"192.168.{77 + r}"

    def _build(self) -> None:
        wan = self.wan
        self.public, self.routers = wan.hosts[:self.n_public], wan.hosts[self.n_public:]
        self.router = self.routers[0]
        for r, router in enumerate(self.routers):
            ns, lan = router.netns, self.lan(r)
            _sh(["ip", "-n", ns, "link", "add", "lan0", "type", "bridge"])
            _sh(["ip", "-n", ns, "addr", "add", f"{lan}.1/24", "dev", "lan0"])
            _sh(["ip", "-n", ns, "link", "set", "lan0", "up"])
        for k in range(self.n_private):
            r = k % self.n_routers
            router, lan = self.routers[r], self.lan(r)
            ns = f"{wan._tag}-p{k}"
            wan._ns_add(ns)
            _sh(["ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"l{k}", "netns", router.netns])
            _sh(["ip", "-n", router.netns, "link", "set", f"l{k}", "master", "lan0"])
            _sh(["ip", "-n", router.netns, "link", "set", f"l{k}", "up"])
            _prep_netns(ns, ["eth0"])
            address = f"{lan}.{k // self.n_routers + 2}"
            _sh(["ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0"])
            for dev in ("lo", "eth0"):
                _sh(["ip", "-n", ns, "link", "set", dev, "up"])
            _sh(["ip", "-n", ns, "route", "add", "default", "via", f"{lan}.1"])
            self.private.append(Host(wan, 100 + k, ns, address, LinkSpec(rate_mbit=1000)))
            self.behind.append(router)
        for r, router in enumerate(self.routers):
            _sh(["ip", "netns", "exec", router.netns, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"])
            rules = RULES.replace("MAPPING", "fully-random" if self.ports == "random" else "")
            subprocess.run(["ip", "netns", "exec", router.netns, self.nft, "-f", "-"], input=rules, text=True,
                           check=True, capture_output=True, timeout=30)
            # a route to the LAN through its router for every other WAN host: only the NAT keeps them out
            for host in self.public + [x for x in self.routers if x is not router]:
                _sh(["ip", "-n", host.netns, "route", "add", f"{self.lan(r)}.0/24", "via", router.address])

    # ---- probes ---------------------------------------------------------------------------------
    def listen(self, host: Host, address: str, out_path) -> subprocess.Popen:
        """A TCP listener in ``host`` printing ``PORT n`` and then ``FROM ip`` per connection."""
        return host.popen([sys.executable, "-I", "-c", PROBE, "listen", address], stdout=open(out_path, "w"),
                          stderr=subprocess.STDOUT)

    def can_connect(self, host: Host, address: str, port: int, timeout: float = 3.0) -> bool:
        return host.run([sys.executable, "-I", "-c", PROBE, "connect", address, str(port), str(timeout)],
                        check=False, timeout=timeout + 30).returncode == 0
