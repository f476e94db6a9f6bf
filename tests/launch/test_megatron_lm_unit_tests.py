"""The harness that runs Megatron-LM's own distributed unit tests with the plugin installed
(tools/megatron_lm_unit_tests, docs/megatron_lm_unit_tests_harness.md).

The merge and comparison logic runs everywhere; one Megatron-LM test file in all three modes
(stock, bits 16, bits 4) runs only with a checkout (``$MEGATRON_LM``) or a local mirror, and
skips, saying so, without (CI on a fresh machine). The whole table is made by hand
(docs/megatron_lm_unit_tests.md): too long for CI's budget.
"""

import importlib.util
import json
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


def _messages_module():
    _run_module()  # puts tools/megatron_lm_unit_tests on sys.path
    import mlm_messages

    return mlm_messages


def test_a_different_failure_message_is_a_difference():
    """Stock failing one way and the plugin failing another way in the same test differ."""
    messages = _messages_module()
    stock = {"t": {"outcome": "failed", "message": "RuntimeError: world_size (2) is not "
                                                  "divisible by 8"}}
    other = {"t": {"outcome": "failed", "message": "KeyError: 'loco'"}}
    (diff,) = messages.differences(stock, other)
    assert diff[:3] == ("t", "failed", "failed") and "loco" in diff[4] and "world_size" in diff[3]
    assert messages.differences(stock, stock) == []


@pytest.mark.parametrize("a,b", [
    ("AssertionError: <Foo object at 0x7f983a53dab0> is not None",
     "AssertionError: <Foo object at 0x7f1ff8153f40> is not None"),
    ("FileNotFoundError: /tmp/pytest-of-root/pytest-12/test_x0/ckpt/common.pt",
     "FileNotFoundError: /tmp/pytest-of-root/pytest-13/test_x0/ckpt/common.pt"),
    ("DistNetworkError: 127.0.0.1:29511 refused (pid=4242)",
     "DistNetworkError: 127.0.0.1:41873 refused (pid=977)"),
    ("hung after 12.5 s", "hung after 130 s"),
    ("AssertionError: unexpected keys {'b', 'a', {'d': 1, 'c': 2}}",
     "AssertionError: unexpected keys {'a', {'c': 2, 'd': 1}, 'b'}"),
    ("Differing items: {'keyE': [6]} != {'keyE': [1]} {'keyK': [2, 3]} != {'keyK': [0, 1]} Use -v",
     "Differing items: {'keyK': [2, 3]} != {'keyK': [0, 1]} {'keyE': [6]} != {'keyE': [1]} Use -v"),
    # mfsdp_v2/test_dbuffer.py in stock: torch.empty's memory in pytest's introspection, and
    # data pointers, differ from one run to the next
    ("AssertionError: assert device(type='cpu') == device(type='cuda', index=1)\n + where "
     "device(type='cpu') = tensor([ 1.6452e-23, 4.5703e-41]).device",
     "AssertionError: assert device(type='cpu') == device(type='cuda', index=1)\n + where "
     "device(type='cpu') = tensor([0., 0.]).device"),
    ("assert 94055408964224 == 94055404388928 + where 94055408964224 = <data_ptr>()",
     "assert 94452797006400 == 94452781761024 + where 94452797006400 = <data_ptr>()"),
])
def test_what_varies_between_runs_is_normalised_away(a, b):
    messages = _messages_module()
    assert messages.normalise(a) == messages.normalise(b)
    assert messages.differences({"t": {"outcome": "failed", "message": a}},
                                {"t": {"outcome": "failed", "message": b}}) == []


def test_normalising_keeps_what_matters():
    """Lists keep their order, numbers that are not addresses, ports or times stay."""
    messages = _messages_module()
    assert messages.normalise("[1, 2]") != messages.normalise("[2, 1]")
    assert messages.normalise("world_size (2) is not divisible by 8") != messages.normalise(
        "world_size (2) is not divisible by 4")
    assert messages.normalise("{'a': 1, 'b'") == "{'a': 1, 'b'"  # cut short: left as it is
    assert messages.normalise("assert 3 == 4 + where 3 = f()") != messages.normalise(
        "assert 3 == 5 + where 3 = f()")  # the assertion itself is compared


def test_message_differences_reach_the_table_and_the_exit_status(monkeypatch, tmp_path):
    """bits 16 failing with another message than stock: a difference (exit 1), both messages
    in the table; bits 4 failing the same way as stock modulo an address: none."""
    run = _run_module()

    def fake_run_file(checkout, test, mode, ranks, timeout, log):
        message = {"stock": "ValueError: at 0x1234", "bits16": "KeyError: 'step'",
                   "bits4": "ValueError: at 0xabcd"}[mode]
        return {f"{test}::t": {"outcome": "failed", "message": message}}

    checkout = tmp_path / "mlm"
    (checkout / "tests/unit_tests/distributed").mkdir(parents=True)
    (checkout / "tests/unit_tests/distributed/test_a.py").write_text("")
    monkeypatch.setattr(run, "run_file", fake_run_file)
    rc = run.main(["--megatron-lm", str(checkout), "--ranks", "2", "--table",
                   str(tmp_path / "t.md")])
    text = (tmp_path / "t.md").read_text()
    assert rc == 1 and "| `test_a.py` | 2 | 0 / 1 / 0 | 0 / 1 / 0 | 0 / 1 / 0 | **no** |" in text
    assert "message differs): stock `ValueError: at 0x1234`; bits16 `KeyError: 'step'`" in text
    assert "bits4" not in text.split("## Results that differ from stock")[1]


def test_a_module_skipped_at_import_shows_with_its_reason():
    run = _run_module()
    why = "MCoreTensorAwareStateDict requires nvidia-resiliency-ext"
    skipped = {"tests/unit_tests/dist_checkpointing/test_strict.py::<collection>": {
        "outcome": "skipped", "message": why}}
    ran = {"tests/unit_tests/dist_checkpointing/test_x.py::t": {"outcome": "passed"}}
    rows = [("tests/unit_tests/dist_checkpointing/test_strict.py", 2,
             {"stock": skipped, "bits16": skipped, "bits4": skipped}),
            ("tests/unit_tests/dist_checkpointing/test_x.py", 2,
             {"stock": ran, "bits16": ran, "bits4": ran})]
    text = run.table("core_vX", rows, [], 60.0)
    assert "| `test_strict.py` | 2 | skipped at import | skipped at import | skipped at import" \
        in text and "0 / 0 / 0" not in text
    assert f"- `test_strict.py` (2 ranks, stock): skipped at import: {why}" in text
    assert run.counts({"f.py::<no tests>": {"outcome": "skipped", "message": "m"}}) == "no tests"


def test_the_plugin_records_a_module_skip(tmp_path):
    """The pytest plugin's collection hook itself (no torchrun): a module that skips at import
    is written as one skipped ``<collection>`` entry with its reason."""
    (tmp_path / "test_skipped.py").write_text(
        "import pytest\npytest.skip('no resiliency ext here', allow_module_level=True)\n")
    out = tmp_path / "out"
    env = dict(os.environ, LOCO_MLM_OUT=str(out), LOCO_MLM_BITS="stock", RANK="0",
               PYTHONPATH=os.pathsep.join([str(HARNESS), str(ROOT)]), OMP_NUM_THREADS="1")
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "loco_mlm_plugin", "-p",
                           "no:cacheprovider", "-o", "addopts=", "test_skipped.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    results = json.loads((out / "rank0.json").read_text())
    assert results == {"test_skipped.py::<collection>": {
        "outcome": "skipped", "message": "no resiliency ext here"}}, proc.stdout[-2000:]


def test_table_headings_name_the_directory():
    run = _run_module()
    ran = {"t": {"outcome": "passed"}}
    text = run.table("core_vX", [("tests/unit_tests/dist_checkpointing/test_optimizer.py", 2,
                                  {"stock": ran, "bits16": ran, "bits4": ran})], [], 60.0,
                     only_files=1)
    assert text.startswith("# Megatron-LM's `dist_checkpointing/` unit tests")
    assert "1 file of `tests/unit_tests/dist_checkpointing/`" in text
    assert "| `test_optimizer.py` | 2 |" in text and "distributed/" not in text.split("\n")[0]
    text = run.table("core_vX", [("tests/unit_tests/distributed/mfsdp_v1/test_a.py", 2,
                                  {"stock": ran}), ("tests/unit_tests/distributed/test_b.py", 2,
                                                    {"stock": ran})], [], 60.0)
    assert text.startswith("# Megatron-LM's `distributed/` unit tests")
    assert "| `mfsdp_v1/test_a.py` | 2 |" in text
    assert run.default_table("tests/unit_tests/dist_checkpointing") == \
        "docs/megatron_lm_unit_tests_dist_checkpointing.md"
    assert run.default_table("tests/unit_tests/distributed") == "docs/megatron_lm_unit_tests.md"


def test_cpu_shims_make_torch_adam_take_lr_none_and_keep_a_step():
    """The FusedAdam shims (mlm_cpu_shims), on torch's Adam in a subprocess (they patch torch)."""
    code = """
import torch, mlm_cpu_shims
mlm_cpu_shims.apply()
params = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))]
opt = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:]}], lr=None)
assert opt.param_groups[0]["lr"] == 1e-3, opt.param_groups
for p in params:  # seeded the FusedAdam way (as Megatron-LM's tests do): no step
    opt.state[p]["exp_avg"] = torch.zeros_like(p)
opt.param_groups[0]["step"] = 7  # FusedAdam counts in the group; group 1 never counted
sd = opt.state_dict()
assert [float(sd["state"][i]["step"]) for i in (0, 1)] == [7.0, 7.0], sd
assert float(opt.state[params[0]]["step"]) == 7.0  # in the state itself, as torch keeps it
p = torch.nn.Parameter(torch.ones(2))
real = torch.optim.Adam([p])
p.grad = torch.ones(2)
real.step()
assert float(real.state_dict()["state"][0]["step"]) == 1.0  # torch's own step untouched
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=str(HARNESS))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
