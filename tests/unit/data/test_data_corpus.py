"""Document readers: stdlib listing, non-UTF-8 skipping, JSONL errors with file:line."""

from __future__ import annotations

import json

import pytest

from loco_megatron.data.corpus import (
    CorpusError,
    CorpusStats,
    iter_jsonl_documents,
    iter_jsonl_files,
    iter_py_documents,
    iter_stdlib_documents,
    list_stdlib_files,
    stdlib_root,
)


def test_stdlib_listing_sorted_and_filtered():
    files = list_stdlib_files()
    root = stdlib_root()
    rel = [p.relative_to(root).as_posix() for p in files]
    assert rel == sorted(rel) and len(rel) == len(set(rel))
    assert len(files) > 100
    assert all(r.endswith(".py") for r in rel)
    assert not any(r.startswith("site-packages/") or "__pycache__" in r for r in rel)
    assert "os.py" in rel
    assert list_stdlib_files() == files  # deterministic


def test_stdlib_documents_capped():
    stats = CorpusStats()
    docs = list(iter_stdlib_documents(max_files=5, stats=stats))
    assert stats.files == 5
    assert stats.documents == len(docs) == 5 - len(stats.skipped_non_utf8)
    assert stats.bytes == sum(len(d.encode("utf-8")) for d in docs)


def test_non_utf8_files_skipped_and_counted(tmp_path):
    good, bad = tmp_path / "good.py", tmp_path / "bad.py"
    good.write_bytes("x = 'é'\r\n".encode("utf-8"))
    bad.write_bytes("x = 'é'\n".encode("latin-1"))
    stats = CorpusStats()
    assert list(iter_py_documents([bad, good], stats)) == ["x = 'é'\r\n"]  # bytes kept as-is
    assert stats.files == 2 and stats.documents == 1
    assert stats.skipped_non_utf8 == [str(bad)]


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_jsonl_reads_key_and_skips_blank_lines(tmp_path):
    f = _write(tmp_path / "a.jsonl", [json.dumps({"text": "one\n", "id": 1}), "",
                                      json.dumps({"text": "two ✓"})])
    g = _write(tmp_path / "b.jsonl", [json.dumps({"body": "three", "text": 3})])
    stats = CorpusStats()
    assert list(iter_jsonl_documents(f, stats=stats)) == ["one\n", "two ✓"]
    assert stats.documents == 2 and stats.files == 1
    assert list(iter_jsonl_documents(g, key="body")) == ["three"]
    assert list(iter_jsonl_files([f, f], "text")) == ["one\n", "two ✓"] * 2


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"text": "b"', "invalid JSON"),
        ('{"txt": "b"}', 'missing key "text"'),
        ('["text"]', "expected a JSON object"),
        ('{"text": 3}', "expected a string"),
        ('{"text": "a\\ud800"}', "not valid Unicode"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, bad_line, message):
    f = _write(tmp_path / "c.jsonl", ['{"text": "a"}', "", bad_line, '{"text": "d"}'])
    docs = iter_jsonl_documents(f)
    assert next(docs) == "a"
    with pytest.raises(CorpusError) as e:
        next(docs)
    assert f"{f}:3:" in str(e.value)
    assert message in str(e.value)


def test_jsonl_invalid_utf8(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"text": "a"}\n{"text": "\xff"}\n')
    with pytest.raises(CorpusError, match=r"d\.jsonl:2: not valid UTF-8"):
        list(iter_jsonl_documents(f))
