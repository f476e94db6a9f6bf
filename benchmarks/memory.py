"""Peak memory per rank with LoCo vs stock megatron-core, measured and against the formula.

A small megatron-core GPT (``GPTModel`` + ``DistributedDataParallel`` + distributed Adam, the
stack of tests/megatron_worker.py) trains a few steps on 2 data-parallel ranks, once stock and
once with ``loco_megatron.install(LoCoConfig(bits=4))``. ``overlap_grad_reduce`` is off, so
megatron reduces the (single) bucket synchronously in ``finish_grad_sync()`` and the gradient
sync is a phase of its own that can be measured. Per rank:

* LoCo's persistent state exactly: ``Compensator.error_bytes()`` (int8 codes + fp32 scale per
  block of the padded bucket);
* the peak of the gradient-sync phase above the memory held when it starts, and the peak of
  the whole run, stock and LoCo.

The measure: on a GPU (2+ devices, NCCL) ``torch.cuda.max_memory_allocated`` (reset before the
phase). On CPU the kernel's peak resident set (``VmHWM`` in ``/proc/self/status``), reset before
the phase by writing 5 to ``/proc/self/clear_refs``, with glibc's mmap threshold fixed at 64 KiB
(``MALLOC_MMAP_THRESHOLD_``) in the ranks, so every tensor larger than that is its own mapping,
returned to the kernel when freed: the resident set then follows the live tensors (plus
whatever gloo and the allocator touch), not malloc's caching.

:func:`loco_memory_formula` lists every allocation of the compressed path with its size (the
reference torch implementation of collectives.py / compensator.py / quantization.py); it is the
one place to update when the hot path changes.
"""

import os
import re
from pathlib import Path
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from loco_megatron.layout import BucketLayout

from .report import Section

#: model of the measured run: (layers, hidden, ffn, heads, vocab, seq, micro-batch, steps)
FULL = dict(layers=4, hidden=256, ffn=704, heads=4, vocab=16384, seq=64, batch=2, steps=4)
QUICK = dict(layers=2, hidden=128, ffn=352, heads=4, vocab=4096, seq=32, batch=2, steps=3)
MMAP_THRESHOLD = 65536


# ------------------------------------------------------------------------------------------
# the formula


def loco_memory_formula(layout: BucketLayout, grad_element_size: int, bits: int,
                        block_size: int, error_dtype: str = "int8") -> Dict:
    """Memory the compressed reduce-scatter of one bucket needs on one rank (synchronous call).

    ``n = world * padded_shard`` (the padded layout), ``s = n / block_size`` scales, fp32 work
    dtype. Returns ``{"persistent": bytes, "phases": [(name, [(tensor, bytes), ...]), ...],
    "transient_peak": bytes, "peak_phase": name}``: each phase lists the tensors live at the
    peak of that phase (beyond the gradient buffer and the persistent error buffer); the
    transient peak is the largest phase. Mirrors, line by line:

    * ``compensated_reduce_scatter``: ``layout.to_padded(input, fp32)`` (P; no copy when the
      layout is the identity and the bucket is fp32), ``compensator.compress``, the received
      payload and scales, then ``finish()``: ``decode`` + ``view(world, pshard).sum(0)``;
    * ``Compensator.compress``: ``e_prev = buf.get()`` (E), ``h = g + e_prev`` (H),
      ``quantize_blockwise(h)`` (codes C), ``err = h - deQ`` (ERR),
      ``new_err = beta * e_prev + (1 - beta) * err`` (NE), ``buf.set(new_err)`` (an 8-bit
      ``quantize_blockwise``), ``pack_codes``;
    * ``quantize_blockwise``: zero-padded copy ``xb``, ``xb.abs()``, ``xb / scale``,
      ``round``, ``.to(int8)``; ``dequantize_blockwise``: ``codes.to(fp32)``, ``* scale``;
    * ``unpack_int4`` (4 bits): int16 copy, two nibble tensors, ``stack``, ``>= 8``, ``- 16``,
      ``where``, ``.to(int8)``.
    """
    n = layout.world * layout.padded_shard
    s = n // block_size
    f = 4  # fp32 work dtype
    wire = n * bits // 8 + 4 * s  # payload + scales of the whole padded bucket
    if error_dtype == "int8":
        persistent = n + 4 * s
    else:
        persistent = n * f
    p = 0 if (layout.is_identity and grad_element_size == f) else n * f
    small_q = 3 * 4 * s  # scales, safe, ones_like in quantize_blockwise
    base = [("P padded fp32 copy", p), ("E e_prev", n * f), ("H h", n * f)]
    phases: List[Tuple[str, List[Tuple[str, int]]]] = [
        ("compress: buf.get()", [("P padded fp32 copy", p),
                                 ("codes.to(fp32)", n * f), ("E e_prev", n * f)]),
        ("compress: quantize h", base + [("xb", n * f), ("xb / scale", n * f),
                                         ("round", n * f), ("scales etc.", small_q)]),
        ("compress: err = h - deQ", base + [("C codes int8", n), ("codes.to(fp32)", n * f),
                                            ("deQ", n * f), ("scales", 4 * s)]),
        ("compress: new_err", base + [("C codes int8", n), ("ERR", n * f), ("beta*e", n * f),
                                      ("(1-beta)*err", n * f), ("NE", n * f)]),
        ("compress: buf.set (8-bit quantize)",
         base + [("C codes int8", n), ("ERR", n * f), ("NE", n * f), ("xb", n * f),
                 ("xb / scale", n * f), ("round", n * f), ("scales etc.", small_q + 4 * s)]),
    ]
    if bits == 4:
        phases.append(("compress: pack_int4",
                       base + [("C codes int8", n), ("ERR", n * f), ("NE", n * f),
                               ("int16 codes", 2 * n), ("& 0xF", 2 * n)]))
        unpack = [("int16 copy", n), ("nibbles (stack)", 2 * n), (">= 8", n), ("- 16", 2 * n),
                  ("where", 2 * n)]
    else:
        unpack = []
    phases.append(("all-to-all", [("payload + scales sent", wire),
                                  ("payload + scales received", wire)]))
    if unpack:
        phases.append(("finish: unpack_int4", [("payload + scales sent", wire),
                                               ("payload + scales received", wire)] + unpack))
    phases.append(("finish: dequantize + sum",
                   [("payload + scales sent", wire), ("payload + scales received", wire),
                    ("codes int8", n if bits == 4 else 0), ("codes.to(fp32)", n * f),
                    ("chunks [world*pshard] fp32", n * f)]))
    sums = [(sum(b for _, b in live), name) for name, live in phases]
    peak, peak_phase = max(sums)
    return {"n_padded": n, "persistent": persistent, "phases": phases, "transient_peak": peak,
            "peak_phase": peak_phase, "phase_bytes": {name: b for b, name in sums}}


# ------------------------------------------------------------------------------------------
# measurement (runs on each rank)


def exact_malloc() -> bool:
    """glibc: every allocation above :data:`MMAP_THRESHOLD` its own mapping, and free heap
    memory handed back now (``malloc_trim``), so the resident set follows the live tensors.
    Returns False where this is not glibc (then the CPU measure includes malloc's caching)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, MMAP_THRESHOLD) == 1
        ok = libc.mallopt(m_trim_threshold, MMAP_THRESHOLD) == 1 and ok
        libc.malloc_trim(0)
        return ok
    except (OSError, AttributeError):
        return False


def _status_kb(field: str) -> int:
    m = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    return int(m.group(1)) * 1024


class _Meter:
    """Peak and current memory of this rank: CUDA allocator on a GPU, resident set on CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.kind = ("torch.cuda.max_memory_allocated" if cuda else
                     "VmHWM/VmRSS (/proc/self/status; clear_refs=5 resets the peak)")

    def current(self) -> int:
        return torch.cuda.memory_allocated() if self.cuda else _status_kb("VmRSS")

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated() if self.cuda else _status_kb("VmHWM")

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            exact_malloc()
            Path("/proc/self/clear_refs").write_text("5")


def _build(dims: Dict, cuda: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(num_layers=dims["layers"], hidden_size=dims["hidden"],
                            ffn_hidden_size=dims["ffn"], num_attention_heads=dims["heads"],
                            gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                            normalization="RMSNorm", add_bias_linear=False,
                            use_cpu_initialization=True, pipeline_dtype=torch.float32,
                            hidden_dropout=0.0, attention_dropout=0.0)
    gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(
        normalization="RMSNorm"), vocab_size=dims["vocab"], max_sequence_length=dims["seq"],
        position_embedding_type="rope", share_embeddings_and_output_weights=False)
    if cuda:
        gpt.cuda()
    model = DistributedDataParallel(config=cfg, module=gpt, ddp_config=DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=False, grad_reduce_in_fp32=True))
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True), [model])
    return model, opt


def _train(rank: int, world: int, mode: str, dims: Dict, meter: "_Meter") -> Dict:
    """Train ``dims["steps"]`` steps (``mode`` "stock" or "loco4"/"loco8") and measure."""
    import loco_megatron

    cuda = meter.cuda
    meter.reset_peak()
    start = meter.current()
    state = None
    if mode != "stock":
        state = loco_megatron.install(loco_megatron.LoCoConfig(bits=int(mode[4:])))
    try:
        model, opt = _build(dims, cuda)
        device = "cuda" if cuda else "cpu"
        gen = torch.Generator().manual_seed(100 + rank)
        b, seq = dims["batch"], dims["seq"]
        position = torch.arange(seq, device=device).unsqueeze(0).expand(b, -1)
        mask = torch.tril(torch.ones(1, 1, seq, seq, device=device)) < 0.5
        run_peak, syncs, losses = meter.peak(), [], []
        for _ in range(dims["steps"]):
            tokens = torch.randint(0, dims["vocab"], (b, seq), generator=gen).to(device)
            model.zero_grad_buffer()
            opt.zero_grad()
            loss = model(tokens, position, mask, labels=tokens).mean()
            loss.backward()
            run_peak = max(run_peak, meter.peak())  # forward/backward since the last reset
            meter.reset_peak()
            before = meter.current()
            model.finish_grad_sync()
            peak = meter.peak()
            after = meter.current()
            syncs.append({"before": before, "peak": peak, "after": after,
                          "peak_above_before": peak - before, "retained": after - before})
            run_peak = max(run_peak, peak)
            meter.reset_peak()
            opt.step()
            losses.append(float(loss))
        run_peak = max(run_peak, meter.peak())
        buckets = [(b.grad_data.numel(), b.grad_data.element_size(),
                    state.layout_for(b, world) if state is not None and state.active else None)
                   for g in model.bucket_groups for b in g.buckets]
        return {"mode": mode, "measure": meter.kind, "run_peak": run_peak - start,
                "syncs": syncs, "losses": losses,
                "error_bytes": state.compensator.error_bytes() if state is not None else 0,
                "wire_bytes": state.wire.bytes_sent if state is not None else 0,
                "buckets": buckets, "params": sum(p.numel() for p in model.module.parameters())}
    finally:
        loco_megatron.uninstall()


def measure_worker(rank: int, world: int, modes: Tuple[str, ...], dims: Dict) -> List[Dict]:
    """One rank: the runs of ``modes`` one after the other (fresh model each), measured."""
    import gc

    from megatron.core import parallel_state as ps

    cuda = torch.cuda.is_available()
    if not cuda:
        from loco_megatron.emulation import activate

        activate()
    ps.initialize_model_parallel(1)
    meter = _Meter(cuda)
    try:
        out = []
        for mode in modes:
            out.append(_train(rank, world, mode, dims, meter))
            gc.collect()
        return out
    finally:
        ps.destroy_model_parallel()


def measure(modes: Tuple[str, ...], dims: Dict, world: int = 2) -> List[List[Dict]]:
    """Spawn ``world`` ranks once (NCCL with 2+ GPUs, else gloo on CPU with the GPU hidden) and
    return each rank's :func:`measure_worker` result."""
    from tests.multiproc import run_ranks

    gpu = torch.cuda.is_available() and torch.cuda.device_count() >= world
    env = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "OMP_NUM_THREADS": "1"}
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # spawned ranks inherit it at start (glibc reads it then)
    try:
        return run_ranks(measure_worker, world, tuple(modes), dims,
                         backend="nccl" if gpu else "gloo")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ------------------------------------------------------------------------------------------
# the section


def _mib(x: float) -> str:
    return f"{x / 2 ** 20:.2f}"


def compare(stock: List[Dict], loco: List[Dict], bits: int, block_size: int = 256) -> Dict:
    """Per-rank numbers: measured vs :func:`loco_memory_formula`."""
    rows = []
    for rank, (s, l) in enumerate(zip(stock, loco)):
        formulas = [loco_memory_formula(lay, elt, bits, block_size) for _, elt, lay in l["buckets"]]
        persistent = sum(f["persistent"] for f in formulas)
        transient = max(f["transient_peak"] for f in formulas)
        steady = slice(1, None)  # step 0 also allocates the error buffers and optimizer state
        s_sync = max(x["peak_above_before"] for x in s["syncs"][steady])
        l_sync = max(x["peak_above_before"] for x in l["syncs"][steady])
        rows.append({
            "rank": rank, "measure": l["measure"], "params": l["params"],
            "buckets": len(l["buckets"]), "n_padded": sum(f["n_padded"] for f in formulas),
            "error_bytes": l["error_bytes"], "formula_persistent": persistent,
            "formula_transient": transient, "peak_phase": formulas[0]["peak_phase"],
            "stock_sync_peak": s_sync, "loco_sync_peak": l_sync,
            "sync_diff": l_sync - s_sync,
            "first_step_retained": l["syncs"][0]["retained"] - s["syncs"][0]["retained"],
            "stock_run_peak": s["run_peak"], "loco_run_peak": l["run_peak"],
            "run_diff": l["run_peak"] - s["run_peak"],
            "formula_total": persistent + transient,
            "phase_bytes": formulas[0]["phase_bytes"],
        })
    return {"rows": rows}


def llama2_7b_formula(dp_sizes, bits: int = 4) -> List[Dict]:
    """:func:`loco_memory_formula` summed over LLaMA-2-7B's buckets at each DP size."""
    from . import wire_bytes as wb

    buckets = wb.llama2_7b_buckets(dp_sizes)
    out = []
    for dp in dp_sizes:
        fs = [loco_memory_formula(wb.loco_layout(b, dp), b["grad_bytes"], bits, wb.BLOCK_SIZE)
              for b in buckets[dp]]
        out.append({"dp": dp, "buckets": len(fs), "largest": max(b["numel"] for b in buckets[dp]),
                    "persistent": sum(f["persistent"] for f in fs),
                    "transient": max(f["transient_peak"] for f in fs),
                    "wire_all": sum(2 * dict(f["phases"])["all-to-all"][0][1] for f in fs)})
    return out


def run(quick: bool, workdir: Path) -> Section:
    dims = QUICK if quick else FULL
    per_rank = measure(("stock", "loco4"), dims)
    stock, loco = [r[0] for r in per_rank], [r[1] for r in per_rank]
    result = compare(stock, loco, bits=4)
    rows = result["rows"]
    measure_kind = rows[0]["measure"]
    lines = [
        f"megatron-core GPT ({dims['layers']} layers, hidden {dims['hidden']}, FFN {dims['ffn']} "
        f"SwiGLU, vocab {dims['vocab']}, {rows[0]['params']:,} parameters, fp32 gradient buffer, "
        f"one bucket: overlap_grad_reduce off) with DDP + distributed Adam, DP=2, "
        f"{dims['steps']} steps, stock vs `--loco-bits 4` (block 256, int8 error buffer). "
        f"Measure: **{measure_kind}**"
        + ("" if "cuda" in measure_kind else
           f", glibc mmap threshold {MMAP_THRESHOLD // 1024} KiB and `malloc_trim` before each "
           "measured phase, so freed tensors leave the resident set") + ". Both runs in the same "
        "2 processes, one after the other (stock first). Whole-run peak = peak above the memory "
        "held before the model was built. Gradient-sync peak = peak during `finish_grad_sync()` minus the "
        "memory held when it starts, worst step after the first; LoCo's is compared with the "
        "formula directly (LoCo never calls the stock reduce-scatter, whose own temporaries are "
        "the stock column).", "",
        "| rank | error buffers (exact, `error_bytes()`) MiB | formula persistent MiB | "
        "grad-sync peak stock MiB | grad-sync peak LoCo MiB | LoCo - stock MiB | formula transient "
        "MiB | LoCo peak/formula | whole-run peak stock MiB | LoCo MiB | diff MiB | formula "
        "persistent+transient MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['rank']} | {_mib(r['error_bytes'])} | {_mib(r['formula_persistent'])} | "
            f"{_mib(r['stock_sync_peak'])} | {_mib(r['loco_sync_peak'])} | "
            f"{_mib(r['sync_diff'])} | {_mib(r['formula_transient'])} | "
            f"{r['loco_sync_peak'] / r['formula_transient']:.3f} | {_mib(r['stock_run_peak'])} | "
            f"{_mib(r['loco_run_peak'])} | {_mib(r['run_diff'])} | {_mib(r['formula_total'])} |")
    r0 = rows[0]
    n = r0["n_padded"]
    lines += ["", f"Formula per phase (rank 0, n = {n:,} padded elements; bytes beyond the "
              f"gradient buffer and the error buffer; peak phase: {r0['peak_phase']}):", "",
              "| phase | MiB | bytes / element |", "|---|---|---|"]
    for name, b in r0["phase_bytes"].items():
        lines.append(f"| {name} | {_mib(b)} | {b / n:.2f} |")
    peak_b = r0["formula_transient"]
    wire_b = r0["phase_bytes"]["all-to-all"] / 2
    lines += ["", f"Persistent: int8 codes + one fp32 scale per block = n * (1 + 4/256) bytes "
              f"(exactly `error_bytes()`). The transient peak of the current torch path is in "
              f"`{r0['peak_phase']}`: {peak_b / n:.1f} bytes per element, "
              f"{peak_b / (4 * n):.1f}x the fp32 gradient bucket (fp32 temporaries of the error "
              f"moving average and of the int8 re-quantization of the error); the wire buffers "
              f"({wire_b / n:.2f} bytes per element each way at 4 bits) are small in comparison. "
              "With overlap_grad_reduce the same per-bucket transients occur per bucket being "
              "compressed, plus the wire buffers of every bucket awaiting its wait(). The "
              "whole-run peak difference is smaller than persistent + transient when stock's "
              "peak is elsewhere (forward/backward activations, optimizer step)."]
    big = llama2_7b_formula((8, 64) if quick else (8, 64, 512))
    lines += ["", "The formula on LLaMA-2-7B (megatron-core's bucket layout of "
              "benchmarks/wire_bytes.py, fp32 gradient buffer, LoCo-4, overlap_grad_reduce on: "
              "one bucket compressed at a time; every rank keeps an error buffer for its whole "
              "buckets, not a shard):", "",
              "| DP | buckets | largest bucket (elements) | persistent error buffers GiB | transient "
              "peak (largest bucket) GiB | wire buffers sent + received, all buckets in flight at once "
              "(upper bound) GiB |",
              "|---|---|---|---|---|---|"]
    for b in big:
        lines.append(f"| {b['dp']} | {b['buckets']} | {b['largest']:,} | "
                     f"{b['persistent'] / 2 ** 30:.2f} | {b['transient'] / 2 ** 30:.2f} | "
                     f"{b['wire_all'] / 2 ** 30:.2f} |")
    return Section(name="memory", title="Peak memory per rank: LoCo vs stock",
                   markdown="\n".join(lines),
                   data={"dims": dims, "rows": rows, "measure": measure_kind, "llama2_7b": big,
                         "syncs": {"stock": [r["syncs"] for r in stock],
                                   "loco": [r["syncs"] for r in loco]}})


def compress_probe(numel: int, world: int, cuts: Tuple[int, ...], bits: int) -> Dict:
    """Measure (resident-set peak) one steady-state ``to_padded`` + ``Compensator.compress`` of
    a bucket in this process; meant for a fresh process started with ``MALLOC_MMAP_THRESHOLD_``
    (tests/test_bench_memory.py). Returns measured peak, the formula and the wire bytes."""
    from loco_megatron import LoCoConfig
    from loco_megatron.compensator import Compensator

    exact_malloc()
    layout = BucketLayout.build(numel, world, 256, cuts)
    comp = Compensator(LoCoConfig(bits=bits))
    x = torch.randn(layout.numel)
    comp.compress(0, layout.to_padded(x, torch.float32))  # allocates the error buffer
    meter = _Meter(False)
    meter.reset_peak()
    before = meter.current()
    payload, scales = comp.compress(0, layout.to_padded(x, torch.float32))
    peak = meter.peak() - before
    f = loco_memory_formula(layout, 4, bits, 256)
    return {"peak": peak, "error_bytes": comp.error_bytes(), "persistent": f["persistent"],
            "identity": layout.is_identity,
            "formula_compress": max(b for name, b in f["phase_bytes"].items()
                                    if name.startswith("compress")),
            "wire": payload.numel() * payload.element_size() + scales.numel() * 4,
            "formula_wire": dict(f["phases"])["all-to-all"][0][1]}
