"""``loco-megatron`` / ``python -m loco_megatron``: the package's command line.

Subcommands:

* ``plan``: predict LoCo's gradient bytes, step time and memory on a cluster before running it
  (loco_megatron/planner, docs/planner.md).

Bad input prints one ``error: ...`` line naming the flag and exits with status 2 (argparse's
convention), never a traceback.
"""

import argparse
import sys
from typing import Any, Dict, Optional, Sequence

from ..config import LoCoConfig, LoCoConfigError
from ..planner.errors import PlannerError

#: ``--help``'s description: plain text (the module docstring is reStructuredText)
DESCRIPTION = ("loco-megatron (also python -m loco_megatron): tools for LoCo low-bit gradient "
               "communication in Megatron. Training runs in Megatron-LM's own script under "
               "torchrun: python -m torch.distributed.run ... -m "
               "loco_megatron.training.run_megatron_lm --megatron-lm CLONE <Megatron-LM flags> "
               "--loco-bits 4")

#: Megatron-LM flags the planner reads (also from ``--config``), with their argparse type
MODEL_FLAGS = {
    "num-layers": int, "hidden-size": int, "ffn-hidden-size": int, "num-attention-heads": int,
    "num-query-groups": int, "kv-channels": int, "vocab-size": int,
    "make-vocab-size-divisible-by": int, "seq-length": int, "max-position-embeddings": int,
    "position-embedding-type": str, "normalization": str, "num-experts": int,
    "moe-ffn-hidden-size": int, "moe-router-topk": int,
    "tensor-model-parallel-size": int, "pipeline-model-parallel-size": int,
    "context-parallel-size": int, "expert-model-parallel-size": int,
    "expert-tensor-parallel-size": int, "data-parallel-size": int,
    "num-distributed-optimizer-instances": int, "ddp-bucket-size": int,
    "global-batch-size": int, "micro-batch-size": int,
}
#: Megatron-LM switches (``--swiglu`` / ``--no-swiglu``)
SWITCHES = ("swiglu", "disable-bias-linear", "untie-embeddings-and-output-weights",
            "group-query-attention", "overlap-grad-reduce", "overlap-param-gather", "bf16",
            "grad-reduce-in-bf16")


def add_plan_args(p: argparse.ArgumentParser) -> None:
    """The ``plan`` subcommand's flags (defaults in docs/planner.md)."""
    m = p.add_argument_group("model and layout (Megatron-LM flags; override --config)")
    m.add_argument("--config", help="a YAML file of Megatron-LM flags, e.g. "
                   "configs/llama2_7b.yaml (its loco: block-size is read too)")
    for flag, typ in MODEL_FLAGS.items():
        m.add_argument(f"--{flag}", type=typ, dest=flag, metavar="N" if typ is int else "S")
    for flag in SWITCHES:
        m.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, dest=flag)
    m.add_argument("--loco-block-size", type=int, dest="block-size", metavar="N",
                   help="LoCo elements per block (default 256)")
    c = p.add_argument_group("cluster (bandwidth per direction)")
    c.add_argument("--nodes", type=int, required=True)
    c.add_argument("--gpus-per-node", type=int, default=8)
    c.add_argument("--intra-node-gbps", type=float, default=2400.0,
                   help="per-GPU intra-node bandwidth, Gbit/s (default 2400: NVLink 3)")
    c.add_argument("--inter-node-gbps", type=float, default=400.0,
                   help="bandwidth of one inter-node NIC, Gbit/s (default 400: NDR IB)")
    c.add_argument("--nics-per-node", type=int, help="inter-node NICs per node "
                   "(default: one per GPU)")
    c.add_argument("--intra-node-latency-us", type=float, default=5.0)
    c.add_argument("--inter-node-latency-us", type=float, default=10.0)
    c.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                   help="gloo runs reduce_scatter_tensor as an all-reduce (stock sends 2x)")
    c.add_argument("--stock-reduce-scatter", choices=("ring", "allreduce"),
                   help="how stock's reduce-scatter is modelled (default: ring; allreduce "
                   "with --backend gloo)")
    k = p.add_argument_group("compute (a prediction needs one: given, or estimated)")
    k.add_argument("--compute-ms", type=float, help="forward + backward per step, ms "
                   "(default: estimated from FLOPs, --mfu and --gpu-tflops)")
    k.add_argument("--mfu", type=float, default=0.40)
    k.add_argument("--gpu-tflops", type=float, default=989.0,
                   help="peak dense TFLOP/s (default 989: H100 SXM bf16)")
    k.add_argument("--compress-GBps", type=float, default=1000.0,
                   help="LoCo compress throughput, GB/s of gradient bucket (assumed)")
    k.add_argument("--decompress-GBps", type=float, default=4000.0)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def merged_flags(args: argparse.Namespace) -> Dict[str, Any]:
    """``--config`` file's flags overridden by the command line's (CLI > YAML > defaults).

    Raises:
        PlannerError: unreadable or malformed ``--config`` (names the file).
    """
    d: Dict[str, Any] = {}
    if args.config:
        from .yaml_config import load_config, loco_section_to_fields

        try:
            d = dict(load_config(args.config))
        except LoCoConfigError as e:
            raise PlannerError(f"{e} Pass a YAML file of Megatron-LM flags, such as "
                               f"configs/llama2_7b.yaml.") from None
        try:  # every spelling of the section's keys (block-size, block_size), checked
            loco = loco_section_to_fields(d.pop("loco", None) or {}, f"--config {args.config}")
        except LoCoConfigError as e:
            raise PlannerError(str(e)) from None
        if "block_size" in loco:
            d["block-size"] = loco["block_size"]
    for key in list(MODEL_FLAGS) + list(SWITCHES) + ["block-size"]:
        value = getattr(args, key, None)
        if value is not None:
            d[key] = value
    return d


def _int(d: Dict[str, Any], key: str, default: Optional[int] = None) -> Optional[int]:
    value = d.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlannerError(f"--{key} {value!r} must be an integer.")
    return value


def build_plan(args: argparse.Namespace) -> Dict:
    """Run the planner on parsed ``plan`` arguments. Raises :class:`PlannerError`."""
    from ..planner.cluster import ClusterSpec, ParallelSpec
    from ..planner.model import ModelSpec
    from ..planner.predict import PlanOptions, plan

    d = merged_flags(args)
    model = ModelSpec.from_flags(d)
    cluster = ClusterSpec(args.nodes, args.gpus_per_node, args.intra_node_gbps,
                          args.inter_node_gbps, args.nics_per_node, args.intra_node_latency_us,
                          args.inter_node_latency_us)
    par = ParallelSpec(cluster.world, _int(d, "tensor-model-parallel-size", 1),
                       _int(d, "pipeline-model-parallel-size", 1),
                       _int(d, "context-parallel-size", 1),
                       _int(d, "expert-model-parallel-size", 1),
                       _int(d, "expert-tensor-parallel-size"),
                       _int(d, "num-distributed-optimizer-instances", 1),
                       _int(d, "data-parallel-size"))
    block = _int(d, "block-size", 256)
    try:  # the same bounds as training (LoCoConfig)
        LoCoConfig(bits=4, block_size=block)
    except LoCoConfigError as e:
        raise PlannerError(str(e)) from None
    allreduce = (args.stock_reduce_scatter == "allreduce" if args.stock_reduce_scatter
                 else args.backend == "gloo")
    opt = PlanOptions(grad_elem=2 if d.get("grad-reduce-in-bf16") else 4,
                      param_elem=2 if d.get("bf16", True) else 4,
                      bucket_size=_int(d, "ddp-bucket-size"),
                      overlap_grad_reduce=bool(d.get("overlap-grad-reduce", True)),
                      overlap_param_gather=bool(d.get("overlap-param-gather", False)),
                      block_size=block, stock_allreduce=allreduce, compute_ms=args.compute_ms,
                      mfu=args.mfu, peak_tflops=args.gpu_tflops,
                      global_batch=_int(d, "global-batch-size"),
                      micro_batch=_int(d, "micro-batch-size", 1),
                      compress_GBps=args.compress_GBps, decompress_GBps=args.decompress_GBps)
    return plan(model, par, cluster, opt)


def parser() -> argparse.ArgumentParser:
    """``loco-megatron`` with its subcommands."""
    top = argparse.ArgumentParser(prog="loco-megatron", description=DESCRIPTION)
    sub = top.add_subparsers(dest="command", required=True)
    add_plan_args(sub.add_parser(
        "plan", help="predict LoCo's step-time gain on a cluster (docs/planner.md)",
        description="Predict gradient bytes, communication and step time of stock "
        "megatron-core vs LoCo (flat, hierarchical; 4 and 8 bits) on a cluster, and LoCo's "
        "extra memory. Predictions of an alpha-beta model: docs/planner.md."))
    return top


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point (console script ``loco-megatron``). Returns the exit status: 0, or 2 on bad
    input (one ``error:`` line on stderr naming the flag)."""
    args = parser().parse_args(argv)
    if args.command == "plan":
        from ..planner import report

        try:
            p = build_plan(args)
        except (PlannerError, LoCoConfigError) as e:
            print(f"loco-megatron plan: error: {e}", file=sys.stderr)
            return 2
        print(report.to_json(p) if args.json else report.table(p))
    return 0
