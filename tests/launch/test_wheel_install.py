"""The package as users install it, not the editable checkout the other tests import.

``python -m build`` makes the sdist and, from that sdist, the wheel (so a file missing from the
sdist is missing from the wheel too). Then:

* every file the package reads at run time is in the wheel and the sdist: the non-Python files
  of ``loco_megatron/``, and every file under ``loco_megatron/`` that the package opens while
  its modules import and its C kernels build (recorded with an audit hook);
* the wheel, installed with ``pip install --no-deps --target DIR`` and run with
  ``PYTHONPATH=DIR`` from a directory outside the repository (the venv's torch and
  megatron-core), trains on 2 CPU ranks with ``--loco-kernels auto`` and ``cpu`` and
  round-trips a checkpoint (tests/launch/worker_wheel.py); its ``loco-megatron`` console
  script prints plain-text help.
"""

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.helpers.megatron_lm_checkouts import free_port

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "loco_megatron"

#: runs in the source tree: the files under loco_megatron/ opened while every module imports
#: and the C kernels build (a fresh kernel cache), as paths relative to the repository root
OPENED = """
import importlib, json, os, pkgutil, sys
root = os.path.abspath("loco_megatron") + os.sep
opened = set()
def hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.abspath(os.fsdecode(args[0]))
        if path.startswith(root) and "__pycache__" not in path:
            opened.add(os.path.relpath(path, os.path.dirname(root.rstrip(os.sep))))
sys.addaudithook(hook)
import torch, loco_megatron
for info in pkgutil.walk_packages(loco_megatron.__path__, "loco_megatron."):
    try:
        importlib.import_module(info.name)
    except Exception:
        pass  # optional dependencies (triton): what imports is what counts
from loco_megatron import kernels
assert kernels.select("cpu", torch.zeros(4)) == "cpu"
print(json.dumps(sorted(opened)))
"""


def _run(cmd, **kwargs):
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, (f"{' '.join(map(str, cmd))} failed:\n"
                                  f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    """``(wheel, sdist)`` built by ``python -m build`` (the venv's setuptools, no download)."""
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
         timeout=600)
    wheels, sdists = list(out.glob("*.whl")), list(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, os.listdir(out)
    return wheels[0], sdists[0]


def _source_data_files():
    """Every non-Python file of the package in the source tree (relative to the root)."""
    return sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and "egg-info" not in str(p)
                  and p.suffix not in (".py", ".pyc", ".so"))


def _opened_at_run_time(tmp_path):
    env = dict(os.environ, LOCO_KERNEL_CACHE=str(tmp_path / "kernels"), PYTHONPATH=str(ROOT))
    return json.loads(_run([sys.executable, "-c", OPENED], cwd=ROOT, env=env,
                           timeout=600).splitlines()[-1])


def test_wheel_and_sdist_hold_every_runtime_file(dists, tmp_path):
    wheel, sdist = dists
    with zipfile.ZipFile(wheel) as z:
        in_wheel = set(z.namelist())
    with tarfile.open(sdist) as t:  # "loco_megatron-X.Y.Z/loco_megatron/..."
        in_sdist = {name.split("/", 1)[1] for name in t.getnames() if "/" in name}
    opened = _opened_at_run_time(tmp_path)
    assert "loco_megatron/kernels/cpu_kernels.c" in opened  # the hook sees what is read
    needed = sorted(set(opened) | set(_source_data_files()))
    for name, files in ((wheel.name, in_wheel), (sdist.name, in_sdist)):
        missing = [f for f in needed if f not in files]
        assert not missing, f"{name} lacks runtime files of the package: {', '.join(missing)}"
    import loco_megatron

    assert wheel.name.startswith(f"loco_megatron-{loco_megatron.__version__}-")
    assert sdist.name == f"loco_megatron-{loco_megatron.__version__}.tar.gz"


def test_installed_wheel_trains_and_round_trips_a_checkpoint(dists, tmp_path):
    wheel, _ = dists
    target, work = tmp_path / "site", tmp_path / "work"
    work.mkdir()
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
          "--target", str(target), str(wheel)], timeout=300)
    script = work / "worker_wheel.py"  # a copy: nothing of the source tree on sys.path
    shutil.copy(Path(__file__).with_name("worker_wheel.py"), script)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(target), OMP_NUM_THREADS="1",
               LOCO_KERNEL_CACHE=str(tmp_path / "kernels"))
    out = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", str(free_port()), str(script), str(tmp_path / "ckpt")],
               cwd=work, env=env, timeout=900)
    assert f"loco_megatron imported from {target / 'loco_megatron'}" in out, out[-3000:]
    for rank in (0, 1):
        for choice in ("auto", "cpu"):
            assert f"WHEEL SMOKE OK rank {rank} kernels {choice}:" in out, out[-3000:]
    # the console script the wheel installs (pip --target puts it in DIR/bin)
    help_text = _run([str(target / "bin" / "loco-megatron"), "--help"], cwd=work, env=env,
                     timeout=120)
    assert help_text.startswith("usage: loco-megatron") and "``" not in help_text, help_text
