"""A rank killed (SIGKILL) in the middle of a compensated reduce-scatter: the other ranks exit
non-zero on their own within the process-group timeout instead of hanging, and the last
checkpoint still loads with its LoCo error buffers (RELIABILITY.md). Each rank is its
own process (python -m tests.distributed.worker_kill), as under a launcher, with gloo on CPU."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.helpers.multiproc import run_ranks
from .worker_ckpt import ckpt_worker

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120  # the process-group timeout the ranks run with (megatron: --distributed-timeout-minutes)


def test_killed_rank_fails_the_others_and_the_checkpoint_loads(tmp_path):
    world = 3
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    logs = [open(tmp_path / f"rank{r}.log", "w") for r in range(world)]
    # each rank in its own session: megatron's checkpoint writer leaves helper processes behind
    # when a rank is killed; they are cleaned up by process group below
    procs = [subprocess.Popen([sys.executable, "-m", "tests.distributed.worker_kill", str(r),
                               str(world), str(tmp_path), str(TIMEOUT_S)], cwd=ROOT, env=env,
                              stdout=logs[r], stderr=subprocess.STDOUT, start_new_session=True)
             for r in range(world)]
    ended = [None] * world
    try:
        deadline = time.monotonic() + 600 + TIMEOUT_S  # start-up + 2 steps + save, loaded machine
        while None in ended and time.monotonic() < deadline:
            for r, p in enumerate(procs):
                if ended[r] is None and p.poll() is not None:
                    ended[r] = time.monotonic()
            time.sleep(0.2)
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        for f in logs:
            f.close()
    outputs = [(tmp_path / f"rank{r}.log").read_text() for r in range(world)]
    codes = [p.returncode for p in procs]
    assert None not in ended, f"ranks still running: {ended}\n" + outputs[0][-3000:]
    assert codes[-1] == -signal.SIGKILL, outputs[-1][-3000:]
    for rank in range(world - 1):
        assert "checkpoint saved" in outputs[rank], outputs[rank][-3000:]
        assert codes[rank] not in (0, -signal.SIGKILL), outputs[rank][-3000:]  # its own error
        assert "should not happen" not in outputs[rank]
        # on their own, well within the process-group timeout (gloo: the peer's socket closed)
        assert ended[rank] - ended[-1] < TIMEOUT_S, (ended, outputs[rank][-3000:])
    saved = [torch.load(tmp_path / f"errors{r}.pt", weights_only=False) for r in range(world)]
    assert saved[0], "LoCo saved no error buffer"
    results = run_ranks(ckpt_worker, world, 1, [
        {"phase": "load", "config": {"bits": 4}, "steps": 1, "format": "torch_dist",
         "dir": str(tmp_path / "ckpt")}], timeout_s=600)
    for rank, (res,) in enumerate(results):
        assert "error" not in res, res.get("error")
        assert res["logs"] == [], res["logs"]  # restored exactly: no reset, no warning
        after = res["errors_after_load"]
        assert after.keys() == saved[rank].keys()
        for key, fields in saved[rank].items():
            for name, t in fields.items():
                assert torch.equal(after[key][name], t), (rank, key, name)
