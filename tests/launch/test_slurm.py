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
            "gpu-a001", "--master-port", "29517", "-m", "loco_megatron.training.pretrain_gpt",
            "--distributed-backend", "nccl", "--transformer-impl", "local",
            "--no-gradient-accumulation-fusion",
            "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
            "--seq-length", "256", "--max-position-embeddings", "256", "--micro-batch-size", "4",
            "--global-batch-size", str(4 * gpus * nnodes), "--train-iters", "300",
            "--split", "98,1,1", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style",
            "cosine", "--lr-warmup-iters", "20", "--weight-decay", "0.1", "--clip-grad", "1.0",
            "--seed", "1234", "--use-distributed-optimizer", "--log-interval", "10",
            "--eval-interval", "100", "--eval-iters", "10", "--tensorboard-dir",
            f"{out_dir}/tensorboard", "--loco-bits", "4", *USER_FLAGS]


def _fake_slurm_env(tmp_path, **extra):
    """A 2-node allocation gpu-a[001-002] x 8 GPUs, job 4242, with a fake ``scontrol``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"  # fake: `scontrol show hostnames <nodelist>`
    scontrol.write_text('#!/bin/bash\n[ "$1 $2 $3" = "show hostnames gpu-a[001-002]" ] '
                        '&& printf "gpu-a001\\ngpu-a002\\n"\n')
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
         "--node-rank", str(rank), "--nproc-per-node", "8", "--master-addr", "gpu-a001",
         "--master-port", "29517", "-m", "loco_megatron.training.run_megatron_lm", "--megatron-lm",
         str(checkout), *flags, "--config", f"{ROOT}/configs/tiny_cpu.yaml"] for rank in (0, 1)]


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
