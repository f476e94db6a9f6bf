"""benchmarks/convergence.py: result parsing (on a real 3-iteration run), the table and the
acceptance computation (hand-computed values), the plot, failure reporting."""

import math
import re
import shlex
import sys
from pathlib import Path

import pytest

from benchmarks import convergence as conv
from benchmarks import launch
from tests.helpers.markers import requires_megatron_training

ROOT = Path(__file__).resolve().parent.parent.parent
MOCK = ("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128")
TINY = conv.Config(iters=3, num_layers=1, hidden_size=32, heads=2, seq_length=32, micro_batch=2,
                   warmup=1, eval_iters=1, last_k=2, timeout_s=240.0)


# ---------------------------------------------------------------- a real tiny run


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One 3-iteration LoCo 4-bit run (mock data) through the benchmark's own launcher."""
    run_dir = tmp_path_factory.mktemp("conv") / "loco"
    result = conv.run_one(TINY, run_dir, [*MOCK, "--loco-bits", "4"])
    return run_dir, result, (run_dir / "log.txt").read_text()


@requires_megatron_training
@pytest.mark.skipif(sys.platform != "linux", reason="torch.distributed.run with gloo")
def test_real_run_losses_match_the_log(tiny_run):
    run_dir, result, log = tiny_run
    # the iteration lines Megatron printed (6 significant digits) vs the event file (exact)
    printed = {int(m.group(1)): float(m.group(2)) for m in
               re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)", log)}
    assert sorted(printed) == [1, 2, 3]
    assert sorted(result.train) == [1, 2, 3]
    # Megatron does not reset its loss accumulator after the first iteration's line
    # (training_log: should_reset = not is_first_iteration), so with --log-interval 1 the line of
    # iteration 2 prints the mean of iterations 1 and 2; the event file has each iteration's own
    tb = result.train
    assert printed[1] == pytest.approx(tb[1], rel=1e-5)
    assert printed[2] == pytest.approx((tb[1] + tb[2]) / 2, rel=1e-5)
    assert printed[3] == pytest.approx(tb[3], rel=1e-5)
    assert "LoCo active: 4-bit" in log  # the flags reached the run
    # validation loss: from the final "on validation set" line, also in the event file at step 3
    assert math.isfinite(result.valid) and result.valid > 0
    tb_valid = [v for s, v in conv.read_scalars(run_dir / "tensorboard")["lm loss validation"]
                if s == 3]
    assert any(v == pytest.approx(result.valid, rel=1e-5) for v in tb_valid)
    assert result.iter_ms is not None and result.iter_ms > 0


# ---------------------------------------------------------------- parsing


def test_parse_validation_takes_the_final_validation_set_line():
    log = "\n".join([
        " validation loss at iteration 10 | lm loss value: 5.000000E+00 | lm loss PPL: 1 | ",
        " validation loss at iteration 20 | lm loss value: 4.500000E+00 | lm loss PPL: 1 | ",
        " validation loss at iteration 20 on validation set | lm loss value: 4.250000E+00 | "
        "lm loss PPL: 7.0E+01 | ",
        " validation loss at iteration 20 on test set | lm loss value: 4.750000E+00 | ",
    ])
    assert conv.parse_validation(log, 20) == 4.25
    with pytest.raises(conv.RunFailed, match="on validation set"):
        conv.parse_validation(log, 10)


def test_train_losses_needs_every_iteration_once():
    ok = {"lm loss": [(1, 3.0), (2, 2.5), (3, 2.0)]}
    assert conv.train_losses(ok, 3) == {1: 3.0, 2: 2.5, 3: 2.0}
    with pytest.raises(conv.RunFailed):
        conv.train_losses({"lm loss": [(1, 3.0), (3, 2.0)]}, 3)  # missing iteration
    with pytest.raises(conv.RunFailed):
        conv.train_losses({"lm loss": [(1, 3.0), (2, 2.5), (2, 2.4), (3, 2.0)]}, 3)  # twice
    with pytest.raises(conv.RunFailed):
        conv.train_losses({}, 3)


def test_parse_iteration_ms_median_after_the_first():
    log = "\n".join(f" iteration {i}/ 5 | elapsed time per iteration (ms): {ms} | lm loss: 1"
                    for i, ms in enumerate([900.0, 100.0, 300.0, 200.0], 1))
    assert conv.parse_iteration_ms(log) == 200.0
    assert conv.parse_iteration_ms("nothing") is None


# ---------------------------------------------------------------- summary


def test_final_loss_mean_and_standard_error():
    train = {1: 10.0, 2: 4.0, 3: 2.0, 4: 3.0, 5: 4.0}
    mean, se = conv.final_loss(train, 3)
    assert mean == pytest.approx(3.0)  # (2 + 3 + 4) / 3
    assert se == pytest.approx(1.0 / math.sqrt(3))  # sample std 1
    assert conv.final_loss(train, 1) == (4.0, 0.0)


def test_paired_difference_hand_computed():
    a, b = {1: 9.0, 2: 3.0, 3: 5.0, 4: 4.0}, {1: 1.0, 2: 2.0, 3: 4.0, 4: 4.0}
    d, se = conv.paired(a, b, 3)  # differences 1, 1, 0; mean of b 10/3
    assert d == pytest.approx((2 / 3) / (10 / 3))
    assert se == pytest.approx((1 / 3) / (10 / 3))  # sample var 1/3, se sqrt(1/9)
    assert d == pytest.approx(conv.rel(conv.final_loss(a, 3)[0], conv.final_loss(b, 3)[0]))


def test_acceptance_hand_computed():
    a = conv.acceptance({"full": 2.0, "nocomp": 2.05, "ef": 2.02, "loco": 2.01})
    assert a["loco_vs_full"] == pytest.approx(0.005)
    assert a["loco_vs_nocomp"] == pytest.approx((2.01 - 2.05) / 2.05)
    assert a["within_tol"] and a["lower_than_nocomp"] and a["met"]
    a = conv.acceptance({"full": 2.0, "nocomp": 2.05, "ef": 2.02, "loco": 2.03})  # +1.5%
    assert a["loco_vs_full"] == pytest.approx(0.015)
    assert not a["within_tol"] and a["lower_than_nocomp"] and not a["met"]
    a = conv.acceptance({"full": 2.0, "nocomp": 1.99, "ef": 2.02, "loco": 1.995})
    assert a["within_tol"] and not a["lower_than_nocomp"] and not a["met"]
    a = conv.acceptance({"full": 2.0, "nocomp": 2.1, "ef": 2.0, "loco": 1.97})  # -1.5%: too far
    assert not a["within_tol"] and not a["met"]


def _fake_results():
    mk = lambda base, valid: conv.RunResult(  # noqa: E731
        {i: base + 4.0 / i for i in range(1, 31)}, valid, seconds=1.0, iter_ms=50.0)
    return {"full": mk(3.0, 3.1), "nocomp": mk(3.2, 3.3), "ef": mk(3.05, 3.12),
            "loco": mk(3.02, 3.11)}


def test_summary_and_markdown_table():
    s = conv.summarize(_fake_results(), k=5)
    full_train = sum(3.0 + 4.0 / i for i in range(26, 31)) / 5
    loco_train = full_train + 0.02
    assert s["rows"]["full"]["train"] == pytest.approx(full_train)
    assert s["train"]["loco_vs_full"] == pytest.approx(0.02 / full_train)
    assert s["valid"]["loco_vs_full"] == pytest.approx(0.01 / 3.1)
    assert s["valid"]["loco_vs_nocomp"] == pytest.approx((3.11 - 3.3) / 3.3)
    md = conv.markdown(s, conv.Config(iters=30))
    assert md.count("\n| ") == 5  # header + 4 runs
    assert f"| {loco_train:.4f} ± " in md
    assert f"{100 * 0.02 / full_train:+.2f}%" in md
    assert md.count("**met**") == 2
    assert s["paired_loco_vs_nocomp"][0] == pytest.approx(-0.18 / (full_train + 0.2))
    assert s["paired_loco_vs_nocomp"][1] == pytest.approx(0.0)  # constant offset: no noise
    md = conv.markdown(conv.summarize({**_fake_results(), "loco": _fake_results()["nocomp"]},
                                      k=5), conv.Config(iters=30))
    assert md.count("**not met**") == 2 and "NOT lower" in md


def test_plot_writes_a_png(tmp_path):
    path = conv.plot(_fake_results(), tmp_path / "sub" / "c.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_run_builds_the_section_and_cleans_up(tmp_path, monkeypatch):
    seen = []

    def fake_run_one(cfg, run_dir, extra):
        run_dir.mkdir(parents=True)
        seen.append((run_dir.name, tuple(extra)))
        return _fake_results()[run_dir.name]

    monkeypatch.setattr(conv, "run_one", fake_run_one)
    sec = conv.run(quick=True, workdir=tmp_path, cfg=conv.Config(iters=30, last_k=5),
                   extra=MOCK)
    assert [name for name, _ in seen] == ["full", "nocomp", "ef", "loco"]
    assert seen[1][1][-4:] == ("--loco-bits", "4", "--loco-reset-interval", "1")
    assert seen[3][1][-4:] == ("--loco-bits", "4", "--loco-err-beta", "0.8")
    assert all(extra[:len(MOCK)] == MOCK for _, extra in seen)
    assert sec.name == "convergence" and sec.files == ["convergence.png"]
    assert (tmp_path / "convergence.png").is_file()
    assert not (tmp_path / "convergence-runs").exists()
    assert sec.data["train"]["met"] is True and len(sec.data["train_loss"]["loco"]) == 30


# ---------------------------------------------------------------- failures


def _fake_launch(code):
    return lambda cfg, run_dir, extra, port: [sys.executable, "-c", code]


def test_failed_run_reports_status_and_log_tail(tmp_path, monkeypatch):
    monkeypatch.setattr(conv, "launch_command", _fake_launch(
        "import sys; print('\\n'.join(f'line {i}' for i in range(100))); sys.exit(3)"))
    with pytest.raises(conv.RunFailed) as e:
        conv.run_one(conv.Config(iters=3), tmp_path / "r", [])
    msg = str(e.value)
    assert "exited with status 3" in msg and "line 99" in msg and "line 10\n" not in msg


def test_timed_out_run_is_killed(tmp_path, monkeypatch):
    monkeypatch.setattr(conv, "launch_command", _fake_launch(
        "import time; print('started', flush=True); time.sleep(60)"))
    with pytest.raises(conv.RunFailed, match=r"timed out after 1 s(.|\n)*started"):
        conv.run_one(conv.Config(iters=3, timeout_s=1.0), tmp_path / "r", [])


def test_run_without_results_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(conv, "launch_command", _fake_launch("print('ok')"))
    with pytest.raises(conv.RunFailed, match="results are incomplete(.|\n)*TensorBoard"):
        conv.run_one(conv.Config(iters=3), tmp_path / "r", [])


# ---------------------------------------------------------------- launch vs run_pretrain.sh


def test_launch_keeps_run_pretrain_defaults():
    """The flags the benchmark takes from run_pretrain.sh are still the script's (no drift)."""
    script = "\n".join(line.split("#", 1)[0] for line in
                       (ROOT / "run_pretrain.sh").read_text().splitlines())
    has = lambda words: re.search(  # noqa: E731
        r"(^|[\s(])" + r"\s+".join(map(re.escape, words)) + r"($|[\s)])", script, re.M)
    for flag in launch.CPU_ARGS:
        if flag.startswith("--"):
            assert has([flag]), flag
    assert has(["--distributed-backend", "gloo"]) and has(["--transformer-impl", "local"])
    for flag, value in zip(conv.DEFAULT_ARGS, [*conv.DEFAULT_ARGS[1:], None]):
        if not flag.startswith("--"):
            continue
        assert has([flag] if value is None or value.startswith("--") else [flag, value]), flag
    assert not has(["--seed", "4321"])  # the check can fail
    cmd = conv.launch_command(conv.FULL, Path("/x"), ["--loco-bits", "16"], 1234)
    assert cmd[cmd.index("--master-port") + 1] == "1234" and cmd[-2:] == ["--loco-bits", "16"]
    assert cmd[cmd.index("--global-batch-size") + 1] == str(conv.FULL.micro_batch * 2)
