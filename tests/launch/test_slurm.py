"""slurm/pretrain.sbatch under a faked Slurm environment (LOCO_DRY_RUN=1): each node's command."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
USER_FLAGS = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
              "--loco-bits", "4", "--tensor-model-parallel-size", "2"]


def _expected(node_rank: int, nnodes: int, gpus: int, out_dir: str):
    """What run_pretrain.sh must launch on one node (GPU flags; TE absent on this machine)."""
    return [".venv/bin/python", "-m", "torch.distributed.run", "--nnodes", str(nnodes),
            "--node-rank", str(node_rank), "--nproc-per-node", str(gpus), "--master-addr",
            "10.1.0.1", "--master-port", "14242", "-m", "loco_megatron.training.pretrain_gpt",
            "--distributed-backend", "nccl", "--transformer-impl", "local",
            "--no-gradient-accumulation-fusion",
            "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
            "--seq-length", "256", "--max-position-embeddings", "256", "--micro-batch-size", "4",
            "--global-batch-size", str(4 * gpus * nnodes), "--train-iters", "300",
            "--split", "98,1,1", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style",
            "cosine", "--lr-warmup-iters", "20", "--weight-decay", "0.1", "--clip-grad", "1.0",
            "--seed", "1234", "--use-distributed-optimizer", "--log-interval", "10",
            "--eval-interval", "100", "--eval-iters", "10", "--tensorboard-dir",
            f"{out_dir}/tensorboard", "--loco-bits", "4", *_ckpt_flags(out_dir), *USER_FLAGS]


def _ckpt_flags(out_dir):
    """The job's own checkpoint flags: save/load in $OUT_DIR/checkpoints, save on SIGTERM."""
    return ["--save", f"{out_dir}/checkpoints", "--load", f"{out_dir}/checkpoints",
            "--save-interval", "100", "--exit-signal-handler"]


def _fake_slurm_env(tmp_path, **extra):
    """A 2-node allocation gpu-a[001-002] x 8 GPUs, job 4242, with a fake ``scontrol`` whose
    nodes' addresses (NodeAddr 10.1.0.x) differ from their names, as on clusters where node
    names are not DNS names."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"  # fake: `scontrol show hostnames <nodelist>`
    scontrol.write_text('#!/bin/bash\n'
                        'case "$*" in "show hostnames gpu-a[001-002]") printf "gpu-a001\\ngpu-a002\\n";;\n'
                        '  "show node gpu-a001") echo "NodeName=gpu-a001 Arch=x86_64"; '
                        'echo "   NodeAddr=10.1.0.1 NodeHostName=gpu-a001";;\n'
                        '  *) exit 1;; esac\n')
    scontrol.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(
        ("SLURM_", "MASTER_", "NNODES", "NODE_RANK", "GPUS_PER", "MEGATRON_LM", "LOCO_PYTHON"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", LOCO_DRY_RUN="1", SLURM_JOB_ID="4242",
               SLURM_JOB_NODELIST="gpu-a[001-002]", SLURM_NNODES="2", SLURM_GPUS_ON_NODE="8",
               SLURM_SUBMIT_DIR=str(ROOT), **extra)
    return env


def _node_commands(env, flags):
    proc = subprocess.run(["bash", str(ROOT / "slurm" / "pretrain.sbatch"), *flags],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("node ")]
    assert [ln.split(":", 1)[0] for ln in lines] == ["node 0", "node 1"]
    return [shlex.split(ln.split(":", 1)[1]) for ln in lines]


@pytest.mark.skipif(sys.platform != "linux", reason="bash launcher")
def test_dry_run_2_nodes_x_8_gpus(tmp_path):
    commands = _node_commands(_fake_slurm_env(tmp_path), USER_FLAGS)
    out_dir = f"{ROOT}/runs/slurm-4242"
    assert commands == [_expected(rank, 2, 8, out_dir) for rank in (0, 1)]
    assert not Path(out_dir).exists()  # a dry run creates nothing


@pytest.mark.skipif(sys.platform != "linux", reason="bash launcher")
def test_dry_run_megatron_lm_checkout_2_nodes_x_8_gpus(tmp_path):
    """MEGATRON_LM set: each node runs the wrapper on the checkout with the user's flags only."""
    checkout = tmp_path / "Megatron-LM"
    checkout.mkdir()
    flags = ["--num-layers", "32", "--use-distributed-optimizer", "--loco-bits", "4"]
    config = ["--config", "configs/tiny_cpu.yaml"]  # relative to the submit directory
    commands = _node_commands(_fake_slurm_env(tmp_path, MEGATRON_LM=str(checkout)),
                              [*flags, *config])
    assert commands == [
        [f"{ROOT}/.venv/bin/python", "-m", "torch.distributed.run", "--nnodes", "2",
         "--node-rank", str(rank), "--nproc-per-node", "8", "--master-addr", "10.1.0.1",
         "--master-port", "14242", "-m", "loco_megatron.training.run_megatron_lm", "--megatron-lm",
         str(checkout), *_ckpt_flags(f"{ROOT}/runs/slurm-4242"), *flags, "--config",
         f"{ROOT}/configs/tiny_cpu.yaml"] for rank in (0, 1)]


@pytest.mark.skipif(sys.platform != "linux", reason="bash launcher")
@pytest.mark.parametrize("megatron_lm", [False, True])
def test_dry_run_triton_cache_node_local_per_job(tmp_path, megatron_lm):
    """Both node launchers (run_pretrain.sh; slurm/megatron_lm_node.sh with MEGATRON_LM) give
    Triton a node-local cache of the job, ``$TMPDIR/loco-triton-$SLURM_JOB_ID``, unless the user
    set TRITON_CACHE_DIR."""
    extra = dict(TMPDIR=str(tmp_path / "local"))
    if megatron_lm:
        (tmp_path / "Megatron-LM").mkdir()
        extra["MEGATRON_LM"] = str(tmp_path / "Megatron-LM")
    base = _fake_slurm_env(tmp_path, **extra)
    base.pop("TRITON_CACHE_DIR", None)
    for user, want in ((None, f"{tmp_path}/local/loco-triton-4242"), ("/nfs/me", "/nfs/me")):
        env = dict(base)
        if user:
            env["TRITON_CACHE_DIR"] = user
        proc = subprocess.run(["bash", str(ROOT / "slurm" / "pretrain.sbatch"), *USER_FLAGS],
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("node-env ")]
        assert lines == [f"node-env {r}: TRITON_CACHE_DIR={want}" for r in (0, 1)], proc.stdout


def test_refuses_to_run_outside_slurm():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", str(ROOT / "slurm" / "pretrain.sbatch")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "run under Slurm (sbatch/salloc): SLURM_JOB_NODELIST is not set" in proc.stderr


def test_megatron_lm_node_refuses_a_missing_checkout():
    env = dict(os.environ, MEGATRON_LM="/nonexistent/Megatron-LM", LOCO_DRY_RUN="1")
    proc = subprocess.run(["bash", str(ROOT / "slurm" / "megatron_lm_node.sh")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "MEGATRON_LM=/nonexistent/Megatron-LM is not a directory" in proc.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="bash launcher")
@pytest.mark.parametrize("flags, added", [
    (["--save", "/ckpt/a"], ["--load", "/ckpt/a"]),  # a requeued job resumes from your --save
    (["--save=/ckpt/a"], ["--load", "/ckpt/a"]),
    (["--save", "/ckpt/a", "--load", "/ckpt/b"], []),
    # your --load alone (a pretrained model): the job still saves, so a preemption keeps work
    (["--load", "/ckpt/b"], ["--save", "CKPT", "--save-interval", "100"]),
])
def test_your_checkpoint_flags_replace_the_jobs(tmp_path, flags, added):
    checkout = tmp_path / "Megatron-LM"
    checkout.mkdir()
    commands = _node_commands(_fake_slurm_env(tmp_path, MEGATRON_LM=str(checkout)), flags)
    tail = commands[0][commands[0].index(str(checkout)) + 1:]
    ckpt = f"{ROOT}/runs/slurm-4242/checkpoints"
    assert tail == [*(ckpt if a == "CKPT" else a for a in added), "--exit-signal-handler", *flags]


@pytest.mark.skipif(sys.platform != "linux", reason="bash launcher")
def test_requeued_job_with_your_load_resumes_from_its_own_checkpoints(tmp_path):
    """--load /pretrained alone: once the job's directory holds a checkpoint (a requeued job),
    --load of that directory comes after yours, so it wins."""
    checkout = tmp_path / "Megatron-LM"
    checkout.mkdir()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("6")
    env = _fake_slurm_env(tmp_path, MEGATRON_LM=str(checkout), CKPT_DIR=str(ckpt),
                          SLURM_RESTART_COUNT="1")
    commands = _node_commands(env, ["--load", "/pretrained"])
    tail = commands[0][commands[0].index(str(checkout)) + 1:]
    assert tail == ["--save", str(ckpt), "--save-interval", "100", "--exit-signal-handler",
                    "--load", "/pretrained", "--load", str(ckpt)]


@pytest.mark.skipif(sys.platform != "linux", reason="bash launcher")
def test_a_config_files_save_counts_as_yours(tmp_path):
    """save:/load: in a --config YAML file are the user's: the job adds no --save/--load of its
    own (they would come after the file's flags and win)."""
    checkout = tmp_path / "Megatron-LM"
    checkout.mkdir()
    cfg = tmp_path / "run.yaml"
    cfg.write_text("save: /yaml/ckpt\nload: /yaml/ckpt\nsave-interval: 7\n")
    commands = _node_commands(_fake_slurm_env(tmp_path, MEGATRON_LM=str(checkout)),
                              ["--config", str(cfg)])
    tail = commands[0][commands[0].index(str(checkout)) + 1:]
    assert tail == ["--exit-signal-handler", "--config", str(cfg)]


@pytest.mark.skipif(sys.platform != "linux", reason="bash launcher")
def test_master_address_and_port_come_from_slurm_not_the_submitting_shell(tmp_path):
    """sbatch exports the submitter's environment: a MASTER_ADDR/MASTER_PORT/OUT_DIR there must
    not reach the job (node 1 would rendezvous with itself; jobs would share checkpoints)."""
    env = _fake_slurm_env(tmp_path, MASTER_ADDR="localhost", MASTER_PORT="1234",
                          OUT_DIR="/shared/out")
    commands = _node_commands(env, USER_FLAGS)
    assert commands == [_expected(rank, 2, 8, f"{ROOT}/runs/slurm-4242") for rank in (0, 1)]
