"""Memory formula of LoCo's compressed reduce-scatter: every allocation, phase by phase.

:func:`loco_memory_formula` lists, for one bucket on one rank, the tensors live at the peak of
each phase of ``compensated_reduce_scatter`` (loco_megatron/collectives.py) for either
implementation of its hot path (loco_megatron/kernels):

* ``impl="fused"`` (``--loco-kernels auto``, the default: the C kernel on CPU tensors, Triton on
  CUDA tensors): one pass reads the bucket through its block table and updates the error buffer
  in place; it allocates the payload and the scales, then the received payload and scales;
* ``impl="torch"`` (``--loco-kernels torch``, algorithm.py): plain torch ops, with
  several fp32 temporaries of the whole padded bucket (~30 bytes per element at the peak).

It is the one place to update when the hot path changes; benchmarks/memory.py checks it against
measured peaks, :func:`llama2_7b_formula` applies it to LLaMA-2-7B.
"""

from typing import Dict, List, Tuple

from loco_megatron.layout import BucketLayout

Phase = Tuple[str, List[Tuple[str, int]]]
IMPLS = ("fused", "torch", "cpu", "triton")


def _fused_phases(n: int, numel: int, shard: int, s: int, bits: int, block: int, device: str,
                  grad_element_size: int, fp16: bool, out_contiguous: bool, telemetry: bool,
                  error_dtype: str) -> List[Phase]:
    """kernels/cpu.py (+ cpu_kernels.c) on ``device="cpu"``, kernels/triton_kernels.py on
    ``"cuda"``: compress_bucket, the all-to-all, decompress_shard."""
    sent = [("payload sent uint8 [n*bits/8]", n * bits // 8), ("scales sent fp32 [n/block]", 4 * s)]
    recv = [("payload received", n * bits // 8), ("scales received", 4 * s)]
    if device == "cpu":
        kernel = [("fp32 copy of the fp16 bucket", 4 * numel if fp16 else 0),
                  ("C block workspace 3*block fp32", 3 * 4 * block)]
    else:
        # telemetry: per-block ||h - deQ||^2 and ||e||^2 partials (the latter allocated for
        # either storage, filled for int8), summed in fp64; no ErrorBuffer.squared_norm() copy
        kernel = [("non-finite flag int32", 4),
                  ("err_sq partials fp32 [n/block] (telemetry)", 4 * s if telemetry else 0),
                  ("buf_sq partials fp32 [n/block] (telemetry)", 4 * s if telemetry else 0)]
    phases: List[Phase] = [("compress: fused kernel", sent + kernel)]
    if device == "cuda" and telemetry:
        phases.append(("compress: partials .double().sum()",
                       sent + [("err_sq + buf_sq partials fp32", 8 * s), ("fp64 copy", 8 * s)]))
    phases.append(("all-to-all", sent + recv))
    if device == "cpu":
        tmp = [("fp32 shard (output not fp32)", 4 * shard if grad_element_size != 4 else 0),
               ("C accumulator 1*block fp32", 4 * block)]
    else:
        tmp = [("shard copy (output not contiguous)",
                grad_element_size * shard if not out_contiguous else 0)]
    phases.append(("finish: fused decompress", sent + recv + tmp))
    return phases


def _torch_phases(layout: BucketLayout, n: int, s: int, bits: int, grad_element_size: int,
                  error_dtype: str, beta: float, telemetry: bool) -> List[Phase]:
    """algorithm.py (+ quantization.py, ErrorBuffer.get/set) line by line."""
    f = 4
    copy = 0 if (layout.is_identity and grad_element_size == f) else n * f
    small = 3 * 4 * s  # scales, safe, ones_like of quantize_blockwise
    quant = [("xb zero-padded copy", n * f), ("xb / scale", n * f), ("round", n * f),
             ("scales, safe, ones_like", small)]
    int8 = error_dtype == "int8"
    eh = [("E e_prev = err.get()", n * f), ("H h", n * f)]
    base = eh + [("C codes int8", n), ("S scales", 4 * s), ("ERR err_now", n * f)]
    if beta:
        base.append(("NE new", n * f))
    phases: List[Phase] = [
        ("compress: err.get()", [("codes.to(fp32)", n * f if int8 else 0), ("E e_prev", n * f)]),
        ("compress: h = to_padded(g) + e", [("P to_padded copy fp32", copy)] + eh),
        ("compress: quantize h", eh + quant),
        ("compress: err_now = h - deQ", eh + [("C codes int8", n), ("S scales", 4 * s),
                                              ("deQ", n * f), ("ERR err_now", n * f)]),
    ]
    if beta:
        phases.append(("compress: new = beta*e + (1-beta)*err", base[:-1] + [
            ("beta*e", n * f), ("(1-beta)*err", n * f), ("NE new", n * f)]))
    # non-finite blocks keep their error: new = where(bad, 0, new), then the storage is written
    # only where the block was finite (where(bad, old storage, new storage))
    kept = (base[:-1] if beta else base) + [("B bad mask [n] bool", n), ("NE new (where)", n * f)]
    phases.append(("compress: new = where(bad, 0, new)",
                   base + [("B bad mask [n] bool", n), ("W torch.where", n * f)]))
    if int8:
        phases.append(("compress: 8-bit quantize of new", kept + quant))
        phases.append(("compress: codes/scales = where(bad, old, new)", kept + [
            ("C8 error codes", n), ("S8 error scales", 4 * s), ("W where codes", n)]))
    else:
        phases.append(("compress: values = where(bad, old, new)", kept + [("W where", n * f)]))
    if bits == 4:
        phases.append(("compress: pack_int4", base + [("int16 codes", 2 * n), ("& 0xF", 2 * n)]))
    sent = [("payload + scales sent", n * bits // 8 + 4 * s)]
    if telemetry and int8:
        phases.append(("compress: telemetry squared_norm()",
                       sent + [("codes.float()", 4 * n), ("per-block norms", 4 * s)]))
    wire = sent + [("payload + scales received", n * bits // 8 + 4 * s)]
    phases.append(("all-to-all", wire))
    codes = []
    if bits == 4:
        phases.append(("finish: unpack_int4", wire + [
            ("int16 copy", n), ("nibbles (stack)", 2 * n), (">= 8", n), ("- 16", 2 * n),
            ("where", 2 * n)]))
        codes = [("codes int8", n)]
    phases.append(("finish: decode (dequantize)", wire + codes + [("codes.to(fp32)", n * f),
                                                                  ("chunks fp32 [n]", n * f)]))
    phases.append(("finish: sum + from_padded_shard", wire + [
        ("chunks fp32 [n]", n * f), ("reduced fp32 [padded_shard]", layout.padded_shard * f)]))
    return phases


def loco_memory_formula(layout: BucketLayout, grad_element_size: int, bits: int,
                        block_size: int, error_dtype: str = "int8", impl: str = "fused", *,
                        device: str = "cpu", fp16: bool = False, beta: float = 0.8,
                        telemetry: bool = False, out_contiguous: bool = True) -> Dict:
    """Memory the compressed reduce-scatter of one bucket needs on one rank (synchronous call).

    Args:
        layout: the bucket's :class:`BucketLayout`; ``n = world * padded_shard`` wire
            elements, ``s = world * blocks_per_shard`` blocks.
        grad_element_size: bytes per gradient element (the reduce-scatter's input and output).
        bits: 4 or 8. ``block_size``: elements per block. ``error_dtype``: ``"int8"``/``"fp32"``.
        impl: ``"fused"`` (C kernel with ``device="cpu"``, Triton with ``"cuda"``), ``"torch"``
            (the reference), or a name :func:`loco_megatron.kernels.select` returns
            (``"cpu"``, ``"triton"``: fused on that device).
        fp16: the gradients are fp16 (the C kernel converts them to fp32 first; bf16 and fp32
            are read directly).
        beta: the error moving-average factor (0: the reference skips the average).
        telemetry: ``LoCoState.enable_metrics()`` is on: ``||h - deQ||^2`` and ``||e||^2``
            (torch: ``ErrorBuffer.squared_norm()``, an fp32 copy of the int8 codes; the C
            kernel sums both in its pass, Triton into per-block partials).
        out_contiguous: the output shard is contiguous (megatron-core's is).

    Returns:
        ``{"impl", "n_padded", "persistent", "table", "phases": [(name, [(tensor, bytes)])],
        "phase_bytes": {name: bytes}, "transient_peak", "peak_phase", "wire"}``: each phase lists
        the tensors live at its peak beyond the gradient buffer and the persistent state;
        ``persistent`` is the error buffer (exactly ``Compensator.error_bytes()``), ``table``
        the cached block table on the device (source and wire offsets int64, length int32 per
        block; its int64 spans stay on the host), ``wire`` payload + scales one way.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl {impl!r} is not one of {IMPLS}")
    if impl in ("cpu", "triton"):
        impl, device = "fused", "cpu" if impl == "cpu" else "cuda"
    n = layout.world * layout.padded_shard
    s = layout.nblocks
    persistent = n + 4 * s if error_dtype == "int8" else 4 * n
    if impl == "fused":
        phases = _fused_phases(n, layout.numel, layout.shard, s, bits, block_size, device,
                               grad_element_size, fp16, out_contiguous, telemetry, error_dtype)
    else:
        phases = _torch_phases(layout, n, s, bits, grad_element_size, error_dtype, beta,
                               telemetry)
    sums = [(sum(b for _, b in live), name) for name, live in phases]
    peak = max(b for b, _ in sums)
    peak_phase = next(name for b, name in sums if b == peak)
    return {"impl": impl if impl == "torch" else f"fused ({'C' if device == 'cpu' else 'Triton'})",
            "n_padded": n, "persistent": persistent, "table": 20 * s, "phases": phases,
            "phase_bytes": {name: b for b, name in sums}, "transient_peak": peak,
            "peak_phase": peak_phase, "wire": n * bits // 8 + 4 * s}


def llama2_7b_formula(dp_sizes, bits: int = 4) -> List[Dict]:
    """:func:`loco_memory_formula` over LLaMA-2-7B's megatron-core buckets (fp32 gradient buffer,
    benchmarks/wire_bytes.py) at each DP size, for the fused path on GPUs (Triton) and the torch
    reference: persistent error buffers (all buckets), transient peak (the largest bucket's),
    wire buffers of all buckets at once (upper bound with overlap_grad_reduce)."""
    from . import wire_bytes as wb

    buckets = wb.llama2_7b_buckets(dp_sizes)
    out = []
    for dp in dp_sizes:
        lays = [(wb.loco_layout(b, dp), b["grad_bytes"]) for b in buckets[dp]]
        row = {"dp": dp, "buckets": len(lays), "largest": max(b["numel"] for b in buckets[dp])}
        for impl, device in (("fused", "cuda"), ("torch", "cuda")):
            fs = [loco_memory_formula(lay, elt, bits, wb.BLOCK_SIZE, impl=impl, device=device)
                  for lay, elt in lays]
            row["persistent"] = sum(f["persistent"] for f in fs)
            row[f"transient_{impl}"] = max(f["transient_peak"] for f in fs)
            row[f"peak_phase_{impl}"] = max(fs, key=lambda f: f["transient_peak"])["peak_phase"]
        row["wire_all"] = sum(2 * f["wire"] for f in fs)
        out.append(row)
    return out


#: LLaMA-2 (Touvron et al. 2023, arXiv 2307.09288; configs/llama2_7b.yaml): RoPE, SwiGLU,
#: RMSNorm, no biases, untied embeddings, vocabulary 32000; 70B with 8 key/value groups
LLAMA2 = {
    "LLaMA-2 7B": dict(num_layers=32, hidden_size=4096, ffn_hidden_size=11008,
                       num_attention_heads=32),
    "LLaMA-2 70B": dict(num_layers=80, hidden_size=8192, ffn_hidden_size=28672,
                        num_attention_heads=64, num_query_groups=8),
}
#: (model, TP, PP, DP) of the figures in docs/kernels.md
STEP_MEMORY_CASES = (("LLaMA-2 7B", 1, 1, 8), ("LLaMA-2 70B", 8, 4, 8))


def step_memory_figures(bits: int = 4, block_size: int = 256) -> List[Dict]:
    """LoCo's memory per GPU (:func:`loco_megatron.step_memory.step_memory`, Triton kernels,
    int8 error storage) for :data:`STEP_MEMORY_CASES`: megatron-core's buckets of the GPU of the
    pipeline stage with the most gradient elements (loco_megatron/planner/buckets.py, default
    ``bucket_size`` ``max(4e7, 1e6 * DP)``). Per row: ``params`` (that GPU's gradient
    elements), ``buckets``, ``persistent`` (``error``, ``tables``: block tables and spans),
    ``host``, and the peak transient bytes with overlap on when no all-to-all lands before the
    end of backward (``transient_bound``), when each lands before the next bucket is ready
    (``transient_landed``), and without overlap (``transient_off``)."""
    from loco_megatron.config import LoCoConfig
    from loco_megatron.planner.buckets import default_bucket_size, gpu_buckets
    from loco_megatron.planner.cluster import GroupSpread
    from loco_megatron.planner.model import ModelSpec
    from loco_megatron.step_memory import step_memory

    cfg = LoCoConfig(bits=bits, block_size=block_size)
    rows = []
    for name, tp, pp, dp in STEP_MEMORY_CASES:
        model = ModelSpec(seq_length=4096, position_embedding_type="rope", swiglu=True,
                          normalization="RMSNorm", add_bias_linear=False,
                          untie_embeddings_and_output_weights=True, **LLAMA2[name])
        params = max((model.stage_params(tp, pp, s) for s in range(pp)),
                     key=lambda ps: sum(p.numel for p in ps))
        buckets = gpu_buckets(params, GroupSpread(dp, 1, dp), None, default_bucket_size(dp))
        wire = [(b.layout(block_size), 4) for b in buckets]
        bound = step_memory(cfg, wire, overlap=True)
        landed = step_memory(cfg, wire, overlap=True, in_flight=1)
        off = step_memory(cfg, wire, overlap=False)
        rows.append(dict(model=name, tp=tp, pp=pp, dp=dp, params=sum(p.numel for p in params),
                         buckets=len(buckets), persistent=bound.persistent, error=bound.error,
                         tables=bound.tables + bound.spans, host=bound.host,
                         transient_bound=bound.transient, transient_landed=landed.transient,
                         transient_off=off.transient))
    return rows
