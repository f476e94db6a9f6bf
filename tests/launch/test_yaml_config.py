"""YAML run configs: ``--config FILE`` (loco_megatron.cli.yaml_config), precedence
CLI > YAML > defaults, errors naming file and key, Megatron-LM's ``--yaml-cfg`` ``loco:`` section,
and the tiny CPU config end to end through run_pretrain.sh."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loco_megatron.config import LoCoConfig, LoCoConfigError
from loco_megatron.cli.flags import FLAGS, add_loco_args, config_from_args
from loco_megatron.cli.yaml_config import config_to_argv, expand_config_argv, loco_keys
from tests.helpers.preloaded import launch_env

ROOT = Path(__file__).resolve().parents[2]


def _write(tmp_path, text, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_values_become_arguments(tmp_path):
    path = _write(tmp_path, "num-layers: 3\nbf16: true\nfp16: false\nload: null\n"
                            "data-path: [0.3, a, 0.7, b]\nsplit: 98,1,1\nlr: 2.5e-4\n"
                            "loco:\n  bits: 4\n  err_beta: 0.5\n  block-size: null\n")
    assert config_to_argv(path) == [
        "--num-layers", "3", "--bf16", "--data-path", "0.3", "a", "0.7", "b",
        "--split", "98,1,1", "--lr", "0.00025", "--loco-bits", "4", "--loco-err-beta", "0.5"]


def test_every_loco_flag_has_a_section_key():
    keys = loco_keys()
    for field, (flag, _typ, _extra) in FLAGS.items():
        suffix = flag[len("--loco-"):]
        assert keys[suffix] == keys[suffix.replace("-", "_")] == field


def test_expand_puts_files_first_and_keeps_the_rest(tmp_path):
    a = _write(tmp_path, "num-layers: 3\n", "a.yaml")
    b = _write(tmp_path, "hidden-size: 8\n", "b.yaml")
    argv = ["--lr", "1", "--config", a, "--num-layers", "5", f"--config={b}"]
    assert expand_config_argv(argv) == ["--num-layers", "3", "--hidden-size", "8",
                                        "--lr", "1", "--num-layers", "5"]
    assert expand_config_argv(["--lr", "1"]) == ["--lr", "1"]


def _loco_parser():
    parser = add_loco_args(argparse.ArgumentParser(allow_abbrev=False))
    parser.add_argument("--num-layers", type=int, default=24)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=None)
    return parser


def test_precedence_cli_over_yaml_over_defaults(tmp_path):
    path = _write(tmp_path, "num-layers: 3\nhidden-size: 8\nloco:\n  bits: 4\n  err-beta: 0.5\n")
    args = _loco_parser().parse_args(expand_config_argv(
        ["--num-layers", "7", "--loco-err-beta", "0.25", "--config", path]))
    assert (args.num_layers, args.hidden_size, args.lr) == (7, 8, None)  # CLI, YAML, default
    assert config_from_args(args) == LoCoConfig(bits=4, beta=0.25)  # YAML, CLI, defaults


def test_yaml_only_cli_only_and_mixed_give_the_same_config(tmp_path):
    full = _write(tmp_path, "loco:\n  bits: 8\n  err-beta: 0.6\n  reset-interval: 50\n"
                            "  block-size: 64\n  error-dtype: fp32\n", "full.yaml")
    half = _write(tmp_path, "loco:\n  bits: 8\n  reset_interval: 50\n  error_dtype: fp32\n",
                  "half.yaml")
    cli = ["--loco-bits", "8", "--loco-err-beta", "0.6", "--loco-reset-interval", "50",
           "--loco-block-size", "64", "--loco-error-dtype", "fp32"]
    configs = [config_from_args(_loco_parser().parse_args(expand_config_argv(argv))) for argv in
               (["--config", full], cli,
                ["--config", half, "--loco-err-beta", "0.6", "--loco-block-size", "64"])]
    assert configs[0] == configs[1] == configs[2] == LoCoConfig(
        bits=8, beta=0.6, reset_interval=50, block_size=64, error_dtype="fp32")


@pytest.mark.parametrize("text,expected", [
    ("loco:\n  bitz: 4\n", r"unknown key 'loco\.bitz'.*bits, block-size"),
    ("loco: 4\n", "'loco' must be a mapping"),
    ("loco:\n  bits: 5\n", r"loco section: --loco-bits 5 is not supported"),
    ("loco:\n  bits: four\n", r"loco\.bits: 'four' is not a valid value for --loco-bits"),
    ("loco:\n  reset-interval: 2.5\n", r"loco\.reset-interval: 2\.5 is not a valid value"),
    ("- num-layers\n- 3\n", "expected a mapping of Megatron-LM flags"),
    ("num_layers: 3\n", r"key 'num_layers' is not a flag name.*num-layers"),
    ("model:\n  num-layers: 3\n", "key 'model' holds a mapping"),
    ("loco-bits: 4\n", "put LoCo settings in the 'loco:' section"),
    ("data-path: []\n", "key 'data-path': a list value"),
    ("num-layers: [3\n", "not valid YAML"),
    ("loco:\n  reset-interval: true\n", r"loco\.reset-interval: True is not a valid value"),
    ("config: other.yaml\n", "a config file cannot include another"),
])
def test_bad_files_name_the_file_and_key(tmp_path, text, expected):
    path = _write(tmp_path, text)
    with pytest.raises(LoCoConfigError, match=expected) as err:
        expand_config_argv(["--config", path])
    assert path in str(err.value)


def test_missing_file_and_missing_argument(tmp_path):
    with pytest.raises(LoCoConfigError, match=r"--config .*nope\.yaml: cannot read the file"):
        expand_config_argv(["--config", str(tmp_path / "nope.yaml")])
    for argv in (["--config"], ["--config", "--lr", "1"]):
        with pytest.raises(LoCoConfigError, match="--config needs a YAML file"):
            expand_config_argv(argv)


def test_command_line_tools_report_the_error_and_exit_2(tmp_path):
    bad = _write(tmp_path, "loco:\n  bitz: 4\n")
    env = launch_env()
    for module in ("loco_megatron.cli.yaml_config", "loco_megatron.training.pretrain_gpt"):
        proc = subprocess.run([sys.executable, "-m", module, "--config", bad], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert f"error: --config {bad}: unknown key 'loco.bitz'" in proc.stderr


# --- Megatron-LM's --yaml-cfg: load_yaml replaces the namespace by a SimpleNamespace ---------

def _load_yaml(path):
    yaml_arguments = pytest.importorskip("megatron.training.yaml_arguments")
    return yaml_arguments.load_yaml(path)


def test_yaml_cfg_section_then_cli_then_defaults(tmp_path):
    path = _write(tmp_path, "num_layers: 2\nloco:\n  bits: 4\n  err_beta: 0.5\n"
                            "  block_size: 128\n")
    args = _load_yaml(path)
    assert not hasattr(args, "loco_bits")  # the --loco-* attributes are gone
    assert config_from_args(args, argv=[]) == LoCoConfig(bits=4, beta=0.5, block_size=128)
    argv = ["--yaml-cfg", path, "--loco-err-beta", "0.25", "--loco-error-dtype", "fp32"]
    assert config_from_args(args, argv=argv) == LoCoConfig(
        bits=4, beta=0.25, block_size=128, error_dtype="fp32")


def test_yaml_cfg_without_loco_and_flat_keys(tmp_path):
    assert config_from_args(_load_yaml(_write(tmp_path, "num_layers: 2\n")), argv=[]) == \
        LoCoConfig()
    flat = _load_yaml(_write(tmp_path, "loco_bits: 8\nloco_block_size: 64\n", "flat.yaml"))
    assert config_from_args(flat, argv=["--loco-bits", "4"]) == LoCoConfig(bits=4, block_size=64)
    # the flag's own spelling (loco_err_beta for --loco-err-beta) works as well as the field's
    flag_named = _load_yaml(_write(tmp_path, "loco_err_beta: 0.5\nloco_start_iter: 3\n", "f.yaml"))
    assert config_from_args(flag_named, argv=[]) == LoCoConfig(beta=0.5, start_iter=3)


@pytest.mark.parametrize("text,expected", [("loco:\n  bitz: 4\n", r"unknown key 'loco\.bitz'"),
                                           ("loco: [4]\n", "'loco' must be a mapping"),
                                           ("loco:\n  bits: 5\n", "--loco-bits 5"),
                                           ("loco:\n  start-iter: true\n", r"loco\.start-iter"),
                                           ("loco_bits: '3'\n", "--loco-bits 3")])
def test_yaml_cfg_errors_name_file_and_key(tmp_path, text, expected):
    path = _write(tmp_path, text)
    with pytest.raises(LoCoConfigError, match=expected) as err:
        config_from_args(_load_yaml(path), argv=[])
    assert f"--yaml-cfg {path}" in str(err.value)


# --- the tiny CPU config end to end --------------------------------------------------------------

@pytest.mark.skipif(sys.platform != "linux", reason="bash launcher")
def test_tiny_cpu_config_trains_with_cli_overrides(tmp_path):
    from tests.launch.test_run_pretrain import _env, _losses

    env = _env(tmp_path)
    env.setdefault("LOCO_DATA_DIR", str(Path.home() / ".cache" / "loco_megatron" / "data"))
    proc = subprocess.run(
        ["bash", str(ROOT / "run_pretrain.sh"), "--config", "configs/tiny_cpu.yaml",
         "--train-iters", "2", "--lr-warmup-iters", "1", "--eval-interval", "2",
         "--eval-iters", "1", "--loco-err-beta", "0.5"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    # bits 4 from the YAML, err-beta 0.5 from the command line, the rest LoCo defaults
    assert "> LoCo active: 4-bit compensated reduce-scatter, block 256, err-beta 0.5, " \
           "reset every 1024 steps" in out
    # Megatron's argument dump: YAML over run_pretrain.sh's defaults (4 layers, 256 hidden),
    # command line over the YAML (20 iterations)
    for name, value in (("num_layers", "2"), ("hidden_size", "64"), ("num_query_groups", "2"),
                        ("normalization", "RMSNorm"), ("train_iters", "2")):
        assert f"  {name} {'.' * (48 - len(name))} {value}\n" in out, name
    assert len(_losses(out)) == 2


@pytest.mark.skipif(sys.platform != "linux", reason="bash launcher")
def test_run_pretrain_places_yaml_between_its_defaults_and_the_cli(tmp_path):
    """run_pretrain.sh expands --config (relative to the caller's directory): its defaults, then
    the file's flags, then the user's, so argparse's last-one-wins gives CLI > YAML > defaults."""
    (tmp_path / "rel.yaml").write_text("num-layers: 3\nmock-data: true\nloco:\n  bits: 8\n")
    env = dict(os.environ, LOCO_DRY_RUN="1", GPUS_PER_NODE="0", OUT_DIR=str(tmp_path / "run"))
    proc = subprocess.run(["bash", str(ROOT / "run_pretrain.sh"), "--num-layers", "5",
                           "--config", "rel.yaml"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip().splitlines()[-1]
    tail = line[line.index("--num-layers 4 "):]  # run_pretrain.sh's own model defaults first
    assert tail.index("--loco-bits 4") < tail.index("--num-layers 3 --mock-data --loco-bits 8") \
        < tail.index("--num-layers 5")
    assert "preparing the default corpus" not in proc.stderr  # mock-data came from the YAML
    bad = subprocess.run(["bash", str(ROOT / "run_pretrain.sh"), "--config", "nope.yaml"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0
    assert "error: --config nope.yaml: cannot read the file" in bad.stderr
