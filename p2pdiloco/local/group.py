"""The collectives between the local workers of one peer, and what rank 0 tells the others.

:class:`LocalGroup` is this process's place in the machine's ``torch.distributed`` group (gloo on
CPU; on CUDA ``cpu:gloo,cuda:nccl``, so the small control messages and the CPU-resident global copy
go through gloo and the gradients and parameters through nccl). Every collective that fails because
another local worker died raises :class:`~p2pdiloco.errors.LocalWorkerLost`: gloo notices a closed
connection within milliseconds, and the launcher's watchdog (:mod:`.launch`) covers the rest. The
group's sockets are bound to loopback (:meth:`LocalGroup.connect`), and it carries tensors and one
fixed-format message (:mod:`.messages`): nothing a worker receives is unpickled.

The protocol, after rank 0's brief at the start (:meth:`LocalLeader.brief`: run folder, data shard,
stream position, inner optimiser state; a fixed-format message, :mod:`.messages`, then the optimiser's
tensors), is one message per inner step (:meth:`LocalLeader.tell`)::

    control (int64): keep going, final, lr step of the next inner step, schedule position, synced step,
                     changed flag per model parameter, changed flag per fragment, outer steps per fragment,
                     gather flag per fragment, gather-the-optimiser flag (both: ``local.sharding = "fsdp"``)
    then the changed parameters (from rank 0's model), then each changed fragment's θ‖momentum (fp32)

Sharded (``local.sharding = "fsdp"``, :mod:`.fsdp`) the changed parameters are scattered (each
worker receives its shard), the changed fragments' global copies are not sent (a worker holds no
full fragment), only their digests (int64 each); the gather flags say which fragments' parameters
(and whether the optimiser state) every worker gathers to rank 0's CPU after its next inner step,
or at once after a message that says stop (rank 0's DiLoCo then applies what is in flight), and the
final message is followed by a gather of the optimiser state (the last checkpoint).

A parameter has changed when rank 0's DiLoCo wrote it since rank 0's inner step (a sync result merged
into the model in ``tau`` mode, the restart of an inner phase in ``delay``/``eager``, a downloaded
state): torch's in-place version counter says so, whatever the mode. A fragment's global copy has
changed when its outer step count or DiLoCo's state epoch (bumped by a download) did; it is read under
``DiLoCo.state_lock``, so a background sync landing meanwhile is sent at the next step, never half.
Every worker therefore starts each inner step with rank 0's parameters (the inner steps themselves
keep them equal: the same averaged gradient, the same AdamW), and logs the digest of the global copy
it received, which is the swarm's.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ..digest import fragment_digest, tensors_digest
from ..errors import LocalWorkerLost, WireError
from ..snapshot import fragment_tensors
from .messages import MAX_BRIEF_BYTES, decode_brief, encode_brief

__all__ = ["LocalGroup", "LocalLeader", "LocalFollower", "Control", "ENV_RANK", "ENV_WORLD", "ENV_STORE",
           "ENV_PARENT", "COLLECTIVE_TIMEOUT_S", "LOOPBACK", "loopback_interface"]

logger = logging.getLogger(__name__)

#: set by the launcher in each worker's environment
ENV_RANK, ENV_WORLD = "P2PDILOCO_LOCAL_RANK", "P2PDILOCO_LOCAL_WORLD"
ENV_STORE, ENV_PARENT = "P2PDILOCO_LOCAL_STORE", "P2PDILOCO_LOCAL_PARENT"
#: how long a worker waits in one collective: rank 0 may spend this long on the network between two
#: messages (a state download, waiting for peers). A *dead* worker is noticed at once (gloo's closed
#: connection, the launcher's watchdog); this only bounds a live process that hangs.
COLLECTIVE_TIMEOUT_S = 2 * 3600
#: the only address the local workers' sockets use: they are on one machine
LOOPBACK = "127.0.0.1"
#: gradients are averaged in buckets of at most this many elements (one all-reduce each)
BUCKET_NUMEL = 1 << 24


def loopback_interface() -> str:
    """The name of the interface that holds 127.0.0.1 (``lo`` on Linux, ``lo0`` on macOS)."""
    try:
        import psutil

        for name, addrs in psutil.net_if_addrs().items():
            if any(a.family == socket.AF_INET and a.address == LOOPBACK for a in addrs):
                return name
    except (ImportError, OSError):
        pass
    return "lo"


def _not_inherited_sockets() -> None:
    """Mark this process's sockets close-on-exec (gloo leaves its listener inheritable): a child we
    start later does not hold our group's sockets open. Linux (/proc); elsewhere nothing to do."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return
    for fd in map(int, fds):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                os.set_inheritable(fd, False)
        except OSError:  # closed meanwhile (the listing's own descriptor)
            pass


class LocalGroup:
    """This process's membership in its machine's group of ``world`` local workers."""

    def __init__(self, rank: int, world: int, store: str, device: str):
        self.rank, self.world, self.store_addr = rank, world, store
        #: this worker's device: ``cuda:<rank>`` when the run trains on CUDA, else the CPU
        self.device = f"cuda:{rank}" if device.startswith("cuda") else device
        self.broken = False
        #: ``local.sharding = "fsdp"``: parameters, gradients and optimiser state in shards (:mod:`.fsdp`)
        self.sharded = False

    @classmethod
    def from_env(cls, device: str) -> Optional["LocalGroup"]:
        """The group the launcher put this process in, or None for a one-process peer."""
        if ENV_RANK not in os.environ:
            return None
        return cls(int(os.environ[ENV_RANK]), int(os.environ[ENV_WORLD]), os.environ[ENV_STORE], device)

    def set_threads(self, threads: int) -> None:
        """``train.threads``, or with 0 (torch's default, every core) on the CPU: this worker's share of
        the cores, so K workers do not oversubscribe the machine K times."""
        if threads:
            torch.set_num_threads(threads)
        elif not self.device.startswith("cuda"):
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.world))

    def connect(self) -> None:
        """Join the process group. Everything is on loopback: the rendezvous is the launcher's TCPStore
        on 127.0.0.1, and gloo's (and nccl's bootstrap) sockets are bound to the loopback interface
        (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``; whatever they were set to, the workers are on one
        machine). The group's sockets are not inherited by the processes we start (the DHT's, the p2p
        daemon)."""
        import torch.distributed as dist

        host, port = self.store_addr.rsplit(":", 1)
        if host != LOOPBACK:
            raise ValueError(f"the local workers' rendezvous must be on {LOOPBACK}, not {host}")
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        if self.device.startswith("cuda"):
            torch.cuda.set_device(self.device)
        backend = "cpu:gloo,cuda:nccl" if self.device.startswith("cuda") else "gloo"
        lo = loopback_interface()
        os.environ["GLOO_SOCKET_IFNAME"] = lo
        os.environ["NCCL_SOCKET_IFNAME"] = "=" + lo  # "=": this interface exactly, not every name it prefixes

        def init() -> None:
            store = dist.TCPStore(host, int(port), self.world, is_master=False, timeout=timeout)
            dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world, timeout=timeout)
        self.collective("join the local group", init)
        _not_inherited_sockets()

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized() and not self.broken:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - leaving anyway
                pass

    @contextlib.contextmanager
    def guard(self, what: str):
        """Around code whose collectives torch issues itself (sharded: FSDP's gathers in the forward,
        its reduce-scatters in the backward, the gradient norm): a failed collective is
        :class:`LocalWorkerLost`, as in :meth:`collective`. Only errors that come from the backend (a
        ``DistError``, or gloo's/nccl's words): an out-of-memory or a bug stays what it is."""
        try:
            yield
        except RuntimeError as e:
            import torch.distributed as dist

            text = str(e)
            if not isinstance(e, dist.DistError) and not any(w in text for w in _BACKEND_WORDS):
                raise
            self.collective(what, _reraise, e)

    def collective(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:  # gloo/nccl: a closed connection, a timeout (DistError is a RuntimeError)
            self.broken = True
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if self.rank:  # rank 0 (or the launcher) says it for the machine, once
                raise LocalWorkerLost(f"local worker {self.rank} of {self.world}: the machine's peer stopped while "
                                      f"we {what} ({first[:200]}); exiting") from None
            raise LocalWorkerLost(f"local worker {self.rank} of {self.world}: another local worker of this "
                                  f"machine stopped while we {what} ({first[:200]}); the peer leaves the swarm "
                                  "(run the same command again to resume from its last checkpoint)") from None

    # ---- the inner step ---------------------------------------------------------------------------------
    def average_gradients(self, params: Sequence[torch.Tensor], loss: float) -> float:
        """Replace every gradient by its mean over the local workers (a missing one counts as zeros);
        returns the mean of ``loss``. The sum is one all-reduce per bucket, then a division by K: every
        worker gets the same bits, so every worker's AdamW step is the same. Sharded (FSDP), the backward
        pass already reduce-scattered the mean gradient of each shard: only the loss is averaged."""
        import torch.distributed as dist

        for p in params if not self.sharded else ():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for bucket in _buckets([p.grad for p in params]) if not self.sharded else ():
            flat = torch.cat([g.reshape(-1) for g in bucket])
            self.collective("averaged gradients", dist.all_reduce, flat)
            flat.div_(self.world)
            off = 0
            for g in bucket:
                g.copy_(flat[off: off + g.numel()].view_as(g))
                off += g.numel()
        t = torch.tensor([float(loss)], dtype=torch.float64)
        self.collective("averaged the loss", dist.all_reduce, t)
        return float(t[0]) / self.world

    # ---- broadcasts from rank 0 -----------------------------------------------------------------------
    def broadcast(self, tensors: Sequence[torch.Tensor], what: str) -> None:
        """Rank 0's ``tensors`` into the others' (same shapes, dtypes, devices), in place."""
        import torch.distributed as dist

        for bucket in _buckets(list(tensors)):
            flat = torch.cat([t.detach().reshape(-1) for t in bucket])
            self.collective(what, dist.broadcast, flat, 0)
            if self.rank:
                off = 0
                with torch.no_grad():
                    for t in bucket:
                        t.copy_(flat[off: off + t.numel()].view_as(t))
                        off += t.numel()

    def broadcast_bytes(self, data: Optional[bytes], what: str, limit: int) -> bytes:
        """Rank 0's ``data`` to every worker (the others pass None): its length as one int64, then the
        bytes as uint8. A length outside 0..``limit`` is refused before anything is allocated."""
        n = torch.tensor([len(data) if data is not None else -1], dtype=torch.int64)
        self.broadcast([n], what)
        size = int(n[0])
        if not 0 <= size <= limit:
            raise WireError(f"local worker {self.rank} of {self.world}: rank 0 announced a message of {size} bytes "
                            f"while we {what} (limit {limit})")
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(size, dtype=torch.uint8)
        if size:
            self.broadcast([buf], what)
        return data if data is not None else buf.numpy().tobytes()


#: words of gloo's and nccl's errors (a closed or reset connection, a timeout), which torch raises as a
#: plain RuntimeError from inside autograd
_BACKEND_WORDS = ("gloo", "nccl", "NCCL", "Connection", "connection", "timed out", "Timed out", "Socket")


def _reraise(e: BaseException) -> None:
    raise e


def _buckets(tensors: List[torch.Tensor]) -> List[List[torch.Tensor]]:
    """Consecutive tensors of one dtype and device, at most BUCKET_NUMEL elements per bucket (a larger
    tensor is a bucket of its own). Every rank builds the same buckets from the same shapes."""
    out: List[List[torch.Tensor]] = []
    size = 0
    for t in tensors:
        if not out or size + t.numel() > BUCKET_NUMEL or (out[-1][0].dtype, out[-1][0].device) != (t.dtype, t.device):
            out.append([])
            size = 0
        out[-1].append(t)
        size += t.numel()
    return out


@dataclass
class Control:
    """One message from rank 0 (see the module docstring)."""

    keep_going: bool    # take another inner step
    final: bool         # rank 0 finished (its last syncs applied): the workers end
    lr_step: int        # the inner lr schedule's step for the next inner step
    step: int           # rank 0's schedule position
    synced_step: int
    event: Optional[Dict[str, Any]] = None  # what changed, as logged (None: nothing)


def _event(rank: int, ctl: Control, outer_steps: List[int], fragments: Dict[int, str], frag_digests: List[str],
           model_digest: Optional[str]) -> Dict[str, Any]:
    """The ``local_sync`` event every worker logs when rank 0 sent something: the same fields, computed
    from what each holds (rank 0: its own state; the others: what they received)."""
    return dict(rank=rank, step=ctl.step, synced_step=ctl.synced_step, final=ctl.final, outer_steps=outer_steps,
                fragments={str(p): d for p, d in fragments.items()}, digest="-".join(frag_digests),
                model_digest=model_digest)


class LocalLeader:
    """Rank 0's side of the protocol, around its model and DiLoCo."""

    def __init__(self, group: LocalGroup, model: torch.nn.Module, diloco, shards=None, train_opt=None):
        """``model``: what DiLoCo syncs (the replica's full parameters; sharded, rank 0's CPU mirror).
        ``shards`` (a :class:`.fsdp.FsdpShards`) and ``train_opt``: this worker's shard and its optimiser,
        with ``local.sharding = "fsdp"``."""
        self.group, self.diloco, self.shards, self.train_opt = group, diloco, shards, train_opt
        self.model = model
        self.params = list(model.parameters())
        self._versions: List[Optional[int]] = [None] * len(self.params)   # after our last inner step
        self._outer_keys: List[Optional[Tuple[int, int]]] = [None] * diloco.num_fragments  # as last sent
        self._frag_digests = [""] * diloco.num_fragments
        index = {n: i for i, (n, _) in enumerate(model.named_parameters())}
        self.frag_params = [[index[n] for n in names] for names in diloco.layout.names]
        self._gather: List[int] = []          # fragments to gather after our next inner step (sharded)
        self._gather_opt = False
        #: sharded: the full inner optimiser state, gathered after this step (None: not gathered this step)
        self.opt_state: Optional[Dict[str, Any]] = None

    def brief(self, info: Dict[str, Any], inner_opt: torch.optim.Optimizer) -> None:
        """The start: ``info`` (run folder, data shard, stream position...) and the inner optimiser's
        state (resumed from a checkpoint, or empty)."""
        skeleton, tensors = _split_state(inner_opt.state_dict())
        self.group.broadcast_bytes(encode_brief(info, skeleton), "sent the start", MAX_BRIEF_BYTES)
        if self.shards is None:
            self.group.broadcast(tensors, "sent the inner optimiser state")
            return
        # sharded: every worker's shard of the parameters and of the optimiser state, then the full
        # state is no longer needed here (the checkpoint gathers it again)
        self.shards.broadcast_buffers(list(self.model.buffers()))
        self.shards.scatter(range(len(self.params)), self.params)
        self.shards.load_optimizer(self.train_opt, skeleton, tensors)
        inner_opt.state.clear()
        self.mark()

    def mark(self) -> None:
        """Right after our inner step: from here on, a parameter whose version moves was changed by DiLoCo."""
        self._versions = [p._version for p in self.params]

    def after_step(self) -> None:
        """Right after our inner step. Sharded: first the parameters DiLoCo needs at this step into our
        CPU mirror (and the optimiser state when a checkpoint may follow), as announced by the last
        message; every worker gathers with us."""
        if self.shards is not None:
            self.opt_state = None
            self.shards.gather([i for p in self._gather for i in self.frag_params[p]], self.params)
            if self._gather_opt:
                self.opt_state = self.shards.gather_optimizer(self.train_opt)
        self.mark()

    def optimizer_state(self) -> Dict[str, Any]:
        """The inner optimiser's state for a checkpoint (unsharded); None when sharded and not gathered
        since our last inner step."""
        return self.opt_state

    def tell(self, keep_going: bool, lr_step: int, final: bool = False) -> Control:
        """Send this step's message and what changed; returns it with its event (None: nothing sent and
        not the final message)."""
        d = self.diloco
        changed = [v is None or p._version != v for p, v in zip(self.params, self._versions)]
        with d.state_lock:  # one consistent view of the global copies (a background sync may land any time)
            keys = [(d._epoch, o.steps) for o in d.outer]
            send = [k != s for k, s in zip(keys, self._outer_keys)]
            flats = {p: torch.cat([t.reshape(-1) for t in fragment_tensors(o)])
                     for p, (o, s) in enumerate(zip(d.outer, send)) if s}
            step, synced = d.position, d.synced_step
        ctl = Control(keep_going=keep_going, final=final, lr_step=lr_step, step=step, synced_step=synced)
        gather, gather_opt = self._plan(keep_going, final)
        msg = [int(keep_going), int(final), lr_step, step, synced, *map(int, changed), *map(int, send), *(k[1] for k in keys),
               *(int(p in gather) for p in range(len(keys))), int(gather_opt)]
        self.group.broadcast([torch.tensor(msg, dtype=torch.int64)], "sent a step's message")
        for p, flat in flats.items():
            self._frag_digests[p] = fragment_digest([flat], keys[p][1])
        if self.shards is None:
            if any(changed):
                self.group.broadcast([p for p, c in zip(self.params, changed) if c], "sent the parameters")
            for flat in flats.values():
                self.group.broadcast([flat], "sent a global copy")
        else:
            self.shards.scatter([i for i, c in enumerate(changed) if c], self.params)
            if flats:
                self.group.broadcast([_digests_to_tensor([self._frag_digests[p] for p in flats])], "sent the digests")
            self._gather, self._gather_opt = sorted(gather), gather_opt
            if not keep_going and not final:  # DiLoCo's finish() reads and writes the model next: gather it now
                self.shards.gather([i for p in self._gather for i in self.frag_params[p]], self.params)
            if final:  # the last checkpoint
                self.opt_state = self.shards.gather_optimizer(self.train_opt)
        self._outer_keys = keys
        self.mark()
        if any(changed) or flats or final:  # the final message always: every worker logs its end state
            if self.shards is not None:  # each worker's own shard
                model_digest: Optional[str] = self.shards.digest()
            else:
                model_digest = tensors_digest(self.params) if any(changed) or final else None
            ctl.event = _event(0, ctl, [k[1] for k in keys], {p: self._frag_digests[p] for p in flats},
                               self._frag_digests, model_digest)
        return ctl

    def _plan(self, keep_going: bool, final: bool) -> Tuple[set, bool]:
        """Sharded: the fragments every worker gathers to our mirror after the next inner step (all of
        them, now, before DiLoCo's finish), and whether the optimiser state too (:func:`fragments_needed`)."""
        if self.shards is None or final:
            return set(), False
        if not keep_going:
            return set(range(self.diloco.num_fragments)), False
        return fragments_needed(self.diloco, self.diloco.position + 1)


def fragments_needed(diloco, t: int) -> Tuple[Set[int], bool]:
    """The fragments DiLoCo will read or write in ``after_inner_step`` at schedule position ``t`` (rounds
    of H steps), and whether the optimiser state is needed too. A landing sync result brings a
    validation (of the whole model) and, for the last fragment, a checkpoint: then every fragment is
    needed, and with the last fragment the optimiser state."""
    lands = diloco.landing(t)
    if lands:
        return set(range(diloco.num_fragments)), diloco.num_fragments - 1 in lands
    return set(diloco.due(t)), False


class LocalFollower:
    """Rank 1..K-1's side: receives the messages into its own model."""

    def __init__(self, group: LocalGroup, model: torch.nn.Module, numels: List[int], shards=None,
                 frag_params: Optional[List[List[int]]] = None):
        """``shards`` and ``frag_params`` (each fragment's parameter indices): ``local.sharding = "fsdp"``."""
        self.group, self.shards, self.frag_params = group, shards, frag_params
        self.params = list(model.parameters())
        self.numels = numels  # per fragment: θ and momentum are 2 × numel fp32 values
        self._frag_digests = [""] * len(numels)
        self.opt: Optional[torch.optim.Optimizer] = None
        self._gather: List[int] = []
        self._gather_opt = False

    @property
    def digest(self) -> str:
        """The digest of the global copy as last received (every fragment's, joined)."""
        return "-".join(self._frag_digests)

    def brief(self, inner_opt: torch.optim.Optimizer) -> Dict[str, Any]:
        """Rank 0's start (:mod:`.messages`); a malformed one is :class:`LocalWorkerLost` (we exit, and
        rank 0's next collective fails)."""
        try:
            info = decode_brief(self.group.broadcast_bytes(None, "waited for the start", MAX_BRIEF_BYTES))
        except WireError as e:
            self.group.broken = True
            raise LocalWorkerLost(f"local worker {self.group.rank} of {self.group.world}: rank 0's start message "
                                  f"failed validation ({e}); exiting") from None
        skeleton = info.pop("opt")
        self.opt = inner_opt
        if self.shards is not None:
            self.shards.broadcast_buffers()
            self.shards.scatter(range(len(self.params)))
            self.shards.load_optimizer(inner_opt, skeleton)
            return info
        state, tensors = _build_state(skeleton, self.params)
        self.group.broadcast(tensors, "received the inner optimiser state")
        inner_opt.load_state_dict(state)
        return info

    def after_step(self) -> None:
        """Right after our inner step (sharded): the gathers rank 0's last message announced."""
        if self.shards is not None:
            self.shards.gather([i for p in self._gather for i in self.frag_params[p]])
            if self._gather_opt:
                self.shards.gather_optimizer(self.opt)

    def recv(self) -> Control:
        n, P = len(self.params), len(self.numels)
        msg = torch.zeros(5 + n + 3 * P + 1, dtype=torch.int64)
        self.group.broadcast([msg], "waited for rank 0")
        vals = msg.tolist()
        ctl = Control(keep_going=bool(vals[0]), final=bool(vals[1]), lr_step=vals[2], step=vals[3], synced_step=vals[4])
        changed, send = vals[5: 5 + n], vals[5 + n: 5 + n + P]
        steps, gather = vals[5 + n + P: 5 + n + 2 * P], vals[5 + n + 2 * P: 5 + n + 3 * P]
        sent = [p for p in range(P) if send[p]]
        got = {}
        if self.shards is None:
            if any(changed):
                self.group.broadcast([p.data for p, c in zip(self.params, changed) if c], "received the parameters")
            for p in sent:
                flat = torch.empty(2 * self.numels[p], dtype=torch.float32)
                self.group.broadcast([flat], "received a global copy")
                got[p] = self._frag_digests[p] = fragment_digest([flat], steps[p])
        else:
            self.shards.scatter([i for i, c in enumerate(changed) if c])
            if sent:
                box = torch.zeros(len(sent), dtype=torch.int64)
                self.group.broadcast([box], "received the digests")
                for p, d in zip(sent, _tensor_to_digests(box)):
                    got[p] = self._frag_digests[p] = d
            self._gather, self._gather_opt = [p for p in range(P) if gather[p]], bool(vals[-1])
            if not ctl.keep_going and not ctl.final:
                self.after_step()
                self._gather_opt = False
            if ctl.final:
                self.shards.gather_optimizer(self.opt)
        if any(changed) or got or ctl.final:
            if self.shards is not None:
                model_digest: Optional[str] = self.shards.digest()
            else:
                model_digest = tensors_digest(self.params) if any(changed) or ctl.final else None
            ctl.event = _event(self.group.rank, ctl, steps, got, self._frag_digests, model_digest)
        return ctl


def _digests_to_tensor(digests: Sequence[str]) -> torch.Tensor:
    """16-hex-digit digests as int64 values (shifted into the signed range)."""
    return torch.tensor([int(d, 16) - (1 << 63) for d in digests], dtype=torch.int64)


def _tensor_to_digests(t: torch.Tensor) -> List[str]:
    return [format(v + (1 << 63), "016x") for v in t.tolist()]


# ---- the inner optimiser's state as (picklable skeleton, tensors) -------------------------------------
def _split_state(state: Any) -> Tuple[Any, List[torch.Tensor]]:
    tensors: List[torch.Tensor] = []

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return ("__tensor__", tuple(x.shape), str(x.dtype).replace("torch.", ""), x.device.type)
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x
    return walk(state), tensors


def _build_state(skeleton: Any, params: Sequence[torch.Tensor]) -> Tuple[Any, List[torch.Tensor]]:
    tensors: List[torch.Tensor] = []
    gpu = next((p.device for p in params if p.device.type == "cuda"), None)

    def walk(x: Any) -> Any:
        if isinstance(x, tuple) and len(x) == 4 and x[0] == "__tensor__":
            device = gpu if x[3] == "cuda" and gpu is not None else "cpu"
            t = torch.zeros(x[1], dtype=getattr(torch, x[2]), device=device)
            tensors.append(t)
            return t
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x
    return walk(skeleton), tensors
