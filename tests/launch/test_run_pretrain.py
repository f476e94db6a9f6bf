"""The main job end to end: run_pretrain.sh -> default corpus -> torchrun -> megatron.training.

Short runs (a few iterations) of exactly what a user starts; the full 300-iteration run and its
losses are in the README.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.markers import requires_megatron_training
from tests.helpers.megatron_lm_checkouts import free_port
from tests.helpers.preloaded import launch_env

pytestmark = requires_megatron_training
ROOT = Path(__file__).resolve().parents[2]
SHORT = ["--train-iters", "4", "--lr-warmup-iters", "1", "--log-interval", "1",
         "--eval-interval", "4", "--eval-iters", "1", "--seq-length", "64",
         "--max-position-embeddings", "64", "--num-layers", "2", "--hidden-size", "64"]


def _env(tmp_path, **extra):
    """The environment of one ``run_pretrain.sh`` launch: the preloaded launcher's, a free
    rendezvous port and ``OUT_DIR`` under ``tmp_path``, plus ``extra``."""
    return dict(launch_env(), MASTER_PORT=str(free_port()), OUT_DIR=str(tmp_path / "run"), **extra)


def _run(tmp_path, *flags, check=True):
    env = _env(tmp_path)
    env.setdefault("LOCO_DATA_DIR", str(Path.home() / ".cache" / "loco_megatron" / "data"))
    proc = subprocess.run(["bash", str(ROOT / "run_pretrain.sh"), *SHORT, *flags], env=env,
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert (proc.returncode == 0) == check, _excerpt(out)
    return out


def _excerpt(out: str) -> str:
    """The lines a failure report needs: every error/abort line, then the output's end."""
    keys = ("error", "Error", "terminate", "Signal", "signal", "Traceback", "exitcode")
    hits = [line for line in out.splitlines() if any(k in line for k in keys)]
    return "\n".join(hits[:80]) + "\n--- last 6000 characters ---\n" + out[-6000:]


def _losses(out):
    return [float(x) for x in re.findall(r"iteration\s+\d+/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)", out)]


# No end-of-line anchors: the ranks share one pipe and print() writes the line and its newline
# separately, so another rank's output can follow a line's last "|" directly.
LOCO_FIELDS = re.compile(
    r"iteration\s+(\d+)/.*?\| loco compression error norm: (\S+) \| loco error buffer norm: "
    r"(\S+) \| loco wire bytes per step: (\d+) \| loco compression ratio: ([0-9.]+) \|")
LOCO_TAGS = ("loco/compression-error-norm", "loco/error-buffer-norm", "loco/wire-bytes-per-step",
             "loco/compression-ratio")


def _scalars(tb_dir):
    """TensorBoard scalars written by the run: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def check_loco_telemetry(out, tb_dir, iterations):
    """LoCo fields on every iteration line (bytes = the start-up line's expected count, ratio =
    stock / LoCo), the same figures in TensorBoard, the loco-* timers in the timer block."""
    expected = re.search(r"> LoCo: model chunk 0: .* (\d+) bytes/step per rank on the wire vs "
                         r"(\d+) stock", out)
    lines = LOCO_FIELDS.findall(out)
    assert [int(m[0]) for m in lines] == list(range(1, iterations + 1)), "\n".join(
        line for line in out.splitlines() if "iteration" in line or "loco" in line.lower())
    for it, err, buf, nbytes, ratio in lines:
        assert float(err) > 0 and float(buf) > 0
        assert int(nbytes) == int(expected[1])
        assert float(ratio) == pytest.approx(int(expected[2]) / int(expected[1]), abs=5e-4)
    for name in ("loco-compress", "loco-comm", "loco-decompress"):
        assert re.search(rf"{name} \.+: \(\d+\.\d+, \d+\.\d+\)", out), name
    scalars = _scalars(tb_dir)
    for col, tag in enumerate(LOCO_TAGS, start=1):
        assert [step for step, _ in scalars[tag]] == list(range(1, iterations + 1))
        for (_, value), line in zip(scalars[tag], lines):
            assert value == pytest.approx(float(line[col]), rel=1e-6, abs=5e-4 if col == 4 else 0)


PARAM_FIELDS = re.compile(
    r"iteration\s+(\d+)/.*?\| loco param-gather bytes per step: (\d+) \(stock (\d+)\) \| "
    r"loco param drift max/rms: (\S+)/(\S+) \|")


def check_param_telemetry(out, tb_dir, iterations):
    """--loco-param-bits: bytes per step = the start-up line's (plus the exact all-gather of
    the first step), drift figures on every line and in TensorBoard."""
    expected = re.search(r"> LoCo: model chunk 0: parameter all-gather as 4-bit weight "
                         r"differences, \d+ buckets: (\d+) bytes/step per rank on the wire vs "
                         r"(\d+) stock", out)
    loco, stock = int(expected[1]), int(expected[2])
    lines = PARAM_FIELDS.findall(out)
    assert [int(m[0]) for m in lines] == list(range(1, iterations + 1))
    for it, nbytes, stock_bytes, dmax, drms in lines:
        assert int(nbytes) == (loco + stock if it == "1" else loco) and int(stock_bytes) == stock
        assert 0 <= float(drms) <= float(dmax) < 0.05  # relative to the parameters' RMS
    assert re.search(r"loco-param-encode \.+: \(\d+\.\d+, \d+\.\d+\)", out)
    scalars = _scalars(tb_dir)
    assert [v for _, v in scalars["loco/param-gather-bytes-per-step"]] == [
        float(m[1]) for m in lines]
    assert len(scalars["loco/param-drift-max"]) == iterations


@pytest.mark.skipif(sys.platform != "linux", reason="bash launcher")
def test_run_pretrain_loco4_on_default_corpus(tmp_path):
    """The main job's defaults plus --loco-param-bits 4 (both directions compressed)."""
    out = _run(tmp_path, "--save", str(tmp_path / "ckpt"), "--save-interval", "4",
               "--timing-log-level", "2", "--loco-param-bits", "4")
    assert "> LoCo active: 4-bit compensated reduce-scatter" in out
    assert re.search(r"> LoCo: model chunk 0: \d+ buckets, \d+ gradient elements", out)
    assert len(_losses(out)) == 4  # Megatron's own iteration lines
    assert "validation loss at iteration 4" in out
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert (tmp_path / "run" / "tensorboard").is_dir()
    check_loco_telemetry(out, tmp_path / "run" / "tensorboard", 4)
    check_param_telemetry(out, tmp_path / "run" / "tensorboard", 4)


@pytest.mark.skipif(sys.platform != "linux", reason="bash launcher")
def test_run_pretrain_bits16_is_stock(tmp_path):
    out = _run(tmp_path, "--loco-bits", "16", "--timing-log-level", "2")
    assert "> LoCo off (--loco-bits 16)" in out and "LoCo: model chunk" not in out
    assert len(_losses(out)) == 4
    assert "loco" not in "".join(re.findall(r".*iteration\s+\d+/.*", out))  # no LoCo fields
    assert "backward-compute" in out  # the level-2 timer block, without LoCo's timers:
    assert not re.search(r"loco-(compress|comm|decompress) \.+:", out)
    assert not [t for t in _scalars(tmp_path / "run" / "tensorboard") if "loco" in t]


@pytest.mark.skipif(sys.platform != "linux", reason="bash launcher")
def test_run_pretrain_tensor_parallel(tmp_path):
    """TP2 on 2 ranks (DP=1: nothing to compress, the stock path runs and says so)."""
    out = _run(tmp_path, "--tensor-model-parallel-size", "2")
    assert "data-parallel size 1, no gradient is communicated" in out
    assert len(_losses(out)) == 4


def test_bad_loco_flag_fails_at_startup_naming_it(tmp_path):
    env = _env(tmp_path)
    proc = subprocess.run(["bash", str(ROOT / "run_pretrain.sh"), *SHORT, "--loco-bits", "3",
                           "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"],
                          env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "error: --loco-bits 3 is not supported" in out
    assert "LoCoConfigError" not in out  # a one-line message, not our traceback
    assert "building GPT model" not in out  # before Megatron starts
    assert "preparing the default corpus" not in out and "ranks, logs" not in out  # at once


@pytest.mark.parametrize("nproc,refused", [("2", True), ("1", False)])
def test_preflight_sees_the_defaults_and_the_world_size(tmp_path, nproc, refused):
    """--calculate-per-token-loss: refused before anything starts with the script's default
    --loco-bits 4 at 2 ranks, with the ranks' own line; accepted at 1 rank, where the ranks
    accept it too (DP size 1: nothing is compressed). LOCO_DRY_RUN stops after the checks."""
    env = _env(tmp_path, NPROC=nproc, LOCO_DRY_RUN="1")
    proc = subprocess.run(["bash", str(ROOT / "run_pretrain.sh"), *SHORT,
                           "--calculate-per-token-loss", "--mock-data", "--tokenizer-type",
                           "NullTokenizer", "--vocab-size", "128"],
                          env=env, capture_output=True, text=True, timeout=600)
    line = "error: --loco-bits cannot be used with --calculate-per-token-loss"
    if refused:
        assert proc.returncode == 2 and line in proc.stderr, proc.stderr[-2000:]
        assert "preparing the default corpus" not in proc.stderr
    else:
        assert proc.returncode == 0 and line not in proc.stderr, proc.stderr[-2000:]
        assert "loco_megatron.training.pretrain_gpt" in proc.stdout


def test_unconvertible_loco_value_is_one_line(tmp_path):
    """argparse errors of --loco-* values: one error line, no usage text per rank."""
    env = _env(tmp_path)
    proc = subprocess.run(["bash", str(ROOT / "run_pretrain.sh"), "--loco-bits", "four"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    assert proc.stderr.count("error: argument --loco-bits: invalid int value: 'four'") == 1
    assert "usage:" not in proc.stderr


def test_async_save_refused_on_cpu_ranks(tmp_path):
    """--async-save without a GPU: one line at start-up (LoCo on, the default), never a hang in
    the save (megatron's persistent checkpoint worker runs outside the CUDA emulation)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: --async-save is megatron's own there")
    env = _env(tmp_path)
    proc = subprocess.run(["bash", str(ROOT / "run_pretrain.sh"), *SHORT, "--mock-data",
                           "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
                           "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
                           "--async-save", "--use-persistent-ckpt-worker",
                           "--async-strategy", "mcore"],
                          env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "error: --async-save needs a GPU" in out, _excerpt(out)
    assert "building GPT model" not in out and "LoCoConfigError" not in out  # our one line


def test_fsdp_refused_at_startup(tmp_path):
    env = _env(tmp_path)
    proc = subprocess.run(["bash", str(ROOT / "run_pretrain.sh"), *SHORT, "--use-megatron-fsdp",
                           "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"],
                          env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "error: --loco-bits 4 cannot be used with --use-megatron-fsdp" in out
    assert "LoCo active" not in out


def _checkpoint_tensors(ckpt_dir, tmp_path):
    """Every tensor of a torch_dist checkpoint, read offline with torch.distributed.checkpoint."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = tmp_path / (Path(ckpt_dir).parent.name + ".pt")
    dcp_to_torch_save(ckpt_dir, flat)
    return {k: v for k, v in torch.load(flat, weights_only=False).items() if torch.is_tensor(v)}


@pytest.mark.skipif(sys.platform != "linux", reason="bash launcher")
def test_resume_is_exact_through_megatron_training(tmp_path):
    """Megatron's own --save/--exit-interval then --load (torch_dist, dp_reshardable, dropout
    on), with the parameter all-gather compressed too (--loco-param-bits 4): the iteration-6
    checkpoint of the resumed run equals the uninterrupted run's tensor for tensor: model
    parameters (what the replicas hold), Adam state and fp32 main parameters, LoCo's error
    buffers (exact and summed forms)."""
    import torch

    straight, split = tmp_path / "straight", tmp_path / "split"
    both = ("--loco-param-bits", "4")
    _run(tmp_path, "--train-iters", "6", "--save", str(straight), "--save-interval", "6", *both)
    _run(tmp_path, "--train-iters", "6", "--save", str(split), "--save-interval", "3",
         "--exit-interval", "3", *both)
    out = _run(tmp_path, "--train-iters", "6", "--load", str(split), "--save", str(split),
               "--save-interval", "3", *both)
    assert re.search(r"successfully loaded checkpoint from .* at iteration 3", out)
    assert re.findall(r"iteration\s+(\d+)/\s*6 \|", out) == ["4", "5", "6"]
    assert "LoCo:" not in out.replace("LoCo: model chunk", "")  # exact restore: no warning
    a = _checkpoint_tensors(straight / "iter_0000006", tmp_path)
    b = _checkpoint_tensors(split / "iter_0000006", tmp_path)
    assert a.keys() == b.keys()
    assert {k for k in a if k.startswith("loco.")} >= {
        "loco.dp_group_idx_0.gbuf_idx_0.bucket_idx_0.exact.codes",
        "loco.dp_group_idx_0.gbuf_idx_0.bucket_idx_0.exact.scales",
        "loco.dp_group_idx_0.gbuf_idx_0.bucket_idx_0.error_sum"}
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


@pytest.mark.skipif(sys.platform != "linux", reason="bash launcher")
def test_failed_save_keeps_previous_checkpoint_loadable(tmp_path):
    """--ckpt-format torch: the LoCo file of the iteration-4 save cannot be written (a directory
    is in its way), the job fails, megatron's tracker still names iteration 2, and --load
    resumes from it."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000004" / "mp_rank_00" / "loco_state_0_dp000.pt").mkdir(parents=True)
    flags = ["--ckpt-format", "torch", "--save", str(ckpt), "--save-interval", "2"]
    out = _run(tmp_path, *flags, check=False)
    assert "loco_state_0_dp000.pt" in out
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert not list(ckpt.glob("iter_0000004/mp_rank_00/*.tmp*"))  # no half-written file left
    out = _run(tmp_path, "--ckpt-format", "torch", "--load", str(ckpt))
    assert re.search(r"successfully loaded checkpoint from .* at iteration 2", out)
    assert re.findall(r"iteration\s+(\d+)/\s*4 \|", out) == ["3", "4"]
