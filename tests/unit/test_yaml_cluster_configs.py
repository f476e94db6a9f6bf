"""The GPU-cluster configs (configs/llama2_7b.yaml, llama2_13b.yaml, mixtral_8x7b.yaml) checked
without training: every key is a flag of Megatron-LM's parser, the arguments pass Megatron's
``validate_args`` for 8 nodes x 8 GPUs, LoCo is on with 4 bits, and the architecture gives the
published parameter counts. Also Megatron-LM's own ``--yaml-cfg`` with a ``loco:`` section
through ``parse_args`` + ``validate_yaml``."""

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from loco_megatron.config import LoCoConfig
from loco_megatron.cli.flags import FLAGS, add_loco_args, config_from_args
from loco_megatron.cli.preflight import check_megatron_args
from loco_megatron.cli.yaml_config import expand_config_argv, load_config

from tests.helpers.megatron_lm_checkouts import MIRROR, mirror_available

ROOT = Path(__file__).resolve().parents[2]
WORLD_SIZE = 64  # 8 nodes x 8 GPUs

# config -> (data-parallel size at 64 GPUs, exact parameter count of the released checkpoint,
#            rounded published figure). Counts: HF meta-llama/Llama-2-7b-hf 6,738,415,616,
# Llama-2-13b-hf 13,015,864,320, mistralai/Mixtral-8x7B-v0.1 46,702,792,704; papers: 6.7B/7B,
# 13B (arXiv 2307.09288), 46.7B (arXiv 2401.04088).
CONFIGS = {
    "llama2_7b": (64, 6_738_415_616, 6.74e9),
    "llama2_13b": (32, 13_015_864_320, 13.0e9),
    "mixtral_8x7b": (16, 46_702_792_704, 46.7e9),
}
LLAMA2_VOCAB = 32000  # the LLaMA-2 / Mixtral SentencePiece tokenizer


@pytest.fixture(scope="module")
def megatron_arguments():
    return pytest.importorskip("megatron.training.arguments")


@pytest.mark.parametrize("name", sorted(CONFIGS) + ["tiny_cpu"])
def test_every_key_is_a_megatron_flag(name, megatron_arguments):
    import argparse

    parser = megatron_arguments.add_megatron_arguments(argparse.ArgumentParser())
    known = {opt for action in parser._actions for opt in action.option_strings}
    data = load_config(str(ROOT / "configs" / f"{name}.yaml"))
    unknown = [k for k in data if k != "loco" and f"--{k}" not in known]
    assert not unknown, f"not Megatron-LM flags: {unknown}"
    assert data["loco"]["bits"] == 4
    assert {f"--loco-{k}" for k in data["loco"]} <= {flag for flag, _t, _e in FLAGS.values()}


def _parse_and_validate(name, megatron_arguments, monkeypatch, extra=()):
    """Parse ``--config configs/NAME.yaml`` with Megatron's parser and run ``validate_args``
    as rank 0 of WORLD_SIZE, on an H100-class device (compute capability 9.0) as far as the
    capability checks are concerned."""
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *a, **k: types.SimpleNamespace(major=9, minor=0, name="H100"))
    monkeypatch.setenv("WORLD_SIZE", str(WORLD_SIZE))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    argv = expand_config_argv(["--config", str(ROOT / "configs" / f"{name}.yaml"),
                               "--tokenizer-model", "/data/llama2/tokenizer.model",
                               "--data-path", "/data/corpus_text_document", *extra])
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    args = megatron_arguments.parse_args(add_loco_args)
    megatron_arguments.validate_args(args, {})
    return args


def _parameter_count(a) -> int:
    """Exact parameter count of a bias-free RMSNorm SwiGLU GPT with untied embeddings and RoPE
    (optionally GQA and top-k MoE): per layer attention (Q, K, V, O), the experts' gated MLPs
    (3 h x ffn matrices each), the router (h x experts), two RMSNorm weights; plus the final
    RMSNorm and the input and output embeddings (padded vocab x h each)."""
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

    h, heads, kv = a.hidden_size, a.num_attention_heads, a.kv_channels
    groups = a.num_query_groups if a.group_query_attention else heads
    attention = h * heads * kv + 2 * h * groups * kv + heads * kv * h
    if a.num_experts:
        mlp = a.num_experts * 3 * h * a.moe_ffn_hidden_size + h * a.num_experts
    else:
        mlp = 3 * h * a.ffn_hidden_size
    vocab = vocab_size_with_padding(LLAMA2_VOCAB, a, logging_enabled=False)
    return a.num_layers * (attention + mlp + 2 * h) + h + 2 * vocab * h


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cluster_config_validates_and_has_published_size(name, megatron_arguments,
                                                         monkeypatch):
    dp, exact, published = CONFIGS[name]
    args = _parse_and_validate(name, megatron_arguments, monkeypatch)
    assert args.data_parallel_size == dp
    assert args.global_batch_size % (args.micro_batch_size * dp) == 0
    assert (args.seq_length, args.bf16, args.use_distributed_optimizer, args.overlap_grad_reduce,
            args.overlap_param_gather) == (4096, True, True, True, True)
    assert (args.normalization, args.swiglu, args.position_embedding_type,
            args.untie_embeddings_and_output_weights, args.add_bias_linear) == \
        ("RMSNorm", True, "rope", True, False)
    config = config_from_args(args)
    assert config == LoCoConfig(bits=4) and config.enabled
    check_megatron_args(args, config)  # no refusal (distributed optimizer, no FSDP)
    count = _parameter_count(args)
    assert count == exact
    assert abs(count - published) / published < 5e-3  # published figures have 3 digits
    if name == "mixtral_8x7b":
        assert (args.num_experts, args.moe_router_topk, args.num_query_groups,
                args.expert_model_parallel_size) == (8, 2, 8, 8)


def test_cli_overrides_a_cluster_config(megatron_arguments, monkeypatch):
    args = _parse_and_validate("llama2_13b", megatron_arguments, monkeypatch,
                               extra=("--tensor-model-parallel-size", "4", "--loco-bits", "8"))
    assert (args.tensor_model_parallel_size, args.data_parallel_size) == (4, 16)
    assert config_from_args(args) == LoCoConfig(bits=8)


def _megatron_example_yaml():
    """Megatron-LM's --yaml-cfg example (examples/gpt3/gpt_config.yaml, removed after
    core_v0.17) from $MEGATRON_LM or the local mirror's core_v0.16.1 tag; None if neither."""
    checkout = os.environ.get("MEGATRON_LM")
    if checkout and (Path(checkout) / "examples/gpt3/gpt_config.yaml").is_file():
        return (Path(checkout) / "examples/gpt3/gpt_config.yaml").read_text()
    if mirror_available():
        proc = subprocess.run(["git", "--git-dir", str(MIRROR), "show",
                               "core_v0.16.1:examples/gpt3/gpt_config.yaml"],
                              capture_output=True, text=True)
        if proc.returncode == 0:
            return proc.stdout
    return None


def test_megatron_yaml_cfg_keeps_the_loco_section(tmp_path, megatron_arguments, monkeypatch):
    import yaml

    text = _megatron_example_yaml()
    if text is None:
        pytest.skip("needs Megatron-LM's examples/gpt3/gpt_config.yaml: set MEGATRON_LM to a "
                    "checkout that has it (tags up to core_v0.17)")
    yaml_arguments = pytest.importorskip("megatron.training.yaml_arguments")
    cfg = yaml.safe_load(text)
    # Attributes that megatron-core 0.19's parse_args/validate_yaml read but the older example
    # lacks: without them --yaml-cfg stops with AttributeError (a Megatron limitation).
    for key in ("disable_msc_deprecated", "enable_msc", "account_for_embedding_in_pipeline_split",
                "step_batch_size_schedule"):
        cfg.setdefault(key, None if key == "step_batch_size_schedule" else False)
    cfg["loco"] = {"bits": 4, "err_beta": 0.5, "block_size": 128}
    path = tmp_path / "gpt_config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--yaml-cfg", str(path),
                                      "--loco-err-beta", "0.25"])
    args = megatron_arguments.parse_args(add_loco_args)
    args = yaml_arguments.validate_yaml(args, {})
    assert isinstance(args.loco, types.SimpleNamespace)  # survived load_yaml and validation
    assert config_from_args(args) == LoCoConfig(bits=4, beta=0.25, block_size=128)


_CHECKOUT_KEYS = """
import argparse, glob, sys, warnings, yaml
warnings.filterwarnings("ignore")
sys.path.insert(0, sys.argv[1])
from megatron.training import arguments
assert arguments.__file__.startswith(sys.argv[1]), arguments.__file__
parser = arguments.add_megatron_arguments(argparse.ArgumentParser())
known = {opt for action in parser._actions for opt in action.option_strings}
for path in sorted(glob.glob("configs/*.yaml")):
    print(path, [k for k in yaml.safe_load(open(path)) if k != "loco" and "--" + k not in known])
"""


def test_config_keys_are_flags_of_a_megatron_lm_checkout(tmp_path):
    """Users run the configs with their own Megatron-LM through the wrapper: the keys must be
    flags of that parser too ($MEGATRON_LM, else core_v0.16.1 from the local mirror)."""
    checkout = os.environ.get("MEGATRON_LM")
    if not checkout:
        if not mirror_available():
            pytest.skip("needs a Megatron-LM checkout: set MEGATRON_LM")
        checkout = str(tmp_path / "Megatron-LM")
        os.makedirs(checkout)
        subprocess.run(f"git --git-dir={MIRROR} archive core_v0.16.1 megatron | tar -x -C "
                       f"{checkout}", shell=True, check=True)
    proc = subprocess.run([sys.executable, "-c", _CHECKOUT_KEYS, checkout], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("configs/")]
    assert len(lines) == 4 and all(line.endswith(" []") for line in lines), proc.stdout
