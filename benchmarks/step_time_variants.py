"""The step-time section's variants and the check that each run's flags reached Megatron.

A run is (DP, variant, overlap); its flags are :func:`run_flags`, and rank 0's log must show
them: Megatron's argument dump (:func:`expected_arguments`), megatron-core's
``DistributedDataParallelConfig`` (:func:`expected_ddp_config`) and, with overlap on, at least
:data:`MIN_BUCKETS` gradient buckets (:func:`check_flags`).
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from .step_log import LogParser


@dataclass(frozen=True)
class Variant:
    """One configuration under test; :attr:`flags` are derived from the fields."""

    key: str
    name: str
    bits: int = 16
    param_bits: Optional[int] = None
    hierarchical: bool = False
    fp32_accumulation: bool = False  # --ddp-reduce-scatter-with-fp32-accumulation
    bf16_reduce: bool = False  # --grad-reduce-in-bf16

    @property
    def flags(self) -> Tuple[str, ...]:
        f = ["--loco-bits", str(self.bits)]
        f += ["--loco-param-bits", str(self.param_bits)] if self.param_bits else []
        f += ["--loco-hierarchical"] if self.hierarchical else []
        f += ["--ddp-reduce-scatter-with-fp32-accumulation"] if self.fp32_accumulation else []
        return tuple(f + (["--grad-reduce-in-bf16"] if self.bf16_reduce else []))


VARIANTS = (Variant("a", "stock"), Variant("b", "stock + fp32-acc RS", fp32_accumulation=True),
            Variant("c", "stock + fp32-acc RS + bf16 grads", fp32_accumulation=True,
                    bf16_reduce=True),
            Variant("d", "LoCo 4-bit", bits=4), Variant("e", "LoCo 4-bit + param 4-bit", bits=4,
                                                         param_bits=4),
            Variant("f", "LoCo 4-bit hierarchical", bits=4, hierarchical=True))
BY_KEY = {v.key: v for v in VARIANTS}
#: the baselines the speedups are taken against, and the variants they are reported for
BASELINES, CANDIDATES = ("b", "c"), ("d", "e", "f")
MIN_BUCKETS = 3  # with overlap on: several buckets, so the reduce-scatter overlaps the backward


def run_key(dp: int, key: str, overlap: bool) -> str:
    """Name of one run in ``data["runs"]``: ``dp4-d-on``."""
    return f"dp{dp}-{key}-{'on' if overlap else 'off'}"


def run_flags(cfg: Dict, variant: Variant, overlap: bool) -> List[str]:
    """The variant's flags plus, with ``overlap``, the overlap flags and the bucket size."""
    return list(variant.flags) + (
        ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size",
         str(cfg["bucket_size"])] if overlap else [])


def expected_arguments(cfg: Dict, dp: int, variant: Variant, overlap: bool) -> Dict[str, str]:
    """What Megatron's argument dump must show for this run (values as Megatron prints them)."""
    bf16 = bool(cfg["model"].get("bf16"))
    return {"overlap_grad_reduce": str(overlap), "overlap_param_gather": str(overlap),
            "ddp_bucket_size": str(cfg["bucket_size"]) if overlap else "None",
            "ddp_reduce_scatter_with_fp32_accumulation": str(variant.fp32_accumulation),
            "grad_reduce_in_bf16": str(variant.bf16_reduce), "loco_bits": str(variant.bits),
            "loco_param_bits": str(variant.param_bits), "loco_hierarchical":
            str(variant.hierarchical), "use_distributed_optimizer": "True", "bf16": str(bf16),
            # Megatron: bf16 accumulates and reduces gradients in fp32 unless
            # --grad-reduce-in-bf16 (arguments.py); fp32 parameters: fp32 anyway
            "accumulate_allreduce_grads_in_fp32": str(bf16 and not variant.bf16_reduce),
            "data_parallel_size": str(dp)}


def expected_ddp_config(cfg: Dict, variant: Variant, overlap: bool) -> Dict[str, str]:
    """What megatron-core's logged ``DistributedDataParallelConfig`` must hold."""
    return {"overlap_grad_reduce": str(overlap), "overlap_param_gather": str(overlap),
            "reduce_scatter_with_fp32_accumulation": str(variant.fp32_accumulation),
            "grad_reduce_in_fp32": str(bool(cfg["model"].get("bf16")) and not variant.bf16_reduce),
            "bucket_size": str(cfg["bucket_size"]) if overlap else "None",
            "use_distributed_optimizer": "True"}


def expected_notices(variant: Variant) -> Dict[str, bool]:
    """Which start-up lines (:data:`.step_log.NOTICES`) rank 0's log must (not) have."""
    return {"fp32_accumulation_rs": variant.fp32_accumulation, "loco_active": variant.bits < 16,
            "loco_hierarchical": variant.hierarchical and variant.bits < 16,
            "loco_param_gather": bool(variant.param_bits)}


def mismatches(where: str, got: Dict[str, str], want: Dict[str, str]) -> List[str]:
    """``"<where> <name> = <got> (want <want>)"`` for every differing entry; one line when
    ``got`` is empty (nothing of that kind in the log)."""
    if not got:
        return [f"no {where} in the log"]
    return [f"{where} {k} = {got.get(k)} (want {v})" for k, v in want.items() if got.get(k) != v]


def check_flags(log: LogParser, cfg: Dict, dp: int, variant: Variant,
                overlap: bool) -> List[str]:
    """Mismatches between the intended configuration and rank 0's log ([] when it matches):
    Megatron's argument dump, megatron-core's DDP config, the start-up lines of megatron-core's
    fp32-accumulation reduce-scatter and of LoCo (:func:`expected_notices`) and, with overlap
    on, at least :data:`MIN_BUCKETS` gradient buckets."""
    bad = (mismatches("argument", log.arguments, expected_arguments(cfg, dp, variant, overlap))
           + mismatches("DDP config", log.ddp_config, expected_ddp_config(cfg, variant, overlap)))
    if log.ddp_config:  # the model was built: its start-up lines are in the log
        bad += [f"start-up line {k} {'missing' if want else 'present'}"
                for k, want in expected_notices(variant).items() if (k in log.notices) != want]
    if overlap and log.ddp_config and sum(log.buckets) < MIN_BUCKETS:
        bad.append(f"{sum(log.buckets)} gradient bucket(s) (want >= {MIN_BUCKETS}: lower "
                   f"bucket_size)")
    return bad
