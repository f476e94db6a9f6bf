"""--data-path checked before ranks start: a missing prefix, a prefix given with its
extension, a corrupted or truncated .idx and a truncated .bin each give one message naming the
flag and file and what to do; a good dataset (and blends, --mock-data) pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loco_megatron.data.check import DataPathError, check_data_args

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A 3-document Megatron indexed dataset (megatron-core's own builder), as a prefix."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path_factory.mktemp("ds") / "good")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for n in (5, 9, 3):
        builder.add_item(torch.arange(n, dtype=torch.int64))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def _copy(prefix, tmp_path, name="bad"):
    out = str(tmp_path / name)
    for ext in (".idx", ".bin"):
        Path(out + ext).write_bytes(Path(prefix + ext).read_bytes())
    return out


def test_good_dataset_blend_and_mock_data_pass(dataset, tmp_path):
    check_data_args(["--data-path", dataset, "--lr", "1"])
    check_data_args(["--data-path", "0.3", dataset, "0.7", _copy(dataset, tmp_path)])
    check_data_args(["--mock-data", "--data-path", str(tmp_path / "nothing")])
    check_data_args(["--lr", "1"])  # no data flag: nothing to check


def test_object_storage_and_sft_paths_are_left_to_megatron(dataset, tmp_path):
    """Prefixes megatron-core reads from S3 / the Multi-Storage Client, and --sft's JSON-lines
    --data-path (megatron.training's SFTDataset), are not local indexed datasets: not refused;
    a local member of the same blend still is."""
    check_data_args(["--data-path", "s3://bucket/corpus/text_document",
                     "--object-storage-cache-path", str(tmp_path)])
    check_data_args(["--data-path", "0.5", "msc://profile/corpus", "0.5", dataset])
    check_data_args(["--sft", "--data-path", str(tmp_path / "train.jsonl")])
    missing = str(tmp_path / "nope")
    with pytest.raises(DataPathError, match=rf"--data-path {missing}: "):
        check_data_args(["--data-path", "0.5", "s3://bucket/corpus", "0.5", missing])


def test_missing_prefix_names_flag_and_files(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(DataPathError) as err:
        check_data_args(["--data-path", missing])
    msg = str(err.value)
    assert msg.startswith(f"--data-path {missing}: {missing}.idx and {missing}.bin not found")
    assert "python -m loco_megatron.data.prepare" in msg and "default corpus" in msg


def test_prefix_with_extension_and_blend_member(dataset, tmp_path):
    with pytest.raises(DataPathError, match=r"drop the \.bin extension"):
        check_data_args(["--data-path", dataset + ".bin"])
    missing = str(tmp_path / "other")
    with pytest.raises(DataPathError, match=rf"--train-data-path {missing}: "):
        check_data_args(["--train-data-path", "0.5", dataset, "0.5", missing])


@pytest.mark.parametrize("damage,expected", [
    (lambda p: Path(p + ".idx").write_bytes(b"not an index at all" * 4),
     r"\.idx is not a readable Megatron index file \(AssertionError: bad header"),
    (lambda p: Path(p + ".idx").write_bytes(Path(p + ".idx").read_bytes()[:40]),
     r"\.idx is not a readable Megatron index file .* truncated or corrupted"),
    (lambda p: Path(p + ".bin").write_bytes(Path(p + ".bin").read_bytes()[:10]),
     r"\.bin holds 10 bytes but .*\.idx points to 34: the \.bin file is truncated"),
])
def test_damaged_files_are_named(dataset, tmp_path, damage, expected):
    bad = _copy(dataset, tmp_path)
    damage(bad)
    with pytest.raises(DataPathError, match=expected) as err:
        check_data_args(["--data-path", bad])
    assert str(err.value).startswith(f"--data-path {bad}: ")


def test_launcher_check_exits_2_with_one_line(tmp_path):
    """What run_pretrain.sh runs before preparing data or starting ranks."""
    missing = str(tmp_path / "nope")
    proc = subprocess.run([sys.executable, "-m", "loco_megatron.cli.preflight",
                           "--data-path", missing, "--loco-bits", "4",
                           "--use-distributed-optimizer"], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: --data-path {missing}: {missing}.idx and ")
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="bash launcher")
@pytest.mark.parametrize("flags", [["--train-data-path={p}"], ["--valid-data-path", "{p}"],
                                   ["--per-split-data-args-path", "{json}"]])
def test_launcher_keeps_per_split_data_flags(dataset, tmp_path, flags):
    """run_pretrain.sh adds its default corpus (--data-path) only when no data flag is given:
    Megatron prefers --data-path, so adding it next to --train/valid/test-data-path (any
    spelling) or --per-split-data-args-path would silently train on the default corpus."""
    split_json = tmp_path / "splits.json"
    split_json.write_text(f'{{"train": ["{dataset}"], "valid": ["{dataset}"], '
                          f'"test": ["{dataset}"]}}')
    argv = [f.format(p=dataset, json=split_json) for f in flags]
    env = dict(os.environ, LOCO_DRY_RUN="1", GPUS_PER_NODE="0", OUT_DIR=str(tmp_path / "run"))
    proc = subprocess.run(["bash", str(ROOT / "run_pretrain.sh"), *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "preparing the default corpus" not in proc.stderr
    line = proc.stdout.strip().splitlines()[-1]
    assert " --data-path " not in line and line.endswith(" ".join(argv)), line
