"""``python -m loco_megatron.training.run_megatron_lm``: a Megatron-LM ``pretrain_gpt.py`` run with LoCo.

(a) Without any checkout (CI): "checkouts" holding only a ``pretrain_gpt.py`` written here, in
each entry-point style, running the installed megatron-core 0.19 ``megatron.training``.
(b) Real Megatron-LM checkouts (``$MEGATRON_LM`` or tags extracted from a local mirror; skipped
otherwise): their own ``pretrain_gpt.py`` for 3 CPU iterations, LoCo 4-bit.
All runs: 2 CPU ranks, gloo, CUDA emulation, mock data, a tiny GPT.
"""

import os
import re
import subprocess
import sys
import textwrap
import types

import pytest

from loco_megatron.training import argument_hooks as lm_hooks
from loco_megatron.training.run_megatron_lm import CheckoutError, resolve_checkout, split_argv

from tests.helpers.megatron_lm_checkouts import (CPU_FLAGS, ROOT, TINY_GPT, real_checkout,
                                                 real_checkout_params, torchrun)

WRAPPER = ["-m", "loco_megatron.training.run_megatron_lm"]
LOCO_LINE = ("> LoCo active: 4-bit compensated reduce-scatter, block 256, err-beta 0.8, reset "
             "every 1024 steps, error storage int8; kernels cpu (auto); on CPU ranks (CUDA "
             "emulation, gloo)")
ITERATION = re.compile(r"iteration\s+(\d+)/\s*3 \|.*?lm loss: ([0-9.E+-]+)")

_HEAD = """
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    from loco_megatron.training.pretrain_gpt import (forward_step, model_provider,
                                            train_valid_test_datasets_provider)


    def user_args(parser):  # the script's own extra_args_provider, chained with LoCo's
        parser.add_argument("--user-flag", type=int, default=0)
        return parser
"""
_RUN = """
    print(f"user flag {args.user_flag}, loco bits {args.loco_bits}", flush=True)
    pretrain(pretrain_cfg_container_from_args(args, None), train_valid_test_datasets_provider,
             ModelType.encoder_or_decoder, forward_step, model_provider=model_provider)
"""
#: core >= 0.18: parse_and_validate_args(extra_args_provider=...), then pretrain(cfg_container)
NEW_STYLE = _HEAD + """
    from megatron.training.arguments import parse_and_validate_args

    if __name__ == "__main__":
        args = parse_and_validate_args(extra_args_provider=user_args,
                                       args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
""" + textwrap.indent(_RUN, "    ")
#: core <= 0.17: pretrain(..., extra_args_provider=...) whose initialize_megatron runs these
#: three steps (megatron/training/initialize.py at core_v0.16.1); the 0.19 wheel's pretrain
#: then finds the global args already set, as after parse_and_validate_args.
OLD_STYLE = _HEAD + """
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables

    if __name__ == "__main__":
        args = parse_args(user_args, False)
        validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
        set_global_variables(args)
""" + textwrap.indent(_RUN, "    ")


def _synthetic_checkout(tmp_path, source):
    (tmp_path / "pretrain_gpt.py").write_text(textwrap.dedent(source))
    return tmp_path


def _assert_trained(out):
    assert LOCO_LINE in out, out[-6000:]
    assert re.search(r"> LoCo: model chunk 0: 1 buckets, \d+ gradient elements", out)
    iterations = ITERATION.findall(out)
    assert [i for i, _ in iterations] == ["1", "2", "3"], out[-6000:]
    assert all(0 < float(loss) < 20 for _, loss in iterations)
    # the training-log telemetry is installed in this launch path too (docs/telemetry.md)
    assert len(re.findall(r"\| loco compression error norm: [0-9.E+-]+ \|", out)) == 3, out[-6000:]


@pytest.mark.parametrize("style", ["new_style", "old_style"])
def test_synthetic_checkout_trains_with_loco(tmp_path, style):
    checkout = _synthetic_checkout(tmp_path, NEW_STYLE if style == "new_style" else OLD_STYLE)
    loco = ["--use-distributed-optimizer", "--loco-bits", "4"]
    if style == "new_style":  # the same settings from a --config YAML file (docs/configs.md)
        (tmp_path / "loco.yaml").write_text("use-distributed-optimizer: true\nloco:\n  bits: 4\n")
        loco = ["--config", str(tmp_path / "loco.yaml")]
    rc, out = torchrun(WRAPPER, ["--megatron-lm", str(checkout), *CPU_FLAGS, *TINY_GPT, *loco,
                                 "--user-flag", "7"])
    assert rc == 0, out[-6000:]
    assert "user flag 7, loco bits 4" in out  # both providers' flags parsed
    assert re.search(r"> LoCo wrapper: running .*/pretrain_gpt.py with megatron-core 0\.19", out)
    _assert_trained(out)


def test_bad_loco_bits_fails_naming_the_flag(tmp_path):
    checkout = _synthetic_checkout(tmp_path, NEW_STYLE)
    rc, out = torchrun(WRAPPER, ["--megatron-lm", str(checkout), *CPU_FLAGS, *TINY_GPT,
                                 "--use-distributed-optimizer", "--loco-bits", "3"])
    assert rc != 0
    assert "error: --loco-bits 3 is not supported" in out
    assert "Traceback" not in out.split("error: --loco-bits")[0]  # no traceback before it
    assert "arguments ----" not in out  # before Megatron parsed anything


def test_combination_checked_after_megatron_parsed_the_flags(tmp_path):
    """Without --use-distributed-optimizer: refused at start-up on every rank, before Megatron
    parses anything or builds a model (the launch path's preflight, the same line as the check
    on Megatron's validated args in the set_global_variables hook)."""
    checkout = _synthetic_checkout(tmp_path, NEW_STYLE)
    rc, out = torchrun(WRAPPER, ["--megatron-lm", str(checkout), *CPU_FLAGS, *TINY_GPT,
                                 "--loco-bits", "4"])
    assert rc != 0
    assert "error: --loco-bits needs the distributed optimizer (--use-distributed-optimizer)" in out
    assert "LoCo active" not in out and "building GPT model" not in out


@pytest.mark.parametrize("loco,line", [
    ([], "> LoCo off (--loco-bits unset): nothing installed, megatron-core runs as shipped"),
    (["--loco-bits", "16"], "> LoCo off (--loco-bits 16): stock megatron-core reduce-scatter")],
    ids=["no_loco_flags", "bits16"])
def test_plain_ddp_with_loco_off_trains(tmp_path, loco, line):
    """Megatron-LM's plain DDP (no --use-distributed-optimizer) with LoCo off: trains as
    stock (it crashed while building DDP when the start-up check read a distributed-optimizer
    attribute of megatron-core's bucket groups)."""
    checkout = _synthetic_checkout(tmp_path, NEW_STYLE)
    rc, out = torchrun(WRAPPER, ["--megatron-lm", str(checkout), *CPU_FLAGS, *TINY_GPT, *loco])
    assert rc == 0, out[-6000:]
    assert line in out
    iterations = ITERATION.findall(out)
    assert [i for i, _ in iterations] == ["1", "2", "3"], out[-6000:]
    assert "loco compression" not in out and "LoCo: model chunk" not in out


@pytest.mark.parametrize("env,argv,message", [
    ({}, [], "no Megatron-LM checkout given: pass --megatron-lm PATH or set MEGATRON_LM=PATH"),
    ({"MEGATRON_LM": "/nonexistent/mlm"}, [],
     "MEGATRON_LM /nonexistent/mlm is not a Megatron-LM checkout (pretrain_gpt.py not found"),
    ({"MEGATRON_LM": str(ROOT)}, ["--megatron-lm", "/nonexistent/x"],
     "--megatron-lm /nonexistent/x is not a Megatron-LM checkout (pretrain_gpt.py not found"),
    ({}, ["--megatron-lm"], "--megatron-lm needs a value"),
])
def test_checkout_path_errors_are_one_line(env, argv, message):
    environ = {k: v for k, v in os.environ.items() if k != "MEGATRON_LM"}
    environ.update(env, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, *WRAPPER, *argv, "--train-iters", "3"], cwd=ROOT,
                          env=environ, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: {message}") and proc.stderr.count("\n") == 1


def test_split_argv_and_resolve(tmp_path):
    (tmp_path / "pretrain_gpt.py").write_text("")
    assert split_argv(["--lr", "1", "--megatron-lm", "/a", "--loco-bits", "4"]) == (
        "/a", ["--lr", "1", "--loco-bits", "4"])
    assert split_argv(["--megatron-lm=/b", "--lr", "1"]) == ("/b", ["--lr", "1"])
    assert resolve_checkout(None, {"MEGATRON_LM": str(tmp_path)}) == str(tmp_path)
    assert resolve_checkout(str(tmp_path), {"MEGATRON_LM": "/elsewhere"}) == str(tmp_path)
    with pytest.raises(CheckoutError, match="--megatron-lm needs a value"):
        split_argv(["--megatron-lm", "--lr"])


def test_rebind_reaches_names_imported_before_the_hook(monkeypatch):
    """core <= 0.17 initialize.py does ``from megatron.training.arguments import parse_args``
    at import time: that binding must be replaced too, and unrelated modules left alone."""
    def parse_args():
        return "stock"

    parse_args.__module__ = "megatron.fake_arguments"
    defining = types.SimpleNamespace(parse_args=parse_args)
    importer = types.SimpleNamespace(parse_args=parse_args)
    outsider = types.SimpleNamespace(parse_args=parse_args)
    monkeypatch.setitem(sys.modules, "megatron.fake_arguments", defining)
    monkeypatch.setitem(sys.modules, "megatron.fake_initialize", importer)
    monkeypatch.setitem(sys.modules, "someone_else", outsider)
    from loco_megatron.patching import PatchSet

    with PatchSet("test-rebind").applied() as patches:
        lm_hooks._rebind(patches, parse_args, lambda: "hooked")
        assert defining.parse_args() == importer.parse_args() == "hooked"
        assert outsider.parse_args is parse_args
    assert defining.parse_args() == importer.parse_args() == "stock"


@pytest.mark.parametrize("which", real_checkout_params())
def test_real_checkout_trains_with_loco(which, tmp_path_factory):
    """The checkout's own pretrain_gpt.py (up to core_v0.17.1: pretrain(extra_args_provider=...);
    from core_v0.18.2: parse_and_validate_args then pretrain(cfg_container)), its own megatron
    package (the dataset helper is compiled for this interpreter on rank 0)."""
    checkout = real_checkout(which, tmp_path_factory)
    # core_v0.13.1's mock data draws token ids up to 4095
    flags = [*TINY_GPT[:-1], "4096"] if TINY_GPT[-2] == "--vocab-size" else TINY_GPT
    rc, out = torchrun(WRAPPER, ["--megatron-lm", str(checkout), *CPU_FLAGS, *flags,
                                 "--use-distributed-optimizer", "--loco-bits", "4"],
                       preloaded=False)  # the checkout's own megatron package
    assert rc == 0, out[-6000:]
    assert "with megatron-core " in out and f"from {checkout}/megatron/core" in out
    _assert_trained(out)
