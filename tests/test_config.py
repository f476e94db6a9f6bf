"""LoCoConfig validation and the generated --loco-* flags."""

import argparse

import pytest

from loco_megatron.config import LoCoConfig, LoCoConfigError
from loco_megatron.megatron.arguments import add_loco_args, config_from_args


@pytest.mark.parametrize("kwargs,flag", [
    ({"bits": 3}, "--loco-bits 3"), ({"bits": 2}, "--loco-bits 2"),
    ({"beta": 1.0}, "--loco-err-beta"), ({"beta": -0.1}, "--loco-err-beta"),
    ({"reset_interval": -1}, "--loco-reset-interval"), ({"block_size": 3}, "--loco-block-size"),
    ({"block_size": 0}, "--loco-block-size"), ({"error_dtype": "fp16"}, "--loco-error-dtype"),
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
                                 "--loco-error-dtype", "fp32"])
    assert config_from_args(args) == LoCoConfig(bits=4, beta=0.5, reset_interval=10,
                                                block_size=128, error_dtype="fp32")
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
                 "--loco-error-dtype"):
        assert flag in text
