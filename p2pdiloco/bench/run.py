"""The emulated-WAN benchmark: hivemind data parallelism against every p2pdiloco mode, one command.

    sudo python -m p2pdiloco.bench.run --matrix quick --rate 10 --delay 50 --peers 4

builds an :class:`~p2pdiloco.bench.wan.EmulatedWAN` with one namespace per peer plus one for the
bootstrap peer, and runs the modes of the matrix one after the other on it, each with the same
model, data shards (peer ``i`` trains on shard ``i`` of ``peers``), inner optimiser and number of
inner steps per peer (so the same tokens). Each mode gets a fresh bootstrap peer and run id.

Modes are data: :data:`MODES` maps a name to the ``--set`` overrides of ``p2pdiloco join`` (a new
mode is one line), :data:`BASELINES` maps a name to arguments of
:mod:`p2pdiloco.bench.hivemind_dp`. A mode whose configuration the CLI rejects (a codec that has
not landed yet, an impossible fragment count) is skipped with the CLI's message as its note.

Measured per mode (from every peer's ``metrics.jsonl`` and the interface counters):

* validation loss against tokens (all peers) and against wall-clock seconds;
* bytes sent per peer: interface bytes of the peer's ``eth0`` (everything: payload, DHT, framing,
  TCP/IP and Ethernet headers), sampled every 0.5 s from ``/proc/<pid>/net/dev`` of a process in
  the namespace; also our own counted all-reduce bytes for p2pdiloco modes;
* peak bytes/s per peer: the largest 0.5 s-window send rate; and the largest over windows of
  1, 2, 4 and 8 s (:data:`PEAK_WINDOWS`, a second table and ``peak_vs_window.png``): P fragments
  put 1/P of the bytes in each burst, which shows at windows longer than a whole-model burst
  and shorter than the interval between fragment syncs;
* compute utilization: ``1 - blocked / wall`` per peer, averaged over peers, where ``blocked`` is
  the time the training loop waited on the network (the summary's ``network_wait_seconds``;
  else the sum of the syncs' ``wait_seconds``, else of their ``sync_seconds``). Validation at
  each sync counts as compute, for every mode alike. For the hivemind baseline the measured
  forward/backward fraction is reported too (``compute_fraction``);
* wall time to reach the target validation loss (``--target-loss``, default the worst final
  loss among the modes, so every mode reaches it): seconds from training start to the first
  validation at or below it.

The wall-clock origin of a mode is the moment its last peer wrote its ``start`` event (all peers
have joined and loaded data); process start-up is not counted.

Writes ``<out>/results.json``, ``loss_vs_tokens.png``, ``loss_vs_time.png``, ``bytes_vs_time.png``,
``table.md`` and per-mode peer logs and metrics, and prints the table. Ctrl-C or SIGTERM tear the
network and every process down (results of the modes finished so far are still written).
Needs root (network namespaces).
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, IO, List, Optional, Sequence, Tuple

from ..errors import ConfigError, UserError
from ..swarm.ledger import ENV as DHT_LEDGER_ENV
from .hivemind_dp import read_iface_bytes
from .wan import EmulatedWAN, Host, LinkSpec, _kill_group, cleanup_stale, require_root

__all__ = ["MODES", "BASELINES", "MATRICES", "run_benchmark", "summarize_mode", "format_table", "main"]

logger = logging.getLogger(__name__)

#: p2pdiloco modes: name -> ``--set`` overrides for ``p2pdiloco join``. A new mode is one line. Every mode
#: starts from blocking fp32 DiLoCo (``scheme=diloco`` comes first, :data:`BASE_SETS`), so its overrides say
#: what differs from it; "default" is the scheme a peer gets with no ``--set`` (config.DEFAULT_SCHEME).
#: (Entries assume the matrix's H = inner.sync_every = 20; one whose values do not fit the H in use is
#: skipped with the CLI's message, e.g. tau must stay below H / fragments.)
MODES: Dict[str, Tuple[str, ...]] = {
    "default": ("scheme=streaming",),
    "diloco-fp32": (),
    "diloco-fp16": ("compression.codec=fp16",),
    "diloco-nf4": ("compression.codec=nf4",),
    "diloco-e3m0": ("compression.codec=e3m0",),
    "diloco-fp4": ("compression.codec=fp4",),
    "diloco-lowrank": ("compression.lowrank=true",),
    "delay-fp32": ("streaming.mode=delay",),
    "eager-fp32": ("streaming.mode=eager",),
    "eager-nf4": ("streaming.mode=eager", "compression.codec=nf4"),
    "streaming4-fp32": ("streaming.fragments=4",),
    "streaming4-nf4": ("streaming.fragments=4", "compression.codec=nf4"),
    "streaming4-e3m0": ("streaming.fragments=4", "compression.codec=e3m0"),
    "streaming4-tau4-fp32": ("streaming.fragments=4", "streaming.tau=4", "streaming.alpha=0.5"),
    "streaming4-tau4-e3m0": ("streaming.fragments=4", "streaming.tau=4", "streaming.alpha=0.5", "compression.codec=e3m0"),
    "streaming4-tau8-e3m0": ("streaming.fragments=4", "streaming.tau=8", "streaming.alpha=0.5", "compression.codec=e3m0"),
    "streaming4-eager-fp32": ("streaming.fragments=4", "streaming.mode=eager"),
    # the default scheme with low-rank factors (rank 1/8 of each matrix, embeddings whole) in 4-bit NF4
    "streaming4-tau4-nf4-lowrank": ("scheme=streaming", "compression.codec=nf4", "compression.lowrank=true",
                                    "compression.rank_fraction=0.125", "compression.adaptive=false",
                                    "compression.dense_params=emb"),
    # the same with error feedback kept in each peer's model (compression.feedback_form=model)
    "streaming4-tau4-nf4-lowrank-keep": ("scheme=streaming", "compression.codec=nf4", "compression.lowrank=true",
                                         "compression.rank_fraction=0.125", "compression.adaptive=false",
                                         "compression.dense_params=emb", "compression.error_feedback=true",
                                         "compression.feedback_form=model"),
    # the default scheme with dense 2-bit values and the quantization residual kept in each peer's model
    "streaming4-tau4-q2-keep": ("scheme=streaming", "compression.codec=q2", "compression.error_feedback=true",
                                "compression.feedback_form=model"),
    "streaming4-eager-nf4": ("streaming.fragments=4", "streaming.mode=eager", "compression.codec=nf4"),
    # the same as their all-public namesakes with every odd-numbered peer private (HALF_PRIVATE)
    "diloco-fp32-halfprivate": (),
    "streaming4-tau4-e3m0-halfprivate": ("streaming.fragments=4", "streaming.tau=4", "streaming.alpha=0.5",
                                         "compression.codec=e3m0"),
    # every trainer private (ALL_PRIVATE): they reach each other only through the bootstrap's relay
    "streaming4-tau4-e3m0-allprivate": ("streaming.fragments=4", "streaming.tau=4", "streaming.alpha=0.5",
                                        "compression.codec=e3m0"),
    # peers of different speeds (--speeds): rounds by the swarm's samples, a round being as many
    # samples as the step-based rounds of all peers ("auto": peers * H * batch); and the step-based
    # rounds of the full-speed peers alone (FAST_ONLY), the slower ones left out, for as many tokens
    "rounds-samples": ("inner.round_samples=auto",),
    "fast-only": (),
    # the weighting of rounds by samples: members' pseudo-gradients normalized to H steps (the default) or
    # raw displacements by samples; on each peer's own slice of the corpus (non-IID, as every matrix) or
    # all peers sampling the whole corpus with their own seeds (IID_MODES)
    "samples-raw": ("inner.round_samples=auto", "inner.normalize_steps=false"),
    "samples-normalized-iid": ("inner.round_samples=auto",),
    "samples-raw-iid": ("inner.round_samples=auto", "inner.normalize_steps=false"),
}

#: the ``--set`` overrides every mode starts from (its own come after them and win)
BASE_SETS: Tuple[str, ...] = ("scheme=diloco",)

#: modes in which only the peers at full speed (--speeds 1) train, for as many rounds as make the same tokens
FAST_ONLY = frozenset({"fast-only"})
#: modes whose peers all sample the whole corpus (one data shard), each with its own seed: IID data
IID_MODES = frozenset({"samples-normalized-iid", "samples-raw-iid"})
#: --speeds of the "speeds" matrix when none are given: two full-speed peers, one at half and one at a fifth
SPEEDS_DEFAULT = (1.0, 1.0, 0.5, 0.2)

#: modes whose odd-numbered peers are *private*: their host drops inbound TCP connections (nftables,
#: with connection tracking: outbound connections and their replies pass, as behind a home router's
#: NAT). They find out with swarm.reachability=auto (nobody can dial them back) and train as members
#: that own no all-reduce shard (swarm/reachability.py).
HALF_PRIVATE = frozenset({"diloco-fp32-halfprivate", "streaming4-tau4-e3m0-halfprivate"})
#: modes whose peers are all private that way: no trainer can be dialed, the bootstrap relays (swarm/relay.py)
ALL_PRIVATE = frozenset({"streaming4-tau4-e3m0-allprivate"})
_PRIVATE_TABLE = "p2pdiloco_private"
_PRIVATE_RULES = f"""table inet {_PRIVATE_TABLE} {{
  chain input {{
    type filter hook input priority 0; policy accept;
    ct state established,related accept
    iifname "lo" accept
    meta l4proto tcp ct state new drop
  }}
}}
"""

#: baselines: name -> extra arguments of ``python -m p2pdiloco.bench.hivemind_dp``.
BASELINES: Dict[str, Tuple[str, ...]] = {
    "hivemind-dp": (),
    "hivemind-dp-fp16": ("--grad-compression", "fp16"),
}

#: named matrices: the modes run by ``--matrix``, in order.
MATRICES: Dict[str, Tuple[str, ...]] = {
    "smoke": ("diloco-fp32",),
    "quick": ("hivemind-dp", "diloco-fp32", "streaming4-tau4-e3m0"),
    "full": ("hivemind-dp", "diloco-fp32", "diloco-fp16", "diloco-nf4", "streaming4-tau4-e3m0"),
    # peak rate with P fragments at equal bytes, overlap vs blocking, eager and one-step delay
    "streaming": ("diloco-fp32", "streaming4-fp32", "streaming4-tau4-fp32", "eager-fp32", "streaming4-eager-fp32",
                  "delay-fp32"),
    # utilization of the same fragments and codec, blocking vs tau overlap
    "overlap": ("streaming4-e3m0", "streaming4-tau4-e3m0"),
    # the same at the papers' longer rounds: run with --set inner.sync_every=40 (tau 8 < H/P = 10)
    "overlap-h40": ("streaming4-e3m0", "streaming4-tau8-e3m0"),
    # half the peers private (behind a stateful firewall) beside all public
    "private": ("diloco-fp32", "diloco-fp32-halfprivate", "streaming4-tau4-e3m0", "streaming4-tau4-e3m0-halfprivate",
                "streaming4-tau4-e3m0-allprivate"),
    # peers of different speeds (--speeds, default 1,1,0.5,0.2): rounds of H steps on every peer,
    # rounds by the swarm's samples, and the full-speed peers alone
    "speeds": ("diloco-fp32", "rounds-samples", "fast-only"),
    # the weighting of rounds by samples at the same speeds: normalized to H steps or raw, non-IID and IID
    "weighting": ("rounds-samples", "samples-raw", "samples-normalized-iid", "samples-raw-iid"),
    # the long horizon (30 outer steps at H = 60): data parallelism's curve computed in process over
    # the whole budget, its time and bytes per step from a networked hivemind run over DP_STEPS steps
    "long": ("hivemind-dp", "diloco-fp32", "default", "streaming4-tau4-nf4-lowrank"),
}

#: settings a matrix runs with, before the user's --set (which win)
MATRIX_SETS: Dict[str, Tuple[str, ...]] = {
    "long": ("inner.sync_every=60", "data.max_bytes=8000000", "train.eval_batches=8"),
}

#: global steps of the networked data-parallel baseline where a matrix does not run it over the whole
#: budget (--dp-steps): its loss curve then comes from the in-process reference (bench/dp_reference.py)
#: and its wall time and bytes from the networked run's per-step figures
DP_STEPS: Dict[str, int] = {"long": 30}
#: validations of the short networked baseline (for the check of the in-process curve against it)
_DP_EVALS = 3

#: default budget of each matrix in outer rounds (inner steps per peer = rounds * H), sized for
#: about 20 minutes on 2 cores at 10 Mbit/s (the data-parallel baseline needs ~8 s per step there)
MATRIX_ROUNDS: Dict[str, int] = {"smoke": 2, "quick": 2, "full": 4, "streaming": 4, "overlap": 4, "overlap-h40": 4,
                                 "private": 4, "speeds": 6, "weighting": 6, "long": 30}

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_DEFAULT_CONFIG = os.path.join(_REPO, "peers", "tiny-cpu.toml")
_SAMPLE_PERIOD = 0.5
#: window lengths (s) of the peak send rate reported per mode: a burst's peak depends on the time scale
#: looked at (a transfer fills the link while it runs; what P fragments change is how many bytes go in
#: one burst), so the benchmark reports the peak at several scales, not at one
PEAK_WINDOWS: Tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, 8.0)


# ----------------------------------------------------------------------------- interface counters
class _Sampler(threading.Thread):
    """Samples (tx, rx) bytes of every host's eth0 every ``period`` seconds.

    Reads ``/proc/<pid>/net/dev`` of an idle anchor process living in each namespace: that file
    shows the counters of the process's network namespace, so no process is spawned per sample.
    """

    def __init__(self, anchors: Sequence[int], period: float = _SAMPLE_PERIOD):
        super().__init__(name="bench-sampler", daemon=True)
        self.anchors = list(anchors)
        self.period = period
        self.samples: List[Tuple[float, List[Tuple[int, int]]]] = []
        self.load: List[Tuple[float, float]] = []  # (time, 1-minute load average): others' work on the machine
        self._lock = threading.Lock()
        self._stop_event = threading.Event()

    def read(self) -> Tuple[float, List[Tuple[int, int]]]:
        now = time.time()
        values = [read_iface_bytes("eth0", f"/proc/{pid}/net/dev") or (0, 0) for pid in self.anchors]
        return now, values

    def run(self) -> None:
        while not self._stop_event.is_set():
            sample = self.read()
            load = _loadavg()
            with self._lock:
                self.samples.append(sample)
                if load:
                    self.load.append((sample[0], float(load.split()[0])))
            self._stop_event.wait(self.period)

    def window(self, t0: float, t1: float) -> List[Tuple[float, List[Tuple[int, int]]]]:
        with self._lock:
            return [s for s in self.samples if t0 <= s[0] <= t1]

    def mean_load(self, t0: float, t1: float) -> Optional[float]:
        with self._lock:
            values = [v for t, v in self.load if t0 <= t <= t1]
        return round(sum(values) / len(values), 2) if values else None

    def stop(self) -> None:
        self._stop_event.set()


# ----------------------------------------------------------------------------- one mode
@dataclass
class _Plan:
    """Everything every mode shares."""

    config: str
    peers: int
    steps: int                       # inner steps (DiLoCo) / global steps (DP) per peer
    sync_every: int
    batch_size: int
    seq_len: int
    user_sets: List[str]
    link: LinkSpec
    out: str
    mode_timeout: float
    allreduce_timeout: float
    matchmaking_timeout: float
    supports_start_wait: bool
    pin_cores: bool = False          # each peer (with its DHT and p2p daemon) on its own share of the cores
    speeds: Tuple[float, ...] = ()   # per peer, 1 = full speed (a slower peer sleeps after each step)
    dp_steps: int = 0                # global steps of the networked baseline (0 = steps)

    @property
    def dp_eval_every(self) -> int:
        """Steps between the baseline's validations: the DiLoCo modes' cadence (H) over the whole budget;
        a few points over a short span (they check the in-process curve)."""
        if self.dp_steps and self.dp_steps < self.steps:
            return max(1, self.dp_steps // _DP_EVALS)
        return self.sync_every


@dataclass
class _ModeRun:
    name: str
    kind: str                        # "diloco" or "baseline"
    argv_extra: Tuple[str, ...]
    status: str = "pending"          # ok | skipped | failed
    note: str = ""
    t_begin: float = 0.0
    t_end: float = 0.0
    peer_dirs: List[str] = field(default_factory=list)


def _peer_overrides(plan: _Plan, name: str, i: int, host: Optional[Host]) -> List[str]:
    sets = [
        *BASE_SETS,
        *((f"data.num_shards=1", "data.shard=0", f"data.seed={i + 1}") if name in IID_MODES
          else (f"data.num_shards={plan.peers}", f"data.shard={i}")),
        f"train.run_dir={os.path.join(plan.out, name, f'peer{i}')}",
        "train.threads=1",
        "train.progress_bar=false",
        f"swarm.run_id=bench-{name}-{os.getpid()}",
        f"swarm.allreduce_timeout={plan.allreduce_timeout:g}",
        f"swarm.matchmaking_timeout={plan.matchmaking_timeout:g}",
    ]
    if plan.supports_start_wait:
        sets += [f"swarm.min_peers_to_start={plan.peers}", "swarm.start_timeout=120"]
    if host is not None:
        sets.append(f"swarm.host_maddrs=/ip4/{host.address}/tcp/0")
    return sets + list(plan.user_sets)


def _mode_peers(plan: _Plan, mode: _ModeRun) -> List[int]:
    """The peers that train in ``mode``: all, or the full-speed ones (FAST_ONLY)."""
    if mode.name in FAST_ONLY and plan.speeds:
        return [i for i in range(plan.peers) if plan.speeds[i] >= 1]
    return list(range(plan.peers))


def _diloco_sets(plan: _Plan, mode: _ModeRun, i: int, host: Optional[Host]) -> List[str]:
    outer = plan.steps // plan.sync_every
    start = []
    if mode.name in FAST_ONLY and plan.speeds:  # fewer peers: more rounds for the same tokens
        outer = math.ceil(outer * plan.peers / max(1, len(_mode_peers(plan, mode))))
        if plan.supports_start_wait:
            start = [f"swarm.min_peers_to_start={len(_mode_peers(plan, mode))}"]
    extra = [*(s.replace("round_samples=auto", f"round_samples={plan.peers * plan.sync_every * plan.batch_size}")
             for s in mode.argv_extra)]
    return [*_peer_overrides(plan, mode.name, i, host), f"train.max_outer_steps={outer}",
            f"train.max_seconds={plan.mode_timeout:g}", *start, *extra]


def _peer_env(plan: _Plan, i: int) -> Dict[str, str]:
    """The peer's environment: with --speeds, a slower peer's throttle (the fault hook's ``slow``)."""
    env = _child_env()
    if plan.speeds and plan.speeds[i] < 1:
        env["P2PDILOCO_FAULTS"] = json.dumps({"phase": "step", "action": "slow", "factor": 1 / plan.speeds[i],
                                              "times": 0})
    return env


def _validate_mode(plan: _Plan, mode: _ModeRun) -> Optional[str]:
    """The CLI's own configuration check, in process: None if accepted, else its message."""
    from ..config import load_config

    sets = _diloco_sets(plan, mode, 0, None) if mode.kind == "diloco" else _peer_overrides(plan, mode.name, 0, None)
    try:
        load_config(plan.config, sets)
    except ConfigError as e:
        return str(e)
    return None


def _peer_argv(plan: _Plan, mode: _ModeRun, i: int, host: Host, maddr: str) -> List[str]:
    if mode.kind == "diloco":
        sets = _diloco_sets(plan, mode, i, host)
        argv = [sys.executable, "-m", "p2pdiloco.cli", "join", "--initial-peers", maddr, "--config", plan.config]
    else:
        sets = _peer_overrides(plan, mode.name, i, host)
        argv = [sys.executable, "-m", "p2pdiloco.bench.hivemind_dp", "--initial-peers", maddr, "--config",
                plan.config, "--peers", str(plan.peers), "--steps", str(plan.dp_steps or plan.steps), "--eval-every",
                str(plan.dp_eval_every), "--averaging-timeout", f"{plan.allreduce_timeout:g}", *mode.argv_extra]
    for s in sets:
        argv += ["--set", s]
    return argv + ["--summary-json", os.path.join(plan.out, mode.name, f"peer{i}.summary.json")]


def _start_bootstrap(host: Host, mode_dir: str, files: List[IO[Any]], timeout: float = 90) -> Tuple[subprocess.Popen, str]:
    err = open(os.path.join(mode_dir, "bootstrap.log"), "w")
    files.append(err)
    proc = host.popen([sys.executable, "-m", "p2pdiloco.cli", "bootstrap", "--identity",
                       os.path.join(mode_dir, "bootstrap.key"), "--host-maddrs", f"/ip4/{host.address}/tcp/0"],
                      stdout=subprocess.PIPE, stderr=err, text=True, env=_child_env())
    import select

    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            if "/p2p/" in line:
                return proc, line.strip()
            if not line:
                break
        if proc.poll() is not None:
            break
    _kill_group(proc)
    raise RuntimeError(f"bootstrap peer printed no address (see {err.name})")


def _child_env() -> Dict[str, str]:
    # the peers keep a ledger of their DHT RPCs for the byte breakdown (swarm/ledger.py)
    return dict(os.environ, PYTHONUNBUFFERED="1", HIVEMIND_LOGLEVEL="WARNING", P2PDILOCO_LOG=os.environ.get("P2PDILOCO_LOG", "INFO"),
                **{DHT_LEDGER_ENV: "1"})


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def _last_events(path: str) -> Dict[str, Any]:
    """The latest sync (with a validation loss) and step seen in one metrics.jsonl, for the status line."""
    out: Dict[str, Any] = {}
    try:
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("event") == "sync":
                    out["step"] = rec.get("step")
                    if rec.get("val_loss") is not None:
                        out["val"] = rec["val_loss"]
                elif rec.get("event") == "start":
                    out.setdefault("val", rec.get("val_loss"))
    except OSError:
        pass
    return out


def _pin(plan: _Plan, i: int):
    """With ``--pin-cores``: a preexec function that keeps peer ``i`` (and every process it starts) on
    core ``i mod cores``, so that peers do not take turns on the same cores at random: on one shared
    machine that makes their speeds differ from round to round, and the faster ones wait for the
    slower ones at every sync, which is not communication."""
    if not plan.pin_cores:
        return None
    cores = sorted(os.sched_getaffinity(0))
    core = cores[i % len(cores)]
    return lambda: os.sched_setaffinity(0, {core})


def _run_mode(plan: _Plan, mode: _ModeRun, wan: EmulatedWAN, sampler: _Sampler, label: str) -> None:
    mode_dir = os.path.join(plan.out, mode.name)
    os.makedirs(mode_dir, exist_ok=True)
    peers = _mode_peers(plan, mode)
    mode.peer_dirs = [os.path.join(mode_dir, f"peer{i}") for i in peers]
    files: List[IO[Any]] = []
    procs: List[subprocess.Popen] = []
    boot = None
    try:
        mode.t_begin = time.time()
        if mode.name in HALF_PRIVATE | ALL_PRIVATE:
            _make_private([wan.hosts[i] for i in range(1 if mode.name in HALF_PRIVATE else 0, plan.peers,
                                                       2 if mode.name in HALF_PRIVATE else 1)])
        boot, maddr = _start_bootstrap(wan.hosts[plan.peers], mode_dir, files)
        for i in peers:
            log = open(os.path.join(mode_dir, f"peer{i}.log"), "w")
            files.append(log)
            argv = _peer_argv(plan, mode, i, wan.hosts[i], maddr)
            log.write("$ " + shlex.join(argv) + "\n")
            log.flush()
            procs.append(wan.hosts[i].popen(argv, stdout=log, stderr=subprocess.STDOUT, env=_peer_env(plan, i),
                                            cwd=mode_dir, preexec_fn=_pin(plan, i)))
        deadline = time.monotonic() + plan.mode_timeout + 180  # + start-up and shutdown
        last_status = 0.0
        first_failure: Optional[float] = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"peers still running after {plan.mode_timeout + 180:.0f} s")
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes):
                first_failure = first_failure or now
                if now - first_failure > 30:  # the others would only wait for their timeouts
                    break
            if now - last_status >= 10:
                last_status = now
                print(_status_line(plan, mode, sampler, label), flush=True)
            time.sleep(0.5)
        codes = [p.poll() for p in procs]
        mode.t_end = time.time()
        if all(c == 0 for c in codes):
            mode.status = "ok"
            return
        logs = [os.path.join(mode_dir, f"peer{i}.log") for i in peers]
        errors = [line for path in logs for line in _tail(path).splitlines() if line.startswith("error: ")]
        if errors and all(c in (None, 2) for c in codes):
            mode.status, mode.note = "skipped", f"rejected by the CLI: {errors[0][7:]}"
        else:
            bad = next(i for i, c in enumerate(codes) if c != 0)
            mode.status = "failed"
            mode.note = f"exit codes {codes}; " + (errors[0] if errors else f"see {logs[bad]}")
    except TimeoutError as e:
        mode.t_end = time.time()
        mode.status, mode.note = "failed", str(e)
    finally:
        for p in procs:
            _kill_group(p, grace=10)
        if boot is not None:
            _kill_group(boot)
        for f in files:
            f.close()
        if mode.name in HALF_PRIVATE | ALL_PRIVATE:
            for i in range(plan.peers):
                wan.hosts[i].run([_nft(), "delete", "table", "inet", _PRIVATE_TABLE], check=False)


def _nft() -> str:
    path = shutil.which("nft")
    if path is None:
        raise UserError("the half-private modes need nftables (nft) to firewall their private peers: "
                        "apt-get install nftables")
    return path


def _make_private(hosts: Sequence[Host]) -> None:
    """Drop inbound TCP connections to ``hosts`` (replies to their own connections still pass)."""
    for host in hosts:
        host.run([_nft(), "-f", "-"], input=_PRIVATE_RULES, timeout=30)


def _status_line(plan: _Plan, mode: _ModeRun, sampler: _Sampler, label: str) -> str:
    elapsed = time.time() - mode.t_begin
    evs = [_last_events(os.path.join(d, "metrics.jsonl")) for d in mode.peer_dirs]
    steps = [e.get("step") or 0 for e in evs]
    vals = [e["val"] for e in evs if e.get("val") is not None]
    sent = ""
    window = sampler.window(mode.t_begin, time.time())
    if len(window) >= 2:
        per_peer = [window[-1][1][i][0] - window[0][1][i][0] for i in range(plan.peers)]
        sent = f", sent/peer {_fmt_bytes(sum(per_peer) / plan.peers)}"
    val = f", val {min(vals):.3f}" if vals else ""
    total = plan.dp_steps or plan.steps if mode.kind == "baseline" else plan.steps
    return f"{label} {mode.name}: {elapsed:5.0f} s, step {min(steps)}/{total}{val}{sent}"


# ----------------------------------------------------------------------------- results
def _read_jsonl(path: str) -> List[Dict[str, Any]]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        pass  # a line cut off by a kill
    except OSError:
        pass
    return out


def windowed_peak(points: Sequence[Tuple[float, float]], window: float) -> float:
    """Largest average rate of a cumulative counter over any span of at least ``window`` seconds.

    ``points`` are (time, cumulative bytes), in time order. Each span runs from one sample to the
    first sample at least ``window`` later (samples are ~0.5 s apart, so a span is ``window`` plus
    at most one sample period; ``window`` 0: consecutive samples). 0.0 when no span is long enough.
    """
    best, j = 0.0, 0
    for i, (t_i, c_i) in enumerate(points):
        j = max(j, i + 1)
        while j < len(points) and points[j][0] - t_i < window - 1e-6:
            j += 1
        if j >= len(points):
            break
        dt = points[j][0] - t_i
        if dt > 0:
            best = max(best, (points[j][1] - c_i) / dt)
    return best


def summarize_mode(events_by_peer: List[List[Dict[str, Any]]], samples: List[Tuple[float, List[Tuple[int, int]]]],
                   *, tokens_per_step: int, baseline: bool) -> Dict[str, Any]:
    """Metrics of one mode from its peers' metrics.jsonl events and the interface samples.

    ``tokens_per_step`` = batch_size * seq_len (one peer, one inner step). ``samples`` hold
    (time, [(tx, rx) per host]) with the peers first. Pure function (tested on fixtures).
    """
    n = len(events_by_peer)
    starts = [next((e for e in evs if e.get("event") == "start"), None) for evs in events_by_peer]
    summaries = [next((e for e in reversed(evs) if e.get("event") == "summary"), None) for evs in events_by_peer]
    if not all(starts):
        raise ValueError("a peer wrote no start event")
    t0 = max(s["time"] for s in starts)  # the last peer is ready: training starts for everyone
    val0 = sum(s["val_loss"] for s in starts) / n

    # curve: one point per (fragment, outer step) that carries a fresh validation loss
    points: Dict[Tuple[int, int], Dict[str, list]] = {}
    for evs in events_by_peer:
        for e in evs:
            if e.get("event") != "sync" or not e.get("ok") or e.get("val_loss") is None:
                continue
            key = (int(e.get("fragment") or 0), int(e.get("outer_step") or 0))
            p = points.setdefault(key, {"step": [], "time": [], "val": []})
            # overlapped modes apply an average some steps after sending it: the model measured is that of
            # the step the average was applied at
            p["step"].append(e["applied_step"] if e.get("applied_step") is not None else e["step"])
            p["time"].append(e["time"])
            p["val"].append(e["val_loss"])
    curve = [{"tokens": 0, "seconds": 0.0, "val_loss": val0}]
    # steps are schedule positions: with rounds by the swarm's samples one is tokens_per_position of the swarm
    per_position = starts[0].get("tokens_per_position") or n * tokens_per_step
    for p in sorted(points.values(), key=lambda p: (max(p["time"]), sum(p["step"]))):
        mean_step = sum(p["step"]) / len(p["step"])
        curve.append({"tokens": int(round(mean_step * per_position)),
                      "seconds": round(max(p["time"]) - t0, 3),
                      "val_loss": sum(p["val"]) / len(p["val"])})
    curve.sort(key=lambda c: (c["tokens"], c["seconds"]))

    ends = [s["time"] if s else max(e["time"] for e in evs) for s, evs in zip(summaries, events_by_peer)]
    wall = max(ends) - t0
    utilization, compute = [], []
    for evs, end, summ in zip(events_by_peer, ends, summaries):
        span = max(end - t0, 1e-9)
        if summ is not None and summ.get("network_wait_seconds") is not None:
            blocked = float(summ["network_wait_seconds"])  # the loop's own total of time blocked on syncs
        else:  # older metrics: per-sync wait (overlapped modes) or the whole sync (blocking)
            blocked = sum(float(e["wait_seconds"] if e.get("wait_seconds") is not None else e.get("sync_seconds") or 0)
                          for e in evs if e.get("event") == "sync" and e["time"] >= t0)
        utilization.append(min(1.0, max(0.0, 1 - blocked / span)))
        if summ is not None and summ.get("compute_seconds") is not None:
            compute.append(float(summ["compute_seconds"]) / span)
    inner_steps = [s.get("inner_steps", 0) if s else 0 for s in summaries]

    # interface bytes per peer over the training window (t0 .. last summary)
    window = [s for s in samples if s[0] <= max(ends) + _SAMPLE_PERIOD]
    before = [s for s in window if s[0] <= t0]
    first = before[-1] if before else (window[0] if window else None)
    series: List[Dict[str, Any]] = []
    sent = recv = peak = [0.0] * n
    peak_by_window: Dict[str, float] = {}
    if first is not None:
        used = [s for s in window if s[0] >= first[0]]
        sent = [used[-1][1][i][0] - first[1][i][0] for i in range(n)]
        recv = [used[-1][1][i][1] - first[1][i][1] for i in range(n)]
        tx = [[(s[0], s[1][i][0]) for s in used] for i in range(n)]  # (time, bytes sent) per peer
        peak = [windowed_peak(points, 0.0) for points in tx]  # between consecutive samples
        peak_by_window = {f"{w:g}": sum(windowed_peak(points, w) for points in tx) / n for w in PEAK_WINDOWS}
        series = [{"seconds": round(s[0] - t0, 2),
                   "sent_per_peer": sum(s[1][i][0] - first[1][i][0] for i in range(n)) / n}
                  for s in used]
    counted = None
    if not baseline and all(summaries):
        counted = sum(int(s.get("bytes_sent") or 0) for s in summaries) / n
    failed = sum(int(s.get("failed_syncs") or 0) for s in summaries if s)
    evals = [s.get("eval_seconds") for s in summaries if s]
    eval_seconds = sum(evals) / n if evals and len(evals) == n and None not in evals else 0.0
    # every replica should end with the same model: a spread means they diverged
    finals = [float(s["val_loss_end"]) for s in summaries if s and s.get("val_loss_end") is not None]
    # the DHT RPCs the peers made, by RPC and record kind (swarm/ledger.py): [calls, request B, response B] per peer
    ledgers = [s["dht_ledger"] for s in summaries if s and s.get("dht_ledger")]
    dht_ledger = None
    if ledgers:
        dht_ledger = {k: [round(sum(lg.get(k, [0, 0, 0])[j] for lg in ledgers) / len(ledgers), 1) for j in range(3)]
                      for k in sorted(set().union(*ledgers))}
    syncs = [int(s.get("syncs") or 0) for s in summaries if s]
    relayed = [int(s.get("relayed_bytes") or 0) for s in summaries if s]
    # the averaged pseudo-gradient's norm per applied round (one peer's view: every member applies the same)
    norms = [float(e["avg_norm"]) for e in (events_by_peer[0] if events_by_peer else [])
             if e.get("event") == "sync" and e.get("ok") and e.get("avg_norm") is not None]
    return {
        "peers": n,
        "wall_seconds": round(wall, 2),
        "tokens": int(sum(inner_steps) * tokens_per_step),
        "inner_steps_per_peer": inner_steps,
        "val_loss_start": val0,
        # p2pdiloco peers: the model at the end is the global model in every mode (DiLoCo.finish), and
        # val_loss_end measures it; the curve's last point is the last sync's, which with fragments saw
        # local steps on the others when no sync landed at the end (tau = 0)
        "val_loss_final": (sum(finals) / n if not baseline and len(finals) == n else curve[-1]["val_loss"]),
        "val_loss_final_per_peer": finals,
        "val_loss_final_spread": max(finals) - min(finals) if finals else None,
        "bytes_sent_per_peer": sum(sent) / n,
        "bytes_sent_per_peer_max": max(sent),
        "bytes_received_per_peer": sum(recv) / n,
        "counted_bytes_sent_per_peer": counted,
        "peak_bytes_per_s_per_peer": sum(peak) / n,
        "peak_bytes_per_s_max": max(peak),
        # per window length (s): the largest send rate over any span that long, mean over peers
        "peak_bytes_per_s_by_window": peak_by_window,
        "mean_bytes_per_s_per_peer": sum(sent) / n / max(wall, 1e-9),
        "utilization": sum(utilization) / n,
        "utilization_per_peer": [round(u, 4) for u in utilization],
        # measured forward/backward time / wall, where the trainer reports it (the hivemind baseline)
        "compute_fraction": sum(compute) / len(compute) if compute else None,
        "failed_syncs": failed,
        "eval_seconds": eval_seconds,  # validation time per peer, where the trainer reports it (the baseline)
        "curve": curve,
        "bytes_series": series,
        "syncs_per_peer": sum(syncs) / len(syncs) if syncs else None,
        # bytes each peer sent on streams through a relay (private peers reached through the bootstrap)
        "relayed_bytes_per_peer": sum(relayed) / len(relayed) if relayed else 0,
        "avg_norm_per_round": [round(x, 4) for x in norms],
        "dht_ledger_per_peer": dht_ledger,
    }


def _time_to_target(curve: List[Dict[str, Any]], target: float) -> Optional[float]:
    """Seconds to the first validation after training started at or below ``target`` (None: never)."""
    for c in curve[1:]:
        if c["val_loss"] <= target:
            return c["seconds"]
    return None


def _fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0
    return f"{n:.1f} GB"  # pragma: no cover


def format_table(results: Dict[str, Any]) -> str:
    """A markdown table of the modes in ``results`` (as written to results.json)."""
    modes = results["modes"]
    ref = modes.get(DP_REFERENCE) or next((m for name, m in modes.items() if name in BASELINES and m.get("status") == "ok"), None)
    head = ("| mode | status | tokens | final val loss | vs DP | wall s | sent/peer (iface) | DP/mode bytes "
            "| counted sent/peer | peak B/s/peer | util | time to target s |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, m in modes.items():
        if m.get("status") != "ok":
            rows.append(f"| {name} | {m.get('status')} | {m.get('note', '')[:90]} |" + " |" * 9)
            continue
        status = f"ok, {m['failed_syncs']} failed syncs" if m.get("failed_syncs") else "ok"
        vs = ratio = "-"
        if ref is not None:
            vs = f"{100 * (m['val_loss_final'] / ref['val_loss_final'] - 1):+.1f}%"
            ratio = f"{ref['bytes_sent_per_peer'] / max(m['bytes_sent_per_peer'], 1):.1f}x"
        ttt = m.get("time_to_target_seconds")
        rows.append(
            f"| {name} | {status} | {m['tokens']:,} | {m['val_loss_final']:.4f} | {vs} | {m['wall_seconds']:.0f} "
            f"| {_fmt_bytes(m['bytes_sent_per_peer'])} | {ratio} | {_fmt_bytes(m['counted_bytes_sent_per_peer'])} "
            f"| {_fmt_bytes(m['peak_bytes_per_s_per_peer'])}/s | {100 * m['utilization']:.1f}% "
            f"| {'-' if ttt is None else f'{ttt:.0f}'} |"
        )
    relayed = {name: m for name, m in modes.items() if m.get("status") == "ok" and m.get("relayed_bytes_per_peer")}
    if relayed:
        rows += ["", "| mode | relayed sent/peer | share of sent | s per sync |", "|---|---|---|---|"]
        for name, m in relayed.items():
            per_sync = m["wall_seconds"] / m["syncs_per_peer"] if m.get("syncs_per_peer") else None
            rows.append(f"| {name} | {_fmt_bytes(m['relayed_bytes_per_peer'])} "
                        f"| {100 * m['relayed_bytes_per_peer'] / max(m['bytes_sent_per_peer'], 1):.0f}% "
                        f"| {'-' if per_sync is None else f'{per_sync:.1f}'} |")
    normed = {name: m for name, m in modes.items() if m.get("status") == "ok" and m.get("avg_norm_per_round")}
    if normed:  # the size of what the outer steps consumed (sync events' avg_norm)
        rows += ["", "| mode | mean avg_norm per round | inner steps per peer |", "|---|---|---|"]
        for name, m in normed.items():
            norms = m["avg_norm_per_round"]
            rows.append(f"| {name} | {sum(norms) / len(norms):.2f} | "
                        f"{', '.join(str(s) for s in m.get('inner_steps_per_peer') or [])} |")
    windowed = {name: m["peak_bytes_per_s_by_window"] for name, m in modes.items()
                if m.get("status") == "ok" and m.get("peak_bytes_per_s_by_window")}
    if windowed:
        ws = sorted({w for peaks in windowed.values() for w in peaks}, key=float)
        rows += ["", "| peak B/s/peer over a window of | " + " | ".join(f"{w} s" for w in ws) + " |",
                 "|---|" + "---|" * len(ws)]
        for name, peaks in windowed.items():
            rows.append(f"| {name} | " + " | ".join(f"{_fmt_bytes(peaks[w])}/s" if w in peaks else "-" for w in ws) + " |")
    rows += format_breakdown(modes)
    return "\n".join(rows)


def format_breakdown(modes: Dict[str, Any]) -> List[str]:
    """Per mode with a DHT ledger: where the interface bytes went, per peer and per sync: the
    all-reduce (our counter), each DHT RPC by record kind (requests + responses of the RPCs the peer
    made, swarm/ledger.py), and the rest (stream framing, encryption, TCP/IP, matchmaking's and the
    warm step's messages). Empty when no mode kept a ledger."""
    rows: List[str] = []
    for name, m in modes.items():
        ledger = m.get("dht_ledger_per_peer") if m.get("status") == "ok" else None
        if not ledger:
            continue
        syncs = max(float(m.get("syncs_per_peer") or 0), 1.0)
        iface = float(m["bytes_sent_per_peer"] + m["bytes_received_per_peer"]) / 2
        counted = float(m.get("counted_bytes_sent_per_peer") or 0)
        rows += ["", f"**{name}**: bytes per peer (interface: mean of sent and received) over {syncs:.0f} syncs",
                 "", "| part | calls/peer | bytes/peer | per sync | share of interface |", "|---|---|---|---|---|"]

        def row(part: str, calls: str, b: float) -> None:
            rows.append(f"| {part} | {calls} | {_fmt_bytes(b)} | {_fmt_bytes(b / syncs)} | {100 * b / max(iface, 1):.1f}% |")
        row("interface (everything)", "-", iface)
        row("all-reduce (counter)", "-", counted)
        dht_total = 0.0
        for key, (calls, req, resp) in sorted(ledger.items(), key=lambda kv: -(kv[1][1] + kv[1][2])):
            row(f"DHT {key}", f"{calls:.0f}", req + resp)
            dht_total += req + resp
        row("DHT total", f"{sum(v[0] for v in ledger.values()):.0f}", dht_total)
        row("rest (framing, encryption, TCP/IP, matchmaking messages)", "-", iface - counted - dht_total)
    return rows


def _save(fig, out: str, fname: str) -> str:
    """Lay out, write and close one figure; its path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = os.path.join(out, fname)
    fig.savefig(path)
    plt.close(fig)
    return path


def _plot(results: Dict[str, Any], out: str) -> List[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    ok = {k: m for k, m in results["modes"].items() if m.get("status") == "ok"}
    target = results.get("target_loss")
    paths = []
    specs = [
        ("loss_vs_tokens.png", "tokens (all peers)", lambda c: c["tokens"], "val_loss", "validation loss vs tokens"),
        ("loss_vs_time.png", "wall-clock seconds (symlog)", lambda c: c["seconds"], "val_loss",
         "validation loss vs wall time"),
    ]
    for fname, xlabel, xf, _, title in specs:
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
        for name, m in ok.items():
            ax.plot([xf(c) for c in m["curve"]], [c["val_loss"] for c in m["curve"]], marker=".", label=name)
        if target is not None:
            ax.axhline(target, color="grey", linestyle=":", linewidth=1, label=f"target {target:.3f}")
        if fname == "loss_vs_time.png":
            ax.set_xscale("symlog", linthresh=10)  # the baseline takes far longer: keep the others readable
            ax.set_xlim(left=0)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss (nats/token)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        paths.append(_save(fig, out, fname))
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for name, m in ok.items():
        s = m["bytes_series"]
        if s:
            ax.plot([p["seconds"] for p in s], [max(p["sent_per_peer"] / 1e6, 0.01) for p in s], label=name)
    ax.set_yscale("log")
    ax.set_ylim(bottom=0.01)
    ax.set_xlabel("wall-clock seconds")
    ax.set_ylabel("MB sent per peer (interface, cumulative)")
    ax.set_title("bytes sent over time", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    paths.append(_save(fig, out, "bytes_vs_time.png"))
    by_window = {name: m["peak_bytes_per_s_by_window"] for name, m in ok.items() if m.get("peak_bytes_per_s_by_window")}
    if by_window:
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
        for name, peaks in by_window.items():
            ws = sorted(peaks, key=float)
            ax.plot([float(w) for w in ws], [peaks[w] / 1e6 for w in ws], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ws_all = sorted({float(w) for peaks in by_window.values() for w in peaks})
        ax.set_xticks(ws_all, [f"{w:g}" for w in ws_all])
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_xlabel("window (s)")
        ax.set_ylabel("peak MB/s sent per peer (interface)")
        ax.set_title("peak send rate over windows of each length", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
        paths.append(_save(fig, out, "peak_vs_window.png"))
    return paths


def _finish(results: Dict[str, Any], modes: List[_ModeRun], plan: _Plan, sampler: Optional[_Sampler],
            target_flag: Optional[float], cfg: Any = None, dp_curve_file: Optional[str] = None) -> None:
    for mode in modes:
        entry: Dict[str, Any] = {"status": mode.status, "note": mode.note, "kind": mode.kind,
                                 "args": list(mode.argv_extra)}
        if mode.status == "ok":
            events = [_read_jsonl(os.path.join(d, "metrics.jsonl")) for d in mode.peer_dirs]
            samples = sampler.window(mode.t_begin, mode.t_end + 2) if sampler else []
            idx = _mode_peers(plan, mode)  # the hosts of the peers that trained, in peer order
            samples = [(t, [hosts[i] for i in idx]) for t, hosts in samples]
            try:
                entry.update(summarize_mode(events, samples, tokens_per_step=plan.batch_size * plan.seq_len,
                                            baseline=mode.kind == "baseline"))
                if sampler is not None:
                    entry["mean_loadavg"] = sampler.mean_load(mode.t_begin, mode.t_end)
            except (ValueError, KeyError) as e:
                entry.update(status="failed", note=f"metrics unreadable: {e!r}")
        results["modes"][mode.name] = entry
    short = [n for n, m in results["modes"].items() if m.get("kind") == "baseline" and m.get("status") == "ok"
             and plan.dp_steps < plan.steps]
    for name in short:
        results["modes"][name]["note"] = (f"networked over {plan.dp_steps} of {plan.steps} steps: its time and bytes "
                                          f"per step make {DP_REFERENCE}'s")
    if short and cfg is not None:
        results["modes"][DP_REFERENCE] = dp_reference_mode(results["modes"][short[0]], short[0], cfg, plan,
                                                            dp_curve_file)
    full = {n: m for n, m in results["modes"].items() if m.get("status") == "ok" and n not in short}
    finals = [m["val_loss_final"] for m in full.values() if m["val_loss_final"] < m["val_loss_start"]]
    ref = full.get(DP_REFERENCE)
    if target_flag is not None:
        target, rule = target_flag, "--target-loss"
    elif ref is not None and all(min(c["val_loss"] for c in m["curve"]) <= ref["val_loss_final"] for m in full.values()):
        target, rule = ref["val_loss_final"], "data parallelism's final validation loss (every mode reaches it)"
    else:
        target = max(finals) if finals else None
        rule = ("worst final validation loss among the modes that improved on the initial loss"
                + (" (not every mode reaches data parallelism's final loss)" if ref is not None else ""))
    results["target_loss"] = target
    results["target_rule"] = rule
    planned = results.get("tokens_planned")
    for name, m in results["modes"].items():
        if m.get("status") != "ok" or name in short:
            continue
        if target is not None:
            m["time_to_target_seconds"] = _time_to_target(m["curve"], target)
            m["tokens_to_target"] = next((c["tokens"] for c in m["curve"][1:] if c["val_loss"] <= target), None)
        if planned and m["tokens"] != planned:
            # train.max_outer_steps counts successful rounds: failed ones add inner steps
            m["note"] = (m.get("note") or "") + f"trained {m['tokens']:,} tokens, not the planned {planned:,}"


def _every(seconds: float, fn):
    """``fn`` at most once per ``seconds`` (status lines of long loops)."""
    last = [0.0]

    def call(line: str) -> None:
        if time.monotonic() - last[0] >= seconds:
            last[0] = time.monotonic()
            fn(line)
    return call


#: the results entry of data parallelism over the whole budget when the networked baseline ran a shorter span
DP_REFERENCE = "dp-reference"


def dp_reference_mode(measured: Dict[str, Any], name: str, cfg: Any, plan: _Plan,
                      curve_file: Optional[str] = None) -> Dict[str, Any]:
    """Data parallelism over the whole budget: the loss curve computed in process (bench/dp_reference.py,
    the same math as the networked run), wall time and bytes per step from the networked baseline
    ``measured`` (its wall time without its validations, and its interface bytes, per global step),
    and the check of the in-process curve against the networked run's validations over the span both ran."""
    from .dp_reference import check_against, dp_curve, identity

    if curve_file:
        with open(curve_file) as f:
            ref = json.load(f)
        if ref.get("identity") != identity(cfg, plan.peers) or ref.get("steps", 0) < plan.steps:
            raise UserError(f"--dp-curve {curve_file} was computed for another configuration or fewer steps than "
                            f"{plan.steps}: recompute it with python -m p2pdiloco.bench.dp_reference (the command "
                            "in docs/benchmark.md)")
    else:
        print(f"data parallelism over {plan.steps} steps, in process (the loss curve; time and bytes per step from "
              f"{name})", flush=True)
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as every peer trains (train.threads=1); more threads only contend on a shared CPU
        try:
            ref = dp_curve(cfg, plan.peers, plan.steps, math.gcd(plan.sync_every, plan.dp_eval_every),
                           status=_every(10.0, lambda line: print("  " + line, flush=True)))
        finally:
            torch.set_num_threads(threads)
    per_step_tokens = plan.peers * plan.batch_size * plan.seq_len
    steps_measured = plan.dp_steps
    compute_wall = max(measured["wall_seconds"] - measured.get("eval_seconds", 0.0), 1e-9)
    per_step = compute_wall / steps_measured
    bytes_per_step = measured["bytes_sent_per_peer"] / steps_measured
    curve = [{"tokens": p["step"] * per_step_tokens, "seconds": round(p["step"] * per_step, 2), "val_loss": p["val"]}
             for p in ref["curve"] if p["step"] <= plan.steps]
    networked = [{"step": int(round(c["tokens"] / per_step_tokens)), "val": c["val_loss"]} for c in measured["curve"][1:]]
    check = check_against(ref["curve"], networked)
    return {
        "status": "ok", "kind": "reference", "args": [],
        "note": (f"loss curve in process over {plan.steps} steps; time and bytes: {name} measured over "
                 f"{steps_measured} steps ({per_step:.2f} s and {_fmt_bytes(bytes_per_step)} per step)"),
        "peers": plan.peers, "wall_seconds": round(per_step * plan.steps, 2), "tokens": plan.steps * per_step_tokens,
        "val_loss_start": curve[0]["val_loss"], "val_loss_final": curve[-1]["val_loss"],
        "bytes_sent_per_peer": bytes_per_step * plan.steps, "counted_bytes_sent_per_peer": None,
        "peak_bytes_per_s_per_peer": measured["peak_bytes_per_s_per_peer"],
        "peak_bytes_per_s_by_window": {}, "utilization": measured["utilization"],
        "compute_fraction": measured.get("compute_fraction"), "failed_syncs": 0, "curve": curve,
        "bytes_series": [{"seconds": c["seconds"], "sent_per_peer": bytes_per_step * c["tokens"] / per_step_tokens}
                         for c in curve],
        "seconds_per_step": round(per_step, 3), "bytes_per_step": bytes_per_step, "check_against_networked": check,
    }


# ----------------------------------------------------------------------------- driver
def budget_sets(cfg: Any, steps: int) -> List[str]:
    """Settings that follow from the benchmark's budget of ``steps`` inner steps per peer: a cosine inner
    lr schedule without ``inner.decay_steps`` spans the budget (in every mode and the in-process reference)."""
    if cfg.inner.lr_schedule == "cosine" and not cfg.inner.decay_steps:
        return [f"inner.decay_steps={steps}"]
    return []


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return ""


def _machine() -> Dict[str, Any]:
    import hivemind
    import torch

    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            mem = f"{int(f.readline().split()[1]) / 2**20:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return {"host": platform.node(), "kernel": platform.release(), "cpu": cpu, "cores": os.cpu_count(),
            "loadavg_at_start": _loadavg(),
            "memory": mem, "python": platform.python_version(), "torch": torch.__version__,
            "hivemind": hivemind.__version__}


def _git_state() -> Dict[str, Any]:
    """The commit benchmarked and the files that differed from it (the tree is what ran)."""
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", "-C", _REPO, *a], capture_output=True, text=True, timeout=10).stdout.rstrip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "HEAD").strip(),
            "modified": [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]}


def run_benchmark(args: argparse.Namespace) -> Dict[str, Any]:
    """Run the matrix described by parsed ``args``; write and return the results."""
    from ..config import SwarmConfig, load_config

    require_root()
    names = [m for m in args.modes.split(",") if m] if args.modes else list(MATRICES[args.matrix])
    unknown = [m for m in names if m not in MODES and m not in BASELINES]
    if unknown:
        raise ConfigError(f"unknown mode(s) {', '.join(unknown)}; known: {', '.join([*BASELINES, *MODES])}")
    if args.peers < 2:
        raise ConfigError(f"--peers ({args.peers}) must be at least 2")
    link = LinkSpec(args.rate, args.delay, args.jitter, args.loss).validate()
    user_sets = [*MATRIX_SETS.get(args.matrix, ()), *args.set]  # also with --modes: --matrix long --modes ...
    base = load_config(args.config, [*BASE_SETS, *user_sets], validate=False)
    H = base.inner.sync_every
    tokens_per_round = args.peers * base.inner.batch_size * base.model.seq_len * H
    if args.tokens:
        steps = max(1, math.ceil(args.tokens / tokens_per_round)) * H
    else:
        steps = args.steps or MATRIX_ROUNDS.get(args.matrix, 2) * H
    if steps % H:
        raise ConfigError(f"--steps ({steps}) must be a multiple of inner.sync_every ({H})")
    user_sets += budget_sets(base, steps)
    base = load_config(args.config, [*BASE_SETS, *user_sets])
    params = _count_params(base)
    # an fp32 all-reduce moves ~2 * params * 4 bytes through each peer's link; allow 3x that plus slack
    est_allreduce = 2 * params * 4 * 8 / (link.rate_mbit * 1e6) + 4 * link.delay_ms / 1000 * 10
    allreduce_timeout = args.allreduce_timeout or max(30.0, 3 * est_allreduce + 10)
    plan = _Plan(
        config=args.config, peers=args.peers, steps=steps, sync_every=H, batch_size=base.inner.batch_size,
        seq_len=base.model.seq_len, user_sets=user_sets, link=link, out=os.path.abspath(args.out),
        mode_timeout=args.mode_timeout, allreduce_timeout=allreduce_timeout,
        matchmaking_timeout=max(60.0, allreduce_timeout),
        supports_start_wait=hasattr(SwarmConfig(), "min_peers_to_start"),
        pin_cores=args.pin_cores, speeds=_speeds(args),
        dp_steps=min(steps, args.dp_steps or DP_STEPS.get(args.matrix, 0) or steps),
    )
    os.makedirs(plan.out, exist_ok=True)
    modes = [_ModeRun(n, "baseline" if n in BASELINES else "diloco", BASELINES.get(n) or MODES.get(n, ())) for n in names]
    for mode in modes:
        problem = _validate_mode(plan, mode)
        if problem:
            mode.status, mode.note = "skipped", f"rejected by the CLI: {problem}"
    results: Dict[str, Any] = {
        "command": " ".join(["python -m p2pdiloco.bench.run", *map(shlex.quote, args.argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": _machine(),
        "git": _git_state(),
        "link": vars(link), "peers": plan.peers, "speeds": list(plan.speeds), "pin_cores": plan.pin_cores, "steps_per_peer": steps, "sync_every": H,
        "batch_size": plan.batch_size, "seq_len": plan.seq_len, "params": params,
        "tokens_planned": steps * plan.peers * plan.batch_size * plan.seq_len,
        "config": os.path.relpath(args.config, _REPO) if args.config.startswith(_REPO) else args.config,
        "sets": user_sets, "allreduce_timeout": allreduce_timeout, "dp_steps": plan.dp_steps, "modes": {},
    }
    todo = [m for m in modes if m.status == "pending"]
    print(f"benchmark: {plan.peers} peers at {link.rate_mbit:g} Mbit/s, {link.delay_ms:g} ms delay"
          f"{f', {link.jitter_ms:g} ms jitter' if link.jitter_ms else ''}{f', {link.loss_pct:g}% loss' if link.loss_pct else ''}; "
          f"{params:,} params, {steps} inner steps/peer (H={H}), {results['tokens_planned']:,} tokens per mode; "
          f"{len(todo)} mode(s) to run -> {plan.out}", flush=True)
    for m in modes:
        if m.status == "skipped":
            print(f"  skip {m.name}: {m.note}", flush=True)
    sampler: Optional[_Sampler] = None
    try:
        if args.cleanup_stale:
            cleanup_stale()
        with EmulatedWAN(plan.peers + 1, link) as wan:
            results["backend"] = wan.backend
            print(f"network: {len(wan.namespaces) - 1} namespaces on {wan.subnet} ({wan.backend}), switch "
                  f"{wan.switch_netns}", flush=True)
            anchors = [h.popen(["sleep", "infinity"]).pid for h in wan.hosts]
            sampler = _Sampler(anchors)
            sampler.start()
            for k, mode in enumerate(todo):
                label = f"[{k + 1}/{len(todo)}]"
                print(f"{label} {mode.name}: starting", flush=True)
                _run_mode(plan, mode, wan, sampler, label)
                done = f"{label} {mode.name}: {mode.status} in {mode.t_end - mode.t_begin:.0f} s"
                if mode.status == "ok":
                    evs = [_last_events(os.path.join(d, "metrics.jsonl")) for d in mode.peer_dirs]
                    vals = [e["val"] for e in evs if e.get("val") is not None]
                    done += f", final val {sum(vals) / max(1, len(vals)):.4f}"
                print(done + (f" ({mode.note})" if mode.note else ""), flush=True)
            sampler.stop()
    finally:
        if sampler is not None:
            sampler.stop()
        results["machine"]["loadavg_at_end"] = _loadavg()
        _finish(results, modes, plan, sampler, args.target_loss, base, args.dp_curve)
        with open(os.path.join(plan.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
    results["plots"] = _plot(results, plan.out)
    table = format_table(results)
    with open(os.path.join(plan.out, "table.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(plan.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print()
    print(table)
    print(f"\ntarget validation loss {results['target_loss']} ({results['target_rule']}); results in {plan.out}")
    return results


def _speeds(args: argparse.Namespace) -> Tuple[float, ...]:
    if not args.speeds:
        return SPEEDS_DEFAULT if args.matrix in ("speeds", "weighting") and not args.modes and args.peers == len(SPEEDS_DEFAULT) else ()
    try:
        speeds = tuple(float(x) for x in args.speeds.split(","))
    except ValueError:
        raise ConfigError(f"--speeds {args.speeds!r}: expected comma-separated numbers, e.g. 1,1,0.5,0.2") from None
    if len(speeds) != args.peers or not all(0 < x <= 1 for x in speeds):
        raise ConfigError(f"--speeds {args.speeds!r}: one speed in (0, 1] per peer ({args.peers} peers)")
    return speeds


def _count_params(cfg: Any) -> int:
    from ..model import build_model, count_parameters

    return count_parameters(build_model(cfg.model))


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m p2pdiloco.bench.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--matrix", choices=sorted(MATRICES), default="quick",
                   help=", ".join(f"{k}: {' '.join(v)}" for k, v in MATRICES.items()))
    p.add_argument("--modes", default="", help="comma-separated modes instead of a matrix; known: "
                   + ", ".join([*BASELINES, *MODES]))
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--rate", type=float, default=10, help="link rate per direction and peer, Mbit/s")
    p.add_argument("--delay", type=float, default=50, help="one-way delay on each peer's uplink, ms")
    p.add_argument("--jitter", type=float, default=0, help="uniform jitter, ms")
    p.add_argument("--loss", type=float, default=0, help="uplink packet loss, percent")
    p.add_argument("--steps", type=int, default=0, help="inner steps per peer (default: rounds of the matrix * H: "
                   + ", ".join(f"{k} {v}" for k, v in MATRIX_ROUNDS.items()) + ")")
    p.add_argument("--tokens", type=int, default=0,
                   help="tokens per mode, all peers together (rounded up to whole outer steps); overrides --steps")
    p.add_argument("--config", default=_DEFAULT_CONFIG, help="peer TOML config (default peers/tiny-cpu.toml)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override for every peer of every mode (repeatable)")
    p.add_argument("--target-loss", type=float, default=None,
                   help="validation loss for time-to-target (default: worst final loss among the modes)")
    p.add_argument("--dp-steps", type=int, default=0,
                   help="global steps of the networked data-parallel baseline (default: the whole budget; long: "
                        f"{DP_STEPS.get('long')}); when fewer, data parallelism's curve over the budget is computed "
                        "in process and its time and bytes per step come from the networked run")
    p.add_argument("--dp-curve", default=None, metavar="JSON",
                   help="the in-process curve written by python -m p2pdiloco.bench.dp_reference --json (same "
                        "config and peers, at least as many steps) instead of computing it")
    p.add_argument("--mode-timeout", type=float, default=1800, help="training budget of one mode, s")
    p.add_argument("--allreduce-timeout", type=float, default=0,
                   help="swarm.allreduce_timeout / hivemind averaging_timeout, s (default: sized for the link)")
    p.add_argument("--speeds", default="", metavar="S0,S1,...",
                   help="relative speed of each peer (1 = full; 0.2 = 5x slower: sleeps 4x each step's compute "
                        f"time); the speeds matrix defaults to {','.join(f'{x:g}' for x in SPEEDS_DEFAULT)}")
    p.add_argument("--pin-cores", action="store_true",
                   help="pin peer i (with its DHT and p2p daemon) to core i mod the number of cores")
    p.add_argument("--out", default=None, help="output directory (default bench_results/<UTC date-time>)")
    p.add_argument("--cleanup-stale", action="store_true", help="first remove namespaces of dead benchmark runs")
    p.add_argument("--replot", metavar="DIR", help="only redraw the plots and table of DIR/results.json (no root needed)")
    return p


def replot(out: str) -> Dict[str, Any]:
    """Redraw the plots and table of an existing run from its results.json."""
    path = os.path.join(out, "results.json")
    if not os.path.isfile(path):
        raise UserError(f"{path} not found: give the output directory of a benchmark run")
    with open(path) as f:
        results = json.load(f)
    results["plots"] = _plot(results, out)
    table = format_table(results)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = _build_parser().parse_args(argv)
    args.argv = argv
    if args.out is None:
        args.out = os.path.join("bench_results", datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S"))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if args.replot:
            replot(args.replot)
            return 0
        results = run_benchmark(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: network and processes torn down; partial results in " + args.out, file=sys.stderr)
        return 130
    return 0 if all(m.get("status") != "failed" for m in results["modes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
