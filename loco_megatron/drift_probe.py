"""Study probe: the cumulative drift of what a rank sends and the share of zero codes.

A research instrument for the convergence study (``python -m benchmarks --only convergence``,
BENCHMARKS.md), not a training feature: it costs two fp64 copies of every bucket and a decode
per compression. For one data-parallel rank and every optimizer step ``t`` it keeps, over all
buckets this rank compresses (LoCo Alg. 1, arXiv 2407.04480; loco_megatron/algorithm.py)::

    S_deq(T) = sum_{t<=T} deQ(c_t)        what the peers decode from this rank's codes
    S_g(T)   = sum_{t<=T} g_t             the gradients the rank had (wire layout, fp64)
    drift(T) = ||S_deq(T) - S_g(T)|| / ||S_g(T)||

Error feedback keeps ``S_deq - S_g`` equal to minus the stored error (bounded, so the drift falls
like ``1/T`` when gradients keep a direction); without compensation it is the sum of independent
rounding errors (growing like ``sqrt(T)``); LoCo's moving average lies between. The second
figure is the fraction of codes equal to 0 among the bucket's real elements (block padding left
out): coordinates whose compensated value rounds to zero in that step (including those whose
value is exactly zero, e.g. the embedding rows of tokens absent from the batch, where nothing
is compensated). Non-finite elements (an fp16 overflow step) are left out of the sums.

Meant for the flat reduce-scatter. With ``--loco-hierarchical`` each stage's compression is
observed as a bucket of its own: the inter-node stage's "gradient" is the node's partial sum,
and its block padding counts as real elements.

Enabled by the environment variable ``LOCO_DRIFT_PROBE=<folder>`` (read by
:func:`loco_megatron.training.iteration_log.install`): each rank then rewrites
``<folder>/drift-rank<R>.json`` after every optimizer step with the series so far.
"""

import json
import os
from pathlib import Path
from typing import Dict, Hashable, List, Optional

import torch

from .kernels.block_table import BlockTable
from .quantization import dequantize_spans, unpack_codes

#: the environment variable that enables the probe (a folder for the per-rank JSON files)
ENV = "LOCO_DRIFT_PROBE"


class DriftProbe:
    """Per-rank accumulators of decoded codes and raw gradients (see the module docstring).

    Args:
        out_dir: folder for ``drift-rank<rank>.json``; None keeps the figures in memory only.
        rank: this rank's global rank (the file name).
    """

    def __init__(self, out_dir: Optional[Path] = None, rank: int = 0):
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.rank = rank
        self._sums: Dict[Hashable, List[torch.Tensor]] = {}  # key -> [S_deq, S_g] fp64
        self._valid: Dict[Hashable, torch.Tensor] = {}       # key -> bool mask of real elements
        self._zero = 0
        self._count = 0
        self.steps = 0
        #: [(step, drift, zero-code fraction of that step)] after each :meth:`end_step`
        self.series: List[tuple] = []

    @classmethod
    def from_env(cls, rank: int) -> Optional["DriftProbe"]:
        """A probe writing to ``$LOCO_DRIFT_PROBE``, or None when the variable is unset."""
        folder = os.environ.get(ENV)
        return cls(Path(folder), rank) if folder else None

    def observe(self, key: Hashable, g: torch.Tensor, table: BlockTable,
                payload: torch.Tensor, scales: torch.Tensor, bits: int) -> None:
        """Add one compression of bucket ``key``.

        Args:
            g: the bucket's local gradient as compressed, ``[table.numel]`` (any float dtype).
            table: its :class:`~loco_megatron.kernels.block_table.BlockTable` (``n`` wire
                elements, ``K`` blocks).
            payload, scales: what the compressor sent (uint8 ``[n * bits / 8]``, fp32 ``[K]``).
            bits: 4 or 8.
        """
        spans = table.spans.to(scales.device)
        deq = dequantize_spans(unpack_codes(payload, bits), scales, spans, torch.float64)
        gw = table.layout.to_wire(g.reshape(-1), torch.float64)
        if key not in self._sums:
            self._sums[key] = [torch.zeros_like(deq), torch.zeros_like(gw)]
            ones = torch.ones(table.numel, dtype=torch.float64, device=g.device)
            self._valid[key] = table.layout.to_wire(ones, torch.float64) != 0
        acc = self._sums[key]
        # a non-finite element (an fp16 overflow step, which megatron then skips) would poison
        # the sums for the rest of the run: it adds nothing
        ok = torch.isfinite(deq) & torch.isfinite(gw)
        acc[0] += torch.where(ok, deq, torch.zeros_like(deq))
        acc[1] += torch.where(ok, gw, torch.zeros_like(gw))
        valid = self._valid[key]
        self._zero += int(((deq == 0) & valid).sum())
        self._count += int(valid.sum())

    def drift(self) -> float:
        """``||S_deq - S_g|| / ||S_g||`` over all buckets so far (NaN before any gradient)."""
        num = sum(float(torch.sum((d - g) ** 2)) for d, g in self._sums.values())
        den = sum(float(torch.sum(g ** 2)) for _, g in self._sums.values())
        return (num / den) ** 0.5 if den > 0 else float("nan")

    def end_step(self) -> None:
        """Close one optimizer step: record its drift and zero-code fraction; write the file."""
        if not self._count:
            return  # nothing compressed this step (warm-up at full precision, DP 1)
        self.steps += 1
        self.series.append((self.steps, self.drift(), self._zero / self._count))
        self._zero = self._count = 0
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            path = self.out_dir / f"drift-rank{self.rank}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"rank": self.rank, "steps": self.steps,
                                       "series": self.series}))
            tmp.replace(path)
