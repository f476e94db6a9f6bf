"""``sbatch slurm/pretrain.sbatch`` on a live Slurm cluster (tests/helpers/slurm_cluster.py).

One controller and two node daemons on this machine, started for this module and stopped after
it (a daemon or job process left behind fails the last test). Every job: 2 Slurm nodes x
``NPROC`` CPU ranks (gloo, the CUDA emulation), the main job on the default corpus unless a
test says otherwise, a tiny GPT. The node names do not resolve: the script takes the master
address from Slurm's ``NodeAddr``. Recipes: docs/slurm.md.
"""

import hashlib
import os
import re
import signal
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.markers import requires_megatron_training
from tests.helpers.megatron_lm_checkouts import (CPU_FLAGS, MIRROR, ROOT, extract_tag,
                                                 mirror_available)
from tests.helpers.slurm_cluster import MARK, SlurmCluster, unavailable_reason
from tests.launch.test_run_pretrain import _checkpoint_tensors

pytestmark = [pytest.mark.slurm, requires_megatron_training]

SBATCH = str(ROOT / "slurm" / "pretrain.sbatch")
TINY = ["--lr-warmup-iters", "1", "--log-interval", "1", "--eval-interval", "1000",
        "--eval-iters", "1", "--seq-length", "64", "--max-position-embeddings", "64",
        "--num-layers", "2", "--hidden-size", "64", "--loco-bits", "4"]
ITERS = 12
ITERATION = re.compile(r"\] iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")
LOCO_LINE = re.compile(r"> LoCo active: 4-bit compensated reduce-scatter.*on CPU ranks")
JOB_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The cluster for this module. Without root or the packages: skipped, saying why; a
    failure instead where ``LOCO_REQUIRE_SLURM=1`` (.ci/run sets it after installing them)."""
    reason = unavailable_reason()
    if reason:
        (pytest.fail if os.environ.get("LOCO_REQUIRE_SLURM") == "1" else pytest.skip)(reason)
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=2)
    try:
        c.start()
        yield c
    finally:
        left = c.stop()
    assert not left, f"left running after the cluster stopped: {left}"


class Job:
    """One submitted job: its id, directory, log (``loco-<id>.log``) and completion records."""

    def __init__(self, cluster, workdir: Path, flags, env=None, sbatch_args=()):
        self.cluster, self.dir = cluster, workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.env = dict(cluster.env, LOCO_REPO=str(ROOT), NPROC="1", OMP_NUM_THREADS="1",
                        LOCO_OUT_DIR=str(workdir / "out"), LOCO_LOG_DIR=str(workdir))
        self.env.update(env or {})
        argv = ["sbatch", "--parsable", "--gpus-per-node=0", "--exclusive=user",
                f"--chdir={workdir}", f"--output={workdir}/slurm-%j.out", *sbatch_args,
                SBATCH, *flags]
        self.id = cluster.run(*argv, env=self.env).strip().split(";")[0]
        self.log = workdir / f"loco-{self.id}.log"

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_for(self, pattern: str, timeout_s: float = JOB_TIMEOUT_S) -> re.Match:
        """The first match of ``pattern`` in the job's log, waiting for it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = re.search(pattern, self.text())
            if m:
                return m
            if not self.cluster.run("squeue", "-h", "-j", self.id, check=False).strip():
                break
            time.sleep(0.2)
        raise AssertionError(f"job {self.id}: no {pattern!r} in its log:\n{self.text()[-5000:]}")

    def finish(self, timeout_s: float = JOB_TIMEOUT_S):
        records = self.cluster.wait_job(self.id, timeout_s)
        for r in records:  # the closing note's sacct lines
            print("sacct:", " | ".join(r.values()))
        return records

    def losses(self, after: str = "") -> dict:
        """Iteration -> the printed lm loss (text), from the log after ``after``'s first match."""
        text = self.text()
        if after:
            text = text[text.index(after):]
        return dict(ITERATION.findall(text))

    def ckpt(self) -> Path:
        return Path(self.env["LOCO_OUT_DIR"]) / "checkpoints"


def _assert_completed(job, records):
    assert records and records[-1]["State"] == "COMPLETED", (records, job.text()[-5000:])
    text = job.text()
    assert LOCO_LINE.search(text), text[-5000:]
    assert re.search(r"> LoCo: model chunk 0: \d+ buckets, \d+ gradient elements, \d+ "
                     r"bytes/step per rank on the wire", text), text[-5000:]


def _job_pids(job, node: str) -> list:
    """Every process of ``job`` on Slurm node ``node`` but Slurm's own (``slurmstepd``): the
    node's task (torchrun), its ranks and their helpers; their environment says which."""
    want = {f"SLURM_JOB_ID={job.id}".encode(), f"SLURMD_NODENAME={node}".encode(),
            f"{MARK}={job.cluster.root}".encode()}  # not another cluster's job of the same id
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = set((d / "environ").read_bytes().split(b"\0"))
            comm = (d / "comm").read_text().strip()
        except OSError:
            continue
        if want <= env and comm != "slurmstepd":
            pids.append(int(d.name))
    assert pids, f"no process of job {job.id} on {node}"
    return pids


def _digest(path: Path) -> dict:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def test_two_jobs_share_the_nodes_and_a_preempted_one_resumes_exactly(cluster, tmp_path):
    """A straight 4-bit run and the same run preempted (SIGUSR1 to the batch shell, as
    ``--signal=B:USR1@300`` sends it): both at once on the same two nodes, on different ports;
    the preempted job saves, requeues itself and resumes with LoCo's state to the same losses."""
    flags = [*TINY, "--train-iters", str(ITERS)]
    straight = Job(cluster, tmp_path / "straight", flags)
    preempted = Job(cluster, tmp_path / "preempted", flags)
    preempted.wait_for(r"\] iteration\s+3/")
    cluster.run("scancel", "--batch", "--signal=USR1", preempted.id)
    records = preempted.finish()
    straight_records = straight.finish()
    _assert_completed(straight, straight_records)
    _assert_completed(preempted, records)
    assert [r["State"] for r in records] == ["PENDING", "COMPLETED"], records  # requeued once

    text = preempted.text()
    saved = int(re.search(r"loco: checkpoint at iteration (\d+) in ", text).group(1))
    assert 3 <= saved < ITERS, text[-5000:]
    assert f"loco: requeued (restart 1): resuming from {preempted.ckpt()} (iteration {saved})" \
        in text
    assert "exiting program after receiving SIGTERM" in text
    ports = [re.search(r"master 127\.0\.0\.1:(\d+),", j.text()).group(1)
             for j in (straight, preempted)]
    assert ports[0] != ports[1], ports
    resumed = preempted.losses(after="loco: requeued")
    reference = straight.losses()
    assert sorted(map(int, reference)) == list(range(1, ITERS + 1))
    assert sorted(map(int, resumed)) == list(range(saved + 1, ITERS + 1)), text[-5000:]
    # Megatron logs a process's first iteration without resetting its loss sum, so its second
    # line (here saved + 2) prints the mean of two iterations; every other line is one iteration.
    second = str(saved + 2)
    mean = (float(reference[str(saved + 1)]) + float(reference[second])) / 2
    assert abs(float(resumed.pop(second)) - mean) <= 1e-6 * mean
    assert resumed == {k: reference[k] for k in resumed}
    # and the iteration-12 checkpoints (weights, Adam, main params, LoCo's error buffers) agree
    a = _checkpoint_tensors(straight.ckpt() / f"iter_{ITERS:07d}", straight.dir)
    b = _checkpoint_tensors(preempted.ckpt() / f"iter_{ITERS:07d}", preempted.dir)
    assert a.keys() == b.keys() and any(k.startswith("loco.") for k in a)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_node_failure_ends_the_job_and_keeps_the_last_checkpoint(cluster, tmp_path):
    """Node n2 lost mid-run (every process of the job there killed at once): the job fails within a bounded time, a line names n2 and
    the last checkpoint the tracker names, and the checkpoint saved before the kill is
    unchanged."""
    flags = [*TINY, "--train-iters", "400"]
    job = Job(cluster, tmp_path / "fail", flags, env={"SAVE_INTERVAL": "2"})
    job.wait_for(r"successfully saved checkpoint from iteration\s+2 ")
    tracker = job.ckpt() / "latest_checkpointed_iteration.txt"
    good = int(tracker.read_text())
    before = _digest(job.ckpt() / f"iter_{good:07d}")
    killed_at = time.monotonic()
    for pid in _job_pids(job, "n2"):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    records = job.finish(timeout_s=180)
    assert time.monotonic() - killed_at < 180
    assert records[-1]["State"] == "FAILED", records
    text = job.text()
    line = re.search(r"loco: job \d+ failed \(exit \d+\) on node (\S+) .*; last good checkpoint: "
                     r"iteration (\d+) in (\S+)", text)
    assert line and line.group(1) == "n2", text[-5000:]
    last = int(tracker.read_text())
    assert int(line.group(2)) == last >= good
    assert (job.ckpt() / f"iter_{last:07d}" / ".metadata").is_file()
    assert _digest(job.ckpt() / f"iter_{good:07d}") == before


def test_hierarchical_one_slurm_node_is_one_loco_node(cluster, tmp_path):
    """``--loco-hierarchical`` with 2 Slurm nodes x 2 ranks: LoCo sees 2 nodes of 2 ranks."""
    job = Job(cluster, tmp_path / "hier", [*TINY, "--train-iters", "4", "--loco-hierarchical"],
              env={"NPROC": "2"})
    records = job.finish()
    _assert_completed(job, records)
    text = job.text()
    assert re.search(r"> LoCo hierarchical: model chunk 0, data-parallel group of 4 ranks = 2 "
                     r"nodes x 2 ranks \(LOCAL_WORLD_SIZE=2\): intra-node stage", text), text[-5000:]
    assert sorted(job.losses()) == ["1", "2", "3", "4"]


def _synthetic_checkout(path: Path) -> Path:
    from tests.launch.test_megatron_lm_wrapper import NEW_STYLE

    path.mkdir(parents=True)
    (path / "pretrain_gpt.py").write_text(textwrap.dedent(NEW_STYLE))
    return path


@pytest.mark.parametrize("checkout", ["synthetic", "core_v0.19.0"])
def test_megatron_lm_checkout_variant(cluster, tmp_path, checkout):
    """``MEGATRON_LM=CLONE sbatch slurm/pretrain.sbatch <pretrain_gpt.py flags>``: the
    checkout's own pretrain_gpt.py on both nodes (the real one where a mirror is available)."""
    if checkout == "synthetic":
        clone = _synthetic_checkout(tmp_path / "Megatron-LM")
    elif not mirror_available():
        pytest.skip(f"no Megatron-LM mirror (LOCO_MEGATRON_LM_MIRROR={MIRROR})")
    else:
        clone = extract_tag(checkout, tmp_path / checkout)
    flags = [*CPU_FLAGS, *TINY, "--train-iters", "4", "--micro-batch-size", "2",
             "--global-batch-size", "4", "--lr", "1e-3", "--num-attention-heads", "4",
             "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
             "--use-distributed-optimizer", "--split", "98,1,1"]
    job = Job(cluster, tmp_path / "job", flags,
              env={"MEGATRON_LM": str(clone), "LOCO_PYTHON": str(ROOT / ".venv/bin/python")})
    records = job.finish()
    _assert_completed(job, records)
    assert sorted(job.losses()) == ["1", "2", "3", "4"]
