"""Configuration: typed dataclasses are the single source of truth.

A peer's configuration is built in three layers, later ones winning:
  1. the dataclass defaults below,
  2. a TOML file (``--config peers/tiny-cpu.toml``), one table per section,
  3. ``--set section.key=value`` overrides from the command line.
Unknown sections or keys, and values of the wrong type, raise :class:`ConfigError` naming the key.
``RunConfig.validate()`` then checks every invariant up front with an actionable message.

The part of a RunConfig that every peer of a run must agree on (model architecture, vocabulary, H,
outer optimizer, fragments, compression) is its fingerprint, computed in :mod:`p2pdiloco.run_identity`.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from .addresses import parse_maddrs
from .compression import get_codec
from .compression.robust import RobustConfig
from .data import DataConfig
from .errors import ConfigError
from .model import PRESETS, ModelConfig
from .tokenizer import tokenizer_vocab_size

__all__ = [
    "RunConfig",
    "InnerConfig",
    "OuterConfig",
    "SwarmConfig",
    "TrainConfig",
    "LocalConfig",
    "StreamingConfig",
    "CompressionConfig",
    "RobustConfig",
    "load_config",
    "config_from_dict",
    "SCHEMES",
    "DEFAULT_SCHEME",
    "scheme_of",
    "describe_scheme",
]


#: the inner lr schedules after the warm-up (InnerConfig.lr_schedule)
LR_SCHEDULES = ("constant", "cosine")


@dataclass
class InnerConfig:
    """Local (inner) optimisation: AdamW on each peer; its state is never averaged (DiLoCo §1)."""

    #: inner steps between two syncs of a fragment (DiLoCo's H)
    sync_every: int = 100
    lr: float = 1e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    #: linear warm-up of the inner learning rate, in inner steps; then ``lr_schedule``
    warmup_steps: int = 20
    #: after the warm-up: ``"constant"`` (inner.lr for good: an open-ended swarm) or ``"cosine"``: from
    #: inner.lr down to ``inner.lr * min_lr_ratio`` at inner step ``decay_steps`` (the run's planned length,
    #: the papers' schedule), then flat. Counted in schedule positions (rounds of H steps only)
    lr_schedule: str = "constant"
    decay_steps: int = 0
    min_lr_ratio: float = 0.1
    #: sequences per inner step on this peer (the sample weight of a peer is batch_size * steps)
    batch_size: int = 8
    #: gradient-norm clip (0 disables)
    grad_clip: float = 1.0
    #: rounds by the swarm's samples: 0 = every peer takes sync_every inner steps per round
    #: (the papers' DiLoCo; the swarm runs at its slowest peer's speed); N > 0 = a round ends when the
    #: whole swarm has processed N sequences, each peer taking as many inner steps as it can meanwhile,
    #: and sync_every only sets the schedule's granularity (N / sync_every sequences per position).
    #: docs/heterogeneous.md
    round_samples: int = 0
    #: with round_samples > 0: each member's pseudo-gradient is normalized to sync_every steps before the
    #: sample-weighted average (Δ_m · H / k_m, FedNova), so a member counts by its samples and the update is
    #: H steps' worth whatever the speeds; false: the raw displacements are averaged by samples (a fast
    #: member then counts by samples x steps). docs/heterogeneous.md
    normalize_steps: bool = True

    def validate(self) -> None:
        _positive(self, "inner", "sync_every", "batch_size")
        if not isinstance(self.round_samples, int) or self.round_samples < 0:
            raise ConfigError(f"inner.round_samples ({self.round_samples!r}) must be an integer >= 0 (0: rounds of "
                              "inner.sync_every steps on every peer)")
        if not isinstance(self.normalize_steps, bool):
            raise ConfigError(f"inner.normalize_steps ({self.normalize_steps!r}) must be true or false")
        if 0 < self.round_samples < self.sync_every:
            raise ConfigError(f"inner.round_samples ({self.round_samples}) must be >= inner.sync_every "
                              f"({self.sync_every}): a schedule position is round_samples / sync_every sequences")
        _positive_float(self, "inner", "lr")
        if not 0 <= self.weight_decay < 1:
            raise ConfigError(f"inner.weight_decay ({self.weight_decay}) must be in [0, 1)")
        for b in ("beta1", "beta2"):
            if not 0 <= getattr(self, b) < 1:
                raise ConfigError(f"inner.{b} ({getattr(self, b)}) must be in [0, 1)")
        if self.warmup_steps < 0 or self.grad_clip < 0:
            raise ConfigError("inner.warmup_steps and inner.grad_clip must be >= 0")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"inner.lr_schedule ({self.lr_schedule!r}) must be one of {', '.join(LR_SCHEDULES)}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"inner.min_lr_ratio ({self.min_lr_ratio}) must be in [0, 1]")
        if self.lr_schedule == "cosine":
            if not isinstance(self.decay_steps, int) or self.decay_steps <= self.warmup_steps:
                raise ConfigError(f"inner.lr_schedule = cosine needs inner.decay_steps (the run's planned inner steps; "
                                  f"now {self.decay_steps!r}) larger than inner.warmup_steps ({self.warmup_steps})")
            if self.round_samples:
                raise ConfigError("inner.lr_schedule = cosine counts schedule positions, which rounds by samples "
                                  "(inner.round_samples > 0) do not share between peers: use the constant schedule there")


@dataclass
class OuterConfig:
    """Outer optimiser: SGD with Nesterov momentum applied to the averaged pseudo-gradient."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True

    def validate(self) -> None:
        _positive_float(self, "outer", "lr")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"outer.momentum ({self.momentum}) must be in [0, 1)")


@dataclass
class StreamingConfig:
    """Fragments and overlap of communication with training. Defaults: the scheme ``streaming`` (:data:`SCHEMES`).

    * ``fragments`` P: the model is split into P fragments of whole blocks, fragment p synced every
      ``inner.sync_every`` (H) steps at offset p·H/P (Streaming DiLoCo, arXiv 2501.18512 §2).
    * ``mode`` how a fragment's average reaches the model while training goes on:

      - ``"tau"``: Streaming DiLoCo Algorithm 2. The average is applied ``tau`` inner steps after it
        was sent: θ~ = OuterOpt(previous global copy, Δ), then θ_local ← alpha·θ_local + (1−alpha)·θ~.
        ``tau = 0, alpha = 0`` is blocking DiLoCo. Needs ``tau < H/P``.
      - ``"delay"``: naive one-step delay (DiLoCoX, arXiv 2506.21263): the average of round r is
        applied at the end of round r+1; the next inner phase starts from the global copy without it.
      - ``"eager"``: Eager Updates (arXiv 2502.12996): like ``delay``, but each peer's own fresh
        pseudo-gradient takes effect at once. ``eager_estimate`` picks how:
        ``"paper"`` (default) the published rule: the peer steps its own outer state with the last
        average plus (its fresh term − its stale term)·w_m/W, kept as the agreed (digest-checked)
        global copy plus a per-peer offset; ``"fresh_heuristic"`` the next phase starts from
        OuterOpt(global copy, Δ_m), the peer's fresh pseudo-gradient standing in for the whole
        average (a heuristic of this project, not the paper's method). The global copy itself only
        ever takes true averages in both. Measured: docs/benchmark.md, "Eager updates".

      See :mod:`p2pdiloco.diloco.overlap` for the exact rules.
    """

    fragments: int = 4
    #: "strided" (block i -> fragment i mod P), "sequential" (runs of ceil(L/P) blocks) or "balanced"
    #: (consecutive blocks, embeddings and head included, cut so the largest fragment is smallest)
    pattern: str = "strided"
    #: "tau", "delay" or "eager" (see above)
    mode: str = "tau"
    #: mode "tau": inner steps between sending a fragment's pseudo-gradient and applying its average
    tau: int = 4
    #: mode "tau": weight of the local progress when the average is merged in (0 = take the average:
    #: measured better than 0.5 over the long horizon, docs/benchmark.md "The default scheme")
    alpha: float = 0.0
    #: start group formation at least this many inner steps before a sync, in the background, so it is
    #: off the critical path (capped at H/P - 1; 0 = form the group at the sync step, with
    #: prepare_seconds = 0 too). Not part of the fingerprint.
    prepare_steps: int = 2
    #: ... and at least this many seconds before it (converted with the measured inner-step time, the
    #: same cap): formation takes a few DHT round trips plus the wait for the slowest member to be ready,
    #: and peers drift apart by seconds per round. Not part of the fingerprint.
    prepare_seconds: float = 3.0
    #: mode "eager": "paper" (Eager Updates as published) or "fresh_heuristic" (see above)
    eager_estimate: str = "paper"
    EAGER_ESTIMATES = ("paper", "fresh_heuristic")

    MODES = ("tau", "delay", "eager")

    def validate(self) -> None:
        _positive(self, "streaming", "fragments")
        if self.pattern not in ("strided", "sequential", "balanced"):
            raise ConfigError(f"streaming.pattern ({self.pattern!r}) must be 'strided', 'sequential' or 'balanced'")
        if self.mode not in self.MODES:
            raise ConfigError(f"streaming.mode ({self.mode!r}) must be 'tau' (Streaming DiLoCo: apply the average "
                              "tau steps later, merged by alpha), 'delay' (one-step delay, DiLoCoX) or 'eager' "
                              "(Eager Updates)")
        if not isinstance(self.tau, int) or self.tau < 0:
            raise ConfigError(f"streaming.tau ({self.tau!r}) must be an integer >= 0 (0 = blocking)")
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"streaming.alpha ({self.alpha}) must be in [0, 1]: 0 takes the averaged fragment, "
                              "1 keeps the local progress, 0.5 averages the two")
        if self.mode != "tau" and (self.tau != 0 or self.alpha != 0.0):
            raise ConfigError(f"streaming.tau and streaming.alpha apply to streaming.mode='tau' only; mode "
                              f"{self.mode!r} applies each average one outer step later by construction. Remove "
                              "streaming.tau/streaming.alpha or use streaming.mode=tau")
        if self.eager_estimate == "fresh":
            raise ConfigError("streaming.eager_estimate 'fresh' was renamed 'fresh_heuristic' (it is not the Eager "
                              "Updates paper's rule); use --set streaming.eager_estimate=fresh_heuristic, or 'paper'")
        if self.eager_estimate not in self.EAGER_ESTIMATES:
            raise ConfigError(f"streaming.eager_estimate ({self.eager_estimate!r}) must be 'paper' (Eager Updates as "
                              "published) or 'fresh_heuristic' (the peer's own fresh pseudo-gradient stands in "
                              "for the round's average)")
        if not isinstance(self.prepare_steps, int) or self.prepare_steps < 0:
            raise ConfigError(f"streaming.prepare_steps ({self.prepare_steps!r}) must be an integer >= 0")
        if not (isinstance(self.prepare_seconds, (int, float)) and 0 <= self.prepare_seconds < 1e6):
            raise ConfigError(f"streaming.prepare_seconds ({self.prepare_seconds!r}) must be a number of seconds >= 0")

    def check_schedule(self, sync_every: int, n_layers: int) -> None:
        """Invariants that involve H (``inner.sync_every``) and the model depth."""
        P, H = self.fragments, sync_every
        if P > n_layers:
            raise ConfigError(f"streaming.fragments ({P}) exceeds model.n_layers ({n_layers}); a fragment holds "
                              "whole layers: use at most n_layers fragments")
        if H % P:
            lo, hi = H - H % P, H - H % P + P
            raise ConfigError(f"inner.sync_every ({H}) must be divisible by streaming.fragments ({P}) so fragment "
                              f"syncs are evenly staggered: use inner.sync_every={hi}" + (f" or {lo}" if lo else "")
                              + " or another number of fragments")
        if self.mode == "tau" and self.tau >= H // P:
            raise ConfigError(f"streaming.tau ({self.tau}) must be smaller than inner.sync_every / streaming.fragments "
                              f"= {H // P}, so a fragment's average is applied before the next fragment is sent: "
                              f"use streaming.tau <= {H // P - 1}, or raise inner.sync_every, or use fewer fragments")


@dataclass
class CompressionConfig:
    """What goes on the wire (reducers in diloco/reducers.py, docs/compression.md).

    ``codec`` encodes every part of the all-reduce (the owner reduces in fp32 and encodes the mean
    once, so all peers decode identical bytes). ``lowrank`` adds PowerSGD-style shared-basis
    low-rank factors for 2-D blocks (the factors then travel with ``codec``).
    """

    #: fp32 (lossless), fp16, a 4-bit blockwise codec: e3m0 (Streaming DiLoCo), nf4, fp4, the 2-bit q2 or the
    #: 1-bit q1 (for what the residual kept in the model follows), or sparse (below)
    codec: str = "e3m0"
    #: carry what a lossy codec / the low-rank projection dropped into the next round (per peer).
    #: Off by default: measured no gain with 4-bit and a loss with low-rank (docs/compression.md)
    error_feedback: bool = False
    #: send 2-D blocks as low-rank factors P (rows x r) and Q (cols x r): 2 all-reduces per sync (+1 tiny)
    lowrank: bool = False
    #: initial and largest rank per matrix
    rank: int = 4
    #: the adaptive rule never goes below this rank
    min_rank: int = 1
    #: adapt each matrix's rank from the energy its factors capture, agreed by the group every round
    adaptive: bool = True
    #: target of ||P P^T M||_F / ||M||_F: the smallest rank reaching it is kept (rank diminishment)
    energy_target: float = 0.9
    #: matrices with fewer elements (and all 1-D tensors) are sent whole with ``codec``
    min_numel: int = 4096
    #: > 0: each matrix's largest rank is this share of its smaller side (floor, >= 1), replacing ``rank``
    rank_fraction: float = 0.0
    #: power iterations per sync (each one more pair of all-reduces); 1 = PowerSGD's warm-started single step
    power_iterations: int = 1
    #: error feedback keeps this share of the low-rank residual (1: all of it)
    feedback_decay: float = 1.0
    #: where the error-feedback residual goes: "resend" (added to the next round's pseudo-gradient) or
    #: "model" (this peer's model keeps it: the next inner phase starts from the average minus it)
    feedback_form: str = "resend"
    #: comma-separated substrings: parameters whose names contain one are sent whole with ``codec``, not
    #: as low-rank factors (e.g. "emb" for the embeddings)
    dense_params: str = ""
    #: low-rank factors on the wire: "columns" (each column its own codec blocks) or "rows" (row-major)
    factor_layout: str = "columns"
    #: low-rank warm start: "ritz" (singular vectors of the averaged Q, strongest first) or "mean" (PowerSGD's)
    warm_start: str = "ritz"
    #: codec "sparse" (SparseLoCo): values per chunk, values kept per chunk, bits per kept value, and the
    #: decay of the per-peer error buffer (docs/compression.md, "Sparse")
    sparse_chunk: int = 4096
    sparse_k: int = 64
    sparse_bits: int = 2
    sparse_decay: float = 0.95

    def validate(self) -> None:
        get_codec(self.codec)  # raises ConfigError naming the valid choices
        self._validate_sparse()
        if self.factor_layout not in ("columns", "rows"):
            raise ConfigError(f"compression.factor_layout ({self.factor_layout!r}) must be 'columns' or 'rows'")
        if self.warm_start not in ("ritz", "mean"):
            raise ConfigError(f"compression.warm_start ({self.warm_start!r}) must be 'ritz' or 'mean'")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"compression.rank ({self.rank!r}) must be an integer >= 1")
        if isinstance(self.min_rank, bool) or not isinstance(self.min_rank, int) or not 1 <= self.min_rank <= self.rank:
            raise ConfigError(f"compression.min_rank ({self.min_rank!r}) must be an integer in [1, compression.rank "
                              f"= {self.rank}]")
        if not 0.0 < self.energy_target <= 1.0:
            raise ConfigError(f"compression.energy_target ({self.energy_target!r}) must be in (0, 1], e.g. 0.9")
        if isinstance(self.min_numel, bool) or not isinstance(self.min_numel, int) or self.min_numel < 1:
            raise ConfigError(f"compression.min_numel ({self.min_numel!r}) must be an integer >= 1")
        if not 0.0 <= self.rank_fraction <= 1.0:
            raise ConfigError(f"compression.rank_fraction ({self.rank_fraction!r}) must be in [0, 1], e.g. 0.125 "
                              "(0: every matrix uses compression.rank)")
        if (isinstance(self.power_iterations, bool) or not isinstance(self.power_iterations, int)
                or self.power_iterations < 1):
            raise ConfigError(f"compression.power_iterations ({self.power_iterations!r}) must be an integer >= 1")
        if not 0.0 <= self.feedback_decay <= 1.0:
            raise ConfigError(f"compression.feedback_decay ({self.feedback_decay!r}) must be in [0, 1]")
        if self.feedback_form not in ("resend", "model"):
            raise ConfigError(f"compression.feedback_form ({self.feedback_form!r}) must be 'resend' (the residual "
                              "is added to the next round's pseudo-gradient) or 'model' (the peer's model keeps it)")
        if self.feedback_form == "model" and not self.error_feedback:
            raise ConfigError("compression.feedback_form=model keeps the error-feedback residual in the model: "
                              "set compression.error_feedback=true as well")

    def _validate_sparse(self) -> None:
        chunk, k = self.sparse_chunk, self.sparse_k
        if isinstance(chunk, bool) or not isinstance(chunk, int) or not 2 <= chunk <= 1 << 16:
            raise ConfigError(f"compression.sparse_chunk ({chunk!r}) must be an integer in [2, 65536], e.g. 4096")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= chunk:
            raise ConfigError(f"compression.sparse_k ({k!r}) must be an integer in [1, compression.sparse_chunk "
                              f"= {chunk}], e.g. 64")
        if self.sparse_bits not in (2, 3, 4, 8):
            raise ConfigError(f"compression.sparse_bits ({self.sparse_bits!r}) must be 2, 3, 4 or 8 (a sign bit and "
                              "the level of the value between the chunk's smallest and largest kept magnitude)")
        if not 0.0 <= self.sparse_decay <= 1.0:
            raise ConfigError(f"compression.sparse_decay ({self.sparse_decay!r}) must be in [0, 1], e.g. 0.95")
        if self.codec == "sparse" and self.lowrank:
            raise ConfigError("compression.codec=sparse does not combine with compression.lowrank=true: choose one")


@dataclass
class SwarmConfig:
    """Discovery and networking."""

    run_id: str = "p2pdiloco-demo"
    initial_peers: List[str] = field(default_factory=list)
    #: where the p2p daemon listens; empty (the default): on loopback when every initial peer is on this
    #: machine, on every interface (a kernel-chosen port) when one is elsewhere (addresses.listen_maddrs)
    host_maddrs: List[str] = field(default_factory=list)
    announce_maddrs: List[str] = field(default_factory=list)
    #: private key file giving this peer a stable identity ("" = fresh identity every start)
    identity_path: str = ""
    #: how long to wait for an initial peer before giving up (seconds)
    bootstrap_timeout: float = 20.0
    #: smallest group an outer step may be taken with (1 = a lone peer keeps training)
    min_group_size: int = 1
    #: wait until this many peers (this one included) are live before the first inner step
    min_peers_to_start: int = 1
    #: how long to wait for them (seconds); training then starts with whoever is there
    start_timeout: float = 60.0
    #: upper bound of the wait for the other live peers to become ready for a sync (seconds); the
    #: actual wait is derived from each missing peer's measured steps/s (swarm/matchmaking.py)
    matchmaking_timeout: float = 30.0
    #: upper bound of one all-reduce, and of one state request to one donor (seconds); the actual
    #: timeout is derived from the measured transfer speed (swarm/timeouts.py)
    allreduce_timeout: float = 60.0
    #: the slowest link the run expects (Mbit/s): derives timeouts before anything was measured
    min_link_mbit: float = 10.0
    #: false: use matchmaking_timeout and allreduce_timeout as fixed timeouts, nothing derived
    adaptive_timeouts: bool = True
    #: how often our progress record is refreshed in the DHT and the others' are read over the network
    #: (seconds); a silent peer's record expires after 3x this + 5 s. Each refresh is one signed record
    #: (~2.7 KB on the wire with its answer) to each of the key's nearest nodes: 10 s keeps a peer's
    #: background traffic near 1 KB/s each way (docs/benchmark.md, "Background traffic")
    progress_period: float = 10.0
    #: can other peers dial this one? "auto" (detected by a dial-back through the initial peers),
    #: "public" or "private" (behind NAT: trains as a full member, owns no all-reduce shard, never
    #: leads a group); see swarm/reachability.py. Local: not part of the fingerprint
    reachability: str = "auto"
    #: when public, also relay for peers behind NAT (swarm/relay.py; the bootstrap relays by default).
    #: Local: not part of the fingerprint
    relay: bool = False
    #: groups of more members than this average in two levels: subgroups of at most this many members,
    #: whose shard owners then average across subgroups, exactly and identically on every member (each
    #: member connects to its subgroup's owners and, as an owner, to one peer per subgroup; see
    #: swarm/allreduce.py, "Capped groups"). 0: one butterfly of all members, however many
    group_cap: int = 0
    #: with a cap, rounds of at least twice as many peers due form through bucket heads that carry their
    #: bucket's join requests to the round's leader (swarm/matchmaking.py, item 13): its requests about N/G +
    #: 2G instead of N. Off by default: identities that stall join requests make many more peers miss them
    gather: bool = False

    def validate(self) -> None:
        if not isinstance(self.gather, bool):
            raise ConfigError(f"swarm.gather ({self.gather!r}) must be true or false")
        if self.reachability not in ("auto", "public", "private"):
            raise ConfigError(f"swarm.reachability ({self.reachability!r}) must be auto, public or private")
        if not self.run_id or any(c in self.run_id for c in " /:\t\n"):
            raise ConfigError(f"swarm.run_id ({self.run_id!r}) must be non-empty without spaces, '/' or ':'")
        _positive(self, "swarm", "min_group_size", "min_peers_to_start")
        if not isinstance(self.group_cap, int) or isinstance(self.group_cap, bool) or self.group_cap < 0 \
                or self.group_cap == 1:
            raise ConfigError(f"swarm.group_cap ({self.group_cap!r}) must be 0 (no cap) or an integer of at least "
                              "2, e.g. 16")
        _positive_float(self, "swarm", "bootstrap_timeout", "matchmaking_timeout", "allreduce_timeout",
                        "progress_period", "start_timeout", "min_link_mbit")
        parse_maddrs(self.initial_peers, "swarm.initial_peers", require_peer_id=True)
        parse_maddrs(self.host_maddrs, "swarm.host_maddrs")
        parse_maddrs(self.announce_maddrs, "swarm.announce_maddrs")


#: train.autocast values: the dtype the inner step's forward runs in under torch.autocast ("off": none)
AUTOCAST = ("off", "bf16")


@dataclass
class TrainConfig:
    """Budget, devices, bookkeeping."""

    #: stop after this many outer steps of fragment 0 (0 = no limit)
    max_outer_steps: int = 0
    #: stop after this many seconds of training (0 = no limit)
    max_seconds: float = 0.0
    #: where metrics.jsonl and checkpoints go ("" = runs/<run_id>/<short peer id>)
    run_dir: str = ""
    #: "auto" picks cuda when available, else cpu; or any torch device string
    device: str = "auto"
    #: the inner step's forward and loss under ``torch.autocast``: "off" (fp32) or "bf16"; parameters,
    #: gradients, AdamW and the outer state stay fp32. A choice of each machine (not in the fingerprint):
    #: the swarm averages pseudo-gradients, whatever precision produced them
    autocast: str = "off"
    #: seed of the model initialisation; part of the fingerprint so every peer starts from one θ
    seed: int = 0
    #: torch intra-op threads (0 = torch's default)
    threads: int = 0
    #: validation batches measured at every sync
    eval_batches: int = 4
    #: write the checkpoint after each outer step on a background thread (training goes on; the state is
    #: first copied to host memory, so a second copy of model, AdamW and outer state is held while it
    #: is written); false: the training thread writes it and waits for the disk, without the copy
    background_checkpoints: bool = True
    #: show a progress bar on stderr
    progress_bar: bool = True
    #: also serve the swarm's web dashboard on this port (0 = no dashboard; p2pdiloco/dashboard)
    dashboard_port: int = 0
    #: the address the dashboard listens on (loopback unless told otherwise)
    dashboard_host: str = "127.0.0.1"

    def validate(self) -> None:
        if self.max_outer_steps < 0 or self.max_seconds < 0 or self.threads < 0:
            raise ConfigError("train.max_outer_steps, train.max_seconds and train.threads must be >= 0")
        if not 0 <= self.dashboard_port <= 65535:
            raise ConfigError(f"train.dashboard_port ({self.dashboard_port}) must be a TCP port, 1-65535 (0: none)")
        _positive(self, "train", "eval_batches")
        if self.autocast not in AUTOCAST:
            raise ConfigError(f"train.autocast ({self.autocast!r}) must be one of {', '.join(AUTOCAST)}")
        if self.device != "auto":
            import torch

            try:
                dev = torch.device(self.device)
            except RuntimeError:
                raise ConfigError(f"train.device ({self.device!r}) is not a torch device; use auto, cpu or cuda") from None
            if dev.type == "cuda" and not torch.cuda.is_available():
                raise ConfigError("train.device is cuda but no CUDA GPU is available; use train.device=auto or cpu")

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class LocalConfig:
    """Local workers of one peer (``join --local-workers K``, :mod:`p2pdiloco.local`). Each machine
    chooses its own: not part of the run fingerprint; ignored by a one-process peer (K = 1)."""

    #: ``replicate``: every worker holds the whole model (DDP-style, the model must fit one device);
    #: ``fsdp``: parameters, gradients and inner optimiser state in K shards (torch FSDP2), for a model
    #: that does not fit one device (:mod:`p2pdiloco.local.fsdp`)
    sharding: str = "replicate"
    #: seconds a local worker may go without a heartbeat (a stopped or frozen process) before the
    #: launcher takes the machine's peer down (:mod:`p2pdiloco.local.launch`)
    heartbeat_timeout: float = 60.0

    def validate(self) -> None:
        if self.sharding not in ("replicate", "fsdp"):
            raise ConfigError(f"local.sharding ({self.sharding!r}) must be replicate or fsdp")
        if not self.heartbeat_timeout >= 2.0:
            raise ConfigError(f"local.heartbeat_timeout ({self.heartbeat_timeout}) must be at least 2 seconds "
                              "(workers beat every 0.5 s)")


_SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "inner": InnerConfig,
    "outer": OuterConfig,
    "streaming": StreamingConfig,
    "compression": CompressionConfig,
    "robust": RobustConfig,
    "swarm": SwarmConfig,
    "train": TrainConfig,
    "local": LocalConfig,
}


#: named training schemes: the values they give the keys they cover. ``--set scheme=NAME`` (or a
#: top-level ``scheme = "NAME"`` in a TOML file) applies one as a layer between the dataclass defaults
#: and the file's and command line's own keys, so an explicit key always wins over the scheme. The
#: dataclass defaults are :data:`DEFAULT_SCHEME` (tested); why these values: docs/benchmark.md,
#: "The default scheme".
SCHEMES: Dict[str, Dict[str, Any]] = {
    # the mission's scheme: Streaming DiLoCo, 4 fragments, each average applied tau steps after it was
    # sent (taken whole: alpha 0), 4-bit E3M0 pseudo-gradients
    "streaming": {"streaming.fragments": 4, "streaming.mode": "tau", "streaming.tau": 4, "streaming.alpha": 0.0,
                  "compression.codec": "e3m0", "compression.lowrank": False, "outer.lr": 0.7},
    # the original DiLoCo: one fragment, blocking, fp32 pseudo-gradients
    "diloco": {"streaming.fragments": 1, "streaming.mode": "tau", "streaming.tau": 0, "streaming.alpha": 0.0,
               "compression.codec": "fp32", "compression.lowrank": False, "outer.lr": 0.7},
}
DEFAULT_SCHEME = "streaming"


def scheme_of(cfg: "RunConfig") -> Optional[str]:
    """The name of the scheme ``cfg`` runs (its values on every key a scheme covers), or None."""
    for name, values in SCHEMES.items():
        if all(_get(cfg, k) == v for k, v in values.items()):
            return name
    return None


def describe_scheme(cfg: "RunConfig") -> str:
    """One line saying what scheme ``cfg`` runs, e.g. for the demo's summary."""
    s, c = cfg.streaming, cfg.compression
    if s.fragments == 1 and s.mode == "tau" and s.tau == 0:
        what = "DiLoCo (blocking)"
    else:
        overlap = {"tau": f"tau={s.tau}, alpha={s.alpha:g}" if s.tau else "blocking",
                   "delay": "one-step delay", "eager": f"eager ({s.eager_estimate})"}[s.mode]
        what = f"Streaming DiLoCo, {s.fragments} fragment{'s' if s.fragments > 1 else ''}, {overlap}"
    wire = c.codec + (f" + low-rank (rank {c.rank})" if c.lowrank else "")
    name = scheme_of(cfg)
    rounds = (f"rounds of {cfg.inner.round_samples} samples by the whole swarm" if cfg.inner.round_samples
              else f"rounds of {cfg.inner.sync_every} inner steps on every peer")
    return (f"{what}, {wire} on the wire, outer lr {cfg.outer.lr:g}" + (f" (scheme '{name}')" if name else "")
            + f"; {rounds}")


def _get(cfg: "RunConfig", dotted: str) -> Any:
    section, key = dotted.split(".", 1)
    return getattr(getattr(cfg, section), key)


def _apply_scheme(cfg: "RunConfig", name: Any) -> None:
    if not isinstance(name, str) or name not in SCHEMES:
        raise ConfigError(f"unknown scheme {name!r}; choose one of {', '.join(SCHEMES)} (default {DEFAULT_SCHEME!r}), "
                          "e.g. --set scheme=diloco for blocking fp32 DiLoCo")
    for dotted, value in SCHEMES[name].items():
        section, key = dotted.split(".", 1)
        setattr(getattr(cfg, section), key, value)


#: eager's outer lr above which :meth:`RunConfig.advice` warns (bench.eager: every overlapped mode is worse at 0.7 than at 0.4)
EAGER_LR_ADVISED = 0.5


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    streaming: StreamingConfig = field(default_factory=StreamingConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    robust: RobustConfig = field(default_factory=RobustConfig)
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    local: LocalConfig = field(default_factory=LocalConfig)

    def validate(self) -> "RunConfig":
        for name in _SECTIONS:
            getattr(self, name).validate()
        self._check_sparse()
        self._check_feedback_form()
        self.streaming.check_schedule(self.inner.sync_every, self.model.num_blocks())
        self._check_vocab()
        if self.local.sharding == "fsdp" and self.inner.round_samples:
            raise ConfigError("local.sharding=fsdp does not work with inner.round_samples > 0 (the swarm clock): "
                              "the clock may move several schedule positions in one step, so worker 0 cannot tell "
                              "the other workers in advance which parameters to gather for its sync; use "
                              "local.sharding=replicate, or inner.round_samples=0 (rounds of H steps)")
        return self

    def _check_sparse(self) -> None:
        """SparseLoCo's error buffer is its momentum: the outer step must be the plain mean (lr 1, no
        momentum), and the shard owners relay parts, which only the plain mean can aggregate."""
        if self.compression.codec != "sparse":
            return
        if self.outer.lr != 1.0 or self.outer.momentum != 0.0:
            raise ConfigError(f"compression.codec=sparse applies the averaged top-k with outer lr 1 and no momentum "
                              f"(its error buffer is the momentum); set --set outer.lr=1 --set outer.momentum=0 "
                              f"(now lr {self.outer.lr:g}, momentum {self.outer.momentum:g})")
        if self.swarm.group_cap:
            raise ConfigError(f"compression.codec=sparse does not combine with swarm.group_cap "
                              f"({self.swarm.group_cap}): its owners relay the members' parts, which do not "
                              "average across subgroups; set --set swarm.group_cap=0")
        if self.robust.aggregator != "mean":
            raise ConfigError(f"compression.codec=sparse needs robust.aggregator=mean (now "
                              f"{self.robust.aggregator!r}): the owners relay the members' sparse parts and every "
                              "member takes their weighted mean; CenteredClip's result is not sparse")

    def _check_feedback_form(self) -> None:
        """The residual kept in the model enters where a ``tau`` result is merged into it; the
        restarting modes (``delay``, ``eager``) start each phase from their own start point, and
        SparseLoCo's buffer is its momentum, not a residual to hand over."""
        if self.compression.feedback_form != "model":
            return
        if self.compression.codec == "sparse":
            raise ConfigError("compression.feedback_form=model does not apply to compression.codec=sparse (its "
                              "error buffer is the outer momentum); use compression.feedback_form=resend")
        if self.streaming.mode != "tau":
            raise ConfigError(f"compression.feedback_form=model needs streaming.mode=tau (blocking DiLoCo is tau 0), "
                              f"not {self.streaming.mode!r}: the residual is kept where a result is merged into the "
                              "model; use compression.feedback_form=resend with delay or eager")

    def _check_vocab(self) -> None:
        """The tokenizer's vocabulary must be the model's: a token id past the embedding would crash
        training, a smaller one wastes rows (both refused with the value to set)."""
        if self.data.tokenizer:
            n = tokenizer_vocab_size(self.data.tokenizer)
            if n != self.model.vocab_size:
                raise ConfigError(f"data.tokenizer {self.data.tokenizer} has {n} ids but model.vocab_size is "
                                  f"{self.model.vocab_size}; set model.vocab_size={n} (or train a tokenizer of "
                                  f"{self.model.vocab_size} ids)")
        elif self.model.vocab_size != 256:
            raise ConfigError(f"model.vocab_size ({self.model.vocab_size}) must be 256 for byte-level data; set "
                              "model.vocab_size=256 or data.tokenizer to a BPE tokenizer of that size")

    def advice(self) -> List[str]:
        """Valid settings that measured badly: one line each, printed at start (nothing is refused)."""
        lines = []
        if self.streaming.mode == "eager":
            if self.streaming.eager_estimate == "paper":
                lines.append("streaming.mode=eager (Eager Updates as published) measured +9.5% to +12.8% validation "
                             "loss against no overlap at outer lr 0.4 (+32-38% at 0.7) with 4 peers over 20 outer "
                             "steps; --set streaming.eager_estimate=fresh_heuristic measured +0.4% to +2.2% at lr 0.4 "
                             "(docs/benchmark.md, python -m p2pdiloco.bench.eager)")
            if self.outer.lr > EAGER_LR_ADVISED:
                lines.append(f"streaming.mode=eager with outer.lr={self.outer.lr:g}: every overlapped mode measured "
                             "worse at lr 0.7 than at 0.4 (fresh_heuristic +8.6-10% against +0.4-2.2% of no "
                             "overlap); consider --set outer.lr=0.4 (docs/benchmark.md)")
        return lines

    def to_dict(self) -> Dict[str, Dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in _SECTIONS}


def _positive(obj: Any, section: str, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"{section}.{n} ({v!r}) must be a positive integer")


def _positive_float(obj: Any, section: str, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if not v > 0:
            raise ConfigError(f"{section}.{n} ({v!r}) must be > 0")


def _coerce(section: str, f: dataclasses.Field, value: Any, from_string: bool) -> Any:
    """Convert ``value`` to the field's declared type, or raise ConfigError naming the key."""
    key = f"{section}.{f.name}"
    typ = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    typ = typ.replace("typing.", "")
    try:
        if typ == "bool":
            if isinstance(value, bool):
                return value
            if from_string and str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if from_string and str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if typ == "int":
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, int):
                return value
            if from_string:
                return int(str(value))
            raise ValueError
        if typ == "float":
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, (int, float)):
                return float(value)
            if from_string:
                return float(str(value))
            raise ValueError
        if typ == "str":
            if isinstance(value, str):
                return value
            raise ValueError
        if typ.startswith("List[") or typ.startswith("list["):
            if isinstance(value, list) and all(isinstance(x, str) for x in value):
                return list(value)
            if from_string:
                return [x for x in str(value).split(",") if x]
            raise ValueError
    except ValueError:
        raise ConfigError(f"{key}: {value!r} is not a valid {typ}") from None
    raise ConfigError(f"{key}: unsupported field type {typ}")  # pragma: no cover


def _apply(cfg: RunConfig, section: str, key: str, value: Any, from_string: bool) -> None:
    if section not in _SECTIONS:
        raise ConfigError(f"unknown config section [{section}]; known sections: {', '.join(_SECTIONS)}")
    obj = getattr(cfg, section)
    fields = {f.name: f for f in dataclasses.fields(obj)}
    if key not in fields:
        raise ConfigError(f"unknown config key {section}.{key}; known keys in [{section}]: {', '.join(fields)}")
    setattr(obj, key, _coerce(section, fields[key], value, from_string))


def load_config(path: Optional[str] = None, overrides: Sequence[str] = (), validate: bool = True) -> RunConfig:
    """Build a RunConfig from defaults, an optional TOML file and ``section.key=value`` overrides."""
    cfg = RunConfig()
    items: List[Tuple[str, str, Any, bool]] = []  # (section, key, value, from_string), in order
    scheme: Any = None
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path} not found; pass an existing file, e.g. --config peers/tiny-cpu.toml")
        data = _read_toml(path)
        preset = data.pop("preset", None)
        if preset is not None:
            _apply_model_preset(cfg, preset)
        scheme = data.pop("scheme", None)
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: top-level key {section!r} must be a [section] table")
            for key, value in table.items():
                items.append((section, key, value, False))
    for item in overrides:
        lhs = item.split("=", 1)[0].strip()
        if "=" in item and lhs == "scheme":
            scheme = item.split("=", 1)[1].strip()
            continue
        if "=" not in item or "." not in lhs:
            raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. --set inner.sync_every=20 "
                              "(or scheme=NAME)")
        value = item.split("=", 1)[1]
        section, key = lhs.split(".", 1)
        items.append((section.strip(), key.strip(), value.strip(), True))
    if scheme is not None:  # below every explicit key, whatever the order they came in
        _apply_scheme(cfg, scheme)
    for section, key, value, from_string in items:
        if section == "model" and key == "preset":  # in order: later keys change the preset's sizes
            _apply_model_preset(cfg, value)
        else:
            _apply(cfg, section, key, value, from_string)
    explicit = {f"{section}.{key}" for section, key, _, _ in items}
    if cfg.streaming.mode != "tau":  # delay and eager have no tau/alpha: drop the defaults' (never the user's)
        for key in ("tau", "alpha"):
            if f"streaming.{key}" not in explicit:
                setattr(cfg.streaming, key, type(getattr(cfg.streaming, key))(0))
    return cfg.validate() if validate else cfg


def _read_toml(path: str, seen: Tuple[str, ...] = ()) -> Dict[str, Any]:
    """The TOML file's tables; a top-level ``base = "other.toml"`` (relative to the file) is read first
    and the file's own keys win over it, key by key."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found (named as base by {seen[-1]})" if seen else
                          f"config file {path} not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base must be the path of another TOML file, got {base!r}")
    full = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), base))
    if full in seen or full == os.path.abspath(path):
        raise ConfigError(f"{path}: base {base!r} includes itself")
    merged = _read_toml(full, (*seen, os.path.abspath(path)))
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def config_from_dict(d: Dict[str, Dict[str, Any]], validate: bool = False) -> RunConfig:
    """A RunConfig from :meth:`RunConfig.to_dict` output (``run_config.json``); unknown keys refused."""
    cfg = RunConfig()
    for section, table in d.items():
        if not isinstance(table, dict):
            raise ConfigError(f"run config: section {section!r} must be a table")
        for key, value in table.items():
            _apply(cfg, section, key, value, from_string=False)
    return cfg.validate() if validate else cfg


def _apply_model_preset(cfg: RunConfig, name: str) -> None:
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    cfg.model = dataclasses.replace(PRESETS[name])


@dataclass
class BootstrapConfig:
    """``p2pdiloco bootstrap``: a DHT peer with a stable identity; it trains nothing."""

    identity: str = "bootstrap.key"
    host_maddrs: List[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    announce_maddrs: List[str] = field(default_factory=list)
    initial_peers: List[str] = field(default_factory=list)
    bootstrap_timeout: float = 20.0
    #: relay for volunteers behind NAT (swarm/relay.py): they reach each other through this peer
    relay: bool = True
    #: private peers holding a slot at once, and streams forwarded at once
    relay_max_reservations: int = 128
    relay_max_circuits: int = 64
    #: MB one forwarded stream may carry (both ways), and GB all of them together per hour (0: no cap)
    relay_max_mb_per_stream: float = 4096.0
    relay_max_gb_per_hour: float = 0.0

    def validate(self) -> "BootstrapConfig":
        for key in ("relay_max_reservations", "relay_max_circuits"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"bootstrap.{key} ({v!r}) must be an integer >= 1")
        for key in ("relay_max_mb_per_stream", "relay_max_gb_per_hour"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ConfigError(f"bootstrap.{key} ({v!r}) must be a number >= 0 (0: no cap)")

        if not self.identity:
            raise ConfigError("bootstrap.identity must name a key file")
        parse_maddrs(self.host_maddrs, "--host-maddrs")
        parse_maddrs(self.announce_maddrs, "--announce-maddrs")
        parse_maddrs(self.initial_peers, "--initial-peers", require_peer_id=True)
        _positive_float(self, "bootstrap", "bootstrap_timeout")
        return self


def load_bootstrap_config(path: Optional[str] = None, **cli: Any) -> BootstrapConfig:
    """Defaults, then the ``[bootstrap]`` table of ``path``, then command-line values that were given."""
    cfg = BootstrapConfig()
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path} not found; see bootstrap/bootstrap.toml for an example")
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        for section, table in data.items():
            if section != "bootstrap" or not isinstance(table, dict):
                raise ConfigError(f"{path}: unknown section [{section}]; a bootstrap config has only [bootstrap]")
            for key, value in table.items():
                if key not in fields:
                    raise ConfigError(f"unknown config key bootstrap.{key}; known keys: {', '.join(fields)}")
                setattr(cfg, key, _coerce("bootstrap", fields[key], value, from_string=False))
    for key, value in cli.items():
        if value is not None:
            setattr(cfg, key, value)
    return cfg.validate()
