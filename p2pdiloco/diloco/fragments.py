"""Which parameters sync together: the fragment layout (Streaming DiLoCo, arXiv 2501.18512 §2).

Rule for a model with transformer blocks under ``blocks.<i>.`` (our GPT, or any module whose
parameter names follow that pattern):

* block ``i`` goes to fragment ``i mod P`` (*strided*, the paper's default) or to fragment
  ``i // ceil(L / P)`` (*sequential*, consecutive blocks), or (*balanced*) the blocks are cut into P
  runs of consecutive blocks, the input-side parameters counted with block 0 and the output side
  with block L-1, so that the largest fragment (in parameters) is as small as possible: a large
  embedding gets fewer blocks beside it;
* parameters outside the blocks: the input side (token/positional embeddings, anything named before
  the first block) joins fragment 0, the output side (final norm, LM head, anything after the
  blocks) joins fragment P-1. A tied head is one parameter and is counted once, in fragment 0.

A Hugging Face model (:class:`p2pdiloco.hf.HFCausalLM`) names its own decoder-layer prefix in
``fragment_block_pattern`` (``lm.model.layers.<i>.`` for Llama): its decoder layers are the blocks.
The same rule places the rest: ``embed_tokens`` (before the first layer) joins fragment 0, the final
norm and an untied ``lm_head`` (after the last layer) join fragment P-1; a tied head is the embedding
itself, in fragment 0. Fragments thus hold equal numbers of decoder layers, with the embeddings at
the two ends (the paper's layout); the embedding of a large-vocabulary model then makes fragment 0
the heaviest, which ``pattern = "balanced"`` evens out by giving it fewer layers (measured on
peers/llama-gpu.toml, 4 fragments: largest 54.1M parameters strided, 49.8M balanced; ``describe()``
prints the sizes at start).

A module without ``blocks.<i>`` parameters (nor a ``fragment_block_pattern``) can only be trained with ``P = 1`` (one fragment holding
everything), which is plain DiLoCo.

The schedule (:class:`Schedule`): fragment ``p`` syncs after inner steps ``t = p·H/P + k·H``, ``k >= 1``,
so some fragment syncs every ``H/P`` steps and each fragment still takes ``H`` inner steps between
two of its syncs. The layout is part of the run fingerprint (:func:`layout_fingerprint`): peers whose
code would split the model differently refuse to train together.
"""
from __future__ import annotations

import functools
import hashlib
import math
import re
import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
from torch import nn

from ..errors import ConfigError
from ..model import ModelConfig, build_model

__all__ = ["FragmentLayout", "Schedule", "split_fragments", "layout_fingerprint"]

_BLOCK = re.compile(r"^(?:.*\.)?blocks\.(\d+)\.")


@dataclass(frozen=True)
class FragmentLayout:
    """``names[p]``: parameter names of fragment p, in the module's own parameter order."""

    names: Tuple[Tuple[str, ...], ...]
    numels: Tuple[int, ...]
    block_pattern: str = _BLOCK.pattern

    @property
    def num_fragments(self) -> int:
        return len(self.names)

    def describe(self) -> str:
        lines = []
        for p, (names, n) in enumerate(zip(self.names, self.numels)):
            block = re.compile(self.block_pattern)
            blocks = sorted({int(m.group(1)) for m in map(block.match, names) if m})
            other = [x for x in names if not block.match(x)]
            lines.append(f"fragment {p}: {n:,} params; blocks {blocks or '-'}; other {other or '-'}")
        return "\n".join(lines)

    def fingerprint(self) -> List[List[str]]:
        return [list(n) for n in self.names]

    def summary(self) -> str:
        """One line for the run fingerprint: sizes per fragment and a hash of who went where."""
        h = hashlib.sha256("\n".join("|".join(n) for n in self.names).encode()).hexdigest()[:12]
        return f"{self.num_fragments} fragment(s) of {'/'.join(str(n) for n in self.numels)} params, names {h}"


@dataclass(frozen=True)
class Schedule:
    """When each fragment syncs (Streaming DiLoCo §2): fragment ``p`` after inner steps
    ``p·H/P + k·H`` for ``k = 1, 2, ...`` (``t`` counts inner steps taken, from 1). Needs ``P | H``."""

    H: int
    P: int

    def offset(self, p: int) -> int:
        return p * self.H // self.P

    def due(self, t: int) -> List[int]:
        """Fragments whose pseudo-gradient is sent right after inner step ``t``."""
        return [p for p in range(self.P) if t - self.offset(p) >= self.H and (t - self.offset(p)) % self.H == 0]

    def round_of(self, p: int, t: int) -> int:
        """The fragment's outer round (0-based) of a sync after inner step ``t``."""
        return (t - self.offset(p)) // self.H - 1

    def send_step(self, p: int, round_: int) -> int:
        return self.offset(p) + (round_ + 1) * self.H

    def next_send(self, after: int) -> int:
        """The first inner step after ``after`` at which some fragment syncs."""
        t = after + 1
        while not self.due(t):
            t += 1
        return t


def split_fragments(model: nn.Module, fragments: int, pattern: str = "strided") -> FragmentLayout:
    """The layout of ``model`` in ``fragments`` fragments (module docstring); :class:`ConfigError` when
    the model cannot be split so."""
    block_re = getattr(model, "fragment_block_pattern", None) or _BLOCK
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    block_of: Dict[str, int] = {}
    for name, _ in named:
        m = block_re.match(name)
        if m:
            block_of[name] = int(m.group(1))
    if fragments == 1:
        return FragmentLayout((tuple(n for n, _ in named),), (sum(p.numel() for _, p in named),), block_re.pattern)
    n_blocks = len(set(block_of.values()))
    if n_blocks == 0:
        raise ConfigError("streaming.fragments > 1 needs a model with parameters under blocks.<i>.; "
                          "this model has none: use streaming.fragments=1")
    if fragments > n_blocks:
        raise ConfigError(f"streaming.fragments ({fragments}) exceeds the model's {n_blocks} blocks; "
                          f"use at most {n_blocks}")
    per = math.ceil(n_blocks / fragments)
    if pattern == "sequential" and math.ceil(n_blocks / per) < fragments:
        raise ConfigError(f"sequential fragments: {n_blocks} blocks cannot fill {fragments} fragments of "
                          f"{per} blocks; choose a number of fragments that divides {n_blocks}")
    first_block_pos = min(i for i, (n, _) in enumerate(named) if n in block_of)
    if pattern == "balanced":
        return _balanced(named, block_of, first_block_pos, fragments, block_re.pattern)
    groups: List[List[str]] = [[] for _ in range(fragments)]
    numels = [0] * fragments
    for pos, (name, p) in enumerate(named):
        if name in block_of:
            b = block_of[name]
            frag = b % fragments if pattern == "strided" else b // per
        else:
            frag = 0 if pos < first_block_pos else fragments - 1
        groups[frag].append(name)
        numels[frag] += p.numel()
    return FragmentLayout(tuple(tuple(g) for g in groups), tuple(numels), block_re.pattern)


def _balanced(named, block_of: Dict[str, int], first_block_pos: int, fragments: int, block_pattern: str
              ) -> FragmentLayout:
    """Consecutive blocks in ``fragments`` runs minimising the largest run's parameters (the embedding,
    before block 0, weighs on the first run; the final norm and an untied head on the last). Exact
    linear partition by dynamic programming; ties go to the earliest cut."""
    blocks = sorted(set(block_of.values()))
    index = {b: k for k, b in enumerate(blocks)}
    weight = [0] * len(blocks)
    owner: List[int] = []  # unit (block position) of each named parameter
    for pos, (name, p) in enumerate(named):
        k = index[block_of[name]] if name in block_of else (0 if pos < first_block_pos else len(blocks) - 1)
        weight[k] += p.numel()
        owner.append(k)
    L, P = len(blocks), fragments
    prefix = [0]
    for w in weight:
        prefix.append(prefix[-1] + w)
    INF = float("inf")
    # best[j][i]: the smallest possible largest run when the first i units form j runs
    best = [[INF] * (L + 1) for _ in range(P + 1)]
    cut = [[0] * (L + 1) for _ in range(P + 1)]
    best[0][0] = 0
    for j in range(1, P + 1):
        for i in range(j, L + 1):
            for c in range(j - 1, i):
                v = max(best[j - 1][c], prefix[i] - prefix[c])
                if v < best[j][i]:
                    best[j][i], cut[j][i] = v, c
    run_of = [0] * L
    i = L
    for j in range(P, 0, -1):
        c = cut[j][i]
        for k in range(c, i):
            run_of[k] = j - 1
        i = c
    groups: List[List[str]] = [[] for _ in range(P)]
    numels = [0] * P
    for (name, p), k in zip(named, owner):
        groups[run_of[k]].append(name)
        numels[run_of[k]] += p.numel()
    return FragmentLayout(tuple(tuple(g) for g in groups), tuple(numels), block_pattern)


@functools.lru_cache(maxsize=16)
def _layout_summary(model_fields: Tuple, fragments: int, pattern: str) -> str:
    cfg = ModelConfig(**dict(model_fields))
    with torch.device("meta"):  # names and shapes only: no memory, no draw from the RNG
        model = build_model(cfg)
    return split_fragments(model, fragments, pattern).summary()


def layout_fingerprint(model_cfg, fragments: int, pattern: str) -> str:
    """The fragment layout of the model of ``model_cfg`` (GPT or HF) as one line (see :meth:`FragmentLayout.summary`)."""
    return _layout_summary(tuple(sorted(dataclasses.asdict(model_cfg).items())), fragments, pattern)
