"""LoCoConfig validation and the generated --loco-* flags."""

import argparse

import pytest

from loco_megatron.config import LoCoConfig, LoCoConfigError
from loco_megatron.cli.flags import add_loco_args, config_from_args


@pytest.mark.parametrize("kwargs,flag", [
    ({"bits": 3}, "--loco-bits 3"), ({"bits": 2}, "--loco-bits 2"),
    ({"beta": 1.0}, "--loco-err-beta"), ({"beta": -0.1}, "--loco-err-beta"),
    ({"reset_interval": -1}, "--loco-reset-interval"), ({"block_size": 3}, "--loco-block-size"),
    ({"block_size": 0}, "--loco-block-size"), ({"error_dtype": "fp16"}, "--loco-error-dtype"),
    ({"grid": "asymmetric"}, "--loco-grid 'asymmetric' is not one of"),
    ({"grid": 8}, "--loco-grid 8: expected str"),
    ({"start_iter": -1}, "--loco-start-iter"), ({"start_iter": 1.5}, "--loco-start-iter"),
    ({"block_size": 65538}, "--loco-block-size"), ({"block_size": 10 ** 12}, "--loco-block-size"),
    # wrong types (the Python API; flags and YAML values are converted by argparse first)
    ({"beta": "0.8"}, "--loco-err-beta '0.8': expected float or int, got str"),
    ({"bits": 4.0}, "--loco-bits 4.0: expected int or None, got float"),
    ({"bits": True}, "--loco-bits True: expected int or None, got bool"),
    ({"block_size": "256"}, "--loco-block-size '256': expected int"),
    ({"hierarchical": 1}, "--loco-hierarchical takes no value.*got 1"),
])
def test_invalid_values_name_the_flag(kwargs, flag):
    with pytest.raises(LoCoConfigError, match=flag):
        LoCoConfig(**kwargs)


@pytest.mark.parametrize("bits,enabled", [(None, False), (16, False), (32, False), (4, True), (8, True)])
def test_enabled_only_for_low_bits(bits, enabled):
    assert LoCoConfig(bits=bits).enabled is enabled


def _parser():
    return add_loco_args(argparse.ArgumentParser())


def test_flags_round_trip_and_defaults():
    args = _parser().parse_args(["--loco-bits", "4", "--loco-err-beta", "0.5",
                                 "--loco-reset-interval", "10", "--loco-block-size", "128",
                                 "--loco-error-dtype", "fp32", "--loco-start-iter", "7"])
    assert config_from_args(args) == LoCoConfig(bits=4, beta=0.5, reset_interval=10,
                                                block_size=128, error_dtype="fp32", start_iter=7)
    assert config_from_args(_parser().parse_args([])) == LoCoConfig()


def test_namespace_without_loco_flags_gives_defaults():
    """--yaml-cfg replaces Megatron's namespace: missing attributes mean defaults."""
    assert config_from_args(argparse.Namespace(lr=1e-3)) == LoCoConfig()


def test_bad_flag_value_fails_at_parse_time_with_flag_name():
    with pytest.raises(LoCoConfigError, match="--loco-bits 5"):
        config_from_args(_parser().parse_args(["--loco-bits", "5"]))
    with pytest.raises(SystemExit):
        _parser().parse_args(["--loco-error-dtype", "int4"])


def test_help_lists_every_field():
    text = _parser().format_help()
    for flag in ("--loco-bits", "--loco-err-beta", "--loco-reset-interval", "--loco-block-size",
                 "--loco-error-dtype", "--loco-start-iter"):
        assert flag in text


def test_preparse_reads_only_loco_flags():
    from loco_megatron.cli.preflight import preparse_loco_config

    argv = ["--num-layers", "4", "--loco-bits", "8", "--lr", "1e-3", "--loco-block-size", "64",
            "--use-distributed-optimizer"]
    assert preparse_loco_config(argv) == LoCoConfig(bits=8, block_size=64)
    with pytest.raises(LoCoConfigError, match="--loco-bits 3"):
        preparse_loco_config(["--loco-bits", "3", "--mock-data"])
    # values argparse cannot convert: one LoCoConfigError (not a usage text and SystemExit)
    for argv, message in ((["--loco-bits", "four"], "argument --loco-bits: invalid int value"),
                          (["--loco-bits"], "argument --loco-bits: expected one argument"),
                          (["--loco-error-dtype", "bf16"], "argument --loco-error-dtype")):
        with pytest.raises(LoCoConfigError, match=message):
            preparse_loco_config(argv)


@pytest.mark.parametrize("flag", ["--fp8-param-gather", "--fp4-param-gather",
                                  "--use-precision-aware-optimizer", "--use-torch-fsdp2",
                                  "--use-megatron-fsdp"])
def test_param_bits_refusals_in_the_preflight(flag):
    """--loco-param-bits with a Megatron flag whose parameter all-gather (or fp32 main
    parameters) it cannot replace: one error naming both, before Megatron starts; the same flag
    without --loco-param-bits (and with --loco-param-bits 16) is left to Megatron."""
    from loco_megatron.cli.preflight import preparse_loco_config

    with pytest.raises(LoCoConfigError, match=f"--loco-param-bits 4 cannot be used with {flag}"):
        preparse_loco_config(["--loco-param-bits", "4", flag, "--use-distributed-optimizer"])
    for bits in ([], ["--loco-param-bits", "16"]):
        assert preparse_loco_config([*bits, flag]).params_enabled is False


@pytest.mark.parametrize("attrs,flag", [
    ({"use_megatron_fsdp": True}, "--use-megatron-fsdp"),
    ({"use_custom_fsdp": True}, "--use-custom-fsdp"),
    ({"use_torch_fsdp2": True}, "--use-torch-fsdp2"),
    ({"use_distributed_optimizer": False}, "--use-distributed-optimizer"),
    ({"ddp_reduce_scatter_with_fp32_accumulation": True},
     "--ddp-reduce-scatter-with-fp32-accumulation"),
    ({"calculate_per_token_loss": True}, "--calculate-per-token-loss"),
])
def test_megatron_combinations_refused_at_startup(attrs, flag):
    from loco_megatron.cli.preflight import check_megatron_args

    base = dict(use_distributed_optimizer=True, num_distributed_optimizer_instances=1)
    args = argparse.Namespace(**{**base, **attrs})
    with pytest.raises(LoCoConfigError, match=flag):
        check_megatron_args(args, LoCoConfig(bits=4))
    check_megatron_args(args, LoCoConfig(bits=16))  # LoCo off: nothing to refuse
    check_megatron_args(argparse.Namespace(**base), LoCoConfig(bits=4))
    # several distributed-optimizer instances: LoCo inside each instance (supported)
    check_megatron_args(argparse.Namespace(**{**base, "num_distributed_optimizer_instances": 2}),
                        LoCoConfig(bits=4))


def test_preparse_refuses_fsdp_before_megatron_starts():
    from loco_megatron.cli.preflight import preparse_loco_config

    with pytest.raises(LoCoConfigError, match="--use-megatron-fsdp"):
        preparse_loco_config(["--use-megatron-fsdp", "--loco-bits", "4"])
    assert preparse_loco_config(["--use-megatron-fsdp", "--loco-bits", "16"]).bits == 16


@pytest.mark.parametrize("sizes,refused", [
    ({"data_parallel_size": 1}, False),  # nothing communicated: plain DDP is fine at bits 4
    ({"data_parallel_size": 2}, True),
    ({"data_parallel_size": 1, "context_parallel_size": 2}, True),  # DP x CP reduces grads
    # MoE: dense DP 1 but experts reduce-scattered over world / (ETP x EP x PP) = 2 ranks
    ({"data_parallel_size": 1, "num_experts": 4, "world_size": 2,
      "tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 1,
      "expert_model_parallel_size": 1}, True),
    ({"data_parallel_size": 1, "num_experts": 4, "world_size": 2,
      "tensor_model_parallel_size": 2, "expert_model_parallel_size": 1}, False),
])
def test_plain_ddp_refused_only_where_gradients_are_communicated(sizes, refused):
    from loco_megatron.cli.preflight import check_megatron_args, gradient_dp_size

    args = argparse.Namespace(use_distributed_optimizer=False, **sizes)
    assert (gradient_dp_size(args) > 1) == refused
    if refused:
        with pytest.raises(LoCoConfigError, match="--use-distributed-optimizer"):
            check_megatron_args(args, LoCoConfig(bits=4))
    else:
        check_megatron_args(args, LoCoConfig(bits=4))


def test_preparse_accepts_a_yaml_cfg_file_naming_itself(tmp_path):
    """Megatron's --yaml-cfg files may hold a top-level ``yaml_cfg`` key (load_yaml overwrites
    it): LoCo's early read must not trip over it; a missing file is one clear error."""
    from loco_megatron.cli.preflight import preparse_loco_config

    path = tmp_path / "megatron.yaml"
    path.write_text(f"yaml_cfg: {path}\nuse_distributed_optimizer: true\nloco:\n  bits: 8\n")
    assert preparse_loco_config(["--yaml-cfg", str(path)]).bits == 8
    with pytest.raises(LoCoConfigError, match=r"--yaml-cfg .*nope\.yaml: cannot read the file"):
        preparse_loco_config(["--yaml-cfg", str(tmp_path / "nope.yaml")])


def test_preparse_reads_the_loco_settings_of_a_megatron_yaml_cfg(tmp_path):
    from loco_megatron.cli.preflight import preparse_loco_config

    path = tmp_path / "megatron.yaml"
    path.write_text("num_layers: 2\nuse_distributed_optimizer: true\nloco_block_size: 64\n"
                    "loco:\n  bits: 8\n")
    assert preparse_loco_config(["--yaml-cfg", str(path)]) == LoCoConfig(bits=8, block_size=64)
    assert preparse_loco_config(["--yaml-cfg", str(path), "--loco-bits", "4"]).bits == 4  # CLI wins
    path.write_text("loco:\n  bits: 3\n")
    with pytest.raises(LoCoConfigError, match=f"--yaml-cfg {path}.*--loco-bits 3"):
        preparse_loco_config(["--yaml-cfg", str(path)])
    with pytest.raises(LoCoConfigError, match="--yaml-cfg .*missing.yaml: cannot read"):
        preparse_loco_config(["--yaml-cfg", str(tmp_path / "missing.yaml")])


@pytest.mark.parametrize("rank,line", [("0", "error: boom"), ("", "error: boom"),
                                       ("$SLURM_PROCID", "error: boom"),
                                       ("1", "error (rank 1): boom")])
def test_fail_prints_one_line_and_exits_2_whatever_rank_says(rank, line):
    import os
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", "from loco_megatron.cli import console\n"
         "console.OTHER_RANKS_WAIT_S = 0\nconsole.fail(ValueError('boom'))"],
        env={**os.environ, "RANK": rank}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == line, proc.stderr


def test_preflight_command_expands_config_files(tmp_path, capsys):
    from loco_megatron.cli.preflight import main

    bad, good = tmp_path / "bad.yaml", tmp_path / "good.yaml"
    bad.write_text("loco:\n  bits: 3\n")
    good.write_text("loco:\n  bits: 4\n")
    assert main(["--config", str(bad)]) == 2
    assert f"--config {bad}, loco section: --loco-bits 3" in capsys.readouterr().err
    assert main(["--config", str(good), "--loco-block-size", "64",
                 "--use-distributed-optimizer"]) == 0


def test_full_precision_1d_refused_with_hierarchical():
    with pytest.raises(LoCoConfigError, match="--loco-full-precision-1d is not supported with "
                                              "--loco-hierarchical"):
        LoCoConfig(bits=4, full_precision_1d=True, hierarchical=True)
    assert LoCoConfig(bits=4, full_precision_1d=True).full_precision_1d
