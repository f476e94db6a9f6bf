"""The GPU compile check (loco_megatron/kernels/compile_check.py, docs/kernels.md): the CI subset
of kernel variants compiles for sm_80 and sm_90 with no spills and 64-bit addresses, and the
checker does fail on a kernel that breaks its rules. Compiles need Triton (not a GPU); the
compat legs' CPU-only torch has no Triton, so those tests skip there."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from loco_megatron.config import MAX_BLOCK_SIZE
from loco_megatron.kernels.compile_check import (narrow_address_arithmetic, parse_ptxas,
                                                  unconditional_atomics)
from loco_megatron.kernels.launch import MAX_TILE, TILE_PAIRS, launch_config
from loco_megatron.kernels.variants import CI_BLOCKS, FULL_BLOCKS

try:
    import triton  # noqa: F401
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

NEEDS_TRITON = pytest.mark.skipif(not HAVE_TRITON, reason="Triton not installed (the CPU-only "
                                                          "torch build of the compat legs)")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env():
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def _class(block):
    c = launch_config(block)
    return c.rows, c.tile, c.num_warps, c.ntiles > 1


def test_launch_config_bounds_every_accepted_block_size():
    """Every even block size --loco-block-size accepts: a tile of at most TILE_PAIRS pairs
    that covers the block, and a launch class the full compile check compiles."""
    checked = {_class(b) for b in FULL_BLOCKS}
    assert set(CI_BLOCKS) <= set(FULL_BLOCKS) and {2, MAX_BLOCK_SIZE} <= set(CI_BLOCKS)
    for block in range(2, MAX_BLOCK_SIZE + 1, 2):
        c = launch_config(block)
        assert c.rows * c.tile <= TILE_PAIRS and c.tile <= MAX_TILE, block
        assert c.tile * c.ntiles >= block // 2 > c.tile * (c.ntiles - 1), block
        assert _class(block) in checked, block
    with pytest.raises(ValueError, match="even"):
        launch_config(7)


PTXAS_LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_compress_kernel' for 'sm_90a'
ptxas info    : Function properties for _compress_kernel
    176 bytes stack frame, 17404 bytes spill stores, 17020 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 176 bytes cumulative stack size
"""


def test_ptxas_parser():
    assert parse_ptxas(PTXAS_LOG) == {"registers": 255, "spill_stores": 17404,
                                      "spill_loads": 17020, "stack": 176}
    with pytest.raises(ValueError, match="no register count"):
        parse_ptxas("ptxas fatal   : Unresolved extern function")


TTIR = """
  tt.func public @k(%p: !tt.ptr<f32> loc("p"(#loc)), %chunk: i32 loc("chunk"(#loc)), %world: i32 loc("world"(#loc))) attributes {noinline = false} {
    %c0_i32 = arith.constant 0 : i32 loc(#loc1)
    %c1_i32 = arith.constant 1 : i32 loc(#loc1)
    %j = tt.make_range {end = 8 : i32, start = 0 : i32} : tensor<8xi32> loc(#loc2)
    %j2 = arith.muli %j, %j : tensor<8xi32> loc(#loc2)
    %q = tt.splat %p : !tt.ptr<f32> -> tensor<8x!tt.ptr<f32>> loc(#loc3)
    %q2 = tt.addptr %q, %j2 : tensor<8x!tt.ptr<f32>>, tensor<8xi32> loc(#loc3)
    scf.for %r = %c0_i32 to %world step %c1_i32  : i32 {
      %at = arith.muli %r, %chunk : i32 loc(#loc4)
      %at64 = arith.extsi %at : i32 to i64 loc(#loc4)
      %x = tt.addptr %p, %at64 : !tt.ptr<f32>, i64 loc(#loc5)
    } loc(#loc6)
    tt.return loc(#loc7)
  } loc(#loc)
"""


def test_narrow_address_rule_on_ttir():
    """``r * chunk`` in i32 (loop counter over a runtime bound times an argument) is flagged
    even though it is widened before the pointer add; arithmetic on tl.arange alone is not."""
    assert narrow_address_arithmetic(TTIR) == ["%at = arith.muli %r, %chunk : i32 loc(#loc4)"]
    assert narrow_address_arithmetic(TTIR.replace(": i32 loc(#loc4)", ": i64 loc(#loc4)")) == []


BAD_KERNELS = textwrap.dedent('''
    import json, sys
    import triton
    import triton.language as tl
    from loco_megatron.kernels.compile_check import compile_variant

    @triton.jit
    def narrow(ptr, chunk, world):
        for r in range(world):
            tl.store(ptr + r * chunk, 1.0)

    @triton.jit
    def wide(ptr, chunk, world):
        for r in range(world):
            tl.store(ptr + r.to(tl.int64) * chunk, 1.0)

    @triton.jit
    def spills(ptr, N: tl.constexpr):
        x = tl.load(ptr + tl.arange(0, N))
        tl.store(ptr + tl.arange(0, N), x * tl.sum(x * x, axis=0))

    sig = {"ptr": "*fp32", "chunk": "i32", "world": "i32"}
    out = {}
    for name, fn in (("narrow", narrow), ("wide", wide)):
        out[name] = compile_variant(fn, sig, {}, int(sys.argv[1]))["errors"]
    out["spills"] = compile_variant(spills, {"ptr": "*fp32", "N": "constexpr"}, {"N": 16384},
                                    int(sys.argv[1]), num_warps=1)
    print(json.dumps(out))
''')


@NEEDS_TRITON
def test_checker_fails_on_bad_kernels(tmp_path):
    """A kernel computing ``ptr + r * chunk`` with i32 arguments breaks the 64-bit address
    rule (widening ``r`` first passes); a kernel keeping 16384 floats live in one warp spills."""
    script = tmp_path / "bad_kernels.py"
    script.write_text(BAD_KERNELS)
    proc = subprocess.run([sys.executable, str(script), "90"], env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["narrow"] == ["32-bit address arithmetic"], out
    assert out["wide"] == [], out
    assert out["spills"]["spill_stores"] > 0 and "spills" in out["spills"]["errors"], out


@NEEDS_TRITON
def test_ci_subset_compiles_for_sm80_and_sm90():
    """Every kernel of the CI subset (compress, decompress, weight difference; the extreme
    block sizes; each dtype, both grids) compiles for sm_80 and sm_90 without spills, with
    64-bit addresses and IEEE arithmetic, and the budgeted variants issue no more than their
    CI guard (sass_figures.GUARDS: the decompress's budget, the compress's figure reached)."""
    proc = subprocess.run(
        [sys.executable, "-m", "loco_megatron.kernels.compile_check", "--arch", "sm_80", "sm_90",
         "--subset", "ci", "--jobs", "2", "--guards"],
        env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=1800)
    lines = proc.stdout.strip().splitlines()
    summary = next((x for x in lines if x.startswith("compile_check: ") and " failed" in x), "")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " 0 failed" in summary and "0 B spill stores" in summary, summary
    # every variant's static figures (warp-instructions per element, occupancy, ceiling), and
    # the budget summary (reported: the compress kernel does not reach its budget yet)
    variants = [x for x in lines if x.startswith("ok   ")]
    assert variants and all(re.search(r"; \d+\.\d\d warp-instructions/element, \d+ warps/SM, "
                                      r"issue ceiling \S+ elements/s", x) for x in variants)
    over = next(x for x in lines if "over their warp-instruction budget" in x)
    assert "reported; --budgets enforces" in over, over
    guarded = next(x for x in lines if "over their CI guard" in x)
    assert guarded.startswith("compile_check: 0 variants") and "(enforced)" in guarded, guarded


def test_unconditional_atomics_are_found():
    """The compress kernel's NaN/Inf counter: an atomic masked by the non-finite count passes;
    the same atomic with the constant mask (every program, every step) is reported."""
    masked = ("    %26 = tt.atomic_rmw add, acq_rel, gpu, %flag_ptr, %nbad_150, %25 : "
              "(!tt.ptr<i32>, i32, i1) -> i32 loc(#loc137)")
    always = masked.replace("%25 :", "%true :")
    assert unconditional_atomics(masked) == []
    assert unconditional_atomics(always) == [always[:always.find(" loc(")].strip()]
