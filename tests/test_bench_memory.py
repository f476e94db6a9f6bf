"""benchmarks/memory.py: the memory formula against LoCo's exact persistent state and against
the measured peak of the compressed path (a fresh process, no ranks: fast)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def probes():
    """Both bit widths measured in one fresh process (its large tensors are all mmapped, so
    the first probe leaves nothing resident for the second to reuse)."""
    code = ("import json; from benchmarks.memory import compress_probe; "
            "print(json.dumps({b: compress_probe(3_000_000, 2, (1000, 777_777, 2_000_001), b) "
            "for b in (4, 8)}))")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status, glibc")
@pytest.mark.parametrize("bits", [4, 8])
def test_compress_memory_matches_formula(bits, probes):
    """Persistent state exactly ``error_bytes()``; measured peak resident memory of
    ``to_padded`` + ``Compensator.compress`` within 5% of the formula's compress phases; the
    formula's wire buffers are what compress returns."""
    r = probes[bits]
    assert not r["identity"]
    assert r["error_bytes"] == r["persistent"]
    assert r["peak"] == pytest.approx(r["formula_compress"], rel=0.05)
    assert r["wire"] == r["formula_wire"]


def test_formula_identity_layout_needs_no_copy():
    from benchmarks.memory import loco_memory_formula
    from loco_megatron.layout import BucketLayout

    ident = BucketLayout.build(4096, 2, 256)
    assert ident.is_identity
    fp32 = loco_memory_formula(ident, 4, 4, 256)
    bf16 = loco_memory_formula(ident, 2, 4, 256)
    assert bf16["transient_peak"] - fp32["transient_peak"] == 4096 * 4
    assert fp32["persistent"] == 4096 + 4096 // 256 * 4
