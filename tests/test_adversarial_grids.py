"""Adversarial regressions for issue 6 (hierarchical mode, fp16 loss scaling, flags, grids)."""

import argparse

import pytest

from loco_megatron.config import LoCoConfigError
from loco_megatron.megatron.arguments import add_loco_args, config_from_args


def _parse(argv):
    from loco_megatron.megatron.yaml_config import expand_config_argv

    return config_from_args(add_loco_args(argparse.ArgumentParser()).parse_args(
        expand_config_argv(argv)))


def test_config_file_intra_node_bits_completed_by_cli_switch(tmp_path):
    """CLI > YAML: a --config file's ``intra-node-bits: 8`` with ``--loco-hierarchical`` on the
    command line is a valid run (as under --yaml-cfg); the file alone is refused at parse time,
    naming the flags."""
    path = tmp_path / "c.yaml"
    path.write_text("loco:\n  bits: 4\n  intra-node-bits: 8\n")
    cfg = _parse(["--config", str(path), "--loco-hierarchical"])
    assert cfg.hierarchical and cfg.intra_node_bits == 8
    # the same under Megatron's --yaml-cfg
    ns = argparse.Namespace(yaml_cfg="y.yaml", loco={"bits": 4, "intra_node_bits": 8})
    assert config_from_args(ns, argv=["--loco-hierarchical"]).intra_node_bits == 8
    with pytest.raises(LoCoConfigError, match="--loco-intra-node-bits 8.*--loco-hierarchical"):
        _parse(["--config", str(path)])
    path.write_text("loco:\n  bits: 4\n  hierarchical: true\n  intra-node-bits: 8\n")
    with pytest.raises(LoCoConfigError, match="--loco-intra-node-bits 8.*--loco-hierarchical"):
        _parse(["--config", str(path), "--no-loco-hierarchical"])
    path.write_text("loco:\n  bits: 4\n  intra-node-bits: 7\n")
    with pytest.raises(LoCoConfigError, match="--loco-intra-node-bits 7"):
        _parse(["--config", str(path), "--loco-hierarchical"])
