"""The prediction: per variant (stock fp32/bf16 reduce-scatter, LoCo flat and hierarchical at 4
and 8 bits, and with the parameter all-gather as weight differences, ``--loco-param-bits``) the
gradient and parameter bytes, communication and kernel time, exposed time, step time, the
step-time ratio to stock, and LoCo's extra memory. docs/planner.md states the model and its
limits.

Step time = compute + compress (overlap off) + exposed gradient communication + decompress +
exposed parameter all-gather. Compute is the forward + backward of all microbatches; with
``overlap_grad_reduce`` the reduce-scatters (all-to-alls) can hide only behind the backward of
the *last* microbatch (megatron's ``no_sync`` holds them back for the others), and with
``overlap_param_gather`` the all-gathers only behind the first microbatch's forward. With
overlap on, LoCo's compress runs on its side stream (loco_megatron/streams.py), one bucket
after another from the time its gradients are ready, and a bucket's all-to-all starts when its
compress ends: the compress is hidden like the communication, except where it delays the last
collective; overlap off, it is added. The decompress runs on the compute stream when megatron
waits for a bucket, so it is added; so is ``--loco-param-bits``'s encode.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional

from ..accounting import param_gather_bytes_per_step
from .buckets import Bucket, bucket_bytes, default_bucket_size, gpu_buckets
from .cluster import ClusterSpec, GroupSpread, ParallelSpec
from .costs import (alltoall_time, exposed_after_window, exposed_before_use, forward_needs,
                    ring_collective)
from .errors import PlannerError
from .model import ModelSpec

#: (name, bits, hierarchical, intra-node bits, parameter all-gather bits); "stock" rows use the
#: grad dtype in the name; "+ param N-bit": ``--loco-param-bits N`` (weight differences)
VARIANTS = (("stock fp32", None, False, None, None), ("stock bf16", None, False, None, None),
            ("LoCo 4-bit flat", 4, False, None, None), ("LoCo 8-bit flat", 8, False, None, None),
            ("LoCo 4-bit hier. intra 16", 4, True, 16, None),
            ("LoCo 4-bit hier. intra 8", 4, True, 8, None),
            ("LoCo 8-bit hier. intra 16", 8, True, 16, None),
            ("LoCo 8-bit hier. intra 8", 8, True, 8, None),
            ("LoCo 4-bit flat + param 4-bit", 4, False, None, 4),
            ("LoCo 8-bit flat + param 8-bit", 8, False, None, 8),
            ("LoCo 4-bit hier. intra 16 + param 4-bit", 4, True, 16, 4),
            ("LoCo 4-bit hier. intra 8 + param 4-bit", 4, True, 8, 4))


@dataclass
class PlanOptions:
    """Training-run settings that are not model or cluster sizes. Raises
    :class:`PlannerError` naming the flag on invalid values."""

    grad_elem: int = 4
    """Bytes per gradient element of the grad buffer: 4 (megatron's default, fp32 accumulation
    and reduce-scatter) or 2 (``--grad-reduce-in-bf16``). Sets the stock reference row."""
    param_elem: int = 2
    """Bytes per parameter element all-gathered by the distributed optimizer: 2 (``--bf16``),
    4 (fp32)."""
    bucket_size: Optional[int] = None
    """Elements per bucket (``--ddp-bucket-size``); None: megatron's ``max(4e7, 1e6 * DP)``."""
    overlap_grad_reduce: bool = True
    """``--overlap-grad-reduce``: buckets reduce during the last microbatch's backward."""
    overlap_param_gather: bool = False
    """``--overlap-param-gather``: all-gathers overlap the first microbatch's forward."""
    block_size: int = 256
    """LoCo elements per quantization block (``--loco-block-size``)."""
    stock_allreduce: bool = False
    """Stock reduce-scatter runs as an all-reduce (gloo does; ``--backend gloo``)."""
    compute_ms: Optional[float] = None
    """Forward + backward of one optimizer step (all microbatches) in ms; None: estimated."""
    mfu: float = 0.40
    """Model FLOPs utilisation assumed for the estimate (compute only)."""
    peak_tflops: float = 989.0
    """GPU peak dense TFLOP/s for the estimate (989 = H100 SXM bf16)."""
    global_batch: Optional[int] = None
    """Sequences per optimizer step (``--global-batch-size``); None: one microbatch per rank."""
    micro_batch: int = 1
    """Sequences per microbatch (``--micro-batch-size``)."""
    backward_fraction: float = 2 / 3
    """Share of compute spent in backward (backward ~ 2x forward FLOPs)."""
    compress_GBps: float = 1000.0
    """LoCo compress throughput, GB/s of gradient bucket (numel x grad element bytes / s), as
    benchmarks/throughput.py measures it. Default: an assumption for H100 (not measured)."""
    decompress_GBps: float = 4000.0
    """LoCo decompress throughput, GB/s of gradient bucket, as compress."""

    def __post_init__(self):
        if self.grad_elem not in (2, 4) or self.param_elem not in (2, 4):
            raise PlannerError("gradient and parameter elements are 2 (bf16) or 4 (fp32) bytes.")
        for flag, v in (("--compute-ms", self.compute_ms), ("--mfu", self.mfu),
                        ("--gpu-tflops", self.peak_tflops),
                        ("--compress-GBps", self.compress_GBps),
                        ("--decompress-GBps", self.decompress_GBps)):
            if v is not None and not (v > 0 and v != float("inf")):
                raise PlannerError(f"{flag} {v!r} must be positive and finite.")
        if self.mfu > 1:
            raise PlannerError(f"--mfu {self.mfu} is a fraction of peak in (0, 1].")
        if self.bucket_size is not None and self.bucket_size < 1:
            raise PlannerError(f"--ddp-bucket-size {self.bucket_size} must be positive.")


def _microbatches(par: ParallelSpec, opt: PlanOptions) -> int:
    dp = par.dp
    if opt.global_batch is None:
        return 1
    if opt.global_batch % (opt.micro_batch * dp):
        raise PlannerError(f"--global-batch-size {opt.global_batch} must be a multiple of "
                           f"--micro-batch-size {opt.micro_batch} x DP {dp}.")
    return opt.global_batch // (opt.micro_batch * dp)


def compute_seconds(model: ModelSpec, par: ParallelSpec, opt: PlanOptions) -> float:
    """Forward + backward seconds per step per GPU: given, or
    ``flops_per_token * global_batch * seq / world / (mfu * peak)``."""
    if opt.compute_ms is not None:
        return opt.compute_ms / 1e3
    sequences = opt.global_batch or opt.micro_batch * par.dp
    flops = model.flops_per_token() * sequences * model.seq_length / par.world
    return flops / (opt.mfu * opt.peak_tflops * 1e12)


def _bottleneck_stage(model: ModelSpec, par: ParallelSpec):
    stages = sorted({0, par.pp // 2, par.pp - 1})
    lists = [model.stage_params(par.tp, par.pp, s, par.ep, par.etp) for s in stages]
    i = max(range(len(stages)), key=lambda k: sum(p.numel for p in lists[k]))
    return stages[i], lists[i]


def param_gather(buckets: List[Bucket], c: ClusterSpec, opt: PlanOptions,
                 param_bits: Optional[int]):
    """Per bucket, the parameter all-gather's ring time and bytes sent per GPU: stock
    (``param_elem`` bytes per element) or, with ``param_bits``, weight differences
    (:func:`loco_megatron.accounting.param_gather_bytes_per_step`, exact)."""
    times, sent = [], 0
    for b in buckets:
        if param_bits and b.group.size > 1:
            nbytes = param_gather_bytes_per_step(param_bits,
                                                 [(b.layout(opt.block_size), opt.param_elem)])[0]
        else:
            nbytes = (b.group.size - 1) * (b.numel // b.group.size) * opt.param_elem
        times.append(ring_collective(b.group, c, nbytes))
        sent += nbytes
    return times, sent


def _variant(name, bits, hier, intra, param_bits, buckets: List[Bucket],
             ar: Optional[GroupSpread], c: ClusterSpec, opt: PlanOptions, bwd_s: float,
             fwd_s: float):
    elem = opt.grad_elem if bits else (4 if name.endswith("fp32") else 2)
    ag, ag_sent = param_gather(buckets, c, opt, param_bits)
    comm, kern_c, kern_d, sent, intra_b, inter_b, error, wire = [], [], [], 0, 0, 0, 0, []
    cross = 0.0  # bytes per GPU that leave its node (its share of the node boundary's load)
    for b in buckets:
        bb = bucket_bytes(b, elem, bits or 4, opt.block_size, hier, intra or 16)
        g, M, L = b.group, b.group.nodes, b.group.per_node
        gbytes = b.numel * elem
        stock_like = bits is None or (hier and M == 1 and intra == 16)
        if g.size == 1:  # nothing to reduce: LoCo leaves megatron's (empty) path alone
            t = kc = kd = 0.0
        elif stock_like:
            t = ring_collective(g, c, bb.stock, allreduce=opt.stock_allreduce)
            sent += bb.stock
            cross += bb.stock * (2 if opt.stock_allreduce else 1) / L if M > 1 else 0
            kc = kd = 0.0
        elif not hier or L == 1 or M == 1:
            flat = bb.flat if not hier or L == 1 else bb.intra  # M == 1: flat 8-bit
            t, sent = alltoall_time(g, c, flat), sent + flat
            cross += flat * (g.size - L) / (g.size - 1) if M > 1 else 0
            kc, kd = gbytes / (opt.compress_GBps * 1e9), gbytes / (opt.decompress_GBps * 1e9)
            if not hier:
                error, wire = error + bb.error, wire + [bb.wire]
            else:
                error += bb.error
        else:
            t = (alltoall_time(GroupSpread(L, 1, L), c, bb.intra)
                 + alltoall_time(GroupSpread(M, M, 1), c, bb.inter))
            sent, intra_b, inter_b = sent + bb.intra + bb.inter, intra_b + bb.intra, \
                inter_b + bb.inter
            cross += bb.inter
            kc = (gbytes * (intra == 8) + gbytes / L) / (opt.compress_GBps * 1e9)
            kd = (gbytes + gbytes / L) / (opt.decompress_GBps * 1e9)
            error += bb.error
        if ar is not None and not b.expert:  # cross-instance all-reduce of the shard
            t += ring_collective(ar, c, (ar.size - 1) * b.numel // g.size * elem // ar.size,
                                 allreduce=True)
        comm.append(t)
        kern_c.append(kc)
        kern_d.append(kd)
    compress, decompress = sum(kern_c), sum(kern_d)
    if opt.overlap_grad_reduce:  # compress on LoCo's side stream, in bucket order
        ready, done = [], 0.0
        for b, kc in zip(buckets, kern_c):
            done = max(done, b.ready * bwd_s) + kc
            ready.append(done)
        exposed = exposed_after_window(ready, comm, bwd_s)
        on_compute = 0.0  # the compute stream does not wait for it
    else:
        exposed = sum(comm)
        on_compute = compress
    if opt.overlap_param_gather:
        order = sorted(zip(forward_needs([b.ready for b in buckets], fwd_s), ag))
        ag_exposed = exposed_before_use([n for n, _ in order], [t for _, t in order])
    else:
        ag_exposed = sum(ag)
    if param_bits:  # the owner's encode of its shard, every rank's decode of the bucket (fp32)
        sent_buckets = [b for b in buckets if b.group.size > 1]
        encode = sum(4 * b.numel / b.group.size for b in sent_buckets) / (
            opt.compress_GBps * 1e9)
        compress, on_compute = compress + encode, on_compute + encode
        decompress += sum(4 * b.numel for b in sent_buckets) / (opt.decompress_GBps * 1e9)
    copies = (sum(b.numel // b.group.size for b in buckets if b.group.size > 1) * 4
              if param_bits and opt.param_elem == 4 else 0)
    return {"name": name, "bits": bits, "hierarchical": hier, "intra_node_bits": intra,
            "param_bits": param_bits, "param_bytes_sent": ag_sent,
            "param_fp32_copy_bytes": copies,
            "grad_elem_bytes": elem, "grad_bytes_sent": sent, "intra_node_bytes": intra_b,
            "inter_node_bytes": inter_b, "cross_node_bytes_per_gpu": cross,
            "grad_comm_ms": 1e3 * sum(comm),
            "compress_ms": 1e3 * compress, "decompress_ms": 1e3 * decompress,
            "grad_exposed_ms": 1e3 * exposed, "param_all_gather_ms": 1e3 * sum(ag),
            "param_all_gather_exposed_ms": 1e3 * ag_exposed,
            "error_buffer_bytes": error if bits else 0,
            "transient_wire_bytes_largest_bucket": 2 * max(wire) if wire else None,
            "transient_wire_bytes_all_buckets": 2 * sum(wire) if wire else None,
            "step_exposed_comm_ms": 1e3 * (on_compute + exposed + decompress + ag_exposed)}


def plan(model: ModelSpec, par: ParallelSpec, c: ClusterSpec, opt: PlanOptions) -> Dict:
    """Predict every variant of :data:`VARIANTS` for the GPU holding the most gradient
    elements (the pipeline stage that is the bottleneck). Returns a JSON-ready dict: inputs,
    placement, buckets, compute, and ``variants`` (bytes per rank per step, ms, ratio to the
    stock row of ``opt.grad_elem``, memory bytes). Raises :class:`PlannerError`."""
    par.check_model(model)
    if par.world != c.world:
        raise PlannerError(f"the parallel layout is for {par.world} GPUs, the cluster has "
                           f"{c.world} (--nodes x --gpus-per-node).")
    stage, params = _bottleneck_stage(model, par)
    dense, ar = par.dense_groups(c.gpus_per_node)
    expert = par.expert_group(c.gpus_per_node) if model.num_experts else None
    size = (opt.bucket_size or default_bucket_size(dense.size)) if opt.overlap_grad_reduce \
        else None
    buckets = sorted(gpu_buckets(params, dense, expert, size), key=lambda b: b.ready)
    micro = _microbatches(par, opt)
    compute = compute_seconds(model, par, opt)
    bwd = compute * opt.backward_fraction / micro
    fwd = compute * (1 - opt.backward_fraction) / micro
    rows = [_variant(*v, buckets, ar, c, opt, bwd, fwd) for v in VARIANTS]
    ref = rows[0] if opt.grad_elem == 4 else rows[1]
    for r in rows:
        r["step_ms"] = 1e3 * compute + r["step_exposed_comm_ms"]
        r["ratio_to_stock"] = r["step_ms"] / (1e3 * compute + ref["step_exposed_comm_ms"])
    return {
        "world": par.world, "tp": par.tp, "pp": par.pp, "cp": par.cp, "ep": par.ep,
        "etp": par.etp, "dp": par.dp, "expert_dp": par.expert_dp if expert else None,
        "instances": par.instances, "stage": stage,
        "dense_group": dense._asdict(), "expert_group": expert._asdict() if expert else None,
        "params_total": model.total_params(), "params_active": model.active_params(),
        "params_per_gpu": sum(p.numel for p in params),
        "expert_params_per_gpu": sum(p.numel for p in params if p.expert),
        "buckets": len(buckets), "bucket_size": size,
        "grad_elements_per_gpu": sum(b.numel for b in buckets),
        "microbatches": micro, "compute_ms": 1e3 * compute,
        "compute_source": "given (--compute-ms)" if opt.compute_ms is not None else
        f"estimated: {model.flops_per_token():.3e} FLOPs/token, MFU {opt.mfu}, "
        f"{opt.peak_tflops} TFLOP/s peak",
        "stock_reference": ref["name"], "stock_allreduce": opt.stock_allreduce,
        "variants": rows}
