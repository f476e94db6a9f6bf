"""The suite's root conftest (layout and conventions: tests/README.md).

* registers the markers (here only; pytest.ini declares none);
* marks every test by the folder it lives in: tests/unit -> ``unit``, tests/distributed ->
  ``distributed``, tests/launch -> ``launch``, tests/benchmarks -> ``benchmark``, tests/bridge
  -> ``bridge``. A test file
  outside these folders is a usage error, so every test has exactly one kind;
* the ``run_ranks`` fixture: :func:`tests.helpers.multiproc.run_ranks`, for tests that start
  gloo (or NCCL) ranks.

The fast loop: ``.venv/bin/python -m pytest -q -m unit tests``.
"""

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

#: folder under tests/ -> the marker every test in it gets
KINDS = {"unit": "unit", "distributed": "distributed", "launch": "launch",
         "benchmarks": "benchmark", "bridge": "bridge"}

MARKERS = {
    "unit": "single process, seconds per file (tests/unit/): the fast loop, -m unit",
    "distributed": "starts several gloo ranks with run_ranks (tests/distributed/)",
    "launch": "end to end through a launcher: run_pretrain.sh, torchrun, a Megatron-LM "
              "checkout, the slurm scripts, the Megatron-LM unit-test harness (tests/launch/)",
    "benchmark": "the benchmark harness, benchmarks/ (tests/benchmarks/)",
    "bridge": "Megatron-Bridge recipes with LoCo (tests/bridge/): need .venv-bridge "
              "(VARIANT=bridge bash install.sh), skipped elsewhere",
    "gpu": "needs CUDA GPUs and NCCL (skipped when too few GPUs are present)",
    "slurm": "submits jobs to a throwaway Slurm cluster on this machine (root and Debian's "
             "slurm packages; skipped otherwise, saying why; tests/launch/test_slurm_cluster.py)",
}


def pytest_configure(config):
    for name, description in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")


def pytest_collection_modifyitems(config, items):
    stray = set()
    for item in items:
        try:
            parts = item.path.resolve().relative_to(TESTS).parts
        except ValueError:
            continue  # not a test of this suite
        kind = KINDS.get(parts[0]) if len(parts) > 1 else None
        if kind is None:
            stray.add(str(item.path))
            continue
        item.add_marker(getattr(pytest.mark, kind))
    if stray:
        raise pytest.UsageError(
            f"test files outside tests/{{{','.join(KINDS)}}}/ (each test lives in the folder of "
            f"its kind, tests/README.md): {', '.join(sorted(stray))}")


@pytest.fixture(scope="session")
def run_ranks():
    """``run_ranks(worker, world_size, *args, backend="gloo", local_world_size=None,
    timeout_s=None)``: each rank's return value, in rank order (tests/helpers/multiproc.py).
    ``worker`` must be a module-level function (it is pickled by its module path)."""
    from tests.helpers.multiproc import run_ranks

    return run_ranks
