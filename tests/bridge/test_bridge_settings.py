"""LoCo's settings and refusals in a Megatron-Bridge recipe (one process, no ranks): a YAML
file's ``loco:`` section and ``loco.*`` overrides beside Bridge's Hydra overrides, and the
one-line refusals before Bridge starts, naming Bridge's settings."""

import os
import re
import textwrap

import pytest

from loco_megatron import LoCoConfig, LoCoConfigError
from loco_megatron.bridge import pretrain, process_config_with_overrides, split_overrides
from .worker_bridge import recipe


def _never(*args, **kwargs):
    raise AssertionError("Bridge's pretrain must not start after a refusal")


def test_yaml_section_and_overrides_beside_bridge_overrides(tmp_path):
    """Precedence: command line > YAML > Python; Bridge's own keys still reach the recipe."""
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent("""\
        train:
          train_iters: 7
        loco:
          bits: 4
          err-beta: 0.5
          block_size: 128
        """))
    cfg = recipe({})
    loco = process_config_with_overrides(
        cfg, str(path), ["train.global_batch_size=8", "loco.bits=8", "loco.param-bits=4"],
        loco=LoCoConfig(bits=4, reset_interval=64))
    assert (cfg.train.train_iters, cfg.train.global_batch_size) == (7, 8)
    assert loco == LoCoConfig(bits=8, beta=0.5, block_size=128, reset_interval=64, param_bits=4)
    assert process_config_with_overrides(recipe({}), None, ["train.train_iters=3"]) is None


@pytest.mark.parametrize("override,words", [
    ("loco.bitz=4", "unknown key 'loco.bitz'"),
    ("loco.bits=3", "loco.bits=3 is not supported"),
    ("loco.err-beta=high", "loco.err-beta: 'high' is not a valid value"),
    ("loco.bits", "'loco.KEY=VALUE'"),
])
def test_bad_loco_override_is_one_line(override, words):
    with pytest.raises(LoCoConfigError) as e:
        process_config_with_overrides(recipe({}), None, [override])
    assert words in str(e.value) and "\n" not in str(e.value)
    assert not re.search(r"--loco-[a-z]", str(e.value))  # Bridge's words, not the flags


def test_split_overrides_keeps_bridge_overrides_in_order():
    fields, rest = split_overrides(["a.b=1", "loco.hierarchical=true", "+c=2", "loco.kernels=torch"])
    assert fields == {"hierarchical": True, "kernels": "torch"} and rest == ["a.b=1", "+c=2"]


@pytest.mark.parametrize("change,words", [
    (lambda c: setattr(c.checkpoint, "ckpt_format", "fsdp_dtensor"),
     "checkpoint.ckpt_format='fsdp_dtensor' cannot be used with loco.bits=4"),
    (lambda c: setattr(c.checkpoint, "non_persistent_ckpt_type", "local"),
     "checkpoint.non_persistent_ckpt_type='local' cannot be used with loco.bits=4"),
    (lambda c: (setattr(c.ddp, "use_distributed_optimizer", False),
                setattr(c.optimizer, "use_distributed_optimizer", False)),
     "loco.bits needs the distributed optimizer (ddp.use_distributed_optimizer=True)"),
    (lambda c: setattr(c.model, "calculate_per_token_loss", True),
     "cannot be used with model.calculate_per_token_loss"),
    (lambda c: setattr(c.checkpoint, "async_save", True), "checkpoint.async_save needs a GPU"),
])
def test_refusals_are_one_line_before_bridge_starts(tmp_path, change, words):
    cfg = recipe({"save": str(tmp_path / "ckpt"), "save_interval": 2})
    change(cfg)
    with pytest.raises(LoCoConfigError) as e:
        pretrain(cfg, None, loco={"bits": 4}, bridge_pretrain=_never)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_loco_off_refuses_nothing(tmp_path):
    """Without LoCo's state to save (bits 16) the formats LoCo cannot carry are Bridge's
    business: nothing is refused."""
    cfg = recipe({"save": str(tmp_path / "ckpt"), "save_interval": 2})
    cfg.checkpoint.ckpt_format = "fsdp_dtensor"
    ran = []
    pretrain(cfg, None, loco={"bits": 16}, bridge_pretrain=lambda *a, **k: ran.append(1))
    assert ran == [1]


def test_triton_cache_node_local_per_job(tmp_path, monkeypatch):
    """Bridge's path points Triton's cache at ``$TMPDIR/loco-triton-<job>`` before Bridge runs
    (a shared ``~/.triton`` on NFS breaks concurrent compiles); a user's own is kept; with
    ``loco=None`` (Bridge as shipped) the environment is left alone."""
    cfg = recipe({"save": str(tmp_path / "ckpt"), "save_interval": 2})
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    seen = []
    run = lambda *a, **k: seen.append(os.environ.get("TRITON_CACHE_DIR"))  # noqa: E731
    pretrain(cfg, None, loco=None, bridge_pretrain=run)
    assert seen == [None]
    seen.clear()
    pretrain(cfg, None, loco={"bits": 16}, bridge_pretrain=run)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/scratch/mine")
    pretrain(cfg, None, loco={"bits": 16}, bridge_pretrain=run)
    assert seen == [str(tmp_path / "loco-triton-77"), "/scratch/mine"]
