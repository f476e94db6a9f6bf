"""The harness that runs Megatron-LM's own distributed unit tests with the plugin installed
(tools/megatron_lm_unit_tests, docs/megatron_lm_unit_tests_harness.md).

The merge and comparison logic runs everywhere; one Megatron-LM test file in all three modes
(stock, bits 16, bits 4) runs only with a checkout (``$MEGATRON_LM``) or a local mirror, and
skips, saying so, without (CI on a fresh machine). The whole table is made by hand
(docs/megatron_lm_unit_tests.md): too long for CI's budget.
"""

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.helpers.megatron_lm_checkouts import NO_CHECKOUT, ROOT, mirror_available

HARNESS = ROOT / "tools" / "megatron_lm_unit_tests"


def _run_module():
    spec = importlib.util.spec_from_file_location("loco_mlm_run", HARNESS / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_test_fails_if_it_fails_on_any_rank():
    run = _run_module()
    per_rank = [{"a": {"outcome": "passed"}, "b": {"outcome": "skipped"},
                 "c": {"outcome": "passed"}},
                {"a": {"outcome": "failed", "message": "x"}, "b": {"outcome": "passed"},
                 "c": {"outcome": "passed"}}]
    merged = run.merge_ranks(per_rank, "f.py", crashed=False)
    assert {k: v["outcome"] for k, v in merged.items()} == {
        "a": "failed", "b": "passed", "c": "passed"}
    crashed = run.merge_ranks(per_rank[:1], "f.py", crashed=True)
    assert crashed["f.py::<file>"]["outcome"] == "failed"  # a crash never reads as a pass


def test_only_listed_bits4_differences_are_expected():
    run = _run_module()
    refusal = "LoCoConfigError: --loco-bits needs the distributed optimizer (--use-distributed-optimizer): ..."
    assert "plain DDP" in run.expected_reason("x.py::test_bucket_sizes[1]", refusal)
    assert "mocks" in run.expected_reason(
        "x.py::t", "LoCo: megatron-core's param_and_grad_buffer.dist_reduce_scatter_func is m")
    assert "exact gradient" in run.expected_reason(
        "tests/unit_tests/distributed/test_param_and_grad_buffer.py::test_grad_sync[1-True]",
        "AssertionError: tensor mismatch")
    assert run.expected_reason("x.py::test_bucket_sizes[1]", "AssertionError: 3 != 4") is None


def test_table_marks_bits16_differences():
    run = _run_module()
    same = {"t1": {"outcome": "passed"}}
    differs = {"t1": {"outcome": "failed", "message": "boom"}}
    rows = [("tests/unit_tests/distributed/a.py", 2,
             {"stock": same, "bits16": same, "bits4": same}),
            ("tests/unit_tests/distributed/b.py", 2,
             {"stock": same, "bits16": differs, "bits4": same})]
    text = run.table("core_vX", rows, [("bits16", 2, "b.py::t1", "passed", "failed", "boom",
                                        None)], 60.0)
    assert "| `a.py` | 2 | 1 / 0 / 0 | 1 / 0 / 0 | 1 / 0 / 0 | yes |" in text
    assert "| `b.py` | 2 | 1 / 0 / 0 | 0 / 1 / 0 | 1 / 0 / 0 | **no** |" in text
    assert "**unexpected**" in text and "boom" in text


def test_one_megatron_lm_file_in_every_mode(tmp_path):
    """``test_distributed_data_parallel.py`` (plain DDP over explicit DP groups) at 2 ranks:
    bits 16 as stock, bits 4 refused as plain DDP (the expected difference); exit status 0."""
    args = []
    if os.environ.get("MEGATRON_LM"):
        args = ["--megatron-lm", os.environ["MEGATRON_LM"]]
    elif mirror_available():
        args = ["--tag", "core_v0.19.0"]
    else:
        pytest.skip(NO_CHECKOUT)
    table = tmp_path / "table.md"
    proc = subprocess.run(
        [sys.executable, str(HARNESS / "run.py"), *args, "--ranks", "2", "--files",
         "tests/unit_tests/distributed/test_distributed_data_parallel.py", "--table", str(table)],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = table.read_text()
    assert "| `test_distributed_data_parallel.py` | 2 | 1 / 0 / 1 | 1 / 0 / 1 | 0 / 1 / 1 | yes |" \
        in text, text
    assert "expected, plain DDP" in text and "**unexpected**" not in text


@pytest.mark.parametrize("argv,message", [
    (["--files", "tests/x.py"], "--files needs --table PATH"),
    (["--modes", "bits16"], "--modes must include stock"),
    (["--tag", "core_v0.19.0", "--table", "/nonexistent/dir/t.md"], "its directory does not exist"),
])
def test_bad_harness_arguments_are_one_line(argv, message):
    proc = subprocess.run([sys.executable, str(HARNESS / "run.py"), *argv],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_stock_is_the_reference_whatever_the_order(monkeypatch, tmp_path):
    """``--modes bits4 stock``: still compared against stock (it used to compare nothing)."""
    run = _run_module()
    seen = []

    def fake_run_file(checkout, test, mode, ranks, timeout, log):
        seen.append(mode)
        return {"t": {"outcome": "passed" if mode == "stock" else "failed", "message": "m"}}

    checkout = tmp_path / "mlm"
    (checkout / "tests/unit_tests/distributed").mkdir(parents=True)
    (checkout / "tests/unit_tests/distributed/test_a.py").write_text("")
    monkeypatch.setattr(run, "run_file", fake_run_file)
    rc = run.main(["--megatron-lm", str(checkout), "--ranks", "2", "--modes", "bits16", "stock",
                   "--table", str(tmp_path / "t.md")])
    assert seen == ["stock", "bits16"] and rc == 1  # bits16 differing from stock: exit 1
    assert "**unexpected**" in (tmp_path / "t.md").read_text()
