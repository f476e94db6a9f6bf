"""Measured peak memory per rank for benchmarks/memory.py: megatron-core training runs on DP
ranks, and a one-process probe of a single compensated reduce-scatter.

The measure: on a GPU (2+ devices, NCCL) ``torch.cuda.max_memory_allocated`` (reset before the
phase). On CPU the kernel's peak resident set (``VmHWM`` in ``/proc/self/status``), reset before
the phase by writing 5 to ``/proc/self/clear_refs``, with glibc's mmap threshold fixed at 64 KiB
(``MALLOC_MMAP_THRESHOLD_``) in the ranks, so every tensor larger than that is its own mapping,
returned to the kernel when freed: the resident set then follows the live tensors (plus
whatever gloo and the allocator touch), not malloc's caching.
"""

import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, List, Tuple

import torch

from loco_megatron.layout import BucketLayout

from .memory_formula import loco_memory_formula

#: model of the measured run: (layers, hidden, ffn, heads, vocab, seq, micro-batch, steps)
FULL = dict(layers=4, hidden=256, ffn=704, heads=4, vocab=16384, seq=64, batch=2, steps=4)
QUICK = dict(layers=2, hidden=128, ffn=352, heads=4, vocab=4096, seq=32, batch=2, steps=3)
MMAP_THRESHOLD = 65536


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
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=False, grad_reduce_in_fp32=True)
    model = DistributedDataParallel(config=cfg, module=gpt, ddp_config=ddp_config)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True), [model])
    return model, opt


@contextmanager
def _recording_impls():
    """Record the implementations ``loco_megatron.kernels.compress_bucket`` and
    ``decompress_shard`` are called with (compensator.py and collectives.py look them up on the
    module at each call)."""
    from loco_megatron import kernels

    ran = {"compress": set(), "decompress": set()}
    saved = kernels.compress_bucket, kernels.decompress_shard

    def compress(impl, *a, **k):
        ran["compress"].add(impl)
        return saved[0](impl, *a, **k)

    def decompress(impl, *a, **k):
        ran["decompress"].add(impl)
        return saved[1](impl, *a, **k)

    kernels.compress_bucket, kernels.decompress_shard = compress, decompress
    try:
        yield ran
    finally:
        kernels.compress_bucket, kernels.decompress_shard = saved


def _train(rank: int, world: int, mode: str, dims: Dict, meter: "_Meter") -> Dict:
    """Train ``dims["steps"]`` steps (``mode``: "stock" or "loco<bits>-<kernels>"), measured."""
    import loco_megatron
    from loco_megatron import kernels

    cuda = meter.cuda
    meter.reset_peak()
    start = meter.current()
    state = None
    if mode != "stock":
        bits, kern = mode[4:].split("-")
        state = loco_megatron.install(loco_megatron.LoCoConfig(bits=int(bits), kernels=kern))
    try:
        model, opt = _build(dims, cuda)
        device = "cuda" if cuda else "cpu"
        gen = torch.Generator().manual_seed(100 + rank)
        b, seq = dims["batch"], dims["seq"]
        position = torch.arange(seq, device=device).unsqueeze(0).expand(b, -1)
        mask = torch.tril(torch.ones(1, 1, seq, seq, device=device)) < 0.5
        run_peak, syncs, losses = meter.peak(), [], []
        with _recording_impls() as ran:
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
                peak, after = meter.peak(), meter.current()
                syncs.append({"before": before, "peak": peak, "after": after,
                              "peak_above_before": peak - before, "retained": after - before})
                run_peak = max(run_peak, peak)
                meter.reset_peak()
                opt.step()
                losses.append(float(loss))
        run_peak = max(run_peak, meter.peak())
        active = state is not None and state.active
        buckets = [(b.grad_data.numel(), b.grad_data.element_size(),
                    state.layout_for(b, world) if active else None,
                    kernels.select(state.config.kernels, b.grad_data) if active else None)
                   for g in model.bucket_groups for b in g.buckets]
        return {"mode": mode, "measure": meter.kind, "run_peak": run_peak - start, "start": start,
                "syncs": syncs, "losses": losses, "steps": dims["steps"],
                "ran": {k: sorted(v) for k, v in ran.items()},
                "error_bytes": state.compensator.error_bytes() if active else 0,
                "wire_bytes": state.wire.bytes_sent if active else 0,
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
    from tests.helpers.multiproc import run_ranks

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


def reduce_scatter_probe(numel: int, cuts: Tuple[int, ...], bits: int, kernels: str = "auto",
                         dtype: str = "float32", telemetry: bool = False) -> Dict:
    """Measure (resident-set peak) one steady-state ``compensated_reduce_scatter`` of a bucket
    on a 1-rank gloo group in this process (compress, all-to-all, decompress; the shard is the
    whole bucket), against :func:`loco_memory_formula`. Meant for a fresh process started with
    ``MALLOC_MMAP_THRESHOLD_`` (tests/benchmarks/test_bench_memory.py); runs ``init_process_group``.
    ``telemetry``: with ``StepMetrics`` attached (``LoCoState.enable_metrics()``)."""
    import tempfile

    import torch.distributed as dist

    from loco_megatron import LoCoConfig
    from loco_megatron import kernels as K
    from loco_megatron.collectives import compensated_reduce_scatter
    from loco_megatron.compensator import Compensator

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/rdv",
                                rank=0, world_size=1)
    exact_malloc()
    layout = BucketLayout.build(numel, 1, 256, cuts)
    comp = Compensator(LoCoConfig(bits=bits, kernels=kernels))
    if telemetry:
        from loco_megatron.collectives import WireStats
        from loco_megatron.metrics import StepMetrics

        comp.metrics = StepMetrics(WireStats())
    x = torch.randn(numel).to(getattr(torch, dtype))
    payload, scales = comp.compress("b", x, layout)  # error buffer, C build, block table
    wire = payload.numel() + 4 * scales.numel()
    del payload, scales
    compensated_reduce_scatter(x, x, compensator=comp, key="b", layout=layout)  # warms gloo
    dist.barrier()  # gloo's worker thread has released the warm-up's tensors
    meter = _Meter(False)
    meter.reset_peak()
    before = meter.current()
    compensated_reduce_scatter(x, x, compensator=comp, key="b", layout=layout)
    peak = meter.peak() - before
    impl = K.select(kernels, x)
    f = loco_memory_formula(layout, x.element_size(), bits, 256, impl=impl,
                            fp16=dtype == "float16", telemetry=telemetry)
    return {"impl": impl, "peak": peak, "formula": f["transient_peak"],
            "peak_phase": f["peak_phase"], "phase_bytes": f["phase_bytes"],
            "error_bytes": comp.error_bytes(), "persistent": f["persistent"], "wire": wire,
            "formula_wire": f["wire"], "identity": layout.is_identity}
