"""Adversarial regressions (hierarchical mode, fp16 loss scaling, flags, grids)."""

import argparse

import pytest

from loco_megatron.config import LoCoConfigError
from loco_megatron.cli.flags import add_loco_args, config_from_args


def _parse(argv):
    from loco_megatron.cli.yaml_config import expand_config_argv

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


def _hierarchical_view(intra_bits=8):
    """An OptimizerLoCo of one bucket on 2 nodes x 2 ranks, without megatron or a process
    group, whose three possible error buffers (flat, intra, inter) all hold values."""
    import types

    import torch

    from loco_megatron.config import LoCoConfig
    from loco_megatron.layout import BucketLayout
    from loco_megatron.megatron.checkpoint.state import BucketRef, OptimizerLoCo
    from loco_megatron.megatron.plugin import LoCoState

    state = LoCoState(LoCoConfig(bits=4, block_size=8, hierarchical=True,
                                 intra_node_bits=intra_bits))
    bucket = types.SimpleNamespace(grad_data=torch.zeros(64), numel_unpadded=64,
                                   loco_param_ranges={"w": (0, 64)})
    view = object.__new__(OptimizerLoCo)
    view.optimizer, view.state, view.group = None, state, None
    view.dp_rank, view.dp_size, view.instances, view.instance = 0, 4, 1, 0
    view.inter_group, view.domain, view.prefix = None, 0, "loco.dp_group_idx_0"
    view.hierarchy = {"nodes": 2, "per_node": 2, "intra_node_bits": intra_bits}
    ref = BucketRef("buffer_0.bucket_0", bucket, (0, 0), BucketLayout.build(64, 4, 8), 0)
    view.buckets = [ref]
    for _prefix, key, numel in view.stages(ref):
        state.compensator.set_error(key, torch.ones(numel))
    return view


@pytest.mark.parametrize("case", ["no_loco_state", "bits_changed", "params_changed",
                                  "no_error_form"])
def test_resume_resets_hierarchical_stage_buffers(case):
    """Every resume branch that resets "the error buffers" resets the hierarchical stage
    buffers too (not only the flat key), e.g. a reload into a process that already trained."""
    from loco_megatron.megatron.checkpoint.state import apply

    view = _hierarchical_view()
    ref = view.buckets[0]
    meta = view.meta()
    if case == "bits_changed":
        meta["fingerprint"]["bits"] = 8
    if case == "params_changed":
        meta["buckets"][ref.name]["params"] = [[0, 32], [32, 64]]
    apply(view, None if case == "no_loco_state" else meta, None, None, "ckpt")
    comp = view.state.compensator
    left = [key for _p, key, _n in view.stages(ref) if key in comp.errors]
    assert left == [], f"{case}: stale stage error buffers kept: {left}"


def _uneven_nodes_worker(rank, world):
    import torch.distributed as dist

    from loco_megatron.hierarchical import group_topology

    # TP2 x DP2: DP groups [0, 2] and [1, 3]; with 3 ranks per node each looks even on its own
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    try:
        group_topology(groups[rank % 2])
    except LoCoConfigError as e:
        return str(e)
    return None


def test_world_not_filling_nodes_refused_on_every_rank(run_ranks):
    """LOCAL_WORLD_SIZE=3 on 4 ranks (TP2 x DP2): refused on every rank, naming the flag, not
    only where a DP group happens to fall unevenly."""
    errors = run_ranks(_uneven_nodes_worker, 4, local_world_size=3)
    assert all(e is not None and "--loco-hierarchical" in e and "LOCAL_WORLD_SIZE=3" in e
               for e in errors), errors


def test_resume_warning_once_across_optimizer_instances(caplog):
    """Several distributed-optimizer instances load the same checkpoint: the resume warning is
    logged once (DP rank 0 of instance 0), not once per instance."""
    import logging

    from loco_megatron.megatron.checkpoint.state import apply

    lines = []
    for instance in (0, 1):
        view = _hierarchical_view()
        view.instances, view.instance = 2, instance
        meta = view.meta()
        meta["hierarchical"] = None  # saved flat: topology changed
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="loco_megatron"):
            notes = apply(view, meta, None, None, "ckpt")
        assert len(notes) == 1 and "topology changed" in notes[0]
        lines.append([r.getMessage() for r in caplog.records])
    assert len(lines[0]) == 1 and lines[1] == [], lines
