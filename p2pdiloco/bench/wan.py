"""An emulated wide-area network: one network namespace per peer, joined by a shaped link.

Topology (all names are local to their namespace, so they never clash)::

    host ns  <prefix><pid>-<k>-h<i>      switch ns  <prefix><pid>-<k>-sw
    ┌──────────────────────┐            ┌───────────────────────────────────────────┐
    │ eth0 10.a.b.(i+1)/24 │──veth──────│ p<i> ──[relay]── q<i> ──veth── qb<i> ── br0 │
    │ tbf (uplink rate)    │            │ tbf (downlink rate)                        │
    └──────────────────────┘            └───────────────────────────────────────────┘

Contract of one host link (``LinkSpec``):

* ``rate_mbit`` limits **both directions** independently: a ``tbf`` on the host's ``eth0``
  (uplink, host → network) and a ``tbf`` on the switch-side end ``p<i>`` (downlink,
  network → host). Between two hosts the slower of the sender's uplink and the receiver's
  downlink is the bottleneck, as on a real WAN.
* ``delay_ms``, ``jitter_ms`` and ``loss_pct`` apply to packets **leaving** the host (its
  uplink). One-way latency A → B is therefore ``delay_A``, and the round trip between A and
  B is ``delay_A + delay_B`` (100 ms for two hosts with ``delay_ms=50``). Jitter is uniform
  in ``±jitter_ms`` and never reorders packets (a packet leaves no earlier than the one
  before it); loss is an independent per-packet drop.

Delay, jitter and loss are applied by the kernel's ``netem`` qdisc where the kernel has it.
Many cloud/VM kernels are built without ``sch_netem`` (this project's CI kernel is one), so
the fallback is a small user-space relay (``_relay`` in ``netns_tools.py``): one process per
host, in the switch namespace, that copies Ethernet frames between ``p<i>`` and ``q<i>`` through
``AF_PACKET`` sockets and holds uplink frames for their delay. For the relay to see ordinary MTU-sized
frames with complete checksums, TSO/GSO/GRO and checksum offload are switched off on every
interface (the same is done on the netem path, so both paths behave alike).
The netem path is not exercised on kernels without netem (ours); note that netem's jitter
may reorder packets, the relay's never does.

Teardown (``close``, also from ``__exit__``, ``atexit`` and a SIGTERM handler that then
re-delivers the signal) kills every process started through ``Host.popen`` (its whole
process group), then every process still inside a namespace, then deletes the namespaces.
A harness whose owner was SIGKILLed leaves namespaces behind; their names carry the
owner's pid, and ``cleanup_stale`` removes those whose owner is dead.

Needs root, ``ip`` and ``tc`` (iproute2); ``require_root`` says so clearly.
"""
from __future__ import annotations

import argparse
import atexit
import itertools
import json
import logging
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import IO, Any, Optional, Sequence, Union

from p2pdiloco.errors import ConfigError, UserError

__all__ = [
    "DEFAULT_PREFIX",
    "LinkSpec",
    "Host",
    "EmulatedWAN",
    "require_root",
    "cleanup_stale",
    "netem_available",
    "measure_throughput",
    "measure_rtt",
    "main",
]

logger = logging.getLogger(__name__)
logger.setLevel(os.environ.get("P2PDILOCO_LOG_LEVEL", "INFO").upper())

DEFAULT_PREFIX = "pdwan-"
_ROOT_MESSAGE = "the emulated WAN needs root (ip netns, tc): run as root or with sudo"
# The in-namespace tools (relay, prep, throughput/RTT probes) run as a script by file path, so they
# import only the standard library (``python -m`` would import the p2pdiloco package, i.e. torch).
_TOOLS = [sys.executable, "-I", os.path.join(os.path.dirname(os.path.abspath(__file__)), "netns_tools.py")]


# ----------------------------------------------------------------------------- configuration
@dataclass
class LinkSpec:
    """Shaping of one host's access link. Units: Mbit/s, milliseconds, percent."""

    rate_mbit: float = 100
    delay_ms: float = 0
    jitter_ms: float = 0
    loss_pct: float = 0

    def validate(self) -> "LinkSpec":
        """Raise ConfigError naming the field when a value is impossible; return self."""
        for name in ("rate_mbit", "delay_ms", "jitter_ms", "loss_pct"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"LinkSpec.{name} must be a number, got {value!r}")
            if value != value or value in (float("inf"), float("-inf")):
                raise ConfigError(f"LinkSpec.{name} must be finite, got {value!r}")
        if not 0.01 <= self.rate_mbit <= 100_000:
            raise ConfigError(f"LinkSpec.rate_mbit must be in [0.01, 100000] Mbit/s, got {self.rate_mbit}")
        if not 0 <= self.delay_ms <= 10_000:
            raise ConfigError(f"LinkSpec.delay_ms must be in [0, 10000] ms, got {self.delay_ms}")
        if not 0 <= self.jitter_ms <= self.delay_ms:
            raise ConfigError(
                f"LinkSpec.jitter_ms must be in [0, delay_ms={self.delay_ms}] ms, got {self.jitter_ms}"
                " (jitter larger than the delay would need negative delays)"
            )
        if not 0 <= self.loss_pct < 100:
            raise ConfigError(f"LinkSpec.loss_pct must be in [0, 100) percent, got {self.loss_pct}")
        return self

    @property
    def impaired(self) -> bool:
        """True when delay, jitter or loss is requested (rate alone needs only tbf)."""
        return self.delay_ms > 0 or self.jitter_ms > 0 or self.loss_pct > 0


# ----------------------------------------------------------------------------- system checks
def require_root() -> None:
    """Raise UserError unless we are root and ``ip`` and ``tc`` are installed."""
    if os.geteuid() != 0:
        raise UserError(_ROOT_MESSAGE)
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise UserError(f"{_ROOT_MESSAGE}; missing binaries: {', '.join(missing)} (install iproute2)")


def _sh(argv: Sequence[str], *, check: bool = True, timeout: float = 30) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(argv)}: {proc.stderr.strip()}")
    return proc.stdout


def _list_netns() -> list[str]:
    out = _sh(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


_netem_cache: Optional[bool] = None


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (probed once in a throw-away namespace)."""
    global _netem_cache
    if _netem_cache is None:
        ns = f"{DEFAULT_PREFIX}{os.getpid()}-probe"
        try:
            _sh(["ip", "netns", "add", ns])
            _sh(["ip", "-n", ns, "link", "add", "d0", "type", "veth", "peer", "name", "d1"])
            probe = subprocess.run(
                ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "d0", "root", "netem", "delay", "1ms"],
                capture_output=True,
            )
            _netem_cache = probe.returncode == 0
        finally:
            _sh(["ip", "netns", "del", ns], check=False)
    return _netem_cache


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_netns_processes(ns: str) -> None:
    """SIGKILL every process still running inside namespace ``ns``."""
    out = _sh(["ip", "netns", "pids", ns], check=False)
    for pid in (int(p) for p in out.split() if p.isdigit()):
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def cleanup_stale(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Delete namespaces ``<prefix><pid>-...`` whose owner pid is dead; return their names.

    Namespaces of living owners (another harness running right now) are left alone.
    """
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)-")
    removed = []
    for ns in _list_netns():
        match = pattern.match(ns)
        if match and not _pid_alive(int(match.group(1))):
            _kill_netns_processes(ns)
            _sh(["ip", "netns", "del", ns], check=False)
            removed.append(ns)
    if removed:
        logger.info("removed %d stale namespaces: %s", len(removed), " ".join(removed))
    return removed


# ----------------------------------------------------------------------------- hosts
class Host:
    """One emulated peer: a network namespace with one address on the emulated WAN."""

    def __init__(self, wan: "EmulatedWAN", index: int, netns: str, address: str, link: LinkSpec):
        self._wan = wan
        self.index = index
        self.name = f"h{index}"
        self.netns = netns
        self.address = address
        self.link = link

    def __repr__(self) -> str:
        return f"Host({self.name}, netns={self.netns}, address={self.address}, link={self.link})"

    def _argv(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *[str(a) for a in argv]]

    def popen(
        self,
        argv: Sequence[str],
        *,
        stdout: Union[None, int, IO[Any]] = None,
        stderr: Union[None, int, IO[Any]] = None,
        **kw: Any,
    ) -> subprocess.Popen:
        """Start ``argv`` inside this host's namespace in its own process group.

        The harness kills the whole group at teardown; ``stdout``/``stderr`` are passed to
        Popen unchanged (a file, PIPE, or None to inherit).
        """
        kw.setdefault("start_new_session", True)
        proc = subprocess.Popen(self._argv(argv), stdout=stdout, stderr=stderr, **kw)
        self._wan._register(proc)
        return proc

    def run(self, argv: Sequence[str], *, timeout: float = 60, check: bool = True, **kw: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` inside the namespace to completion (bounded by ``timeout`` seconds)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self._argv(argv), timeout=timeout, check=check, **kw)


# ----------------------------------------------------------------------------- the harness
_live: "set[EmulatedWAN]" = set()
_live_lock = threading.Lock()
_instance_counter = itertools.count()
_prev_sigterm: Any = None
_handlers_installed = False


def _teardown_all() -> None:
    with _live_lock:
        wans = list(_live)
    for wan in wans:
        wan.close()


def _on_sigterm(signum: int, frame: Any) -> None:
    _teardown_all()
    prev = _prev_sigterm
    if callable(prev):
        prev(signum, frame)
    else:  # default disposition: die of SIGTERM, as if we had not been here
        signal.signal(signal.SIGTERM, prev if prev is not None else signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_handlers() -> None:
    global _handlers_installed, _prev_sigterm
    if _handlers_installed:
        return
    atexit.register(_teardown_all)
    if threading.current_thread() is threading.main_thread():
        _prev_sigterm = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _on_sigterm)
    _handlers_installed = True


class EmulatedWAN:
    """``n_hosts`` namespaces on one shaped bridge; a context manager (see module docstring).

    ``link`` is one LinkSpec for every host, or a list with one per host. The subnet
    ``10.a.b.0/24`` is derived from the owner pid and an instance counter, so concurrent
    harnesses normally use different subnets (each has its own bridge and namespaces, so even
    a coincidence cannot mix their traffic). Setup failures tear down what was built.
    """

    def __init__(self, n_hosts: int, link: Union[LinkSpec, Sequence[LinkSpec]] = LinkSpec(), *, prefix: Optional[str] = None):
        if not isinstance(n_hosts, int) or not 1 <= n_hosts <= 250:
            raise ConfigError(f"n_hosts must be an integer in [1, 250], got {n_hosts!r}")
        links = [link] * n_hosts if isinstance(link, LinkSpec) else list(link)
        if len(links) != n_hosts:
            raise ConfigError(f"got {len(links)} LinkSpecs for {n_hosts} hosts: give one, or one per host")
        for spec in links:
            if not isinstance(spec, LinkSpec):
                raise ConfigError(f"link must be a LinkSpec or a list of them, got {spec!r}")
            spec.validate()
        self.prefix = prefix or DEFAULT_PREFIX
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,20}", self.prefix):
            raise ConfigError(f"prefix must be 1-20 characters of [A-Za-z0-9_.-], got {self.prefix!r}")
        self.links = links
        self.n_hosts = n_hosts
        k = next(_instance_counter)
        self._tag = f"{self.prefix}{os.getpid()}-{k}"
        idx = (os.getpid() * 8 + k) % (200 * 256)
        self.subnet = f"10.{16 + idx // 256}.{idx % 256}.0/24"
        self._net = f"10.{16 + idx // 256}.{idx % 256}"
        self.switch_netns = f"{self._tag}-sw"
        self.hosts: list[Host] = []
        self._namespaces: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._relays: list[subprocess.Popen] = []
        self._closed = False
        self._started = False
        self.use_netem = False
        self.backend = "tbf"  # "tbf", "tbf + netem" or "tbf + relay", decided at start()

    # -- lifecycle
    def __enter__(self) -> "EmulatedWAN":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> "EmulatedWAN":
        """Create namespaces, links, shaping; idempotent. On failure everything is removed."""
        if self._started:
            return self
        require_root()
        _install_handlers()
        with _live_lock:
            _live.add(self)
        self._started = True
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        logger.info(
            "emulated WAN up: %d hosts on %s (switch %s, %s)",
            self.n_hosts, self.subnet, self.switch_netns, self.backend,
        )
        return self

    def _ns_add(self, ns: str) -> None:
        self._namespaces.append(ns)
        _sh(["ip", "netns", "add", ns])

    def _build(self) -> None:
        need_impair = any(spec.impaired for spec in self.links)
        self.use_netem = need_impair and netem_available()
        use_relay = need_impair and not self.use_netem
        self.backend = "tbf + netem" if self.use_netem else ("tbf + relay" if use_relay else "tbf")
        sw = self.switch_netns
        self._ns_add(sw)
        _sh(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        sw_ifaces = ["br0"]
        for i, spec in enumerate(self.links):
            ns = f"{self._tag}-h{i}"
            self._ns_add(ns)
            address = f"{self._net}.{i + 1}"
            _sh(["ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}", "netns", sw])
            if use_relay:
                _sh(["ip", "-n", sw, "link", "add", f"q{i}", "type", "veth", "peer", "name", f"qb{i}"])
                _sh(["ip", "-n", sw, "link", "set", f"qb{i}", "master", "br0"])
                sw_ifaces += [f"p{i}", f"q{i}", f"qb{i}"]
            else:
                _sh(["ip", "-n", sw, "link", "set", f"p{i}", "master", "br0"])
                sw_ifaces += [f"p{i}"]
            _prep_netns(ns, ["eth0"])
            _sh(["ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0"])
            for dev in ("lo", "eth0"):
                _sh(["ip", "-n", ns, "link", "set", dev, "up"])
            self.hosts.append(Host(self, i, ns, address, spec))
        _prep_netns(sw, sw_ifaces)
        for dev in ["lo", *sw_ifaces]:
            _sh(["ip", "-n", sw, "link", "set", dev, "up"])
        for i, spec in enumerate(self.links):
            host = self.hosts[i]
            up_netem = self.use_netem and spec.impaired
            _shape(host.netns, "eth0", spec, netem=up_netem)
            _shape(sw, f"p{i}", LinkSpec(rate_mbit=spec.rate_mbit, delay_ms=spec.delay_ms), netem=False)
            if use_relay:
                argv = [
                    "ip", "netns", "exec", sw, *_TOOLS, "_relay",
                    f"p{i}", f"q{i}", str(spec.delay_ms), str(spec.jitter_ms), str(spec.loss_pct),
                ]
                relay = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.PIPE, text=True)
                self._relays.append(relay)
        for relay in self._relays:  # each relay prints one line once its sockets are bound
            line = _readline_timeout(relay, 20)
            if line.strip() != "ready":
                raise RuntimeError(f"link relay failed to start (exit code {relay.poll()})")

    def _register(self, proc: subprocess.Popen) -> None:
        if self._closed:
            _kill_group(proc)
            raise RuntimeError("EmulatedWAN is closed")
        self._procs.append(proc)

    def close(self) -> None:
        """Kill started processes, then delete every namespace; idempotent, never raises."""
        if self._closed:
            return
        self._closed = True
        with _live_lock:
            _live.discard(self)
        for proc in self._procs + self._relays:
            _kill_group(proc)
        for ns in self._namespaces:
            try:
                _kill_netns_processes(ns)
            except Exception:  # pragma: no cover - keep going, the namespace must still go
                logger.exception("killing processes in %s failed", ns)
        for ns in reversed(self._namespaces):
            try:
                _sh(["ip", "netns", "del", ns], check=False)
            except Exception:  # pragma: no cover
                logger.exception("deleting namespace %s failed", ns)
        logger.debug("emulated WAN %s torn down", self._tag)

    @property
    def namespaces(self) -> list[str]:
        """Every namespace this harness created (switch first)."""
        return list(self._namespaces)


def _kill_group(proc: subprocess.Popen, grace: float = 2.0) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    try:  # the group may outlive its leader (e.g. p2pd started by a DHT)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:  # pragma: no cover
        logger.warning("process %d did not exit after SIGKILL", proc.pid)


def _readline_timeout(proc: subprocess.Popen, timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else ""


def _prep_netns(ns: str, ifaces: Sequence[str]) -> None:
    _sh(["ip", "netns", "exec", ns, *_TOOLS, "_prep", *ifaces])


def _shape(ns: str, dev: str, spec: LinkSpec, *, netem: bool) -> None:
    """Install rate limiting (tbf) and, if asked, netem delay/jitter/loss under it.

    tbf sizing: ``burst`` of 2 ms at line rate but at least 10 full frames (a burst smaller
    than the timer resolution throttles below the configured rate); queue ``limit`` of
    100 ms plus two delays at line rate, so a TCP window covering the bandwidth-delay
    product fits instead of being tail-dropped. netem's own queue (``limit``, in packets)
    is sized for the same bandwidth-delay product.
    """
    rate_bps = spec.rate_mbit * 1e6 / 8
    burst = int(max(10 * 1514, rate_bps * 0.002))
    limit = int(max(3 * burst, rate_bps * (0.1 + 2 * spec.delay_ms / 1000)))
    rate = f"{int(spec.rate_mbit * 1000)}kbit"
    tc = ["ip", "netns", "exec", ns, "tc", "qdisc"]
    if netem:
        _sh([*tc, "replace", "dev", dev, "root", "handle", "1:", "tbf", "rate", rate, "burst", str(burst), "limit", str(limit)])
        packets = int(max(1000, 2 * rate_bps * (0.1 + spec.delay_ms / 1000) / 1500))
        args = ["netem", "limit", str(packets)]
        if spec.delay_ms > 0:
            args += ["delay", f"{spec.delay_ms}ms"]
            if spec.jitter_ms > 0:
                args += [f"{spec.jitter_ms}ms"]
        if spec.loss_pct > 0:
            args += ["loss", f"{spec.loss_pct}%"]
        _sh([*tc, "add", "dev", dev, "parent", "1:1", "handle", "10:", *args])
    else:
        _sh([*tc, "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst), "limit", str(limit)])


# ----------------------------------------------------------------------------- measurements
def _tool(host: Host, *args: str, stdout: Any = subprocess.PIPE) -> subprocess.Popen:
    return host.popen([*_TOOLS, *args], stdout=stdout, stderr=subprocess.PIPE, text=True)


def _server_port(proc: subprocess.Popen, what: str) -> int:
    line = _readline_timeout(proc, 20)
    if not line.startswith("PORT "):
        err = proc.stderr.read() if proc.poll() is not None and proc.stderr else ""
        raise RuntimeError(f"{what} server did not start: {line!r} {err}")
    return int(line.split()[1])


def measure_throughput(src: Host, dst: Host, seconds: float = 3) -> float:
    """Goodput in Mbit/s of one TCP stream src → dst, averaged over ``seconds``.

    The first quarter second (at most) is excluded as slow start. Both ends stop by
    themselves: the receiver after ``seconds`` of data, the sender when the receiver closes
    or ``seconds + 20`` s have passed.
    """
    server = _tool(dst, "_recv", dst.address, str(seconds))
    try:
        port = _server_port(server, "throughput")
        client = _tool(src, "_send", dst.address, str(port), str(seconds + 20), stdout=subprocess.DEVNULL)
        out, err = server.communicate(timeout=seconds + 30)
        client.wait(timeout=30)
    finally:
        _kill_group(server)
    if server.returncode != 0:
        raise RuntimeError(f"throughput receiver failed: {err.strip()}")
    result = json.loads(out.strip().splitlines()[-1])
    return result["bytes"] * 8 / result["seconds"] / 1e6


def measure_rtt(src: Host, dst: Host, count: int = 5) -> float:
    """Median round-trip time in ms of 1-byte TCP ping-pongs src → dst → src (TCP_NODELAY)."""
    server = _tool(dst, "_echo", dst.address)
    try:
        port = _server_port(server, "echo")
        client = src.run([*_TOOLS, "_ping", dst.address, str(port), str(count)], timeout=60)
    finally:
        _kill_group(server)
    return float(client.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- command line
def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m p2pdiloco.bench.wan --hosts 2 --rate 10 --delay 50``: build, measure, tear down."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].startswith("_"):
        from .netns_tools import run_tool

        run_tool(argv)
        return 0
    parser = argparse.ArgumentParser(prog="python -m p2pdiloco.bench.wan", description=main.__doc__)
    parser.add_argument("--hosts", type=int, default=2, help="number of hosts (namespaces)")
    parser.add_argument("--rate", type=float, default=100, help="link rate per direction, Mbit/s")
    parser.add_argument("--delay", type=float, default=0, help="one-way delay added on each host's uplink, ms")
    parser.add_argument("--jitter", type=float, default=0, help="uniform jitter (±), ms")
    parser.add_argument("--loss", type=float, default=0, help="uplink packet loss, percent")
    parser.add_argument("--seconds", type=float, default=3, help="duration of the throughput test, s")
    parser.add_argument("--cleanup-stale", action="store_true", help="first remove namespaces of dead runs")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        require_root()
        if args.cleanup_stale:
            cleanup_stale()
        spec = LinkSpec(args.rate, args.delay, args.jitter, args.loss).validate()
        if args.hosts < 2:
            raise ConfigError("--hosts must be at least 2 to measure anything")
        with EmulatedWAN(args.hosts, spec) as wan:
            src, dst = wan.hosts[0], wan.hosts[1]
            print(f"{args.hosts} hosts on {wan.subnet} ({wan.backend}); link {spec}")
            rtt = measure_rtt(src, dst)
            print(f"RTT {src.name} -> {dst.name}: configured {2 * spec.delay_ms:.1f} ms, measured {rtt:.2f} ms (TCP ping-pong median)")
            mbit = measure_throughput(src, dst, args.seconds)
            print(f"throughput {src.name} -> {dst.name}: configured {spec.rate_mbit:.1f} Mbit/s, measured {mbit:.2f} Mbit/s "
                  f"({100 * mbit / spec.rate_mbit:.0f}%)")
        return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
