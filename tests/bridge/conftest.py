"""Megatron-Bridge tests (marker ``bridge``): they need the venv of ``VARIANT=bridge bash
install.sh`` (.venv-bridge) and skip, saying so, where ``megatron.bridge`` is not installed (the
main venv); under ``LOCO_REQUIRE_BRIDGE=1`` (``.ci/run`` sets it for the Bridge leg) each of them
fails instead, with the same reason. Run: ``.venv-bridge/bin/python -m pytest -q -m bridge tests/bridge``.

Puts ``tests/bridge/stand_ins`` first on ``PYTHONPATH`` (the test ranks and the documented
example get Bridge's stand-ins for GPU-only imports from its ``sitecustomize.py``; README.md
there lists them) and on this process's path, and has the ranks' fork server import Bridge's
training modules once.
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
STAND_INS = HERE / "stand_ins"


def bridge_installed() -> bool:
    try:
        return importlib.util.find_spec("megatron.bridge") is not None
    except ImportError:
        return False


SKIP_REASON = ("Megatron-Bridge is not installed in this venv: build .venv-bridge with "
               "'VARIANT=bridge bash install.sh' and run "
               "'.venv-bridge/bin/python -m pytest -q -m bridge tests/bridge'")

if bridge_installed():
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(STAND_INS)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    if str(STAND_INS) not in sys.path:
        sys.path.insert(0, str(STAND_INS))
    import bridge_stand_ins  # noqa: E402  (the fork server gets them from sitecustomize.py)

    bridge_stand_ins.activate()
    from tests.helpers import multiproc  # noqa: E402

    for module in ("megatron.bridge.training.pretrain", "megatron.bridge.training.gpt_step"):
        if module not in multiproc.PRELOAD:
            multiproc.PRELOAD.append(module)


def bridge_required() -> bool:
    """``LOCO_REQUIRE_BRIDGE=1``: a Bridge test that would skip fails instead (as
    ``LOCO_REQUIRE_SLURM`` for the live Slurm tests)."""
    return os.environ.get("LOCO_REQUIRE_BRIDGE") == "1"


def _here(item) -> bool:
    return HERE in Path(item.path).resolve().parents


def pytest_collection_modifyitems(config, items):
    if bridge_installed():
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if _here(item):
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under ``LOCO_REQUIRE_BRIDGE=1`` a skip of a test here (Bridge missing, or a ``skipif``,
    an ``importorskip``, a ``pytest.skip`` in a fixture) is reported as a failure with its
    reason."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and bridge_required() and not hasattr(report, "wasxfail") and _here(item):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"LOCO_REQUIRE_BRIDGE=1: this Bridge test would skip: {reason}"
