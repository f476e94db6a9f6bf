"""tests/helpers/multiproc.py itself: ranks forked from the preloaded fork server must not inherit
an initialised CUDA driver (torch's "poison fork"), so NCCL ranks are spawned."""

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import multiproc

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import importlib, importlib.util, sys, torch
calls = []
if hasattr(torch._C, "_cuda_getDeviceCount"):  # a CUDA build: count cudaGetDeviceCount calls
    orig = torch._C._cuda_getDeviceCount
    torch._C._cuda_getDeviceCount = lambda: calls.append(1) or orig()
for m in sys.argv[1:]:
    if importlib.util.find_spec(m.split(".")[0]) is not None:
        importlib.import_module(m)
print(len(calls))
"""


def test_nccl_ranks_are_not_forked_from_a_server_that_initialised_cuda():
    proc = subprocess.run([sys.executable, "-c", CHILD, *multiproc.PRELOAD], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    cuda_inits = int(proc.stdout.split()[-1])
    if cuda_inits:  # the preload calls cudaGetDeviceCount (CUDA builds of torch, as here)
        assert multiproc.start_method("nccl") == "spawn"
    assert multiproc.start_method("gloo") == multiproc.START_METHOD
