"""Section 2: compression throughput of the hot path, per implementation (loco_megatron/kernels).

GB/s of gradient processed (bucket elements x the gradient dtype's bytes, per second) for the
compress pass (compensate + quantize + pack + error update) and the decompress pass (unpack +
dequantize + sum of ``world`` received chunks into the shard), on one CPU thread (as a training
rank runs: OMP_NUM_THREADS=1) and, where CUDA is present, on the GPU with the GPU's measured
device-to-device copy bandwidth for the ratio. Timed with ``torch.utils.benchmark``.
"""

import os
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils import benchmark as tbench

from loco_megatron import kernels
from loco_megatron.compensator import ErrorBuffer
from loco_megatron.layout import BucketLayout

from .report import Section

WORLD = 8  # chunks summed by decompress (a DP-8 bucket)
BLOCK = 256


def _setup(numel, dtype, device):
    layout = BucketLayout.build(numel, WORLD, BLOCK)
    table = kernels.block_table(layout, device)
    err = ErrorBuffer(table.padded_numel, BLOCK, "int8", torch.float32, device, table.spans)
    g = torch.randn(numel, device=device).to(dtype)
    return table, err, g


def measure(impl, numel, dtype, device, min_time):
    """(compress GB/s, decompress GB/s) of ``impl`` on a bucket of ``numel`` elements."""
    table, err, g = _setup(numel, dtype, device)

    def compress():
        return kernels.compress_bucket(impl, g, table, err, bits=4, beta=0.8, reset=False,
                                       want_err_sq=False)

    payload, scales = compress()[:2]
    out = torch.empty(table.shard, dtype=dtype, device=device)

    def decompress():
        kernels.decompress_shard(impl, payload, scales, table, 0, bits=4, average=False, out=out)

    nbytes = numel * g.element_size()
    res = []
    for fn in (compress, decompress):
        t = tbench.Timer("fn()", globals={"fn": fn}, num_threads=1).blocked_autorange(
            min_run_time=min_time)
        res.append(nbytes / t.median / 1e9)
    return res


def copy_bandwidth(numel, device, min_time):
    """GB/s of a same-device tensor copy (bytes read + written)."""
    x = torch.randn(numel, device=device)
    y = torch.empty_like(x)
    t = tbench.Timer("y.copy_(x)", globals={"x": x, "y": y}, num_threads=1).blocked_autorange(
        min_run_time=min_time)
    return 2 * x.numel() * 4 / t.median / 1e9


def static_ceiling(dtype: torch.dtype, capability: int, average: bool = False):
    """``(compress, decompress)`` GB/s of gradient (the unit :func:`measure` reports) at the
    issue ceiling of the Triton variants :func:`measure` launches, compiled for
    ``sm_<capability>`` (no GPU needed; ``loco_megatron.kernels.sass_figures``): the figure a
    measured one can reach at most while the kernel is issue-bound. ``average``: the
    decompress divides by the DP size (AVG, as benchmarks/gpu_check.py measures it)."""
    from loco_megatron.kernels import sass_figures, triton_kernels as tk
    from loco_megatron.kernels.compile_check import compile_variant
    from loco_megatron.kernels.launch import launch_config
    from loco_megatron.kernels.variants import _compress, _decompress

    name = str(dtype).split(".")[1].replace("float32", "fp32").replace("bfloat16", "bf16")
    out = []
    for v, fn in ((_compress(BLOCK, 4, name, "symmetric", "int8", True, False),
                   tk._compress_kernel), (_decompress(BLOCK, 4, name, average), tk._decompress_kernel)):
        r = compile_variant(fn, v.signature, v.constexprs, capability, v.num_warps)
        f = sass_figures.variant_figures(v.kernel, v.constexprs, v.signature, v.num_warps,
                                         BLOCK, launch_config(BLOCK).ntiles, r.pop("sass"),
                                         r["registers"], r["shared"], capability)
        out.append(f["ceiling"] * torch.empty((), dtype=dtype).element_size() / 1e9)
    return tuple(out)


def static_apply_ceiling(dtype: torch.dtype, capability: int) -> float:
    """GB/s of parameters (``dtype``: fp32 or bf16) at the issue ceiling of the fused
    weight-difference apply (``kernels.apply_chunks``: the decompress kernel with ``world ==
    1``, accumulating into the parameters), compiled for ``sm_<capability>`` without a GPU."""
    from loco_megatron.kernels import sass_figures, triton_kernels as tk
    from loco_megatron.kernels.compile_check import compile_variant
    from loco_megatron.kernels.launch import launch_config
    from loco_megatron.kernels.variants import _decompress

    name = str(dtype).split(".")[1].replace("float32", "fp32").replace("bfloat16", "bf16")
    v = _decompress(BLOCK, 4, name, False, world="constexpr", tag="weightdiff", accumulate=True)
    r = compile_variant(tk._decompress_kernel, v.signature, v.constexprs, capability,
                        v.num_warps)
    f = sass_figures.variant_figures(v.kernel, v.constexprs, v.signature, v.num_warps, BLOCK,
                                     launch_config(BLOCK).ntiles, r.pop("sass"), r["registers"],
                                     r["shared"], capability)
    return f["ceiling"] * torch.empty((), dtype=dtype).element_size() / 1e9


_INTERPRETED = r"""
import os, sys, time, torch
os.environ["TRITON_INTERPRET"] = "1"
from benchmarks.throughput import measure
print(*measure("triton", int(sys.argv[1]), torch.float32, "cpu", 0.5))
"""


def _interpreted_triton(numel):
    """Triton on CPU exists only as the interpreter (a correctness tool): measured in a child
    process (the interpreter must be chosen before Triton decorates the kernels)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED, str(numel)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=root)
    if proc.returncode:
        return None
    return [float(x) for x in proc.stdout.split()[-2:]]


def run(quick: bool, workdir: Path) -> Section:
    torch.manual_seed(0)
    numel = (1 << 20) if quick else (1 << 24)
    min_time = 0.3 if quick else 2.0
    rows, data = [], {"numel": numel, "world": WORLD, "block": BLOCK, "bits": 4, "threads": 1}
    cpu_copy = copy_bandwidth(numel, "cpu", min_time)
    data["cpu_copy_GBps"] = cpu_copy
    for dtype in (torch.float32, torch.bfloat16):
        for impl in ("torch", "cpu"):
            c, d = measure(impl, numel, dtype, "cpu", min_time)
            data[f"cpu/{impl}/{dtype}"] = {"compress_GBps": c, "decompress_GBps": d}
            rows.append(("CPU, 1 thread", impl, str(dtype).split(".")[1], numel, c, d,
                         c / cpu_copy, d / cpu_copy))
    small = 1 << 16
    interp = _interpreted_triton(small)
    if interp is not None:
        data["cpu/triton-interpreted/float32"] = {"numel": small, "compress_GBps": interp[0],
                                                  "decompress_GBps": interp[1]}
        rows.append(("CPU (TRITON_INTERPRET=1)", "triton", "float32", small, *interp,
                     interp[0] / cpu_copy, interp[1] / cpu_copy))
    gpu_note = "No GPU in this run: the GPU rows are missing."
    if torch.cuda.is_available():
        gnumel = 1 << 26
        gcopy = copy_bandwidth(gnumel, "cuda", min_time)
        data["gpu"] = torch.cuda.get_device_name(0)
        data["gpu_copy_GBps"] = gcopy
        major, minor = torch.cuda.get_device_capability(0)
        ceilings = []
        for dtype in (torch.float32, torch.bfloat16):
            for impl in ("torch", "triton"):
                c, d = measure(impl, gnumel, dtype, "cuda", min_time)
                data[f"gpu/{impl}/{dtype}"] = {"compress_GBps": c, "decompress_GBps": d}
                rows.append((data["gpu"], impl, str(dtype).split(".")[1], gnumel, c, d,
                             c / gcopy, d / gcopy))
            try:
                sc, sd = static_ceiling(dtype, 10 * major + minor)
                data[f"gpu/static_ceiling/{dtype}"] = {"compress_GBps": sc, "decompress_GBps": sd}
                ceilings.append(f"{str(dtype).split('.')[1]} {sc:.0f} / {sd:.0f} GB/s")
            except Exception as e:  # noqa: BLE001 - an architecture without figures
                ceilings.append(f"{str(dtype).split('.')[1]} n/a ({type(e).__name__}: {e})")
        gpu_note = (f"GPU copy bandwidth (read + write): {gcopy:.0f} GB/s. Triton's static issue "
                    f"ceiling (compile check, compress / decompress): {'; '.join(ceilings)}.")
    md = [f"4-bit, block {BLOCK}, int8 error buffer, beta 0.8; decompress sums {WORLD} chunks "
          f"(DP {WORLD}). GB/s = gradient elements x gradient dtype bytes / median time. "
          f"CPU copy bandwidth (read + write, 1 thread): {cpu_copy:.1f} GB/s. {gpu_note}", "",
          "| device | implementation | gradient dtype | elements | compress GB/s | "
          "decompress GB/s | compress / copy bw | decompress / copy bw |",
          "|---|---|---|---|---|---|---|---|"]
    for dev, impl, dt, n, c, d, rc, rd in rows:
        md.append(f"| {dev} | {impl} | {dt} | {n:,} | {c:.3f} | {d:.3f} | {rc:.3f} | {rd:.3f} |")
    ref = data["cpu/torch/torch.float32"]
    fused = data["cpu/cpu/torch.float32"]
    md += ["", f"C kernel vs torch reference on CPU (fp32): compress "
               f"{fused['compress_GBps'] / ref['compress_GBps']:.1f}x, decompress "
               f"{fused['decompress_GBps'] / ref['decompress_GBps']:.1f}x."]
    return Section("throughput", "Compression throughput", "\n".join(md), data)
