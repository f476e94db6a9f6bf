"""benchmarks/memory*.py: the memory formula of both hot-path implementations against LoCo's
exact persistent state and against the measured peak of one compensated reduce-scatter (a fresh
process, one gloo rank: fast), and the section's consistency checks."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.memory_formula import loco_memory_formula
from loco_megatron.layout import BucketLayout

ROOT = Path(__file__).resolve().parents[2]
CUTS = (1000, 777_777, 2_000_001, 2_999_999)
#: (bits, --loco-kernels, gradient dtype, bucket elements, telemetry): the torch reference peaks
#: at ~33 bytes per element, the fused kernel at ~1 (a larger bucket keeps the counters' slack
#: small)
PROBES = [(4, "torch", "float32", 3_000_000, False), (8, "torch", "float32", 3_000_000, False),
          (4, "torch", "float32", 3_000_000, True), (4, "auto", "float32", 8_000_000, False),
          (8, "auto", "float32", 8_000_000, False), (4, "auto", "float16", 8_000_000, False),
          (4, "auto", "bfloat16", 8_000_000, False), (4, "auto", "float32", 8_000_000, True)]
#: /proc's resident-set counters are per-CPU batched: each reading is off by up to
#: percpu_counter_batch - 1 pages per online CPU, a difference of two readings by twice that
_CPUS = os.cpu_count() or 1
SLACK = 2 * _CPUS * (max(32, 2 * _CPUS) - 1) * 4096


def _c_kernel_available() -> bool:
    from loco_megatron.kernels import cpu

    return cpu.unavailable_reason(torch.zeros(1)) is None


@pytest.fixture(scope="module")
def probes():
    """All probes in one fresh process (its large tensors are all mmapped, so one probe leaves
    nothing resident for the next to reuse)."""
    code = ("import json; from benchmarks.memory_measure import reduce_scatter_probe as p; "
            f"print(json.dumps([p(n, {CUTS!r}, b, k, d, t) for b, k, d, n, t in {PROBES!r}]))")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return dict(zip(PROBES, json.loads(out.stdout.strip().splitlines()[-1])))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status, glibc")
@pytest.mark.parametrize("probe", PROBES, ids=lambda p: "-".join(map(str, p[:3]))
                         + ("-telemetry" if p[4] else ""))
def test_reduce_scatter_memory_matches_formula(probe, probes):
    """Persistent state exactly ``error_bytes()``; the wire buffers exactly what compress
    returns; the measured peak of ``compensated_reduce_scatter`` within 2% (+ the counters'
    slack) of the formula of the implementation ``kernels.select`` chose."""
    kernels = probe[1]
    r = probes[probe]
    assert not r["identity"]
    if kernels == "torch":
        assert r["impl"] == "torch"
    elif _c_kernel_available():
        assert r["impl"] == "cpu"
    assert r["error_bytes"] == r["persistent"]
    assert r["wire"] == r["formula_wire"]
    assert abs(r["peak"] - r["formula"]) <= 0.02 * r["formula"] + SLACK, r["phase_bytes"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status, glibc")
def test_measure_tells_the_implementations_apart(probes):
    """Per element, the reference's measured peak is > 25x the fused kernel's, so a formula of
    the wrong implementation fails the comparison above."""
    if not _c_kernel_available():
        pytest.skip("no C compiler: auto runs the torch reference")
    (ref, r), (fused, f) = [(probes[p], p[3]) for p in (PROBES[0], PROBES[3])]
    assert ref["peak"] / r > 25 * fused["peak"] / f
    assert abs(fused["peak"] - ref["formula"] * f / r) > 0.5 * fused["peak"]


def _layout(identity: bool) -> BucketLayout:
    lay = BucketLayout.build(8192, 2, 256, () if identity else (1001, 5001))  # odd: copied
    assert lay.is_identity == identity
    return lay


def test_torch_formula_phases():
    """Identity fp32 layouts need no padded copy; the peak is the 8-bit re-quantization of the
    error (30 bytes/element); fp32 error storage has no re-quantization; beta 0 skips the
    average but keeps err_now next to the new error, so the peak is the same."""
    ident = _layout(True)
    n = 8192
    fp32 = loco_memory_formula(ident, 4, 4, 256, impl="torch")
    bf16 = loco_memory_formula(ident, 2, 4, 256, impl="torch")
    h = "compress: h = to_padded(g) + e"
    assert bf16["phase_bytes"][h] - fp32["phase_bytes"][h] == 4 * n
    assert fp32["persistent"] == n + n // 256 * 4
    assert fp32["peak_phase"] == "compress: 8-bit quantize of new"
    assert 30 <= fp32["transient_peak"] / n < 30.2
    f32err = loco_memory_formula(ident, 4, 4, 256, "fp32", impl="torch")
    assert f32err["persistent"] == 4 * n
    assert not any("8-bit" in name for name in f32err["phase_bytes"])
    no_beta = loco_memory_formula(ident, 4, 4, 256, impl="torch", beta=0.0)
    assert no_beta["transient_peak"] == fp32["transient_peak"]
    assert "compress: new = beta*e + (1-beta)*err" not in no_beta["phase_bytes"]


def test_fused_formula_phases():
    """The fused peak is the wire buffers sent + received (plus a block workspace); the C
    kernel copies fp16 (not bf16) buckets to fp32 and decompresses into an fp32 shard when the
    output is not fp32; Triton does neither; telemetry adds per-block partials (Triton)."""
    lay = _layout(False)
    n, s = lay.world * lay.padded_shard, lay.nblocks  # wire codes, blocks (the last ones short)
    c = loco_memory_formula(lay, 4, 4, 256)
    assert c["impl"] == "fused (C)" and c["wire"] == n // 2 + 4 * s
    assert 0 <= c["transient_peak"] - 2 * c["wire"] <= 4 * 256
    assert c["peak_phase"] == "finish: fused decompress"
    assert loco_memory_formula(lay, 4, 4, 256, impl="cpu")["phases"] == c["phases"]
    fp16 = loco_memory_formula(lay, 2, 4, 256, fp16=True)
    bf16 = loco_memory_formula(lay, 2, 4, 256)
    comp = "compress: fused kernel"
    assert fp16["phase_bytes"][comp] - bf16["phase_bytes"][comp] == 4 * lay.numel
    assert bf16["phase_bytes"]["finish: fused decompress"] - c["transient_peak"] == 4 * lay.shard
    tri = loco_memory_formula(lay, 2, 4, 256, impl="triton", fp16=True)
    assert tri["impl"] == "fused (Triton)"
    assert tri["transient_peak"] - 2 * tri["wire"] < 16
    tele = loco_memory_formula(lay, 4, 4, 256, impl="triton", telemetry=True)
    assert tele["transient_peak"] - 2 * tele["wire"] < 16  # partials: 16 bytes a block at most
    assert not any("squared_norm" in name for name, _ in tele["phases"])
    c_tele = loco_memory_formula(lay, 4, 4, 256, impl="cpu", telemetry=True)
    assert c_tele["phases"] == c["phases"]  # the C kernel sums ||e||^2 in its pass
    with pytest.raises(ValueError):
        loco_memory_formula(lay, 4, 4, 256, impl="cuda")


def _run(mode, impl, ran, wire_bytes, lay, steps=2):
    syncs = [{"peak_above_before": 10, "peak": 100, "retained": 0}] * steps
    return {"mode": mode, "measure": "test", "params": 1, "ran": {"compress": ran,
            "decompress": ran}, "buckets": [(lay.numel, 4, lay, impl)], "steps": steps,
            "wire_bytes": wire_bytes, "error_bytes": 0, "syncs": syncs, "run_peak": 100,
            "start": 0}


def test_compare_checks_implementation_and_wire_bytes():
    """The section refuses a run whose kernel calls were not the implementation
    ``kernels.select`` chose, or whose sent bytes differ from the formula's wire buffers."""
    from benchmarks.memory import compare

    lay = _layout(False)
    wire = 2 * (loco_memory_formula(lay, 4, 4, 256)["wire"] // 2)  # 2 steps, 1 of 2 chunks
    stock = [_run("stock", None, [], 0, lay)] * 2
    ok = [_run("loco4-auto", "cpu", ["cpu"], wire, lay)] * 2
    rows = compare(stock, ok, 4)["rows"]
    assert rows[0]["impl"] == "fused (C)" and rows[0]["wire_bytes"] == wire
    with pytest.raises(RuntimeError, match="kernels.select"):
        compare(stock, [_run("loco4-auto", "cpu", ["torch"], wire, lay)] * 2, 4)
    with pytest.raises(RuntimeError, match="wire buffers"):
        compare(stock, [_run("loco4-auto", "cpu", ["cpu"], wire + 1, lay)] * 2, 4)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_triton_telemetry_formula_follows_the_kernel():
    """The formula has an ``ErrorBuffer.squared_norm()`` phase (an fp32 copy of all int8 codes)
    exactly for the implementations after which the compensator calls it: those returning no
    ``buf_sq`` (the torch reference). Triton returns it (per-block partials), so its telemetry
    formula must not charge the copy (it did: 4.5 instead of ~1 bytes per element)."""
    code = (
        "import torch\n"
        "from loco_megatron import kernels\n"
        "from loco_megatron.compensator import ErrorBuffer\n"
        "from loco_megatron.layout import BucketLayout\n"
        "lay = BucketLayout.build(2048, 2, 256)\n"
        "t = kernels.block_table(lay, 'cpu')\n"
        "err = ErrorBuffer(t.padded_numel, 256, 'int8', torch.float32, 'cpu', t.spans)\n"
        "out = kernels.compress_bucket('triton', torch.randn(2048), t, err, bits=4, beta=0.8,\n"
        "                              reset=False, want_err_sq=True)\n"
        "print(out[4] is not None)\n")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    returns_buf_sq = proc.stdout.strip().splitlines()[-1] == "True"
    lay = _layout(False)
    tele = loco_memory_formula(lay, 4, 4, 256, impl="triton", telemetry=True)
    charged = any("squared_norm" in name for name, _ in tele["phases"])
    assert charged == (not returns_buf_sq)


def test_step_memory_figures_are_the_documented_ones():
    """docs/kernels.md's 7B and 70B memory table is what step_memory_figures computes, and
    the overlap-on bound holds every bucket's send and receive buffers (~1 B per element at
    4 bits) while each-landed equals overlap off (the largest bucket's)."""
    from pathlib import Path

    from benchmarks.memory_formula import step_memory_figures

    doc = (Path(__file__).parents[2] / "docs" / "kernels.md").read_text()
    gib = lambda b: f"{b / 2**30:.2f}"  # noqa: E731
    for r in step_memory_figures():
        row = next(line for line in doc.splitlines() if line.startswith(f"  | {r['model']},"))
        assert f"{r['params'] / 1e9:.2f}e9, {r['buckets']} |" in row, row
        assert (f"{gib(r['persistent'])} GiB ({gib(r['error'])} + {gib(r['tables'])})"
                in row), (row, r)
        assert f"{gib(r['transient_bound'])} GiB / {r['transient_landed'] / 2**20:.0f} MiB" in row
        assert r["transient_landed"] == r["transient_off"] < r["transient_bound"]
        assert 1.0 < r["transient_bound"] / r["params"] < 1.1
