"""benchmarks/gpu_check.sh (docs/gpu_check.md) without a GPU: the no-GPU exit, its detection,
the parsers of pytest's summary and of run_pretrain.sh's log, the step budget, the install.sh
staleness test, the report rendering, and the kernel checks' logic (C kernels on CPU)."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check, gpu_check_report as rep

ROOT = Path(__file__).resolve().parents[2]
HAS_GPU = torch.cuda.is_available() or shutil.which("nvidia-smi") is not None
no_gpu_only = pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU: the check would run")


# ------------------------------------------------------------------------------- no-GPU exit

@no_gpu_only
def test_script_without_gpu_prints_one_line_exits_0_writes_nothing(tmp_path):
    default = ROOT / "benchmarks" / "results" / "gpu_check.md"
    before = default.read_bytes() if default.exists() else None
    for extra in (["--out", str(tmp_path / "r.md")], []):
        proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), *extra],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert len(lines) == 1 and lines[0].startswith("gpu_check: no GPU on this machine (")
        assert lines[0].endswith("); nothing to check")
    assert list(tmp_path.iterdir()) == []
    assert (default.read_bytes() if default.exists() else None) == before


@no_gpu_only
def test_torch_probe_is_asked_when_nvidia_smi_is_present(monkeypatch, tmp_path, capsys):
    """nvidia-smi faked present: the fresh-Python torch probe (no loco_megatron import) says
    no CUDA, so still nothing is checked."""
    monkeypatch.setattr(gpu_check, "nvidia_smi", lambda: {"gpu": "fake", "driver": "1"})
    assert gpu_check.main(["--out", str(tmp_path / "r.md")]) == 0
    out = capsys.readouterr().out
    assert out.strip() == ("gpu_check: no GPU on this machine (torch.cuda.is_available() is "
                           "False); nothing to check")
    assert not (tmp_path / "r.md").exists()


def test_no_gpu_reason():
    good = {"cuda_available": True, "loco_megatron_imported": False}
    assert gpu_check.no_gpu_reason({"gpu": "H200"}, good) is None
    assert gpu_check.no_gpu_reason({"error": "nvidia-smi not found"},
                                   {"torch_error": "not probed"}) == "nvidia-smi not found"
    assert gpu_check.no_gpu_reason({"gpu": "H200"}, {"cuda_available": False}) == \
        "torch.cuda.is_available() is False"
    why = gpu_check.no_gpu_reason({"gpu": "H200"}, dict(good, loco_megatron_imported=True))
    assert "emulation" in why
    assert gpu_check.no_gpu_reason({"gpu": "x"}, {"torch_error": "ImportError: no torch"}) == \
        "torch: ImportError: no torch"


# ---------------------------------------------------------------------------------- pytest

PYTEST_OUT = """\
..ssss                                                                   [100%]
=========================== short test summary info ============================
SKIPPED [4] tests/distributed/test_megatron_grid.py:31: needs 2 GPUs, found 1
2 passed, 4 skipped, 612 deselected in 41.20s
"""


def test_parse_pytest_quiet_summary():
    s = rep.parse_pytest(PYTEST_OUT)
    assert (s["passed"], s["skipped"], s["deselected"], s["failed"], s["errors"]) == (2, 4, 612,
                                                                                      0, 0)
    assert s["seconds"] == 41.2 and s["line"] == "2 passed, 4 skipped, 612 deselected in 41.20s"
    assert s["skip_reasons"] == ["SKIPPED [4] tests/distributed/test_megatron_grid.py:31: needs "
                                 "2 GPUs, found 1"]
    assert rep.pytest_status(0, False, s) == "pass"


def test_parse_pytest_failures_errors_and_framed_lines():
    text = ("F.E\nFAILED tests/distributed/test_gpu.py::test_q - AssertionError: x\n"
            "ERROR tests/distributed/test_gpu.py::test_n - RuntimeError: NCCL\n"
            "==== 1 failed, 1 passed, 1 error, 2 warnings in 75.12s (0:01:15) ====\n")
    s = rep.parse_pytest(text)
    assert (s["failed"], s["passed"], s["errors"], s["warnings"]) == (1, 1, 1, 2)
    assert s["seconds"] == 75.12 and len(s["failures"]) == 2
    assert rep.pytest_status(1, False, s) == "fail"
    s = rep.parse_pytest("3 errors in 2.00s\n")
    assert s["errors"] == 3 and rep.pytest_status(1, False, s) == "fail"


def test_parse_pytest_no_tests_and_no_summary():
    s = rep.parse_pytest("\nno tests ran in 0.12s\n")
    assert s["passed"] == s["failed"] == 0 and s["seconds"] == 0.12
    assert rep.pytest_status(5, False, s) == "no tests"
    s = rep.parse_pytest("612 deselected in 3.2s")
    assert s["deselected"] == 612 and rep.pytest_status(5, False, s) == "no tests"
    # killed at the timeout: dots but no summary line
    assert rep.parse_pytest("..s.\n2 passed in the middle of a sentence") is None
    assert rep.pytest_status(None, True, None) == "timeout"
    assert rep.pytest_status(2, False, None) == "error"


# ------------------------------------------------------------------------------ run_pretrain

def _iter_line(i, loss, ms, extra=""):
    # megatron's format (tests/benchmarks/test_bench_step_time.py's captured log)
    return (f" [2026-11-30 10:48:57.315086] iteration {i:8d}/{50:8d} | consumed samples: "
            f"{4 * i:12d} | elapsed time per iteration (ms): {ms} | learning rate: 5.000000E-04 | "
            f"global batch size:     4 | lm loss: {loss:.6E} | loss scale: 1.0 | grad norm: 1.234 "
            f"| number of skipped iterations:   0 | number of nan iterations:   0 |{extra}")


STARTUP = ("> LoCo active: 4-bit compensated reduce-scatter, block 256, err-beta 0.8, reset "
           "every 512 steps, error storage int8; kernels triton (auto); on GPU\n"
           "> LoCo: model chunk 0: data-parallel size 1, no gradient is communicated; stock path\n")
# megatron's argument dump (a path that happens to hold an error word is no error)
ARGS = "  loco_error_dtype ................................ int8\n" \
       "  data_path ....................................... ['/data/KeyError-corpus/text']\n"


def _pretrain_log(n=50, every=5):
    lines = [ARGS, STARTUP]
    lines += [_iter_line(i, 9.0 - i / 10, 900.0 if i == every else 20.0 + i / 100)
              for i in range(every, n + 1, every)]
    lines += [" validation loss at the end of training for val data | lm loss value: "
              "5.123456E+00 | lm loss PPL: 1.678E+02 | "]
    return "\n".join(lines) + "\n"


def test_parse_pretrain_dp1_run():
    p = rep.parse_pretrain(_pretrain_log())
    assert p["iterations_logged"] == list(range(5, 51, 5)) and p["last_iteration"] == 50
    assert p["train_iters"] == 50
    assert p["last_loss"] == pytest.approx(4.0) and p["first_loss"] == pytest.approx(8.5)
    assert p["ms_first_logged"] == 900.0
    assert p["ms_per_iteration_median"] == pytest.approx(20.3)  # the first interval left out
    assert p["validation"] == [{"at": "the end of training for val data", "lm_loss": 5.123456}]
    assert p["loco_lines"] == STARTUP.splitlines() and p["errors"] == []
    assert p["dp1_stock_path"] and not p["compressed"]
    assert "nothing was compressed" in p["exercised"]
    assert rep.pretrain_status(0, False, p, 50) == "pass"
    assert rep.pretrain_status(0, False, p, 60) == "fail"  # fewer iterations than asked
    assert rep.pretrain_status(None, True, p, 50) == "timeout"


def test_parse_pretrain_errors_and_compressed():
    loco = (" loco compression error norm: 1.677032E+00 | loco error buffer norm: 5.169279E-01 | "
            "loco wire bytes per step: 5419128 | loco compression ratio: 7.758 |")
    text = (_iter_line(5, 8.9, 100.0, loco) + "\n" + _iter_line(10, float("nan"), 30.0, loco)
            + "\nTraceback (most recent call last):\ntorch.distributed.elastic.multiprocessing."
              "errors.ChildFailedError: \n  exitcode  : 1 (pid: 4242)\n")
    p = rep.parse_pretrain(text)
    assert p["compressed"] and "compressed the gradient" in p["exercised"]
    assert p["error_count"] == 3 and p["errors"][0].startswith("Traceback")
    assert p["last_iteration"] == 10 and p["last_loss"] != p["last_loss"]  # NaN parsed
    assert rep.pretrain_status(0, False, p, 10) == "fail"
    p = rep.parse_pretrain(_iter_line(10, float("nan"), 30.0))
    assert p["errors"] == [] and rep.pretrain_status(0, False, p, 10) == "fail"  # NaN loss
    assert "did not get as far" in rep.parse_pretrain("")["exercised"]


# ------------------------------------------------------------------------- budget, install.sh

def test_step_timeouts_leave_the_later_steps_their_share():
    later = ["kernels", "pytest", "pretrain"]
    floors = sum(gpu_check.STEPS[s][1] for s in later)
    assert gpu_check.step_timeout("throughput", 1000, later) == gpu_check.STEPS["throughput"][0]
    assert gpu_check.step_timeout("throughput", floors + 30, later) == 30
    assert gpu_check.step_timeout("throughput", floors - 5, later) == 0
    assert gpu_check.step_timeout("pretrain", 200, []) == 200
    assert sum(v[0] for v in gpu_check.STEPS.values()) > gpu_check.DEFAULT_BUDGET_S
    # the probe runs inside the budget; past it: the last step's kill, the report, start-up
    assert gpu_check.DEFAULT_BUDGET_S + 2 * gpu_check.KILL_GRACE_S + 10 <= 8 * 60


def test_install_stale_reason(tmp_path):
    for f in ("pyproject.toml", "setup.py", "install.sh"):
        (tmp_path / f).write_text("x")
    assert "missing" in gpu_check.install_stale_reason(tmp_path, {})
    stamp = tmp_path / ".venv" / ".loco-installed"
    stamp.parent.mkdir()
    stamp.write_text("")
    for f in ("pyproject.toml", "setup.py", "install.sh"):
        os.utime(tmp_path / f, (1, 1))
    assert gpu_check.install_stale_reason(tmp_path, {}) is None
    assert "records" in gpu_check.install_stale_reason(tmp_path, {"MCORE_VERSION": "0.16.1"})
    os.utime(tmp_path / "setup.py", None)
    os.utime(stamp, (2, 2))
    assert gpu_check.install_stale_reason(tmp_path, {}).startswith("setup.py is newer")
    os.utime(tmp_path / "setup.py", (1, 1))
    os.utime(tmp_path / "pyproject.toml", None)  # the package metadata
    assert gpu_check.install_stale_reason(tmp_path, {}).startswith("pyproject.toml is newer")


def test_skip_install_shim(tmp_path):
    shim = gpu_check._skip_install_shim(tmp_path)
    env = dict(os.environ, PATH=f"{shim}{os.pathsep}{os.environ['PATH']}")
    skipped = subprocess.run(["bash", "-c", "bash install.sh; echo after"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=30)
    assert skipped.stdout == "after\n" and "install.sh skipped" in skipped.stderr
    other = subprocess.run(["bash", "-c", "bash -c 'echo real'"], env=env, capture_output=True,
                           text=True, timeout=30)
    assert other.stdout == "real\n"


# ------------------------------------------------------------------------------- the report

def _results():
    row = {"dtype": "float32", "MiB": 64, "numel": 16777216, "compress_ms": 0.5,
           "compress_GBps": 1000.0, "compress_traffic_GBps": 1625.0,
           "compress_first_call_s": 2.5, "decompress_ms": 0.25, "decompress_GBps": 2000.0,
           "decompress_traffic_GBps": 1500.0, "decompress_first_call_s": 0.7, "apply_ms": 0.3,
           "apply_GBps": 1500.0, "apply_traffic_GBps": 2250.0, "apply_first_call_s": 0.5,
           "calls": [50, 50, 50]}
    case = {"bits": 4, "dtype": "bfloat16", "error_storage": "int8", "grid": "full-range",
            "steps": 5, "compress": {"vs torch on cuda": "bit-identical",
                                     "vs torch on cpu": "step 3: scales differ at 2 of 160"},
            "decompress": {"elements": 80000, "equal": 79990, "max_abs_diff": 1.5e-8,
                           "within_bound": True}, "ok": False}
    return {"command": "bash benchmarks/gpu_check.sh", "started": "2026-12-02T10:00:00",
            "seconds": 301.4, "budget_s": 470,
            "machine": {"gpu": "NVIDIA H200 (sm 9.0, 1 visible)", "driver": "570.1",
                        "torch": "2.14.1+cu130", "triton": "3.8.0", "commit": "abc1234"},
            "steps": {
                "throughput": {"status": "ok", "seconds": 40.2, "timeout_s": 120,
                               "log": "throughput.log",
                               "data": {"impl": "triton", "bits": 4, "block": 256, "world": 8,
                                        "beta": 0.8, "error_storage": "int8",
                                        "copy": {"GBps": 4000.0, "bytes": 256 << 20},
                                        "rows": [row], "errors": ["512 MiB torch.bfloat16: OOM"]}},
                "kernels": {"status": "fail", "seconds": 30, "timeout_s": 120,
                            "data": {"impl": "triton", "world": 8, "block": 256, "numel": 40000,
                                     "boundaries": [1234], "beta": 0.8, "reset_step": 2,
                                     "grids": ["symmetric", "full-range"], "cases": [case]}},
                "pytest": {"status": "timeout", "seconds": 150.0, "timeout_s": 150,
                           "data": {"summary": None}},
                "pretrain": {"status": "pass", "seconds": 80, "timeout_s": 160,
                             "data": {"command": "NPROC=1 bash run_pretrain.sh --bf16", "iters": 50,
                                      "install": "install.sh ran first (up to date: a no-op)",
                                      "parsed": rep.parse_pretrain(_pretrain_log())}}}}


def test_compile_step_rendered():
    """The compile check's step: its command, exit status and last lines in the report."""
    md = "\n".join(rep.render_compile({"command": "python -m loco_megatron.kernels.compile_check",
                                         "rc": 1, "tail": ["x spills 16 bytes"]}))
    assert "exit 1" in md and "    x spills 16 bytes" in md
    assert rep.TITLES["compile"].startswith("3. ") and "compile" in gpu_check.STEPS
    assert gpu_check.COMPILE_CMD[:2] == ["-m", "loco_megatron.kernels.compile_check"]


def test_render_markdown():
    md = rep.render_markdown(_results())
    assert "| GPU | NVIDIA H200 (sm 9.0, 1 visible) |" in md and "| triton | 3.8.0 |" in md
    assert "**4000 GB/s**" in md
    # GB/s, fractions of copy bandwidth (1000/4000, 1625/4000, 2000/4000, 1500/4000; apply
    # 2250/4000), compile s
    assert ("| float32 | 64 | 16,777,216 | 1000.0 | 0.250 | 0.406 | 2000.0 | 0.500 | 0.375 | "
            "1500.0 | 0.562 | 2.50 / 0.70 / 0.50 |") in md
    assert "Not measured: 512 MiB torch.bfloat16: OOM" in md
    assert ("| full-range | 4 | bfloat16 | vs torch on cuda: bit-identical; vs torch on cpu: "
            "step 3: scales differ at 2 of 160 | 79990/80000 / 1.5e-08 / yes | NO |") in md
    assert "| 4. pytest -m gpu | timed out after 150 s | 150 | 150 |" in md
    assert "No pytest summary line" in md
    assert "* iterations: 50 of 50" in md and "last 4.0000" in md
    assert "median 20.3 over the logged intervals after the first (first: 900.0)" in md
    assert "    > LoCo: model chunk 0: data-parallel size 1" in md


def test_write_report_markdown_and_json(tmp_path):
    res = _results()
    js = rep.write_report(res, tmp_path / "sub" / "gpu_check.md")
    assert js == tmp_path / "sub" / "gpu_check.json"
    assert json.loads(js.read_text())["steps"]["kernels"]["status"] == "fail"
    assert (tmp_path / "sub" / "gpu_check.md").read_text() == rep.render_markdown(res)


# ------------------------------------------------------- the kernel checks' logic, on CPU

def test_correctness_case_on_cpu_kernels_and_a_mismatch_is_caught(monkeypatch):
    from benchmarks import gpu_check_kernels as gk
    from loco_megatron import kernels
    from loco_megatron.kernels import cpu as cpu_kernels

    if cpu_kernels.unavailable_reason(torch.empty(0)) is not None:
        pytest.skip(cpu_kernels.unavailable_reason(torch.empty(0)))
    case = gk.check_case(4, torch.float32, gk.grid_kwargs()[0], impl="cpu", device="cpu")
    assert case["ok"] and case["compress"] == {"vs torch on cpu": "bit-identical"}
    assert case["decompress"]["equal"] == case["decompress"]["elements"] == gk.CHECK_NUMEL

    real = kernels.decompress_shard

    def off_by_a_lot(impl, *a, out, **kw):
        real(impl, *a, out=out, **kw)
        if impl == "cpu":
            out[7] += 1.0

    monkeypatch.setattr(kernels, "decompress_shard", off_by_a_lot)
    bad = gk.check_case(8, torch.bfloat16, gk.grid_kwargs()[0], impl="cpu", device="cpu")
    assert not bad["ok"] and not bad["decompress"]["within_bound"]
    assert bad["compress"] == {"vs torch on cpu": "bit-identical"}


def test_first_mismatch():
    from benchmarks.gpu_check_kernels import first_mismatch

    step = {"payload": torch.zeros(4, dtype=torch.uint8), "scales": torch.ones(2),
            "error codes": torch.zeros(4, dtype=torch.int8), "error scales": torch.ones(2),
            "nonfinite": 0}
    assert first_mismatch([step, step], [step, dict(step)]) is None
    neg0 = dict(step, scales=torch.tensor([1.0, -0.0]))
    assert first_mismatch([step, dict(step, scales=torch.tensor([1.0, 0.0]))], [step, neg0]) == \
        "step 1: scales differ at 1 of 2"
    assert first_mismatch([step], [dict(step, nonfinite=1)]) == "step 0: non-finite blocks 1 vs 0"


def test_throughput_row_on_cpu(tmp_path):
    from benchmarks import gpu_check_kernels as gk

    from loco_megatron.kernels import cpu as cpu_kernels

    impl = "cpu" if cpu_kernels.unavailable_reason(torch.empty(0)) is None else "torch"
    data = gk.run_throughput(tmp_path / "t.json", [1], impl, "cpu", copy_mib=8)
    assert json.loads((tmp_path / "t.json").read_text()) == json.loads(json.dumps(data))
    assert data["copy"]["GBps"] > 0 and data["copy"]["bytes"] == 8 << 20
    assert data["errors"] == [] and [r["dtype"] for r in data["rows"]] == ["float32", "bfloat16"]
    r = data["rows"][0]
    assert (r["MiB"], r["numel"], data["impl"]) == (1, 1 << 18, impl)
    assert r["compress_GBps"] > 0 and r["decompress_GBps"] > 0 and r["apply_GBps"] > 0
    assert r["compress_GBps"] == pytest.approx((1 << 20) / r["compress_ms"] / 1e6)
    assert r["apply_traffic_GBps"] > r["apply_GBps"]  # parameters read and written, codes read


def _alive(pid, wait_s=5.0):
    """Whether ``pid`` still runs after up to ``wait_s`` (a zombie awaiting its reaper is not)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        if state in ("Z", "X") or time.monotonic() > deadline:
            return state not in ("Z", "X")
        time.sleep(0.1)


def test_run_child_timeout_kills_the_process_group(tmp_path):
    log = tmp_path / "step.log"
    r = gpu_check.run_child(["bash", "-c", "sleep 60 & echo $!; wait"], log, 1,
                            env=dict(os.environ))
    assert r["timed_out"] and r["rc"] is not None
    grandchild = int(log.read_text().splitlines()[1])  # line 0: the command
    assert not _alive(grandchild)  # killed with its group, not left behind
    r = gpu_check.run_child(["bash", "-c", "exit 3"], log, 30, env=dict(os.environ))
    assert r == {"rc": 3, "seconds": r["seconds"], "timed_out": False}


def test_main_runs_the_steps_in_budget_and_writes_the_report(monkeypatch, tmp_path, capsys):
    """The orchestration with the GPU and the steps faked: order, timeouts, report, exit."""
    monkeypatch.setattr(gpu_check, "nvidia_smi", lambda: {"gpu": "Fake GPU", "driver": "1.0"})
    monkeypatch.setattr(gpu_check, "torch_probe", lambda py: {
        "cuda_available": True, "loco_megatron_imported": False, "torch": "2.x"})
    calls = []

    def fake(name, status):
        def step(*args):
            calls.append((name, round(args[1])))  # (logs, timeout, ...)
            return {"status": status, "seconds": 1.0, "rc": 0, "timed_out": False}
        return step

    monkeypatch.setattr(gpu_check, "_kernel_step",
                        lambda what, logs, timeout, sizes: fake(what, "ok")(logs, timeout))
    monkeypatch.setattr(gpu_check, "_pytest_step", fake("pytest", "pass"))
    monkeypatch.setattr(gpu_check, "_compile_step", fake("compile", "pass"))
    monkeypatch.setattr(gpu_check, "_pretrain_step",
                        lambda logs, timeout, iters, allow: fake("pretrain", "fail")(logs, timeout))
    out = tmp_path / "r" / "gpu.md"
    rc = gpu_check.main(["--out", str(out), "--logs", str(tmp_path / "logs")])
    assert rc == 1  # the main job "failed"
    assert [c[0] for c in calls] == ["throughput", "kernels", "compile", "pytest", "pretrain"]
    assert [c[1] for c in calls] == [120, 120, 120, 150, 300]
    res = json.loads(out.with_suffix(".json").read_text())
    assert {n: s["status"] for n, s in res["steps"].items()} == {
        "throughput": "ok", "kernels": "ok", "compile": "pass", "pytest": "pass",
        "pretrain": "fail"}
    assert res["machine"]["gpu"] == "Fake GPU" and "| GPU | Fake GPU |" in out.read_text()
    assert capsys.readouterr().out.startswith(f"gpu_check: report {out} (throughput ok, ")

    calls.clear()  # a budget that only the later steps' shares fit: the first step is skipped
    rc = gpu_check.main(["--out", str(out), "--logs", str(tmp_path / "logs"), "--budget", "215",
                         "--only", "throughput", "pytest", "pretrain"])
    assert rc == 1 and [c[0] for c in calls] == ["pytest", "pretrain"]
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["steps"]["throughput"]["status"] == "skipped"


def _fake_run_child(monkeypatch, text, rc=0, timed_out=False):
    """run_child that records its command and environment and writes ``text`` as the log."""
    seen = {}

    def run_child(cmd, log, timeout, env=None):
        seen.update(cmd=cmd, env=env, timeout=timeout)
        log.write_text(text)
        return {"rc": rc, "seconds": 1.0, "timed_out": timed_out}

    monkeypatch.setattr(gpu_check, "run_child", run_child)
    return seen


def test_pretrain_step_command_and_parse(monkeypatch, tmp_path):
    seen = _fake_run_child(monkeypatch, _pretrain_log())
    r = gpu_check._pretrain_step(tmp_path, 200, 50, False)
    assert seen["cmd"][1:] == ["run_pretrain.sh", "--bf16", "--loco-bits", "4", "--train-iters",
                               "50", "--log-interval", "5"]
    env = seen["env"]
    assert env["NPROC"] == "1" and env["OUT_DIR"] == str(tmp_path / "pretrain")
    assert int(env["MASTER_PORT"]) > 0 and "TRITON_INTERPRET" not in env
    assert r["status"] == "pass" and r["data"]["parsed"]["last_iteration"] == 50
    assert r["data"]["install"].startswith("install.sh")
    stale = gpu_check.install_stale_reason(gpu_check.ROOT, env)
    assert (str(tmp_path / "shim") in env["PATH"]) == (stale is not None)
    _fake_run_child(monkeypatch, _pretrain_log(), timed_out=True)
    assert gpu_check._pretrain_step(tmp_path, 200, 50, False)["status"] == "timeout"


def test_pytest_step_command_and_parse(monkeypatch, tmp_path):
    seen = _fake_run_child(monkeypatch, PYTEST_OUT)
    r = gpu_check._pytest_step(tmp_path, 100)
    assert seen["cmd"][1:] == ["-m", "pytest", "-q", "-m", "gpu", "tests", "-rfEs", "-p",
                               "no:cacheprovider"]
    assert r["status"] == "pass" and r["data"]["summary"]["skipped"] == 4
    _fake_run_child(monkeypatch, "....", timed_out=True)
    r = gpu_check._pytest_step(tmp_path, 100)
    assert r["status"] == "timeout" and r["data"]["summary"] is None


@no_gpu_only
@pytest.mark.parametrize("what", ["throughput", "kernels"])
def test_kernel_step_command_is_the_workers(monkeypatch, tmp_path, capsys, what):
    """The command gpu_check builds parses in the worker, which then refuses without CUDA."""
    from benchmarks import gpu_check_kernels as gk

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # other tests of the session set it
    seen = _fake_run_child(monkeypatch, "", rc=2)
    r = gpu_check._kernel_step(what, tmp_path, 100, [64, 128])
    assert r["status"] == "error" and seen["cmd"][1:4] == ["-m", "benchmarks.gpu_check_kernels",
                                                           what]
    assert gk.main(seen["cmd"][3:]) == 2
    assert "gpu_check_kernels: no CUDA device" in capsys.readouterr().err


def test_throughput_prints_the_static_ceiling_beside_measured_figures():
    """The throughput step states the compile check's issue ceiling beside what it measured
    (sm_90 here, computed without a GPU); without Triton it says why not."""
    pytest.importorskip("triton")
    from benchmarks.gpu_check_report import render_throughput

    # in a clean child process: compiles need TRITON_INTERPRET unset (other tests of the
    # session set it) and a Triton the suite's imports have not touched
    code = ("import json; from benchmarks import gpu_check_kernels as gk; "
            "print(json.dumps(gk.static_ceilings('cpu', capability=90)))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ceiling = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ceiling.get("arch") == "sm_90", ceiling
    assert 0 < ceiling["bfloat16"]["compress_GBps"] < 1e4, ceiling
    assert 0 < ceiling["bfloat16"]["apply_GBps"] < 1e4, ceiling
    row = dict(dtype="bfloat16", MiB=64, numel=1 << 25, compress_GBps=400.0,
               decompress_GBps=900.0, compress_ms=1.0, decompress_ms=1.0, apply_GBps=500.0)
    md = "\n".join(render_throughput(dict(rows=[row], copy={"GBps": 3000.0, "bytes": 1 << 28},
                                          static_ceiling=ceiling, world=8, block=256)))
    c = ceiling["bfloat16"]["compress_GBps"]
    assert "Static issue ceiling (sm_90" in md and f"bfloat16 compress {c:.0f} GB/s" in md, md
    d = ceiling["bfloat16"]["decompress_GBps"]
    assert f"(measured at 64 MiB: {400.0 / c:.3f} / {900.0 / d:.3f} of it)" in md, md
    a = ceiling["bfloat16"]["apply_GBps"]
    assert f"apply {a:.0f} GB/s (measured: {500.0 / a:.3f} of it)" in md, md
    md = "\n".join(render_throughput(dict(rows=[], static_ceiling={"error": "ImportError: x"})))
    assert "Static issue ceiling: not computed (ImportError: x)" in md
