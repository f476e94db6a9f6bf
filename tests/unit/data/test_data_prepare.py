"""prepare CLI/API: final stdout line, idempotence, clear errors, no half-built cache."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from loco_megatron.data import cache, indexed, prepare

REPO = Path(__file__).resolve().parents[3]
LINE = re.compile(r"^DATA_PREFIX=(\S+) TOKENIZER_DIR=(\S+)$")


def run_cli(*args, env_extra=None):
    env = dict(os.environ, PYTHONPATH=str(REPO), **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "loco_megatron.data.prepare", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_cli_builds_once_then_reuses(tmp_path):
    env = {"LOCO_DATA_DIR": str(tmp_path / "cache")}
    first = run_cli("--max-docs", "40", "--vocab-size", "512", env_extra=env)
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    assert len(lines) == 1, first.stdout
    match = LINE.match(lines[0])
    assert match, lines[0]
    prefix, tok_dir = map(Path, match.groups())
    version = "{}.{}".format(*sys.version_info[:2])
    out = tmp_path / "cache" / f"python{version}-stdlib-n40-v512"
    assert prefix == out / "text_document" and tok_dir == out / "tokenizer"
    assert (tok_dir / "tokenizer.json").is_file()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["vocab_size"] == 512 and manifest["eod_id"] == 0
    assert 0 < manifest["documents"] <= 40 and manifest["tokens"] > manifest["documents"]
    assert "tokenize:" in first.stderr  # progress is shown
    bin_mtime = Path(f"{prefix}.bin").stat().st_mtime_ns

    second = run_cli("--max-docs", "40", "--vocab-size", "512", env_extra=env)
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout
    assert "cache hit" in second.stderr
    assert Path(f"{prefix}.bin").stat().st_mtime_ns == bin_mtime


@pytest.mark.parametrize(
    "args, status, needle",
    [
        (["--vocab-size", "200"], 2, "--vocab-size 200: must be at least 257"),
        (["--jsonl", "/nonexistent/x.jsonl"], 2, "--jsonl /nonexistent/x.jsonl: no such file"),
        (["--max-docs", "0"], 2, "--max-docs 0"),
    ],
)
def test_cli_bad_arguments(tmp_path, args, status, needle):
    result = run_cli(*args, "--out", str(tmp_path / "out"))
    assert result.returncode == status
    assert needle in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "content, needle",
    [
        ('{"text": "a"}\n{"body": "b"}\n', ':2: missing key "text"'),
        ('{"text": "a"}\n\n{"text": \n', ":3: invalid JSON"),
        ("\n\n", "has no documents"),
    ],
)
def test_cli_bad_jsonl(tmp_path, content, needle):
    f = tmp_path / "in.jsonl"
    f.write_text(content)
    result = run_cli("--jsonl", str(f), "--out", str(tmp_path / "out"), "--vocab-size", "300")
    assert result.returncode == 1
    assert needle in result.stderr and (needle.startswith("has") or str(f) in result.stderr)
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.tmp-*"))


def _jsonl(path, n, extra=""):
    path.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}{extra}\n"})
                            + "\n" for i in range(n)))
    return path


def test_failed_build_leaves_no_complete_cache(tmp_path, monkeypatch):
    data = _jsonl(tmp_path / "in.jsonl", 50)
    out = tmp_path / "out"
    real = indexed.write_indexed_dataset

    def crash_midway(docs, tok, prefix, eod, **kw):
        def boom(stats):
            raise RuntimeError("disk full (simulated)")
        return real(docs, tok, prefix, eod, batch_size=8, progress=boom)

    monkeypatch.setattr(indexed, "write_indexed_dataset", crash_midway)
    with pytest.raises(RuntimeError, match="simulated"):
        prepare.prepare_data([data], out_dir=out, vocab_size=300)
    assert not out.exists()
    assert not list(tmp_path.glob(".out.tmp-*"))  # staging directory removed

    monkeypatch.setattr(indexed, "write_indexed_dataset", real)
    built = prepare.prepare_data([data], out_dir=out, vocab_size=300)
    assert built.built and cache.read_manifest(out)["documents"] == 50
    old_manifest = (out / "manifest.json").read_text()

    # A failing forced rebuild keeps the previous complete cache untouched.
    monkeypatch.setattr(indexed, "write_indexed_dataset", crash_midway)
    with pytest.raises(RuntimeError):
        prepare.prepare_data([data], out_dir=out, vocab_size=300, force=True)
    assert (out / "manifest.json").read_text() == old_manifest
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_stale_staging_ignored_and_input_change_rebuilds(tmp_path):
    data = _jsonl(tmp_path / "in.jsonl", 20)
    out = tmp_path / "out"
    stale = tmp_path / ".out.tmp-1-dead"  # what a killed build leaves behind
    (stale / "tokenizer").mkdir(parents=True)
    (stale / "manifest.json").write_text("{}")
    first = prepare.prepare_data([data], out_dir=out, vocab_size=300)
    assert first.built and not stale.exists()
    assert not prepare.prepare_data([data], out_dir=out, vocab_size=300).built

    _jsonl(data, 30, extra="  # changed")
    again = prepare.prepare_data([data], out_dir=out, vocab_size=300)
    assert again.built and again.manifest["documents"] == 30


def test_refuses_to_replace_unrelated_directory(tmp_path):
    data = _jsonl(tmp_path / "in.jsonl", 5)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(prepare.PrepareError, match="not a loco_megatron data cache"):
        prepare.prepare_data([data], out_dir=out, vocab_size=300)
    assert (out / "notes.txt").read_text() == "keep me"
