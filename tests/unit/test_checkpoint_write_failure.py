"""A LoCo checkpoint file that cannot be written (disk full, directory not writable): a clear
error naming the file, no partial file left, an earlier file at that path untouched
(RELIABILITY.md). The failures are real OS ones: a file-size limit (RLIMIT_FSIZE, as a full
disk or quota fails a write part-way) in a child process, and a directory path that is a file.
The end-to-end case through megatron.training (the job fails, its previous checkpoint resumes)
is tests/launch/test_run_pretrain.py::test_failed_save_keeps_previous_checkpoint_loadable."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loco_megatron.megatron.checkpoint.torch_format import write_atomically

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import resource, sys, torch
from loco_megatron.megatron.checkpoint.torch_format import write_atomically
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
try:
    write_atomically({"x": torch.zeros(100000)}, sys.argv[1])
except OSError as e:
    print(e)
    sys.exit(3)
"""


def _check_message(msg, path):
    assert f"LoCo could not write its checkpoint file {path}" in msg, msg
    assert "disk full" in msg and "previous checkpoint" in msg and "resume from it" in msg, msg


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE")
def test_disk_full_keeps_the_earlier_file_and_leaves_no_partial_file(tmp_path):
    path = tmp_path / "loco_state_0_dp000.pt"
    write_atomically({"x": torch.arange(10.0)}, str(path))  # an earlier save's file
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path)], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr  # the write failed, and said so
    _check_message(proc.stdout, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no .tmp file left
    assert torch.equal(torch.load(path, weights_only=True)["x"], torch.arange(10.0))


def test_unwritable_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "iter_0000004"
    blocker.write_text("a file where the checkpoint directory should be")
    path = blocker / "loco_state_0_dp000.pt"
    with pytest.raises(OSError) as err:
        write_atomically({"x": torch.ones(3)}, str(path))
    _check_message(str(err.value), path)
    assert blocker.read_text().startswith("a file")


def test_temporary_file_of_a_killed_save_is_removed_by_the_next_save(tmp_path):
    """A save killed inside torch.save leaves ``<file>.tmp<pid>``; the next save of that file
    removes it (other files' temporaries are not touched)."""
    path = tmp_path / "loco_state_0_dp000.pt"
    killed = tmp_path / "loco_state_0_dp000.pt.tmp4242"
    other = tmp_path / "loco_state_0_dp001.pt.tmp4243"  # another rank's, maybe still writing
    killed.write_bytes(b"half a file")
    other.write_bytes(b"half a file")
    write_atomically({"x": torch.arange(3)}, str(path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, other.name]
    assert torch.equal(torch.load(path, weights_only=True)["x"], torch.arange(3))
