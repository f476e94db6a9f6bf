"""Static performance figures from SASS (loco_megatron/kernels/sass_figures.py, docs/kernels.md):
the clean path a warp issues (a slow path's call set-up cold, a loop's body once per trip),
occupancy from registers, and the issue ceiling, on hand-written SASS: no Triton, no GPU.
Planted: a loop counted once, a slow path counted hot, nested loops."""

import pytest

from loco_megatron.kernels import sass_figures as sf

SASS = """
        .type           _k,@function
_k:
.text._k:
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;
.L_x_0:
        /*0020*/                   MUFU.RCP R3, R2 ;
        /*0030*/                   FCHK P0, R1, R2 ;
        /*0040*/               @!P0 BRA `(.L_x_1) ;
        /*0050*/                   MOV R6, R1 ;
        /*0060*/                   CALL.REL.NOINC `($__internal_0_$__cuda_sm3x_div_rn_noftz_f32_slowpath) ;
.L_x_1:
        /*0070*/                   FADD R1, R1, R3 ;
        /*0080*/                   ISETP.GE.AND P1, PT, R0, 0x8, PT ;
        /*0090*/               @!P1 BRA `(.L_x_0) ;
        /*00a0*/                   STG.E desc[UR4][R4.64], R1 ;
        /*00b0*/                   EXIT ;
.L_x_2:
        /*00c0*/                   BRA `(.L_x_2);
        /*00d0*/                   NOP;
$__internal_0_$__cuda_sm3x_div_rn_noftz_f32_slowpath:
        /*00e0*/                   FFMA R0, R1, R2, R3 ;
        /*00f0*/                   RET.REL.NODEC R20 `(_k) ;
"""


def test_hot_path_counts_a_loop_per_trip_and_leaves_the_slow_path_out():
    # straight: S2R, LDG, STG, EXIT (the BRA to itself after it is never issued); body: RCP,
    # FCHK, BRA, FADD, ISETP, BRA
    assert sf.hot_path(SASS, "_k") == (4, 6)
    # per element: 1 warp, 8 trips over 256 elements
    assert sf.per_element(4, 6, 8, 1, 256) == pytest.approx((4 + 48) / 256)
    # planted: the call set-up is hot once its branch is gone
    assert sf.hot_path(SASS.replace("@!P0 BRA `(.L_x_1) ;", "NOP ;"), "_k") == (4, 7)
    with pytest.raises(ValueError, match="no function '_other'"):
        sf.hot_path(SASS, "_other")


def test_nested_loops_are_refused():
    nested = SASS.replace("        /*00a0*/                   STG.E",
                          "        /*009c*/                   BRA `(.L_x_0) ;\n"
                          "        /*00a0*/                   STG.E")
    nested = nested.replace(".L_x_0:\n        /*0020*/",
                            ".L_x_0:\n        /*0018*/                   NOP ;\n"
                            ".L_x_3:\n        /*0020*/")
    nested = nested.replace("@!P1 BRA `(.L_x_0) ;", "@!P1 BRA `(.L_x_3) ;")
    with pytest.raises(ValueError, match="nested loops"):
        sf.hot_path(nested, "_k")


def test_occupancy_and_issue_ceiling():
    h100, a100 = sf.ARCHS[90], sf.ARCHS[80]
    # 136 registers, 4-warp programs: 3 programs (12 warps) per SM; 64 registers, 1 warp: the
    # 32-program limit; shared memory limits too
    assert sf.warps_per_sm(136, 4, 128, h100) == 12
    assert sf.warps_per_sm(64, 1, 0, h100) == 32
    assert sf.warps_per_sm(32, 4, 100000, a100) == 4
    # 4.0 warp-instructions per element on H100: 132 SMs * 4 * 1.98 GHz / 4 elements/s
    assert sf.issue_ceiling(4.0, h100) == pytest.approx(2.6136e11)


def test_budgets_apply_to_the_default_gradient_path():
    b = {"B": sf.DEFAULT_BLOCK}
    assert sf.budget("compress", "compress grad b4 bf16 ...", {**b, "BITS": 4,
                                                               "INT8_ERR": True}) == 1.2
    assert sf.budget("compress", "compress grad b4 bf16 ...", {"B": 2, "BITS": 4,
                                                               "INT8_ERR": True}) is None
    assert sf.budget("compress", "compress grad b8 fp32", {**b, "BITS": 8, "INT8_ERR": True}) \
        is None
    assert sf.budget("decompress", "decompress grad b4", {**b, "BITS": 4}) == 0.6
    assert sf.budget("decompress", "decompress grad b8", {**b, "BITS": 8, "world": 1}) is None
    assert sf.budget("compress", "compress weightdiff b4", {**b, "BITS": 4,
                                                            "INT8_ERR": False}) is None
    # CI's guards: the budget where it is met, never looser than 3% over today's figure
    assert sf.guard("decompress", "decompress grad b4", {**b, "BITS": 4}) == 0.6
    assert sf.BUDGETS["compress"] <= sf.guard("compress", "compress grad b4", {
        **b, "BITS": 4, "INT8_ERR": True}) <= 1.65
    # compress bf16, int8 error, 4 bits: 2 + 2 + 0.5 B; decompress 4 bits to bf16 at 8 ranks
    assert sf.hbm_bytes_per_element("compress", {"BITS": 4, "INT8_ERR": True},
                                    {"g_ptr": "*bf16"}) == 4.5
    assert sf.hbm_bytes_per_element("decompress", {"BITS": 4}, {"out_ptr": "*i16"}) == 0.75


def test_fused_apply_moves_at_most_6_bytes_per_bf16_element():
    """The weight-difference apply (kernels.apply_chunks: the decompress kernel accumulating
    into the parameters) reads 0.5 B of codes and reads and writes 2 B of bf16 parameter per
    element at 4 bits: 4.5 B, where decode-to-fp32 then float/add/copy moved 28.5 B."""
    from loco_megatron.kernels.variants import block_variants

    apply = [v for v in block_variants(sf.DEFAULT_BLOCK) if v.kernel == "decompress"
             and "weightdiff" in v.name and "out=bf16" in v.name]
    assert len(apply) == 1 and apply[0].constexprs["ACCUMULATE"]
    assert sf.hbm_bytes_per_element("decompress", apply[0].constexprs, apply[0].signature) \
        == 4.5 <= 6
