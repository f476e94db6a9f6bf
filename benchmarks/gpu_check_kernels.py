"""Steps 1 and 2 of the GPU check (docs/gpu_check.md), run in a child process of
``benchmarks/gpu_check.py``:

* ``throughput``: Triton compress/decompress/apply GB/s on fp32 and bf16 buckets of the given sizes
  (4-bit, block 256, DP-8 table layout, int8 error buffer, beta 0.8; the buckets of
  ``benchmarks/throughput.py``) and the device's copy bandwidth, CUDA-event timed after warm-up;
* ``kernels``: the Triton kernels against the torch reference on CUDA tensors (and on CPU):
  payload, scales and the int8 error buffer bit for bit over several steps (a reset among them),
  4 and 8 bits, fp32 and bf16, each quantizer grid ``compress_bucket`` offers; the decompressed
  shard within fp32 rounding.

    python -m benchmarks.gpu_check_kernels throughput|kernels --json PATH

The JSON file is rewritten after every row / case, so a step killed at its timeout still
reports what it measured. The functions take ``impl`` and ``device`` so that they also run on
CPU (the C kernels) in the unit tests; the command line refuses to run without CUDA.
"""

import argparse
import inspect
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from loco_megatron import kernels
from loco_megatron.error_buffer import ErrorBuffer
from loco_megatron.layout import BucketLayout
from loco_megatron.quantization import dequantize_spans, unpack_codes

from .throughput import BLOCK, WORLD, _setup, static_apply_ceiling, static_ceiling

MiB = 1 << 20
BITS = 4
BETA = 0.8
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# correctness: a DP-8 bucket with parameter boundaries (blocks padded at every cut)
CHECK_NUMEL = WORLD * 5000
CHECK_BOUNDARIES = (1234, 7777, 20001, 33333)
CHECK_STEPS = 5
CHECK_RESET_STEP = 2


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_call(fn, device, min_s=0.2, warmup=2, max_iters=50):
    """(median seconds per call, seconds of the first call incl. compilation, calls timed)."""
    t0 = time.perf_counter()
    fn()
    _sync(device)
    first = time.perf_counter() - t0
    for _ in range(warmup - 1):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    one = time.perf_counter() - t0
    n = max(5, min(max_iters, math.ceil(min_s / max(one, 1e-6))))
    if torch.device(device).type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(n)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) / 1e3 for start, end in events]
    else:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times), first, n


def copy_bandwidth(device, nbytes=256 * MiB, min_s=0.2):
    """GB/s of a same-device fp32 tensor copy, bytes read + written (as benchmarks/throughput)."""
    x = torch.randn(nbytes // 4, device=device)
    y = torch.empty_like(x)
    t, _, n = time_call(lambda: y.copy_(x), device, min_s)
    return {"GBps": 2 * nbytes / t / 1e9, "bytes": nbytes, "calls": n}


def traffic_bytes(table, elem, bits=BITS):
    """Modelled device-memory bytes of one compress / one decompress / one apply call (int8
    error buffer): compress reads the gradient, reads and writes the error codes and scales,
    writes the payload and its scales; decompress reads the ``world`` chunks of one shard and
    writes the shard; the weight-difference apply (``kernels.apply_chunks``) reads every
    chunk's codes and scales and reads and writes the whole bucket of parameters."""
    padded, nblocks = table.padded_numel, table.nblocks
    compress = table.numel * elem + 2 * padded + 2 * 4 * nblocks + padded * bits // 8 + 4 * nblocks
    decompress = padded * bits // 8 + 4 * nblocks + table.shard * elem
    apply = padded * bits // 8 + 4 * nblocks + 2 * table.numel * elem
    return compress, decompress, apply


def measure_bucket(mib, dtype, impl="triton", device="cuda", min_s=0.2):
    """One row: compress and decompress of a ``mib`` MiB bucket of ``dtype`` gradients."""
    elem = torch.empty((), dtype=dtype).element_size()
    numel = mib * MiB // elem // WORLD * WORLD
    table, err, g = _setup(numel, dtype, device)
    state = {}

    def compress():
        state["out"] = kernels.compress_bucket(impl, g, table, err, bits=BITS, beta=BETA,
                                               reset=False, want_err_sq=False)

    tc, first_c, nc = time_call(compress, device, min_s)
    payload, scales = state.pop("out")[:2]
    out = torch.empty(table.shard, dtype=dtype, device=device)

    def decompress():
        kernels.decompress_shard(impl, payload, scales, table, 0, bits=BITS, average=True,
                                 out=out)

    td, first_d, nd = time_call(decompress, device, min_s)
    params = torch.zeros(numel, dtype=dtype, device=device)  # a bucket's param_data

    def apply():  # every rank's chunk of the payload, as the parameter all-gather delivers it
        kernels.apply_chunks(impl, payload, scales, table, bits=BITS, out=params)

    ta, first_a, na = time_call(apply, device, min_s)
    bc, bd, ba = traffic_bytes(table, elem)
    nbytes = numel * elem
    return {"dtype": str(dtype).split(".")[1], "MiB": mib, "numel": numel,
            "compress_ms": tc * 1e3, "compress_GBps": nbytes / tc / 1e9,
            "compress_traffic_GBps": bc / tc / 1e9, "compress_first_call_s": first_c,
            "decompress_ms": td * 1e3, "decompress_GBps": nbytes / td / 1e9,
            "decompress_traffic_GBps": bd / td / 1e9, "decompress_first_call_s": first_d,
            "apply_ms": ta * 1e3, "apply_GBps": nbytes / ta / 1e9,
            "apply_traffic_GBps": ba / ta / 1e9, "apply_first_call_s": first_a,
            "calls": [nc, nd, na]}


def grid_kwargs():
    """``[{}]`` when ``compress_bucket`` has no ``grid`` keyword, else one ``{"grid": g}`` per
    grid (loco_megatron.config.GRIDS, or the two known ones)."""
    if "grid" not in inspect.signature(kernels.compress_bucket).parameters:
        return [{}]
    from loco_megatron import config
    return [{"grid": g} for g in getattr(config, "GRIDS", ("symmetric", "full-range"))]


def _compress_run(impl, device, layout, bits, dtype, gkw):
    """Per step (CPU copies): payload, scales, non-finite count, error codes, error scales."""
    table = kernels.block_table(layout, device)
    err = ErrorBuffer(table.padded_numel, layout.block_size, "int8", torch.float32, device,
                      table.spans)
    gen = torch.Generator().manual_seed(11)
    steps = []
    for step in range(CHECK_STEPS):
        g = (torch.randn(layout.numel, generator=gen) * 10.0 ** (step - 2)).to(dtype).to(device)
        payload, scales, nonfinite = kernels.compress_bucket(
            impl, g, table, err, bits=bits, beta=BETA, reset=step == CHECK_RESET_STEP,
            want_err_sq=True, **gkw)[:3]
        steps.append({"payload": payload.cpu(), "scales": scales.cpu(),
                      "nonfinite": int(nonfinite), "error codes": err.codes.cpu(),
                      "error scales": err.scales.cpu()})
    return steps


def _references(device):
    """The torch reference on ``device`` and, for a GPU, also on CPU (IEEE division there)."""
    return [("torch", device)] + ([("torch", "cpu")] if torch.device(device).type != "cpu" else [])


def first_mismatch(ref, got):
    """None when every step's tensors are equal bit for bit, else what differs first."""
    for step, (r, g) in enumerate(zip(ref, got)):
        for field in ("payload", "scales", "error codes", "error scales", "nonfinite"):
            a, b = r[field], g[field]
            if field == "nonfinite":
                if a != b:
                    return f"step {step}: non-finite blocks {b} vs {a}"
                continue
            if a.shape != b.shape:
                return f"step {step}: {field} shape {tuple(b.shape)} vs {tuple(a.shape)}"
            # bit patterns: NaN == NaN, -0.0 != 0.0
            ai = a.view(torch.int32) if a.dtype == torch.float32 else a
            bi = b.view(torch.int32) if b.dtype == torch.float32 else b
            if not torch.equal(ai, bi):
                n = int((ai != bi).sum())
                return f"step {step}: {field} differ at {n} of {a.numel()}"
    if len(ref) != len(got):
        return f"{len(got)} steps vs {len(ref)}"
    return None


def decompress_check(impl, device, layout, bits, dtype, payload, scales):
    """Every rank's shard by ``impl`` on ``device`` against the torch reference there and on
    CPU: elements bit-equal, max |diff|, and whether each is within the fp32 rounding bound
    ``(world + 1) 2^-24 sum_r |chunk_r|`` (/ world: AVG) plus one ulp of the output dtype."""
    table = kernels.block_table(layout, device)
    table_cpu = kernels.block_table(layout, "cpu")
    world, shard = layout.world, layout.shard
    codes, K = unpack_codes(payload.cpu(), bits), table_cpu.blocks_per_shard
    res = {"elements": 0, "equal": 0, "max_abs_diff": 0.0, "within_bound": True}
    for rank in range(world):
        # the chunks as rank ``rank`` reads them: its shard's blocks, once per sender
        spans = table_cpu.spans[rank * K:(rank + 1) * K].repeat(world)
        absum = dequantize_spans(codes, scales.cpu(), spans).abs() \
            .view(world, layout.padded_shard).sum(dim=0)
        got = torch.empty(shard, dtype=dtype, device=device)
        kernels.decompress_shard(impl, payload.to(device), scales.to(device), table, rank,
                                 bits=bits, average=True, out=got)
        got = got.cpu().float()
        bound = torch.empty(shard, dtype=torch.float32)
        layout.from_padded_shard(absum, rank, bound)
        bound = bound * ((world + 1) * 2.0 ** -24 / world)
        for ref_impl, ref_dev in _references(device):
            ref = torch.empty(shard, dtype=dtype, device=ref_dev)
            kernels.decompress_shard(ref_impl, payload.to(ref_dev), scales.to(ref_dev),
                                     table if ref_dev == device else table_cpu, rank, bits=bits,
                                     average=True, out=ref)
            ref = ref.cpu().float()
            ulp = ref.abs() * (2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -23)
            diff = (got - ref).abs()
            res["elements"] += shard
            res["equal"] += int((got.view(torch.int32) == ref.view(torch.int32)).sum())
            res["max_abs_diff"] = max(res["max_abs_diff"], float(diff.max()) if shard else 0.0)
            res["within_bound"] &= bool((diff <= bound + ulp).all())
    return res


def check_case(bits, dtype, gkw, impl="triton", device="cuda"):
    """One case: ``impl`` on ``device`` against the torch reference on ``device`` and on CPU."""
    layout = BucketLayout.build(CHECK_NUMEL, WORLD, BLOCK, CHECK_BOUNDARIES)
    got = _compress_run(impl, device, layout, bits, dtype, gkw)
    case = {"bits": bits, "dtype": str(dtype).split(".")[1], "error_storage": "int8",
            "grid": gkw.get("grid"), "steps": CHECK_STEPS, "compress": {}}
    for ref_impl, ref_dev in _references(device):
        ref = _compress_run(ref_impl, ref_dev, layout, bits, dtype, gkw)
        diff = first_mismatch(ref, got)
        case["compress"][f"vs {ref_impl} on {ref_dev}"] = diff or "bit-identical"
    last = got[-1]
    case["decompress"] = decompress_check(impl, device, layout, bits, dtype, last["payload"],
                                          last["scales"])
    case["ok"] = (all(v == "bit-identical" for v in case["compress"].values())
                  and case["decompress"]["within_bound"])
    return case


def _write(path, data):
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def run_throughput(path, sizes_mib, impl="triton", device="cuda", copy_mib=256):
    data = {"impl": impl, "bits": BITS, "block": BLOCK, "world": WORLD, "beta": BETA,
            "error_storage": "int8", "rows": [], "errors": []}
    data["copy"] = copy_bandwidth(device, copy_mib * MiB)
    _write(path, data)
    for dtype in DTYPES.values():
        for mib in sizes_mib:
            try:
                data["rows"].append(measure_bucket(mib, dtype, impl, device))
            except Exception as exc:  # e.g. out of memory: report it, measure the rest
                data["errors"].append(f"{mib} MiB {dtype}: {type(exc).__name__}: {exc}"[:500])
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
            _write(path, data)
    if impl == "triton":  # beside the measured figures: the compile check's issue ceiling
        data["static_ceiling"] = static_ceilings(device)
        _write(path, data)
    return data


def static_ceilings(device, capability=None):
    """``{"arch", dtype name: {"compress_GBps", "decompress_GBps", "apply_GBps"}}``: the static
    issue ceilings (:func:`benchmarks.throughput.static_ceiling`, AVG decompress;
    :func:`benchmarks.throughput.static_apply_ceiling`) for ``device``'s
    capability (``capability`` overrides it), or ``{"error": why}``."""
    try:
        if capability is None:
            major, minor = torch.cuda.get_device_capability(torch.device(device))
            capability = 10 * major + minor
        out = {"arch": f"sm_{capability}"}
        for name, dtype in DTYPES.items():
            c, d = static_ceiling(dtype, capability, average=True)
            out[name] = {"compress_GBps": c, "decompress_GBps": d,
                         "apply_GBps": static_apply_ceiling(dtype, capability)}
        return out
    except Exception as exc:  # noqa: BLE001 - reported: no Triton, an architecture unknown
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def run_correctness(path, impl="triton", device="cuda"):
    grids = grid_kwargs()
    data = {"impl": impl, "world": WORLD, "block": BLOCK, "numel": CHECK_NUMEL,
            "boundaries": list(CHECK_BOUNDARIES), "beta": BETA, "reset_step": CHECK_RESET_STEP,
            "grids": [g.get("grid") for g in grids], "cases": []}
    for gkw in grids:
        for bits in (4, 8):
            for dtype in DTYPES.values():
                try:
                    case = check_case(bits, dtype, gkw, impl, device)
                except Exception as exc:
                    case = {"bits": bits, "dtype": str(dtype).split(".")[1],
                            "grid": gkw.get("grid"), "ok": False,
                            "error": f"{type(exc).__name__}: {exc}"[:500]}
                data["cases"].append(case)
                _write(path, data)
    return data


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check_kernels")
    p.add_argument("what", choices=("throughput", "kernels"))
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 128, 256, 512])
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("gpu_check_kernels: TRITON_INTERPRET is set; unset it to run the compiled kernels",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu_check_kernels: no CUDA device", file=sys.stderr)
        return 2
    from loco_megatron.emulation import is_active
    probe = torch.empty(1, device="cuda")
    if is_active() or probe.device.type != "cuda":
        print("gpu_check_kernels: the CPU emulation of CUDA is active; refusing", file=sys.stderr)
        return 2
    impl = kernels.select("triton", probe)  # raises with the reason when Triton cannot run
    if args.what == "throughput":
        run_throughput(args.json, args.sizes_mib, impl)
    else:
        run_correctness(args.json, impl)
    return 0


if __name__ == "__main__":
    sys.exit(main())
