"""LoCo figures per optimizer step, accumulated on the device and reduced only when reported.

Definitions, groups and cost: docs/telemetry.md. For every optimizer step ``s`` this rank keeps

* ``err_sq[s]`` = sum over its buckets of ``||h - deQ(Q(h))||^2``: ``h = g + e`` is the
  compensated gradient the :class:`~loco_megatron.compensator.Compensator` encodes (LoCo Alg. 1
  steps 1-2, arXiv 2407.04480), in the padded wire layout (padding contributes 0);
* ``buf_sq[s]`` = sum over its buckets of ``||e||^2`` of the error buffer as stored after the
  step's update (int8 storage: the decoded value ``codes * scale``);
* compress calls, non-finite compressions (error buffer cleared), and the bytes sent / the stock
  reduce-scatter would have sent (:class:`~loco_megatron.collectives.WireStats` deltas).

The two squared sums and the non-finite count stay on the gradient device (one fp64 ``[3]``
tensor per step, added to
with asynchronous kernels): nothing is copied to the host until :meth:`StepMetrics.reduce`, which
all ranks call together (two small all-reduces over the group).
"""

import math
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist


@dataclass
class LoCoFigures:
    """What :meth:`StepMetrics.reduce` reports for the steps since the previous report.

    Attributes:
        steps: optimizer steps in the window in which some rank compressed a bucket.
        error_norm: mean over those steps (finite steps only) of the global compression error
            norm ``sqrt(sum over ranks and buckets ||h - deQ(Q(h))||^2)``, in gradient-buffer
            units; NaN when every step had a non-finite gradient.
        buffer_norm: same for the stored error buffers ``sqrt(sum ||e||^2)`` after each step.
        bytes_per_step: bytes one rank sent to the other ranks per step, exact: the largest
            per-rank mean over the window (every rank sends the same with data parallelism only).
        stock_bytes_per_step: what megatron-core's reduce-scatter would have sent per step, the
            largest per-rank mean likewise.
        compression_ratio: stock bytes / LoCo bytes summed over all ranks and steps (> 1 means
            LoCo sends fewer bytes).
        nonfinite_steps: steps left out of the norms because some bucket was non-finite.
    """

    steps: int
    error_norm: float
    buffer_norm: float
    bytes_per_step: float
    stock_bytes_per_step: float
    compression_ratio: float
    nonfinite_steps: int


class StepMetrics:
    """One rank's LoCo figures, per optimizer step.

    Args:
        wire: the :class:`~loco_megatron.collectives.WireStats` that counts this rank's bytes.

    The :class:`~loco_megatron.compensator.Compensator` calls :meth:`record` once per bucket
    compression; the training loop calls :meth:`end_step` once per optimizer step on every rank
    (Megatron: from ``training_log``), and :meth:`reduce` on every rank to report.
    """

    def __init__(self, wire):
        self.wire = wire
        self._sq: Optional[torch.Tensor] = None
        self._calls = 0
        self._closed: List[tuple] = []
        self._mark = (wire.bytes_sent, wire.stock_bytes)

    def record(self, err_sq: torch.Tensor, buf_sq: torch.Tensor, nonfinite: torch.Tensor) -> None:
        """Add one bucket's compression to the open step, without a host sync.

        Args:
            err_sq: 0-dim ``||h - deQ(Q(h))||^2`` (0 when ``h`` was non-finite).
            buf_sq: 0-dim ``||e||^2`` of the stored error buffer after the update.
            nonfinite: 0-dim bool: ``h`` was non-finite (the error buffer was cleared).
        """
        self._calls += 1
        sq = torch.stack([err_sq.to(torch.float64), buf_sq.to(torch.float64),
                          nonfinite.to(device=buf_sq.device, dtype=torch.float64)])
        self._sq = sq if self._sq is None else self._sq + sq

    def end_step(self) -> None:
        """Close the current optimizer step (call once per step on every rank, compressed or
        not, so the ranks' step lists line up)."""
        sent, stock = self.wire.bytes_sent, self.wire.stock_bytes
        self._closed.append((self._sq, self._calls, sent - self._mark[0], stock - self._mark[1]))
        self._mark = (sent, stock)
        self._sq, self._calls = None, 0

    def pending_steps(self) -> int:
        """Closed steps not yet reported."""
        return len(self._closed)

    def reduce(self, group=None) -> Optional[LoCoFigures]:
        """Reduce the closed steps over ``group`` (default: all ranks) and start a new window.

        Collective: every rank of ``group`` must call it with the same number of closed steps.
        Returns None (on every rank) when no rank compressed anything in the window.
        """
        steps, self._closed = self._closed, []
        if not steps:
            return None
        device = (torch.device("cuda", torch.cuda.current_device())
                  if dist.get_backend(group) == "nccl" else torch.device("cpu"))
        zero = torch.zeros(3, dtype=torch.float64, device=device)
        sq = torch.stack([s[0].to(device) if s[0] is not None else zero for s in steps])
        host = torch.tensor([s[1:] for s in steps], dtype=torch.float64, device=device)
        table = torch.cat([sq, host], dim=1)  # [k, 6]: err_sq buf_sq nonfinite calls bytes stock
        dist.all_reduce(table, group=group)
        mine = torch.tensor([[sum(s[2] for s in steps), sum(s[3] for s in steps)]],
                            dtype=torch.float64, device=device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
        table, mine = table.cpu().tolist(), mine.cpu().tolist()[0]
        compressed = [row for row in table if row[3] > 0]
        if not compressed:
            return None
        finite = [row for row in compressed if row[2] == 0]
        n = len(compressed)
        loco = sum(row[4] for row in compressed)
        stock = sum(row[5] for row in compressed)

        def mean_norm(col):
            return sum(math.sqrt(row[col]) for row in finite) / len(finite) if finite else math.nan

        return LoCoFigures(steps=n, error_norm=mean_norm(0), buffer_norm=mean_norm(1),
                           bytes_per_step=mine[0] / n, stock_bytes_per_step=mine[1] / n,
                           compression_ratio=stock / loco if loco else math.nan,
                           nonfinite_steps=n - len(finite))
