"""Streaming DiLoCo: fragments on a schedule, syncs in the background, the tau / delay / eager modes.

Single process. A :class:`Hub` stands in for the network so M peers (one thread each, the real
:class:`DiLoCo`) average together in member order, exactly as the butterfly owners do; it can hold an
all-reduce back until a peer has taken more inner steps, or fail a round for everyone. Each mode is
compared with :func:`reference_run`, an independent single-process implementation of Streaming
DiLoCo's fragments and overlap modes (torch's own SGD(nesterov) as the outer optimiser, look-aheads
on copies); the multi-process swarm is compared with the same reference in test_streaming_swarm.py.
"""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch

from conftest import TINY
from p2pdiloco.compression.robust import weighted_mean
from p2pdiloco.config import load_config
from p2pdiloco.data import BatchStream, load_corpus
from p2pdiloco.diloco.core import DiLoCo
from p2pdiloco.diloco.fragments import Schedule
from p2pdiloco.train.inner import inner_setup, inner_step
from p2pdiloco.diloco.outer import OuterState
from p2pdiloco.diloco.background import BandwidthMeter
from p2pdiloco.diloco.overlap import lookahead
from p2pdiloco.errors import ConfigError, SyncFailed
from p2pdiloco.model import build_model
from p2pdiloco.run_identity import fingerprint_fields, run_fingerprint
from p2pdiloco.swarm.group import Coverage, Group
from p2pdiloco.swarm.protocol import Traffic

# a small model so every test here takes a second or two
SMALL = ["model.d_model=32", "model.n_heads=2", "model.seq_len=32", "inner.batch_size=2", "train.threads=1"]


def make_cfg(*overrides: str):
    return load_config(TINY, SMALL + list(overrides))


# ---- the stand-in network ------------------------------------------------------------------------------
class Hub:
    """All-reduce among ``m`` in-process peers: weighted mean summed in member order, in fp32."""

    def __init__(self, m: int, fail: Sequence[Tuple[int, int]] = ()):
        self.m = m
        self.fail = set(fail)
        self.cond = threading.Condition()
        self.parts: Dict[Tuple[str, str], Dict[int, Tuple[float, torch.Tensor]]] = {}
        self.results: Dict[Tuple[str, str], torch.Tensor] = {}
        self.calls: List[Tuple[int, int, int, str, int]] = []   # (peer, frag, round, phase, inner step)
        self.groups: List[Tuple[int, int, int, int, int]] = []  # (peer, frag, round, send step, inner step)

    def reduce(self, idx: int, key: Tuple[str, str], vec: torch.Tensor, weight: float) -> torch.Tensor:
        with self.cond:
            self.parts.setdefault(key, {})[idx] = (weight, vec.detach().clone())
            if len(self.parts[key]) == self.m:
                parts = [self.parts[key][i] for i in range(self.m)]
                self.results[key] = weighted_mean([p for _, p in parts], [w for w, _ in parts])
                self.cond.notify_all()
            assert self.cond.wait_for(lambda: key in self.results, timeout=60), f"hub: {key} incomplete"
            return self.results[key].clone()


class FakeSwarm:
    """The two calls DiLoCo makes on a Swarm, answered by the hub. ``hold(peer, group, phase)`` may
    block an all-reduce (to keep it in flight while the peer trains on)."""

    def __init__(self, hub: Hub, idx: int, hold: Optional[Callable] = None):
        self.hub, self.idx, self.hold = hub, idx, hold
        traffic = Traffic()
        self.node = SimpleNamespace(traffic=traffic, state_traffic=Traffic(parent=traffic))
        self.diloco: Optional[DiLoCo] = None
        self.threads = set()
        self.finishing = False  # set when the peer's loop ended and it drains its syncs

    def expected_group(self, sync_step: int) -> int:
        return self.hub.m

    def form_group(self, frag: int, round_: int, sync_step: int) -> Group:
        self.hub.groups.append((self.idx, frag, round_, sync_step, self.diloco.position))
        members = tuple(f"peer{i}" for i in range(self.hub.m))
        return Group(gid=f"{frag}:{round_}", members=members, my_index=self.idx, frag=frag, round=round_)

    def allreduce(self, group: Group, phase: str, vec: torch.Tensor, weight: float, codec,
                  on_coverage=None) -> torch.Tensor:
        self.threads.add(threading.current_thread().name)
        if self.hold is not None:
            self.hold(self, group, phase)
        self.hub.calls.append((self.idx, group.frag, group.round, phase,
                               -1 if self.finishing else self.diloco.position))
        if (group.frag, group.round) in self.hub.fail:
            raise SyncFailed(f"injected failure of fragment {group.frag} round {group.round}")
        self.node.traffic.add(sent=4 * vec.numel(), received=4 * vec.numel())
        return self.hub.reduce(self.idx, (group.gid, phase), vec, weight)


def hold_until(steps_after_send: Callable[[int], int], extra_sleep: float = 0.0):
    """A hold that keeps the all-reduce of the sync sent at step s until the peer reached s + k."""

    def hold(swarm: FakeSwarm, group: Group, phase: str) -> None:
        d = swarm.diloco
        send = d.schedule.send_step(group.frag, group.round)
        target = send + steps_after_send(group.frag)
        while d.position < target and not swarm.finishing:
            time.sleep(0.001)
        if extra_sleep:
            time.sleep(extra_sleep)

    return hold


# ---- peers driven like loop.py ----------------------------------------------------------------------------
_RNG = threading.Lock()  # the init draws from torch's global RNG, which the peer threads share


def _inner_setup(cfg, shard: int):
    with _RNG:
        return inner_setup(cfg, load_corpus(cfg.data), shard)


def _inner_step(cfg, model, opt, stream, step: int) -> int:
    """One inner step as loop.py takes it (the same function); ``step`` = steps taken before."""
    return inner_step(cfg, model, opt, stream, step)[1]


def run_peers(cfg, m: int, outer_steps: int, hub: Optional[Hub] = None, hold=None, factory=DiLoCo,
              after_report: Optional[Callable] = None, on_sync: Optional[Callable] = None):
    """``m`` peers in threads until fragment 0 has ``outer_steps`` rounds (as loop.py stops), then finish()
    (``before_finish``: each peer's parameters when its loop stopped). ``after_report(i, diloco, report, drained)`` sees each report when the loop gets it; ``on_sync(i,
    diloco, report)`` is DiLoCo's own callback (called before the next round of the fragment is sent)."""
    hub = hub or Hub(m)
    torch.set_num_threads(1)  # as the reference: the same kernels, the same roundings
    out: Dict[int, dict] = {}
    errors: List[BaseException] = []

    def peer(i: int) -> None:
        try:
            model, opt, stream = _inner_setup(cfg, shard=i)
            swarm = FakeSwarm(hub, i, hold)
            d = factory(model, cfg, swarm)
            swarm.diloco = d
            if on_sync is not None:
                d.on_sync = lambda r: on_sync(i, d, r)
            reports = []
            while d.outer_round() < outer_steps:
                n = _inner_step(cfg, model, opt, stream, d.position)
                for r in d.after_inner_step(n):
                    reports.append(r)
                    if after_report is not None:
                        after_report(i, d, r, False)
            swarm.finishing = True
            before_finish = [p.detach().clone() for p in model.parameters()]
            if hasattr(d, "finish"):
                for r in d.finish():
                    reports.append(r)
                    if after_report is not None:
                        after_report(i, d, r, True)
                d.close()
            out[i] = {"diloco": d, "model": model, "reports": reports, "swarm": swarm, "before_finish": before_finish}
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)

    threads = [threading.Thread(target=peer, args=(i,)) for i in range(m)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(out) == m, "a peer did not finish"
    return out, hub


# ---- the independent reference ----------------------------------------------------------------------------
def _fragment_of(name: str, n_blocks: int, P: int) -> Optional[int]:
    """Strided rule, written out again: block i -> i mod P; before the blocks -> 0; after -> P - 1."""
    if name.startswith("blocks."):
        return int(name.split(".")[1]) % P
    return 0 if name.endswith("emb.weight") else P - 1


def reference_run(cfg, shards: Sequence[int], outer_steps: int, fail: Sequence[Tuple[int, int]] = (),
                  starts: Optional[Dict[Tuple[int, int], Dict[int, torch.Tensor]]] = None):
    """M peers in lockstep in one thread; returns (global params per fragment, each peer's params).

    Per fragment p with send steps s_k = p·H/P + (k+1)·H and Δ(k) the sample-weighted mean:
      tau:   Δ_m = θ − θ_m at s_k; at s_k + tau: θ ← SGD(θ, Δ), θ_m ← lerp(θ_m, θ, 1 − alpha)
      delay: Δ_m = W_m − θ_m at s_k; apply Δ(k−1) to θ; W_m ← θ; θ_m ← W_m
      eager: as delay, but ("fresh_heuristic") W_m ← SGD step on a copy of (θ, momentum) with
             Δ~ = Δ_m(k); or ("paper", the Eager Updates paper as published) W_m ← θ + f with the
             peer's offset (f, e) stepped by δ = Δ'_m(k)/M − (the own term added last: Δ'_m(k−1)/M, even
             when round k−1 failed and Δ'_m(k) resends it) (overlap.py's formulation, whose
             equality with the paper's per-peer state test_eager_is_the_papers_update_sequence checks
             without inner training: through AdamW, an ulp of difference can flip an update)
    SGD is written out (b ← μ·b + g; θ ← θ − lr·(g + μ·b)), one rounding per operation, as the
    swarm's outer step is. A failed round applies nothing; delay/eager then resend their Δ_m with
    the next round. The run stops after outer_steps·H inner steps; rounds still in flight are then
    applied and every model takes θ, whatever the mode. ``starts`` (if given) receives each peer's W_m per
    (fragment, round) sent.
    """
    torch.set_num_threads(1)
    st, H = cfg.streaming, cfg.inner.sync_every
    P, mode, M = st.fragments, st.mode, len(shards)
    sched_offset = [p * H // P for p in range(P)]
    torch.manual_seed(cfg.train.seed)
    glob = build_model(cfg.model)
    names = [n for n, _ in glob.named_parameters()]
    n_blocks = cfg.model.n_layers
    frag_names = [[n for n in names if _fragment_of(n, n_blocks, P) == p] for p in range(P)]
    gparams = dict(glob.named_parameters())
    lr, mu, nesterov = cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov
    gbufs = {n: torch.zeros_like(gparams[n]) for n in names}
    peers = [_inner_setup(cfg, s) for s in shards]
    # eager "paper": each peer's offset (f, e) from the agreed (θ, b), per fragment, and the own term
    # (flat) it added last
    own = [[([torch.zeros_like(gparams[n]) for n in frag_names[p]], [torch.zeros_like(gparams[n]) for n in frag_names[p]])
            for p in range(P)] for _ in range(M)]
    own_term = [[torch.zeros(sum(gparams[n].numel() for n in frag_names[p])) for p in range(P)] for _ in range(M)]
    lp = [dict(m.named_parameters()) for m, _, _ in peers]
    start = [[[gparams[n].detach().clone() for n in frag_names[p]] for p in range(P)] for _ in range(M)]
    pending: Dict[int, dict] = {}   # fragment -> {"deltas", "due", "round", "w", "base"}
    base = [0] * P                  # samples count from this step: the weight of a peer's Δ_m
    batch = cfg.inner.batch_size

    def flat(ts):
        return torch.cat([t.reshape(-1) for t in ts])

    def unflat(v, like):
        out, off = [], 0
        for t in like:
            out.append(v[off: off + t.numel()].view_as(t))
            off += t.numel()
        return out

    def sgd(ps, bs, grads):
        for prm, b, g in zip(ps, bs, grads):
            b.copy_(b * mu + g)
            prm.copy_(prm - (g + b * mu) * lr if nesterov else prm - b * lr)

    def outer_step(p, avg):
        ps = [gparams[n] for n in frag_names[p]]
        sgd(ps, [gbufs[n] for n in frag_names[p]], unflat(avg, ps))

    def sgd_lookahead(p, est):
        ps = [gparams[n].detach().clone() for n in frag_names[p]]
        sgd(ps, [gbufs[n].clone() for n in frag_names[p]], unflat(est, ps))
        return ps

    def mean(deltas, w):
        acc = torch.zeros_like(deltas[0])
        for d in deltas:
            acc += d * float(w)
        return acc / (float(w) * len(deltas))

    def local(m, p):
        return [lp[m][n] for n in frag_names[p]]

    for t in range(1, outer_steps * H + 1):
        for m, (model, opt, stream) in enumerate(peers):
            _inner_step(cfg, model, opt, stream, t - 1)
        with torch.no_grad():
            for p in range(P):
                if t - sched_offset[p] < H or (t - sched_offset[p]) % H:
                    continue
                k = (t - sched_offset[p]) // H - 1
                if mode == "tau":
                    deltas = [flat([gparams[n] for n in frag_names[p]]) - flat(local(m, p)) for m in range(M)]
                    pending[p] = {"deltas": deltas, "due": t + st.tau, "round": k, "w": batch * (t - base[p]),
                                  "base": base[p]}
                    base[p] = t
                else:
                    deltas = [flat(start[m][p]) - flat(local(m, p)) for m in range(M)]
                    prev = pending.pop(p, None)
                    have_prev = prev is not None and (p, prev["round"]) not in fail
                    if prev is not None and not have_prev:
                        deltas = [d + pd for d, pd in zip(deltas, prev["deltas"])]
                        base[p] = prev["base"]
                    if have_prev:
                        prev_avg = mean(prev["deltas"], prev["w"])
                        outer_step(p, prev_avg)
                    for m in range(M):
                        if mode == "delay":
                            new = [gparams[n].detach().clone() for n in frag_names[p]]
                        elif st.eager_estimate == "fresh_heuristic":
                            new = sgd_lookahead(p, deltas[m])
                        else:  # the paper, as agreed θ + this peer's offset (f, e) (overlap.py; the
                            # equality with the paper's own per-peer state: test_eager_is_the_papers_update_sequence)
                            f_m, e_m = own[m][p]
                            gb = [gbufs[n] for n in frag_names[p]]
                            # δ = Δ'_m(k)/M minus exactly the own term added last (a failed round's too);
                            # 1/M computed as core.py does (w/W·M_{k−1}/M_k), for the same bits
                            share = prev["w"] / (prev["w"] * M) * M / M if have_prev else 1.0 / M
                            term = deltas[m] * share
                            d = unflat(term - own_term[m][p], f_m)
                            own_term[m][p] = term
                            if have_prev:
                                sgd(f_m, e_m, d)
                            else:  # the paper's peer steps alone: from (θ + f, b + e), the agreed copy stays
                                for fx, ex, bx, dx in zip(f_m, e_m, gb, d):
                                    bm, fm = bx + ex, fx.clone()
                                    sgd([fm], [bm], [dx])
                                    ex.copy_(bm - bx)
                                    fx.copy_(fm)
                            new = [gparams[n].detach() + fx for n, fx in zip(frag_names[p], f_m)]
                        start[m][p] = new
                        if starts is not None:
                            starts.setdefault((p, k), {})[m] = flat(new)
                        for dst, src in zip(local(m, p), new):
                            dst.copy_(src)
                    pending[p] = {"deltas": deltas, "round": k, "w": batch * (t - base[p]), "base": base[p]}
                    base[p] = t
            if mode == "tau":
                for p in [q for q, v in pending.items() if v["due"] <= t]:
                    job = pending.pop(p)
                    if (p, job["round"]) in fail:
                        base[p] = job["base"]
                        continue
                    outer_step(p, mean(job["deltas"], job["w"]))
                    for m in range(M):
                        for dst, g in zip(local(m, p), [gparams[n] for n in frag_names[p]]):
                            dst.lerp_(g.detach(), 1.0 - st.alpha) if st.alpha else dst.copy_(g)
    with torch.no_grad():  # the end of the run: apply what is in flight; every model takes θ (every mode)
        for p in sorted(pending, key=lambda q: pending[q]["round"] * H + sched_offset[q]):
            job = pending[p]
            if (p, job["round"]) not in fail:
                outer_step(p, mean(job["deltas"], job["w"]))
        for m in range(M):
            for n, dst in lp[m].items():
                dst.copy_(gparams[n])
    glob_frags = [[gparams[n].detach().clone() for n in frag_names[p]] for p in range(P)]
    return glob_frags, [[p.detach().clone() for p in model.parameters()] for model, _, _ in peers]


def max_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


# ---- validation, schedule, layout ----------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, key", [
    (["streaming.tau=5", "inner.sync_every=20", "streaming.fragments=4"], "streaming.tau"),
    (["streaming.fragments=5"], "model.n_layers"),
    (["streaming.alpha=1.5"], "streaming.alpha"),
    (["streaming.alpha=-0.1"], "streaming.alpha"),
    (["streaming.fragments=3"], "divisible"),
    (["streaming.mode=async"], "streaming.mode"),
    (["streaming.mode=eager", "streaming.eager_estimate=guess"], "streaming.eager_estimate"),
    (["streaming.mode=eager", "streaming.tau=1"], "streaming.tau"),
    (["streaming.mode=delay", "streaming.alpha=0.5"], "streaming.alpha"),
    (["streaming.tau=-1"], "streaming.tau"),
])
def test_invalid_combinations_are_refused_up_front(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides)
    msg = str(e.value)
    assert key in msg and ("use" in msg or "must" in msg), msg


def test_valid_streaming_settings_load():
    cfg = load_config(TINY, ["streaming.fragments=4", "streaming.tau=4", "streaming.alpha=0.5"])  # H/P = 5
    assert (cfg.streaming.mode, cfg.streaming.tau, cfg.streaming.alpha) == ("tau", 4, 0.5)
    for mode in ("delay", "eager"):
        assert load_config(TINY, [f"streaming.mode={mode}", "streaming.fragments=2"]).streaming.mode == mode


def test_eager_at_a_high_outer_lr_is_advised_against_not_refused():
    """peers/tiny-cpu.toml has outer lr 0.7: eager loads, with one line on the paper's rule as measured
    (naming the heuristic) and one naming the lr fix; nothing is refused."""
    paper, lr = load_config(TINY, ["streaming.mode=eager"]).advice()
    assert "as published" in paper and "eager_estimate=fresh_heuristic" in paper
    assert "outer.lr=0.7" in lr and "--set outer.lr=0.4" in lr
    (paper,) = load_config(TINY, ["streaming.mode=eager", "outer.lr=0.4"]).advice()
    assert "as published" in paper
    assert load_config(TINY, ["streaming.mode=eager", "outer.lr=0.4",
                              "streaming.eager_estimate=fresh_heuristic"]).advice() == []
    assert load_config(TINY, ["streaming.mode=delay"]).advice() == []   # delay is bad at any lr: the docs say so
    assert load_config(TINY, []).advice() == []


def test_schedule_matches_the_formula():
    # fragment p syncs after inner steps p*H/P + k*H, k >= 1; written out by hand for H = 8, P = 4
    s = Schedule(8, 4)
    got: Dict[int, List[int]] = {p: [] for p in range(4)}
    for t in range(1, 33):
        for p in s.due(t):
            got[p].append(t)
            assert s.send_step(p, s.round_of(p, t)) == t
    assert got == {0: [8, 16, 24, 32], 1: [10, 18, 26], 2: [12, 20, 28], 3: [14, 22, 30]}
    assert [s.round_of(1, t) for t in got[1]] == [0, 1, 2]
    assert s.next_send(8) == 10 and s.next_send(0) == 8
    assert Schedule(10, 1).due(10) == [0] and Schedule(10, 1).due(5) == []


def test_a_sync_counts_its_own_bytes_not_a_state_download_served_meanwhile():
    """A sync's bytes (its report's ``bytes_sent``/``bytes_received``: the sync events and the demo's
    bytes sent) are the node's stream bytes over the sync less those of state downloads it served or
    fetched meanwhile (they share the node's counter)."""
    cfg = make_cfg()
    served = 1_000_000

    def serve_state(swarm, group, phase):  # a joiner downloads our state while this all-reduce runs
        swarm.node.state_traffic.add(sent=served, received=100)

    plain, _ = run_peers(cfg, 2, outer_steps=2)
    busy, _ = run_peers(cfg, 2, outer_steps=2, hold=serve_state)
    for i in range(2):
        want = [(r.fragment, r.round, r.bytes_sent, r.bytes_received) for r in plain[i]["reports"]]
        got = [(r.fragment, r.round, r.bytes_sent, r.bytes_received) for r in busy[i]["reports"]]
        assert got == want and all(r.bytes_sent > 0 for r in busy[i]["reports"])
        node = busy[i]["swarm"].node
        assert node.state_traffic.sent >= served * len(got)  # the downloads happened, inside the syncs
        assert node.traffic.sent - node.state_traffic.sent == plain[i]["swarm"].node.traffic.sent


def test_schedule_in_a_run_matches_the_formula():
    """Which fragment synced at which step, as seen by the network, in a run of 2 peers (P = 4)."""
    cfg = make_cfg("inner.sync_every=8", "streaming.fragments=4", "streaming.prepare_steps=0")
    out, hub = run_peers(cfg, 2, outer_steps=3)
    sent = sorted({(frag, rnd, step) for peer, frag, rnd, phase, step in hub.calls})
    assert sent == [(p, k, 2 * p + 8 * (k + 1)) for p in range(4) for k in range(3 if p == 0 else 2)]
    for i in range(2):
        assert [(r.fragment, r.step) for r in out[i]["reports"]] == \
            [(0, 8), (1, 10), (2, 12), (3, 14), (0, 16), (1, 18), (2, 20), (3, 22), (0, 24)]


def test_layout_is_part_of_the_fingerprint():
    base = fingerprint_fields(load_config(TINY, ["streaming.fragments=2"]))
    assert base["streaming.layout"].startswith("2 fragment(s) of ")
    other = fingerprint_fields(load_config(TINY, ["streaming.fragments=2", "streaming.pattern=sequential"]))
    four = fingerprint_fields(load_config(TINY, ["streaming.fragments=4"]))
    assert len({base["streaming.layout"], other["streaming.layout"], four["streaming.layout"]}) == 3
    # the local latency knob is not something peers must agree on
    assert "streaming.prepare_steps" not in base
    assert run_fingerprint(load_config(TINY, ["streaming.fragments=2", "streaming.prepare_steps=0"])) == \
        run_fingerprint(load_config(TINY, ["streaming.fragments=2"]))


def test_lookahead_is_bitwise_a_real_step():
    torch.manual_seed(0)
    ps = [torch.randn(5, 3), torch.randn(7)]
    o = OuterState(ps, lr=0.7, momentum=0.9)
    o.step(torch.randn(22))  # non-zero momentum
    d = torch.randn(22)
    before = [t.clone() for t in (*o.params, *o.buffers)]
    ahead = lookahead(o, d)
    assert all(torch.equal(a, b) for a, b in zip(before, (*o.params, *o.buffers))), "lookahead changed the state"
    o.step(d)
    assert all(torch.equal(a, b) for a, b in zip(ahead, o.params))


def test_bandwidth_meter_peak_over_a_window():
    traffic = Traffic()
    meter = BandwidthMeter(traffic, window=1.0, period=3600)  # sampled by hand below
    for now, total in [(0.0, 0), (0.5, 0), (1.0, 1000), (1.5, 5000), (2.0, 5000), (3.0, 5000)]:
        traffic.sent = total
        meter.sample(now)
    assert meter.peak == pytest.approx(5000.0)   # 0.5 -> 1.5 s: 5000 B in 1 s
    assert meter.take_peak() == pytest.approx(5000.0) and meter.take_peak() == 0.0
    meter.close()


# ---- P = 1, tau = 0 is the foundation's DiLoCo -----------------------------------------------------------------
class FoundationDiLoCo:
    """The blocking DiLoCo of the foundation commit (59da7f3), its sync path kept verbatim."""

    def __init__(self, model, cfg, swarm=None):
        from p2pdiloco.compression import get_codec
        from p2pdiloco.diloco.fragments import split_fragments
        from p2pdiloco.diloco.reducers import make_reducer

        self.swarm, self.H = swarm, cfg.inner.sync_every
        P = cfg.streaming.fragments
        self.layout = split_fragments(model, P, cfg.streaming.pattern)
        named = dict(model.named_parameters())
        self.local = [[named[n] for n in names] for names in self.layout.names]
        self.outer = [OuterState(ps, lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=cfg.outer.nesterov)
                      for ps in self.local]
        self.codec = get_codec(cfg.compression.codec)
        self.reducers = [make_reducer(cfg, ps) for ps in self.local]
        self.position, self.synced_step, self.samples_since = 0, 0, [0] * P
        self.state_lock = threading.Lock()

    def offset(self, p):
        return p * self.H // len(self.outer)

    def due(self, t):
        return [p for p in range(len(self.outer))
                if t - self.offset(p) >= self.H and (t - self.offset(p)) % self.H == 0]

    def round_of(self, p, t):
        return (t - self.offset(p)) // self.H - 1

    def outer_round(self):
        return self.outer[0].steps

    def after_inner_step(self, samples):
        self.position += 1
        for p in range(len(self.outer)):
            self.samples_since[p] += samples
        return [self._sync(p, self.round_of(p, self.position)) for p in self.due(self.position)]

    def _sync(self, p, round_):
        outer = self.outer[p]
        delta = outer.pseudo_gradient(self.local[p])
        report = SimpleNamespace(step=self.position, fragment=p, round=round_, ok=False, digest="")
        weight = float(self.samples_since[p])
        try:
            group = self.swarm.form_group(p, round_, self.position)

            def allreduce(vec, phase, codec=None):
                return self.swarm.allreduce(group, f"f{p}.{phase}", vec, weight, codec or self.codec)

            avg = self.reducers[p].reduce(delta, allreduce)
        except SyncFailed:
            pass
        else:
            with self.state_lock:
                outer.step(avg)
                outer.copy_to(self.local[p])
                self.synced_step = self.position
            self.samples_since[p] = 0
            report.ok, report.digest = True, outer.digest()
        return report


@pytest.mark.parametrize("fragments", [1, 2])
def test_tau0_is_bit_for_bit_the_foundation(fragments):
    cfg = make_cfg("inner.sync_every=6", f"streaming.fragments={fragments}", "outer.lr=0.7")
    new, _ = run_peers(cfg, 3, outer_steps=3)
    old, _ = run_peers(cfg, 3, outer_steps=3, factory=FoundationDiLoCo)
    for i in range(3):
        assert [(r.step, r.fragment, r.round, r.ok, r.digest) for r in new[i]["reports"]] == \
            [(r.step, r.fragment, r.round, r.ok, r.digest) for r in old[i]["reports"]]
        # the loop's model bit for bit; then finish() leaves the global copies in it (the foundation,
        # which has no finish(), keeps its local steps on the fragments synced before the last)
        assert all(torch.equal(a, b) for a, b in zip(new[i]["before_finish"], old[i]["model"].parameters()))
        for on, oo in zip(new[i]["diloco"].outer, old[i]["diloco"].outer):
            assert all(torch.equal(a, b) for a, b in zip((*on.params, *on.buffers), (*oo.params, *oo.buffers)))
        for frag, oo in zip(new[i]["diloco"].fragments, old[i]["diloco"].outer):
            assert all(torch.equal(a, b) for a, b in zip(frag.model_params, oo.params))
        assert new[i]["diloco"].synced_step == old[i]["diloco"].synced_step
        # and the sync ran in the background, yet the loop blocked on it (tau = 0)
        assert new[i]["swarm"].threads == {"p2pdiloco-sync"}
        assert all(r.overlapped_steps == 0 for r in new[i]["reports"])


# ---- each mode against the reference ------------------------------------------------------------------------
MODES = {
    "tau": ["streaming.mode=tau", "streaming.tau=2", "streaming.alpha=0.5"],
    "delay": ["streaming.mode=delay"],
    "eager": ["streaming.mode=eager"],  # the paper's rule, the default
    "eager-heuristic": ["streaming.mode=eager", "streaming.eager_estimate=fresh_heuristic"],
}


def _mode_cfg(mode: str, *extra: str):
    return make_cfg("inner.sync_every=8", "streaming.fragments=2", *MODES[mode], *extra)


@pytest.mark.parametrize("mode", list(MODES))
def test_mode_matches_reference_with_allreduce_in_flight(mode):
    """Every all-reduce is held until the peer has taken k more inner steps (tau for 'tau', H - 1 for
    the one-outer-step modes): training goes on meanwhile, and the result still equals the reference."""
    cfg = _mode_cfg(mode)
    H = cfg.inner.sync_every
    k = cfg.streaming.tau if mode == "tau" else H - 1
    seen = []
    out, hub = run_peers(cfg, 3, outer_steps=3, hold=hold_until(lambda frag: k),
                         after_report=lambda i, d, r, drained: drained or seen.append((i, r.overlapped_steps)))
    ref_glob, ref_local = reference_run(cfg, [0, 1, 2], outer_steps=3)
    for i in range(3):
        d = out[i]["diloco"]
        worst = max(max_diff(o.params, g) for o, g in zip(d.outer, ref_glob))
        assert worst < 1e-6, f"{mode}: global copy differs from the reference by {worst}"
        worst = max_diff([p.detach() for p in out[i]["model"].parameters()], ref_local[i])
        assert worst < 1e-6, f"{mode}: model differs from the reference by {worst}"
        assert out[i]["swarm"].threads == {"p2pdiloco-sync"}  # the reducer ran on the background worker
    # counted, not timed: the all-reduce entered the network only k steps after its send step...
    in_loop = [c for c in hub.calls if c[-1] >= 0]  # not the ones drained at the end
    assert len(in_loop) == 3 * (4 if mode == "tau" else 3)
    for peer, frag, rnd, phase, step in in_loop:
        assert step >= Schedule(H, 2).send_step(frag, rnd) + k
    # ...and the loop counted the inner steps it completed while each sync was in flight: at least k - 1
    # (the step at which the hold lets go may or may not count), at most up to the due step
    due = cfg.streaming.tau if mode == "tau" else H
    assert len(seen) == len(in_loop) and all(k - 1 <= n <= due for _, n in seen), seen


@pytest.mark.parametrize("mode", ["delay", "eager", "eager-heuristic"])
def test_global_copies_identical_after_each_correction(mode):
    """After every applied round all peers hold bitwise identical global copies and momenta, while
    (eager) the points their inner phases started from differ; also across an injected failed round,
    whose progress is resent with the next round, as the reference does."""
    cfg = _mode_cfg(mode)
    fail = [(1, 0)]
    states: Dict[Tuple[int, int], Dict[int, str]] = {}
    starts: Dict[Tuple[int, int], Dict[int, torch.Tensor]] = {}

    def record_global(i, d, r):
        # DiLoCo's callback runs when round r was applied and before the fragment's next round is sent
        with d.state_lock:
            o = d.outer[r.fragment]
            states.setdefault((r.fragment, r.round), {})[i] = (o.digest(), o.steps)
            if mode == "delay":  # the model it reports on (validation) restarted from the global copy
                assert all(torch.equal(a, b) for a, b in zip(d.fragments[r.fragment].model_params, o.params))

    def record_start(i, d, r, drained):
        # after the step: the next phase started from a point derived from round r's global copy
        # (eager: with this peer's own fresh pseudo-gradient); only the training thread writes it
        if not drained:
            starts.setdefault((r.fragment, r.round), {})[i] = torch.cat([t.view(-1) for t in d.fragments[r.fragment].start])

    out, hub = run_peers(cfg, 3, outer_steps=3, hub=Hub(3, fail=fail), on_sync=record_global,
                         after_report=record_start)
    assert len(states) == 5
    for key, per_peer in states.items():
        assert len(per_peer) == 3 and len(set(per_peer.values())) == 1, (key, per_peer)
    failed = [r for r in out[0]["reports"] if not r.ok]
    assert [(r.fragment, r.round) for r in failed] == fail, "the injected failure did not fire"
    assert out[0]["diloco"].outer[1].steps == 1  # of fragment 1's two rounds only the second applied
    mid = (0, 1)  # a round in mid-run: its start points were set from the eager estimate (or θ for delay)
    spread = max(float((starts[mid][i] - starts[mid][0]).abs().max()) for i in range(3))
    assert (spread > 1e-6) if mode.startswith("eager") else (spread == 0.0), spread
    ref_starts: Dict[Tuple[int, int], Dict[int, torch.Tensor]] = {}
    ref_glob, _ = reference_run(cfg, [0, 1, 2], outer_steps=3, fail=fail, starts=ref_starts)
    for i in range(3):
        worst = max(max_diff(o.params, g) for o, g in zip(out[i]["diloco"].outer, ref_glob))
        assert worst < 1e-6, worst
    # every peer's own trajectory: the point each inner phase started from, per round, equals the
    # reference's (for "eager", the paper's per-peer outer state, stepped with Δ(k−1) − Δ_m(k−1)/M + Δ_m(k)/M)
    compared = 0
    for (frag, rnd), per_peer in starts.items():  # reported round r: the phase started at round r + 1's send
        if (frag, rnd + 1) not in ref_starts:
            continue
        for i, w in per_peer.items():
            worst = float((w - ref_starts[(frag, rnd + 1)][i]).abs().max())
            assert worst < 1e-6, f"{mode}: peer {i}'s start point after fragment {frag} round {rnd}: {worst}"
            compared += 1
    assert compared >= 6, compared


@pytest.mark.parametrize("fail", [(), (3,)], ids=["clean", "round-3-fails"])
def test_eager_is_the_papers_update_sequence(fail):
    """Eager Updates as published (Kale et al., arXiv 2502.12996), without inner training in the way:
    3 peers with chosen pseudo-gradients Δ_m(k); each peer's phase start W_m must follow the paper's
    own per-peer outer state, θ_m ← NesterovSGD(θ_m, Δ(k−1) − Δ'_m(k−1)/M + Δ'_m(k)/M) (Δ(k−1) = 0 when
    round k−1 brought no average; Δ'_m(k) resends a failed round's Δ'_m(k−1), and its own term
    Δ'_m(k−1)/M is taken out all the same), to 1e-6 over 10 rounds, while the agreed global copies stay
    bitwise identical and equal the delayed trajectory θ ← NesterovSGD(θ, Δ(k−1))."""
    M, K, H = 3, 10, 2
    cfg = make_cfg(f"inner.sync_every={H}", "streaming.mode=eager", "outer.lr=0.7", "outer.momentum=0.9")
    hub = Hub(M, fail=[(0, r) for r in fail])
    gen = torch.Generator().manual_seed(5)
    shape = (16, 8)
    init = torch.rand(shape, generator=gen)
    deltas = [[(torch.rand(shape, generator=gen) - 0.5) * 0.1 for _ in range(K)] for _ in range(M)]
    starts: Dict[int, List[torch.Tensor]] = {m: [] for m in range(M)}
    sent: Dict[int, List[torch.Tensor]] = {m: [] for m in range(M)}
    dilocos: Dict[int, DiLoCo] = {}
    errors: List[BaseException] = []

    def peer(m: int) -> None:
        try:
            model = torch.nn.Linear(8, 16, bias=False)
            with torch.no_grad():
                model.weight.copy_(init)
            d = DiLoCo(model, cfg, FakeSwarm(hub, m))
            d.swarm.diloco = d
            dilocos[m] = d
            for k in range(K):
                d.after_inner_step(1)  # not a send step
                with torch.no_grad():  # the inner phase "trained" to W_m − Δ_m(k)
                    model.weight.copy_(d.fragments[0].start[0] - deltas[m][k])
                sent[m].append((d.fragments[0].start[0] - model.weight).detach().clone())  # Δ_m(k) exactly as sent
                d.after_inner_step(1)
                starts[m].append(d.fragments[0].start[0].detach().clone())
            d.finish()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=peer, args=(m,)) for m in range(M)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    lr, mu = 0.7, 0.9

    def sgd(theta, b, g):
        b = b * mu + g
        return theta - (g + b * mu) * lr, b

    own = [(init.clone(), torch.zeros(shape)) for _ in range(M)]
    agreed = (init.clone(), torch.zeros(shape))
    avg_prev = None
    actual = [[None] * K for _ in range(M)]  # Δ_m(k) as the round carried it: a failed round's is resent
    for k in range(K):
        for m in range(M):
            actual[m][k] = sent[m][k] + (actual[m][k - 1] if k - 1 in fail else 0)
        avg = sum(actual[m][k] for m in range(M)) / M
        for m in range(M):
            est = (0 if avg_prev is None else avg_prev) - (actual[m][k - 1] / M if k else 0) + actual[m][k] / M
            own[m] = sgd(*own[m], est)
            worst = float((starts[m][k] - own[m][0]).abs().max())
            assert worst < 1e-6, f"peer {m}, round {k}: start differs from the paper's θ_m by {worst}"
        if avg_prev is not None:
            agreed = sgd(*agreed, avg_prev)
        avg_prev = None if k in fail else avg
    agreed = sgd(*agreed, avg_prev)  # finish() applies the last round
    for m in range(M):
        assert torch.equal(dilocos[m].outer[0].params[0], dilocos[0].outer[0].params[0])
        assert float((dilocos[m].outer[0].params[0] - agreed[0]).abs().max()) < 1e-6
    assert float((starts[0][-1] - starts[1][-1]).abs().max()) > 1e-4  # the peers' own terms differ
    if fail:
        assert [r for r in hub.calls if r[2] in fail], "the injected failure did not fire"


# ---- eager updates through failures, group changes and joins ----------------------------------------------
class RosterHub:
    """All-reduce among the members of each round's group (peers join and leave between rounds): the
    sample-weighted mean in member order, and the total weight (the coverage the swarm reports)."""

    def __init__(self, fail: Sequence[int] = ()):
        self.fail = set(fail)
        self.cond = threading.Condition()
        self.parts: Dict[Tuple[str, str], Dict[int, Tuple[float, torch.Tensor]]] = {}
        self.results: Dict[Tuple[str, str], Tuple[torch.Tensor, float]] = {}

    def reduce(self, group: Group, phase: str, vec: torch.Tensor, weight: float) -> Tuple[torch.Tensor, float]:
        key = (group.gid, phase)
        with self.cond:
            self.parts.setdefault(key, {})[group.my_index] = (weight, vec.detach().clone())
            if len(self.parts[key]) == group.size:
                parts = [self.parts[key][i] for i in range(group.size)]
                self.results[key] = (weighted_mean([v for _, v in parts], [w for w, _ in parts]),
                                     sum(w for w, _ in parts))
                self.cond.notify_all()
            assert self.cond.wait_for(lambda: key in self.results, timeout=60), f"hub: {key} incomplete"
            avg, total = self.results[key]
            return avg.clone(), total


class RosterSwarm(FakeSwarm):
    """A swarm whose round k has the members ``roster(k)``; a result carries its coverage (members and
    total sample weight), as the real all-reduce reports it; the rounds in ``hub.fail`` fail for all."""

    def __init__(self, hub: RosterHub, idx: int, roster: Callable[[int], Tuple[int, ...]]):
        super().__init__(hub, idx)
        self.roster = roster

    def expected_group(self, sync_step: int) -> int:
        raise AssertionError("the test forms every group before its send step")

    def form_group(self, frag: int, round_: int, sync_step: int) -> Group:
        members = tuple(f"peer{i}" for i in self.roster(round_))
        return Group(gid=f"{frag}:{round_}", members=members, my_index=members.index(f"peer{self.idx}"),
                     frag=frag, round=round_)

    def allreduce(self, group: Group, phase: str, vec: torch.Tensor, weight: float, codec,
                  on_coverage=None) -> torch.Tensor:
        if group.round in self.hub.fail:
            raise SyncFailed(f"injected failure of round {group.round}")
        avg, total = self.hub.reduce(group, phase, vec, weight)
        if on_coverage is not None:
            on_coverage(Coverage(members=group.members, weight=total))
        return avg


#: name: (rounds that fail for everyone, the members of round k); a peer in round k but not in round
#: k − 1 joins by downloading peer 0's state once round k − 1 is applied (which must not fail)
EAGER_PATTERNS = {
    "no-failure": ((), lambda k: (0, 1, 2)),
    "one-failure": ((3,), lambda k: (0, 1, 2)),
    "two-in-a-row": ((3, 4), lambda k: (0, 1, 2)),
    "failure-then-smaller-group": ((2,), lambda k: (0, 1, 2) if k <= 2 else (0, 1)),
    "join-then-failure": ((6,), lambda k: (0, 1, 2) if k < 4 else (0, 1, 2, 3)),
}


@pytest.mark.parametrize("pattern", list(EAGER_PATTERNS))
def test_eager_follows_each_peers_paper_trajectory_through_failures(pattern):
    """Eager Updates (Kale et al., arXiv 2502.12996) with failed rounds, resends, sample weights that
    change every round, a group that shrinks and a peer that joins. Each peer's model after each send
    must equal its own outer state in the paper's per-peer recurrence, to 1e-6:

        θ_m, b_m ← NesterovSGD(θ_m, b_m, A + ρ_k·Δ'_m(k) − (own term added last))

    A = the average of the peer's previous round if that arrived (else 0), Δ'_m(k) = Δ_m(k) plus a failed
    previous round's Δ'_m (resent, its weight too), ρ_k = the peer's share as core.py estimates it
    (w_m/W of the previous round · M_{k−1}/M_k when that arrived, else 1/M_k). The own term telescopes:
    whatever happens, the peer's state is the agreed one plus its latest own term. A joiner starts from
    the state it downloaded. After finish() every peer holds the agreed global model."""
    fail, roster = EAGER_PATTERNS[pattern]
    K, H = 9, 2
    cfg = make_cfg(f"inner.sync_every={H}", "streaming.mode=eager", "outer.lr=0.7", "outer.momentum=0.9")
    hub = RosterHub(fail)
    gen = torch.Generator().manual_seed(7)
    shape = (16, 8)
    init = torch.rand(shape, generator=gen)
    peers = sorted(set().union(*(roster(k) for k in range(K))))
    deltas = {m: [(torch.rand(shape, generator=gen) - 0.5) * 0.1 for _ in range(K)] for m in peers}
    samples = {m: [1 + (3 * m + k) % 4 for k in range(K)] for m in peers}  # per inner step, in round k
    sent: Dict[Tuple[int, int], torch.Tensor] = {}     # (m, k): Δ_m(k) exactly as the model gave it
    starts: Dict[Tuple[int, int], torch.Tensor] = {}   # (m, k): the model right after round k's send
    dilocos: Dict[int, DiLoCo] = {}

    def make(m: int) -> DiLoCo:
        model = torch.nn.Linear(8, 16, bias=False)
        with torch.no_grad():
            model.weight.copy_(init)
        d = DiLoCo(model, cfg, RosterSwarm(hub, m, roster))
        d.swarm.diloco = d
        return d

    try:
        for m in roster(0):
            dilocos[m] = make(m)
        for k in range(K):
            for m in [m for m in dilocos if m not in roster(k)]:  # left the swarm
                dilocos.pop(m).close()
            for m in [m for m in roster(k) if m not in dilocos]:  # joins: peer 0's state after round k − 1
                assert k > 0 and k - 1 not in fail
                donor = dilocos[0]
                for job in list(donor._inflight):
                    job.future.result(30)
                dilocos[m] = make(m)
                dilocos[m].load_snapshot(*donor.snapshot())
                assert dilocos[m].position == k * H
            for step in range(H):
                for m, d in dilocos.items():
                    for fut in list(d.groups.prepared.values()):  # formed before the send: its size is known there
                        fut.result(30)
                    if step == H - 1:  # the inner phase "trained" to W_m − Δ_m(k)
                        with torch.no_grad():
                            d.model.weight.copy_(d.fragments[0].start[0] - deltas[m][k])
                        sent[(m, k)] = (d.fragments[0].start[0] - d.model.weight).detach().clone()
                    d.after_inner_step(samples[m][k])
                    if step == H - 1:
                        starts[(m, k)] = d.model.weight.detach().clone()
        for d in dilocos.values():
            d.finish()
    finally:
        for d in dilocos.values():
            d.close()

    lr, mu = 0.7, 0.9

    def sgd(theta, b, g):
        b = b * mu + g
        return theta - (g + b * mu) * lr, b

    agreed = (init.clone(), torch.zeros(shape))  # the global copy: true averages only, in round order
    state = {m: agreed for m in roster(0)}         # the paper's per-peer outer state (θ_m, b_m)
    own: Dict[int, Optional[torch.Tensor]] = {m: None for m in roster(0)}  # the own term added last
    carried: Dict[Tuple[int, int], Tuple[torch.Tensor, float]] = {}        # (m, k): Δ'_m(k), w'_m(k)
    avg: Dict[int, Tuple[torch.Tensor, float]] = {}                        # k: (Δ(k), W(k))
    compared = 0
    for k in range(K):
        members = roster(k)
        for m in members:
            if m not in state:  # joined: the downloaded state, no offset
                state[m], own[m] = agreed, None
            resend = k > 0 and m in roster(k - 1) and k - 1 in fail
            d_m, w_m = sent[(m, k)], float(H * samples[m][k])
            if resend:
                d_m, w_m = d_m + carried[(m, k - 1)][0], w_m + carried[(m, k - 1)][1]
            carried[(m, k)] = (d_m, w_m)
        for m in members:
            arrived = k > 0 and m in roster(k - 1) and k - 1 not in fail
            if arrived:
                share = carried[(m, k - 1)][1] / avg[k - 1][1] * len(roster(k - 1)) / len(members)
                a = avg[k - 1][0]
            else:
                share, a = 1.0 / len(members), torch.zeros(shape)
            term = carried[(m, k)][0] * share
            state[m] = sgd(*state[m], a + term - (own[m] if own[m] is not None else 0))
            own[m] = term
            worst = float((starts[(m, k)] - state[m][0]).abs().max())
            assert worst < 1e-6, f"{pattern}: peer {m} after round {k} differs from its paper state by {worst}"
            compared += 1
        if k not in fail:
            total = sum(carried[(m, k)][1] for m in members)
            avg[k] = (sum(carried[(m, k)][0] * carried[(m, k)][1] for m in members) / total, total)
            agreed = sgd(*agreed, avg[k][0])
    assert compared == sum(len(roster(k)) for k in range(K))
    final = list(dilocos.values())
    for d in final:  # finish(): every peer ends with the agreed global model, the same bits everywhere
        assert torch.equal(d.outer[0].params[0], final[0].outer[0].params[0])
        assert torch.equal(d.model.weight, d.outer[0].params[0].to(d.model.weight.dtype))
        assert float((d.model.weight.detach() - agreed[0]).abs().max()) < 1e-6
    assert float((starts[(0, K - 1)] - starts[(1, K - 1)]).abs().max()) > 1e-4  # the own terms differ


def test_late_result_waits_and_is_recorded():
    """tau = 1, but each all-reduce finishes 0.3 s after the due step: the loop waits, records it,
    and applies the complete result (the same as the reference)."""
    cfg = make_cfg("inner.sync_every=4", "streaming.tau=1", "streaming.alpha=0.5")
    out, _ = run_peers(cfg, 2, outer_steps=2, hold=hold_until(lambda frag: 1, extra_sleep=0.3))
    ref_glob, ref_local = reference_run(cfg, [0, 1], outer_steps=2)
    for i in range(2):
        reps = out[i]["reports"]
        assert len(reps) == 2 and all(r.ok and r.applied_step == r.step + 1 for r in reps[:1])
        assert all(r.wait_seconds > 0.15 for r in reps), [r.wait_seconds for r in reps]
        assert out[i]["diloco"].wait_seconds >= sum(r.wait_seconds for r in reps)
        assert max_diff(out[i]["diloco"].outer[0].params, ref_glob[0]) < 1e-6
        assert max_diff([p.detach() for p in out[i]["model"].parameters()], ref_local[i]) < 1e-6


def test_group_formation_is_prepared_ahead():
    cfg = make_cfg("inner.sync_every=8", "streaming.fragments=2", "streaming.tau=1", "streaming.prepare_steps=2")
    out, hub = run_peers(cfg, 2, outer_steps=2)
    assert hub.groups, "no group was formed"
    for peer, frag, rnd, send, step_then in hub.groups:
        assert send == Schedule(8, 2).send_step(frag, rnd)
        assert step_then <= send - 1, "group formation was not started ahead of the sync"


class TwoPhaseReducer:
    """A reducer with two all-reduces per sync (like the low-rank one); can fail in the second."""

    def __init__(self, fail_round: Optional[int] = None):
        self.fail_round, self.calls, self.threads = fail_round, 0, set()

    def reduce(self, delta, allreduce):
        self.threads.add(threading.current_thread().name)
        self.calls += 1
        half = allreduce(delta * 0.5, "a")
        if self.fail_round is not None and self.calls - 1 == self.fail_round:
            raise SyncFailed("injected failure in the second phase")
        return half + allreduce(delta * 0.5, "b")

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_reducer_seam_in_the_background_and_no_partial_results():
    cfg = make_cfg("inner.sync_every=4", "streaming.tau=1")
    reducers = {}

    def factory(model, cfg, swarm):
        d = DiLoCo(model, cfg, swarm)
        d.fragments[0].reducer = TwoPhaseReducer(fail_round=1)
        reducers[swarm.idx] = d.reducers[0]
        return d

    digests = {}
    out, hub = run_peers(cfg, 2, outer_steps=3, factory=factory,
                         after_report=lambda i, d, r, drained: digests.setdefault(i, []).append((r.ok, d.digest())))
    for i in range(2):
        assert reducers[i].threads == {"p2pdiloco-sync"} and reducers[i].calls == 4
        oks = [ok for ok, _ in digests[i]]
        assert oks == [True, False, True, True], oks  # the failed round is not counted: one more is run
        # the failed round (its first phase had completed) changed nothing
        assert digests[i][1][1] == digests[i][0][1]
    assert {ph for *_, ph, _ in hub.calls} == {"f0.a", "f0.b"}


def test_download_drops_syncs_in_flight():
    """A state downloaded while a sync is in flight replaces it; the late result is not applied."""
    cfg = make_cfg("inner.sync_every=4", "streaming.mode=eager")
    release = threading.Event()
    hub = Hub(1)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    swarm = FakeSwarm(hub, 0, hold=lambda s, g, ph: release.wait(30))
    d = DiLoCo(model, cfg, swarm)
    swarm.diloco = d
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    for _ in range(4):
        d.after_inner_step(2)
    assert len(d._inflight) == 1 and not d._inflight[0].future.done()
    donor = DiLoCo(build_model(cfg.model), cfg)
    meta, payload = donor.snapshot()
    d.load_snapshot(meta, payload)
    job_future = d._inflight[0].future if d._inflight else None
    assert job_future is None
    release.set()
    time.sleep(0.3)
    assert d.digest() == donor.digest() and d.outer[0].steps == 0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), donor.model.parameters()))
    d.close()
    donor.close()


def _flat_by_fragment(d: DiLoCo, params: Sequence[torch.Tensor]) -> torch.Tensor:
    """``params`` (in the module's order) flattened in fragment order, as the global copies are."""
    index = {n: k for k, (n, _) in enumerate(d.model.named_parameters())}
    return torch.cat([params[index[n]].detach().reshape(-1) for f in d.fragments for n in f.names])


@pytest.mark.parametrize("mode", list(MODES))
def test_finish_applies_what_is_in_flight_and_ends_on_the_global_model(mode):
    """Every mode ends a run the same way: the syncs in flight are applied, then the model holds every
    fragment's global copy bit for bit (tau: not its local steps since a fragment's last sync nor the
    alpha merge; eager: not its own offset), with nothing unsent left counted; the syncs applied at the
    end are reported with that model in place (a validation in on_sync measures it)."""
    cfg = _mode_cfg(mode)
    seen_at_finish = []

    def on_sync(i, d, r):
        if d.swarm.finishing:
            seen_at_finish.append(all(torch.equal(a, b) for f in d.fragments
                                      for a, b in zip(f.model_params, f.outer.params)))

    out, _ = run_peers(cfg, 2, outer_steps=2, on_sync=on_sync)
    for i in range(2):
        d = out[i]["diloco"]
        assert d.outer[0].steps == 2 and not d._inflight
        flat_global = torch.cat([t.reshape(-1) for o in d.outer for t in o.params])
        before = _flat_by_fragment(d, out[i]["before_finish"])
        assert not torch.equal(before, flat_global), "the loop's model was already the global one"
        after = _flat_by_fragment(d, list(d.model.parameters()))
        assert torch.equal(after, flat_global), f"{mode}: the model does not end on the global copies"
        assert d.samples_since == [0, 0] and d.steps_since == [0, 0]  # the dropped progress, with its weight
        assert all(f.offset is None and f.own_term is None for f in d.fragments)
        if d.overlap.restarts_phases:  # the next phase starts from the global copy, as the model does
            assert all(torch.equal(a, b) for f in d.fragments for a, b in zip(f.start, f.outer.params))
    assert seen_at_finish and all(seen_at_finish), seen_at_finish


def test_checkpoint_keeps_the_start_points():
    """delay/eager: where each fragment's inner phase started is part of a checkpoint (else a resumed
    peer would measure its progress from the wrong point)."""
    cfg = make_cfg("inner.sync_every=4", "streaming.mode=eager", "streaming.fragments=2")
    torch.manual_seed(0)
    model = build_model(cfg.model)
    d = DiLoCo(model, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stream = BatchStream(load_corpus(cfg.data).train, shard=0, num_shards=cfg.data.num_shards, batch_size=2,
                         seq_len=cfg.model.seq_len, seed=0)
    init = [p.detach().clone() for p in d.outer[0].params]
    for step in range(6):  # fragment 0 restarted at step 4 from a look-ahead of its first round
        _inner_step(cfg, model, opt, stream, step)
        d.after_inner_step(2)
    state = d.overlap_state_dict()
    assert not torch.equal(state["start"][0][0], init[0])
    d2 = DiLoCo(build_model(cfg.model), cfg)
    d2.load_overlap_state(state)
    assert all(torch.equal(a, b) for s, s2 in zip((f.start for f in d.fragments), (f.start for f in d2.fragments)) for a, b in zip(s, s2))
    d2.load_overlap_state(None)  # an older checkpoint: start from the global copy
    assert all(torch.equal(a, b) for s, o in zip((f.start for f in d2.fragments), d2.outer) for a, b in zip(s, o.params))
    d.close()
    d2.close()


@pytest.mark.timeout(120)
def test_exit_with_a_sync_in_flight_is_clean(tmp_path):
    """A program that stops without finish() while a background sync runs torch code exits normally
    (a daemon thread stopped inside a torch kernel would abort the process)."""
    import subprocess
    import sys

    script = tmp_path / "leave.py"
    script.write_text(
        "from p2pdiloco.config import load_config\n"
        "from p2pdiloco.diloco.core import DiLoCo\n"
        "from p2pdiloco.model import build_model\n"
        f"cfg = load_config({TINY!r}, ['inner.sync_every=4', 'streaming.mode=eager', 'streaming.fragments=2'])\n"
        "d = DiLoCo(build_model(cfg.model), cfg)\n"
        "for _ in range(6):\n"
        "    d.after_inner_step(2)\n"
        "print('inflight', len(d._inflight))\n")
    for _ in range(2):
        res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100)
        assert res.returncode == 0 and "inflight 2" in res.stdout, (res.returncode, res.stderr[-2000:])
        assert "terminate called" not in res.stderr


def _two_fragments_synced():
    """A DiLoCo of two fragments after two syncs each, and its state as a donor sends it."""
    cfg = make_cfg("inner.sync_every=2", "streaming.fragments=2")
    torch.manual_seed(0)
    d = DiLoCo(build_model(cfg.model), cfg)
    for _ in range(4):
        d.after_inner_step(1)
    d.finish()
    return (d, *d.snapshot())


def test_a_digest_mismatch_names_the_first_differing_tensor():
    """Two states of the same synced step must be the same bits; when a downloaded one is not, the peer
    says where: the first differing tensor (fragment, name, θ or momentum) and how many elements differ."""
    d, meta, payload = _two_fragments_synced()
    assert d.first_difference(meta, payload) is None  # the same state
    flat = torch.frombuffer(bytearray(payload), dtype=torch.float32).clone()
    o1 = d.outer[1]
    off = sum(o.numel for o in d.outer[:1]) * 2 + o1.numel + o1.params[0].numel() + 3  # fragment 1, 2nd momentum
    flat[off] += 1.0
    flat[off + 1] -= 1e-3
    diff = d.first_difference(meta, flat.numpy().tobytes())
    assert diff == {"fragment": 1, "tensor": d.layout.names[1][1], "kind": "momentum", "differing": 2,
                    "numel": o1.buffers[1].numel(), "max_abs_diff": pytest.approx(1.0)}
    assert d.first_difference({**meta, "step": meta["step"] + 2}, flat.numpy().tobytes()) is None  # a catch-up


def test_a_mismatch_after_a_split_history_is_not_reported_as_a_bug(caplog):
    """Adopting the majority's state after our recent groups were not theirs (a split history, resolved
    by design) says so; the same difference from donors whose last group is ours is reported as a bug."""
    import types

    from p2pdiloco.config import RunConfig
    from p2pdiloco.train.recovery import Recovery

    d, meta, payload = _two_fragments_synced()
    flat = torch.frombuffer(bytearray(payload), dtype=torch.float32).clone()
    flat[5] += 1.0
    got = types.SimpleNamespace(meta=meta, payload=flat.numpy().tobytes(), digest="theirs", donors={"D": [0, 1]})
    events = []
    lineage = {"g-ours"}
    last = {0: {"D", "me"}, 1: {"D", "me"}}  # the members of our last sync of each fragment
    swarm = types.SimpleNamespace(set_give_way=lambda f: None, lineage=lambda last=None: lineage,
                                  last_members=lambda f: last.get(f, set()))
    metrics = types.SimpleNamespace(write=lambda event, **kw: events.append(dict(kw, event=event)))
    r = Recovery(RunConfig(), types.SimpleNamespace(short_id="me"), swarm, d, metrics)
    read = {"D": {"gid": "g-theirs"}}

    def report() -> str:
        caplog.clear()
        r._report_mismatch(got, read)
        return "bug" if "this is a bug" in caplog.text else "split" if "split history" in caplog.text else "?"

    with caplog.at_level("WARNING", logger="p2pdiloco.train.recovery"):
        assert report() == "split"  # the donors' last group is none of ours
        lineage.add("g-theirs")  # we were in the donors' last group: the same bits were due
        assert report() == "bug"
        # the donors' last group was ours, but the differing fragment's last sync was a group of our own
        # (we synced it alone after a timeout, they synced it together): a split of that fragment
        last[0] = {"me"}
        assert report() == "split"
        last[0] = {"D", "me"}
        got.meta = dict(meta, outer_steps=[s + 1 for s in meta["outer_steps"]])  # they synced it once more
        assert report() == "split"
        got.meta = meta
        got.donors = {"D": [1], "E": [0]}  # fragment 0 came from E, not in our group of it
        assert report() == "split"
    assert [e["cause"] for e in events] == ["split history", "same group"] + ["split history"] * 3
    assert all(e["event"] == "digest_mismatch" and e["fragment"] == 0 for e in events)


def test_eager_offset_survives_a_checkpoint():
    """A peer's eager offset (its own share of the trajectory) and the own term in it are part of its
    checkpoint: a resumed peer restarts its next phase from agreed θ plus the same offset; a downloaded
    state zeroes both."""
    cfg = make_cfg("inner.sync_every=2", "streaming.mode=eager")
    torch.manual_seed(0)
    model = build_model(cfg.model)
    d = DiLoCo(model, cfg)
    for k in range(3):
        d.after_inner_step(1)
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.01 * (k + 1))  # some progress for the next pseudo-gradient
        d.after_inner_step(1)
    state = d.overlap_state_dict()
    assert state["offsets"][0] is not None and float(state["offsets"][0][0][0].abs().max()) > 0
    d2 = DiLoCo(build_model(cfg.model), cfg)
    d2.load_overlap_state(state)
    f, f2 = d.fragments[0], d2.fragments[0]
    for a, b in zip(f.offset[0] + f.offset[1], f2.offset[0] + f2.offset[1]):
        assert torch.equal(a, b)
    # the own term inside the offset comes along: the next round takes exactly that out again
    assert f2.own_term[0] == f.own_term[0] and torch.equal(f2.own_term[1], f.own_term[1])
    older = {k: v for k, v in state.items() if k != "own"}  # without its own term an offset is unusable
    d3 = DiLoCo(build_model(cfg.model), cfg)
    d3.load_overlap_state(older)
    assert d3.fragments[0].offset is None and d3.fragments[0].own_term is None and d3.num_fragments == 1
    meta, payload = d.snapshot()
    d2.load_snapshot(meta, payload)
    assert d2.fragments[0].offset is None and d2.fragments[0].own_term is None and d2.num_fragments == 1
    for x in (d, d2, d3):
        x.close()


@pytest.mark.parametrize("mode", list(MODES))
def test_a_checkpoint_after_finish_resumes_from_the_global_model(mode):
    """A checkpoint written after finish() holds the global model and nothing unsent: the resumed peer
    starts from the global copies (tau measures its next Δ_m against them, delay/eager restart their
    phase there) and trains on bit for bit as the same peer going on without a restart."""
    import copy

    from p2pdiloco.train.replica import restore, snapshot

    cfg = _mode_cfg(mode)
    torch.set_num_threads(1)
    model, opt, stream = _inner_setup(cfg, shard=0)
    d = DiLoCo(model, cfg)
    while d.outer_round() < 2:
        d.after_inner_step(_inner_step(cfg, model, opt, stream, d.position))
    d.finish()
    ckpt = copy.deepcopy(snapshot(model, opt, d, stream))  # state_dict() holds the live tensors
    model2, opt2, stream2 = _inner_setup(cfg, shard=0)
    d2 = DiLoCo(model2, cfg)
    restore(ckpt, model2, opt2, d2, stream2)
    assert all(torch.equal(a, b) for f in d2.fragments for a, b in zip(f.model_params, f.outer.params))
    assert d2.samples_since == [0, 0] and d2.steps_since == [0, 0]
    ends = []
    for dd, mm, oo, ss in ((d2, model2, opt2, stream2), (d, model, opt, stream)):
        torch.set_rng_state(ckpt["torch_rng"])
        while dd.outer_round() < 4:
            dd.after_inner_step(_inner_step(cfg, mm, oo, ss, dd.position))
        dd.finish()
        dd.close()
        ends.append((dd.digest(), [p.detach().clone() for p in mm.parameters()]))
    assert ends[0][0] == ends[1][0]
    assert all(torch.equal(a, b) for a, b in zip(ends[0][1], ends[1][1]))
