"""The settings registry (``Setting`` metadata on every ``LoCoConfig`` field, loco_megatron/config.py):
every field has a flag, a YAML key, one line of help and its agreement and checkpoint decisions,
and the flags, YAML keys, agreement check, fingerprint and messages are all derived from it."""

import argparse
from dataclasses import MISSING, fields

import pytest
import torch

from loco_megatron import agreement
from loco_megatron.cli.flags import FLAGS, add_loco_args, config_from_args, explicit_loco_flags
from loco_megatron.cli.yaml_config import loco_keys, loco_section_to_fields
from loco_megatron.config import (CONVERT, RECORD, RESET, SETTINGS, LoCoConfig, LoCoConfigError,
                                  Setting, fingerprint, fingerprint_fields, shared_settings)
from loco_megatron.layout import BucketLayout

#: a valid non-default value per field; a new field must be added here (the first test fails)
SAMPLES = {"bits": 4, "beta": 0.5, "reset_interval": 10, "block_size": 64, "grid": "full-range",
           "error_dtype": "fp32", "start_iter": 3, "kernels": "torch", "hierarchical": True,
           "intra_node_bits": 8, "full_precision_1d": True, "param_bits": 8}


def test_every_field_has_a_complete_registry_entry():
    names = [f.name for f in fields(LoCoConfig)]
    assert list(SETTINGS) == names and set(SAMPLES) == set(names)
    flags = [s.flag for s in SETTINGS.values()]
    assert len(set(flags)) == len(flags)
    for f in fields(LoCoConfig):
        s = f.metadata["loco"]
        assert isinstance(s, Setting) and s is SETTINGS[f.name]
        assert s.flag.startswith("--loco-") and s.yaml_key == s.flag[len("--loco-"):]
        assert s.help and "\n" not in s.help and len(s.help) <= 72, f.name  # one --help line
        assert isinstance(s.shared, bool)
        assert s.checkpoint in (None, RESET, CONVERT, RECORD)
        assert f.default is not MISSING


def test_flags_come_from_the_registry():
    parser = add_loco_args(argparse.ArgumentParser())
    loco = {opt for opt in parser._option_string_actions if opt.startswith("--loco-")}
    assert loco == {s.flag for s in SETTINGS.values()}
    for f in fields(LoCoConfig):
        action = parser._option_string_actions[SETTINGS[f.name].flag]
        assert action.dest == f"loco_{f.name}" and action.default == f.default
        assert action.help == f"{SETTINGS[f.name].help} (default: {f.default})"
        assert FLAGS[f.name][0] == SETTINGS[f.name].flag
    # --loco-full-precision-1d is refused with --loco-hierarchical: two valid combinations
    for leave_out in (("full_precision_1d",), ("hierarchical", "intra_node_bits")):
        sample = {k: v for k, v in SAMPLES.items() if k not in leave_out}
        argv = []
        for name, value in sample.items():
            argv += [SETTINGS[name].flag] if value is True else [SETTINGS[name].flag, str(value)]
        assert config_from_args(parser.parse_args(argv)) == LoCoConfig(**sample)
        assert explicit_loco_flags(argv) == sample


def test_yaml_keys_come_from_the_registry():
    keys = loco_keys()
    for name, s in SETTINGS.items():
        assert keys[s.yaml_key] == keys[s.yaml_key.replace("-", "_")] == name
    section = {SETTINGS[name].yaml_key: value for name, value in SAMPLES.items()}
    assert loco_section_to_fields(section, "test.yaml") == SAMPLES
    with pytest.raises(LoCoConfigError, match="unknown key 'loco.no-such-setting'"):
        loco_section_to_fields({"no-such-setting": 1}, "test.yaml")


def test_agreement_and_fingerprint_come_from_the_registry():
    shared = {name for name, s in SETTINGS.items() if s.shared}
    assert set(shared_settings()) == shared and "kernels" not in shared
    assert set(agreement.SHARED_SETTINGS) == shared - {"bits", "param_bits"}
    config = LoCoConfig(bits=4, block_size=64)
    layout = BucketLayout.build(256, 2, 64)
    described = agreement.describe(config, (0, 0, 0), layout, torch.zeros(256))
    assert shared <= set(described)
    assert set(fingerprint(config)) == {n for n, s in SETTINGS.items() if s.checkpoint}
    assert fingerprint_fields(RESET) == ("bits", "block_size", "grid", "full_precision_1d")
    assert fingerprint_fields(CONVERT) == ("error_dtype",)


@pytest.mark.parametrize("name", [n for n in SETTINGS if not isinstance(SAMPLES[n], bool)])
def test_messages_name_the_flag(name):
    with pytest.raises(LoCoConfigError) as info:
        LoCoConfig(**{name: [1]})
    assert str(info.value).startswith(SETTINGS[name].flag + " [1]: expected ")


def test_one_setting_under_two_spellings_is_refused():
    with pytest.raises(LoCoConfigError, match="'loco.err_beta' and 'loco.err-beta' are the same "
                                              "setting \\(--loco-err-beta\\)"):
        loco_section_to_fields({"err-beta": 0.5, "err_beta": 0.6}, "test.yaml")
