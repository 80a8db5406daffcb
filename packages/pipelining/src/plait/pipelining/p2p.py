"""The point-to-point link of one pp-rank to its pipeline neighbours, with the metadata handshake."""

from __future__ import annotations

import json
import logging
from typing import Any

import torch
import torch.distributed as dist
from plait.dist_core import parse_dtype
from plait.pipelining.actions import Action, ActionKind, AnyAction
from plait.pipelining.runner import StageRunner
from plait.pipelining.topology import StageTopology

__all__ = ["P2PLink"]

log = logging.getLogger("plait.pipelining.executor")  # DEBUG: one line per posted group (hang hunting)

_META_BYTES = 4096
Meta = list[tuple[str, torch.dtype, tuple[int, ...], bool]]
SentMeta = list[tuple[str, str, tuple[int, ...], bool]]


class P2PLink:
    """Sends and receives a rank's activations and gradients, one communication group at a time.

    In a step that exchanges metadata (:meth:`begin_step` with ``lockstep=True``), the first activation
    message of each stage edge is preceded by its metadata (keys, dtypes, shapes, requires_grad), posted
    as a group of its own by both ends; the receiver reads it before it allocates the data buffers.
    Later steps reuse it, and a send whose tensors no longer match raises.

    Args:
        group: the pipeline process group.
        topology: stage placement.
        runner: the rank's stage runner (source of sent tensors, sink of received gradients).
        device: device of the communicated tensors.
    """

    def __init__(
        self, group: dist.ProcessGroup, topology: StageTopology, runner: StageRunner, device: torch.device
    ) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.topology = topology
        self.runner = runner
        self.device = device
        self.lockstep = True
        self._meta: dict[int, Meta] = {}
        self._out_meta: dict[int, SentMeta] = {}
        self._recv_f: dict[tuple[int, int], tuple[dict[str, torch.Tensor], dict[str, bool]]] = {}
        self._recv_works: dict[Action, list[Any]] = {}
        self._pending: list[Any] = []
        self._waited: dict[int, Any] = {}  # id -> work, kept alive so that its id is not reused

    def peer(self, stage: int) -> int:
        """Global rank running ``stage``."""
        return dist.get_global_rank(self.group, self.topology.rank_of(stage))

    def connect(self) -> None:
        """Create the communicator and open the connections to the pipeline neighbours (a collective call).

        NCCL does both lazily, inside the call that first needs them, and that call blocks until the peer
        joins. Done here, every pp-rank joins at the same point and no step waits on it.
        """
        me = dist.get_rank()
        topo = self.topology
        peers = sorted(
            {
                self.peer(s + d)
                for s in topo.stages_of(self.rank)
                for d in (-1, 1)
                if 0 <= s + d < topo.num_stages and not topo.is_local_edge(min(s, s + d))
            }
            - {me}
        )
        ops = []
        for p in peers:  # a few MiB so that NCCL connects every channel it uses for a peer
            ops.append(dist.P2POp(dist.isend, torch.zeros(1 << 20, device=self.device), p, self.group))
            ops.append(dist.P2POp(dist.irecv, torch.empty(1 << 20, device=self.device), p, self.group))
        if ops:
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def begin_step(self, lockstep: bool) -> None:
        """Start a step; ``lockstep`` exchanges metadata again and waits for every group on the host."""
        self.lockstep = lockstep
        if lockstep:
            self._meta.clear()
            self._out_meta.clear()

    def end_step(self) -> None:
        """Wait for every communication still in flight."""
        for w in self._pending:
            if id(w) not in self._waited:
                w.wait()
        self._pending.clear()
        self._waited.clear()
        self._recv_f.clear()
        self._recv_works.clear()

    def _post(self, ops: list[dist.P2POp], what: tuple[Action, ...], *, wait: bool) -> list[Any]:
        """Post `ops` as one group; with `wait` (or in lockstep) block until it completed on the GPU."""
        if log.isEnabledFor(logging.DEBUG):
            sent = [(o.op.__name__, o.peer, tuple(o.tensor.shape), str(o.tensor.dtype)) for o in ops]
            log.debug("pp-rank %d posts %s: %s", self.rank, [str(x) for x in what], sent)
        works = dist.batch_isend_irecv(ops)
        if wait or self.lockstep:
            for w in works:
                w.wait()  # NCCL: the current stream waits for the group
                self._waited[id(w)] = w
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            log.debug("pp-rank %d: group done", self.rank)
        else:
            self._pending.extend(works)
        return works

    def _send_meta(self, a: Action) -> dist.P2POp | None:
        out = self.runner.outputs[(a.stage, a.microbatch)]
        meta = [(k, str(v.dtype), tuple(v.shape), bool(v.requires_grad)) for k, v in sorted(out.items())]
        known = self._out_meta.get(a.stage)
        if known is not None:
            if known != meta:
                raise ValueError(
                    f"stage {a.stage}'s outputs for microbatch {a.microbatch} are {meta}, but the pipeline "
                    f"exchanged {known} (keys, dtypes, shapes, requires_grad) at its first step; when they "
                    "change, call step(..., new_shapes=True) on every pp-rank"
                )
            return None
        raw = json.dumps(meta).encode()
        if len(raw) > _META_BYTES:
            raise ValueError(f"stage {a.stage} outputs too many tensors to describe in {_META_BYTES} bytes")
        buf = torch.zeros(_META_BYTES, dtype=torch.uint8)
        buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        self._out_meta[a.stage] = meta
        return dist.P2POp(dist.isend, buf.to(self.device), self.peer(a.stage + 1), self.group)

    def issue(self, group: tuple[Action, ...]) -> None:
        """Post one communication group of the program (after its metadata, in a step that exchanges it)."""
        meta_ops: list[dist.P2POp] = []
        incoming: list[tuple[int, torch.Tensor]] = []
        for a in group:
            if a.kind is ActionKind.SEND_F and (op := self._send_meta(a)) is not None:
                meta_ops.append(op)
            elif a.kind is ActionKind.RECV_F and a.stage not in self._meta:
                buf = torch.zeros(_META_BYTES, dtype=torch.uint8, device=self.device)
                meta_ops.append(dist.P2POp(dist.irecv, buf, self.peer(a.stage - 1), self.group))
                incoming.append((a.stage, buf))
        if meta_ops:
            self._post(meta_ops, group, wait=True)
            for stage, buf in incoming:
                raw = bytes(buf.cpu().tolist()).rstrip(b"\0")
                self._meta[stage] = [(k, parse_dtype(d), tuple(sh), rg) for k, d, sh, rg in json.loads(raw)]
        works = self._post([op for a in group for op in self._data_ops(a)], group, wait=False)
        for a in group:
            if a.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
                self._recv_works[a] = works

    def ready(self, entry: AnyAction) -> bool:
        """Whether every send of a communication entry has its data already."""
        r = self.runner
        return all(
            (a.stage, a.microbatch) in (r.outputs if a.kind is ActionKind.SEND_F else r.input_grads)
            for a in entry.sub_actions()
            if a.kind in (ActionKind.SEND_F, ActionKind.SEND_B)
        )

    def _data_ops(self, a: Action) -> list[dist.P2POp]:
        r, s, k = self.runner, a.stage, a.microbatch
        if a.kind is ActionKind.SEND_F:
            out = r.outputs[(s, k)]
            return [dist.P2POp(dist.isend, v.detach().contiguous(), self.peer(s + 1), self.group)
                    for _, v in sorted(out.items())]  # fmt: skip
        if a.kind is ActionKind.SEND_B:
            grads = r.input_grads.pop((s, k))
            return [
                dist.P2POp(dist.isend, g.contiguous(), self.peer(s - 1), self.group)
                for _, g in sorted(grads.items())
            ]
        if a.kind is ActionKind.RECV_F:
            bufs = {
                key: torch.empty(shape, dtype=dt, device=self.device) for key, dt, shape, _ in self._meta[s]
            }
            self._recv_f[(s, k)] = (bufs, {key: rg for key, _, _, rg in self._meta[s]})
            return [dist.P2POp(dist.irecv, bufs[key], self.peer(s - 1), self.group) for key in sorted(bufs)]
        # RECV_B: gradients for this stage's outputs that require grad, in key order
        out = r.outputs[(s, k)]
        bufs = {key: torch.empty_like(v) for key, v in sorted(out.items()) if v.requires_grad}
        r.output_grads[(s, k)] = bufs
        return [dist.P2POp(dist.irecv, bufs[key], self.peer(s + 1), self.group) for key in sorted(bufs)]

    def _wait(self, a: Action) -> None:
        # gloo hangs when a finished receive is waited on twice: wait each work object once.
        for w in self._recv_works.pop(a, []):
            if id(w) not in self._waited:
                w.wait()
                self._waited[id(w)] = w

    def activations(self, stage: int, mb: int) -> tuple[dict[str, torch.Tensor], dict[str, bool]]:
        """Wait for the activations ``stage`` consumes for ``mb``; return them and their requires_grad."""
        self._wait(Action(stage, ActionKind.RECV_F, mb))
        return self._recv_f.pop((stage, mb))

    def wait_output_grads(self, stage: int, mb: int) -> None:
        """Wait for the gradients of ``stage``'s outputs for ``mb`` (received into ``runner.output_grads``)."""
        self._wait(Action(stage, ActionKind.RECV_B, mb))
