"""benchmarks/convergence*.py: result and probe parsing (on a real 3-iteration run), the
across-seed statistics and the tables (hand-computed values), the plan of runs and their flags,
the plot, failure reporting."""

import json
import math
import re
import shlex
import sys
from pathlib import Path

import pytest

from benchmarks import convergence as conv
from benchmarks import convergence_report
from benchmarks import convergence_runs as runs
from benchmarks import convergence_stats as stats
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
    result = runs.run_one(TINY, run_dir, [*MOCK, "--loco-bits", "4"])
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
    tb_valid = [v for s, v in runs.read_scalars(run_dir / "tensorboard")["lm loss validation"]
                if s == 3]
    assert any(v == pytest.approx(result.valid, rel=1e-5) for v in tb_valid)
    assert result.iter_ms is not None and result.iter_ms > 0
    # the drift probe ran on both ranks, one record per optimizer step
    assert sorted(p.name for p in (run_dir / "probe").iterdir()) == ["drift-rank0.json",
                                                                    "drift-rank1.json"]
    assert [s for s, _ in result.drift_series] == [1, 2, 3]
    assert 0 < result.drift < 1 and 0 <= result.zero_fraction < 1


# ---------------------------------------------------------------- parsing


def test_parse_validation_takes_the_final_validation_set_line():
    log = "\n".join([
        " validation loss at iteration 10 | lm loss value: 5.000000E+00 | lm loss PPL: 1 | ",
        " validation loss at iteration 20 | lm loss value: 4.500000E+00 | lm loss PPL: 1 | ",
        " validation loss at iteration 20 on validation set | lm loss value: 4.250000E+00 | "
        "lm loss PPL: 7.0E+01 | ",
        " validation loss at iteration 20 on test set | lm loss value: 4.750000E+00 | ",
    ])
    assert runs.parse_validation(log, 20) == 4.25
    with pytest.raises(runs.RunFailed, match="on validation set"):
        runs.parse_validation(log, 10)


def test_train_losses_needs_every_iteration_once():
    ok = {"lm loss": [(1, 3.0), (2, 2.5), (3, 2.0)]}
    assert runs.train_losses(ok, 3) == {1: 3.0, 2: 2.5, 3: 2.0}
    with pytest.raises(runs.RunFailed):
        runs.train_losses({"lm loss": [(1, 3.0), (3, 2.0)]}, 3)  # missing iteration
    with pytest.raises(runs.RunFailed):
        runs.train_losses({"lm loss": [(1, 3.0), (2, 2.5), (2, 2.4), (3, 2.0)]}, 3)  # twice
    with pytest.raises(runs.RunFailed):
        runs.train_losses({}, 3)


def test_parse_iteration_ms_median_after_the_first():
    log = "\n".join(f" iteration {i}/ 5 | elapsed time per iteration (ms): {ms} | lm loss: 1"
                    for i, ms in enumerate([900.0, 100.0, 300.0, 200.0], 1))
    assert runs.parse_iteration_ms(log) == 200.0
    assert runs.parse_iteration_ms("nothing") is None


# ---------------------------------------------------------------- probe files


def _probe_file(folder, rank, series):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"drift-rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "steps": len(series), "series": series}))


def test_read_probe_averages_ranks_and_steps(tmp_path):
    _probe_file(tmp_path, 0, [[1, 0.5, 0.2], [2, 0.3, 0.4]])
    _probe_file(tmp_path, 1, [[1, 0.6, 0.1], [2, 0.1, 0.3]])
    drift, zeros, series = runs.read_probe(tmp_path)
    assert drift == pytest.approx(0.2)             # last step, mean over ranks
    assert zeros == pytest.approx(1.0 / 4)          # (0.2 + 0.4 + 0.1 + 0.3) / 4
    assert series == [(1, 0.5), (2, 0.3)]           # rank 0
    assert runs.read_probe(tmp_path / "none") == (None, None, [])
    _probe_file(tmp_path, 2, [[1, 0.6, 0.1]])
    with pytest.raises(ValueError, match="different step counts"):
        runs.read_probe(tmp_path)


# ---------------------------------------------------------------- statistics


def test_across_seeds_hand_computed():
    s = stats.across_seeds([0.01, 0.02, 0.03])
    se = math.sqrt((0.01 ** 2 + 0.0 + 0.01 ** 2) / 2 / 3)
    assert s["mean"] == pytest.approx(0.02) and s["se"] == pytest.approx(se)
    assert s["ci95"] == pytest.approx(4.303 * se) and not s["beyond_noise"]  # 0.02 < 0.0248
    s = stats.across_seeds([0.010, 0.011, 0.012])
    assert s["beyond_noise"] and s["negative"] == 0
    s = stats.across_seeds([-0.010, -0.011, 0.002])
    assert s["negative"] == 2 and not s["beyond_noise"]
    one = stats.across_seeds([0.5])
    assert one["mean"] == 0.5 and math.isnan(one["se"]) and not one["beyond_noise"]
    with pytest.raises(ValueError):
        stats.across_seeds([])
    assert stats.t975(2) == 4.303 and stats.t975(12) == 2.228 and math.isnan(stats.t975(0))


def _run(base, valid, drift=None, zeros=None):
    return runs.RunResult({i: base + 4.0 / i for i in range(1, 31)}, valid, seconds=1.0,
                          iter_ms=50.0, drift=drift, zero_fraction=zeros,
                          drift_series=[(i, 0.1) for i in range(1, 31)] if drift else [])


#: per seed: full precision's offset; the arms add a fixed offset per arm plus seed noise
SEEDS = (1, 2, 3)
OFFSET = {"nocomp": 0.06, "ef": 0.03, "loco": 0.02, "loco-fr": 0.015, "loco+param": 0.021}
NOISE = {1: 0.0, 2: 0.002, 3: -0.002}


def _fake_results(blocks=(256, 4096)):
    out = {}
    for s in SEEDS:
        out[("full", None, s)] = _run(3.0 + 0.01 * s, 3.1 + 0.01 * s)
        for b in blocks:
            for arm, off in OFFSET.items():
                out[(arm, b, s)] = _run(3.0 + 0.01 * s + off + NOISE[s],
                                        3.1 + 0.01 * s + off + NOISE[s],
                                        drift=0.01 * (1 + s), zeros=0.2)
    return out


def test_summary_pairs_by_seed():
    res = _fake_results()
    s = stats.summarize(res, list(OFFSET), (256, 4096), SEEDS, 5, conv.COMPARISONS)
    k_mean = sum(4.0 / i for i in range(26, 31)) / 5
    per_seed = [(0.02 + NOISE[s_]) / (3.0 + 0.01 * s_ + k_mean) for s_ in SEEDS]
    row = s["rows"]["loco@256"]
    assert row["vs_full"]["train"]["per_seed"] == pytest.approx(per_seed)
    assert row["vs_full"]["train"]["mean"] == pytest.approx(sum(per_seed) / 3)
    valid = [(0.02 + NOISE[s_]) / (3.1 + 0.01 * s_) for s_ in SEEDS]
    assert row["vs_full"]["valid"]["per_seed"] == pytest.approx(valid)
    assert row["drift"]["mean"] == pytest.approx(0.03)
    assert row["zero_fraction"]["mean"] == pytest.approx(0.2)
    c = s["comparisons"]["loco-vs-ef@4096"]
    # the same seed noise in both arms cancels: a clean -0.01 offset
    expect = [(-0.01) / (3.1 + 0.01 * s_ + 0.03 + NOISE[s_]) for s_ in SEEDS]
    assert c["valid"]["per_seed"] == pytest.approx(expect)
    assert c["valid"]["beyond_noise"] and stats.wins(c)
    assert not stats.wins(s["comparisons"]["loco+param-vs-loco@256"])  # it is worse


def test_markdown_tables_and_verdicts():
    s = stats.summarize(_fake_results(), list(OFFSET), (256, 4096), SEEDS, 5, conv.COMPARISONS)
    labels = {a.key: a.label for a in (conv.FULL_ARM, *conv.ARMS)}
    cfg = conv.Config(iters=30, last_k=5, arms=tuple(OFFSET))
    md = conv.markdown(s, cfg, labels, why="because")
    assert md.count("**Block 256**") == 1 and md.count("**Block 4096**") == 1
    assert md.count("| 4-bit LoCo (β = 0.8) |") == 2
    assert "Why this size: because" in md
    loco = s["rows"]["loco@256"]["vs_full"]["valid"]
    assert f"{100 * loco['mean']:+.2f}% ± {100 * loco['se']:.2f}%" in md
    assert "| loco vs ef | 4096 |" in md
    assert "- Does LoCo beat plain error feedback: yes, beyond seed noise" in md
    assert "- Does the 4-bit parameter all-gather lower the loss: not shown" in md
    # the grid line follows the rule: full-range wins at every block here
    lines = convergence_report.verdicts(s["comparisons"], "symmetric")
    assert any("wins at every block size" in ln and "the default should be `full-range`" in ln
               for ln in lines)
    lines = convergence_report.verdicts(s["comparisons"], "full-range")
    assert not any("should be" in ln for ln in lines)
    assert any("so `full-range` is the default by the rule" in ln for ln in lines)


def test_plot_writes_a_png(tmp_path):
    cfg = conv.Config(iters=30, last_k=5, arms=tuple(OFFSET))
    labels = {a.key: a.label for a in (conv.FULL_ARM, *conv.ARMS)}
    path = conv.plot(_fake_results(), cfg, labels, tmp_path / "sub" / "c.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_run_plans_every_seed_arm_and_block(tmp_path, monkeypatch):
    seen = []
    fake = _fake_results()

    def fake_run_one(cfg, run_dir, extra):
        run_dir.mkdir(parents=True)
        extra = list(extra)
        seed = int(extra[extra.index("--seed") + 1])
        block = (int(extra[extra.index("--loco-block-size") + 1])
                 if "--loco-block-size" in extra else None)
        arm = next(a.key for a in (conv.FULL_ARM, *conv.ARMS)
                   if extra[-len(a.flags) - (2 if block else 0):][:len(a.flags)] == list(a.flags))
        seen.append((arm, block, seed))
        return fake[(arm, block, seed)]

    monkeypatch.setattr(conv, "run_one", fake_run_one)
    cfg = conv.Config(iters=30, last_k=5)
    sec = conv.run(quick=False, workdir=tmp_path, cfg=cfg, extra=MOCK)
    assert len(seen) == 3 * (1 + 2 * len(conv.ARMS)) and len(set(seen)) == len(seen)
    assert seen[0] == ("full", None, 1) and seen[1] == ("nocomp", 256, 1)
    assert sec.name == "convergence" and sec.files == ["convergence.png"]
    assert (tmp_path / "convergence.png").is_file()
    assert not (tmp_path / "convergence-runs").exists()
    assert set(sec.data["rows"]) == {f"{a.key}@{b}" for a in conv.ARMS for b in (256, 4096)}
    assert len(sec.data["train_loss"]["loco@4096@2"]) == 30


def test_arm_flags():
    flags = {a.key: a.flags for a in conv.ARMS}
    assert flags["nocomp"][:4] == ("--loco-bits", "4", "--loco-reset-interval", "1")
    assert "--loco-err-beta" in flags["ef"] and flags["ef"][flags["ef"].index("--loco-err-beta") + 1] == "0"
    assert flags["loco-fr"][-2:] == ("--loco-grid", "full-range")
    assert all(f[f.index("--loco-grid") + 1] == "symmetric" for k, f in flags.items()
               if k != "loco-fr")
    assert "--loco-param-bits" in flags["loco+param"]
    assert conv.run_flags(conv.ARMS[0], 4096)[-2:] == ["--loco-block-size", "4096"]
    assert conv.run_flags(conv.FULL_ARM, None) == ["--loco-bits", "16"]


# ---------------------------------------------------------------- failures


def _fake_launch(code):
    return lambda cfg, run_dir, extra, port: [sys.executable, "-c", code]


def test_failed_run_reports_status_and_log_tail(tmp_path, monkeypatch):
    monkeypatch.setattr(runs, "launch_command", _fake_launch(
        "import sys; print('\\n'.join(f'line {i}' for i in range(100))); sys.exit(3)"))
    with pytest.raises(runs.RunFailed) as e:
        runs.run_one(conv.Config(iters=3), tmp_path / "r", [])
    msg = str(e.value)
    assert "exited with status 3" in msg and "line 99" in msg and "line 10\n" not in msg


def test_timed_out_run_is_killed(tmp_path, monkeypatch):
    monkeypatch.setattr(runs, "launch_command", _fake_launch(
        "import time; print('started', flush=True); time.sleep(60)"))
    with pytest.raises(runs.RunFailed, match=r"timed out after 1 s(.|\n)*started"):
        runs.run_one(conv.Config(iters=3, timeout_s=1.0), tmp_path / "r", [])


def test_run_without_results_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(runs, "launch_command", _fake_launch("print('ok')"))
    with pytest.raises(runs.RunFailed, match="results are incomplete(.|\n)*TensorBoard"):
        runs.run_one(conv.Config(iters=3), tmp_path / "r", [])


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
    cmd = runs.launch_command(conv.FULL, Path("/x"), ["--loco-bits", "16"], 1234)
    assert cmd[cmd.index("--master-port") + 1] == "1234" and cmd[-2:] == ["--loco-bits", "16"]
    assert cmd[cmd.index("--global-batch-size") + 1] == str(conv.FULL.micro_batch * 2)


def test_a_diverged_run_is_flagged_and_a_silent_probe_fails(tmp_path, monkeypatch):
    res = _fake_results()
    res[("ef", 256, 2)] = _run(float("nan"), float("nan"), drift=0.1, zeros=0.2)
    s = stats.summarize(res, list(OFFSET), (256, 4096), SEEDS, 5, conv.COMPARISONS)
    assert s["rows"]["ef@256"]["diverged"] == 1 and s["rows"]["ef@4096"]["diverged"] == 0
    labels = {a.key: a.label for a in (conv.FULL_ARM, *conv.ARMS)}
    md = conv.markdown(s, conv.Config(iters=30, last_k=5, arms=tuple(OFFSET)), labels)
    assert md.count("1 run(s) diverged") == 1

    def no_probe(cfg, run_dir, extra):  # a compressed run whose probe wrote nothing
        run_dir.mkdir(parents=True)
        return _run(3.0, 3.1)

    monkeypatch.setattr(conv, "run_one", no_probe)
    with pytest.raises(runs.RunFailed, match="no drift-probe files"):
        conv.run(quick=False, workdir=tmp_path, cfg=conv.Config(iters=30, last_k=5), extra=MOCK)
