"""Document sources: the running Python's standard library, and JSONL files.

A *document* is one ``str`` (one source file, or one JSONL record's text field).
Both readers are generators, so a corpus is streamed and can be read twice (once
to train the tokenizer, once to tokenize) without holding it in memory.

Default corpus (docs/architecture.md): every ``*.py`` file under
``sysconfig.get_paths()['stdlib']`` except ``site-packages/`` (third-party code) and
``__pycache__/``. The stdlib's own test suites (``test/``, ``idlelib/idle_test/``, ...)
are *included*: they are real, hand-written Python, and with them the corpus is about
1,740 files / 31.7 MB on CPython 3.12 (without them ~690 files / 13 MB). Files that are
not valid UTF-8 (CPython ships a few on purpose, e.g. ``test/encoded_modules/*``) are
skipped and counted in :class:`CorpusStats`. Order is deterministic: files sorted by
their POSIX path relative to the stdlib root.
"""

from __future__ import annotations

import json
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, List, Optional, Sequence


class CorpusError(ValueError):
    """Unreadable corpus input; the message names the file (and line) and the problem."""


@dataclass
class CorpusStats:
    """Counters filled in while a reader is iterated.

    Attributes:
        files: input files opened (``.py`` files or JSONL files).
        documents: documents yielded.
        bytes: UTF-8 bytes of the yielded documents' text.
        skipped_non_utf8: paths of ``.py`` files skipped because they are not UTF-8.
    """

    files: int = 0
    documents: int = 0
    bytes: int = 0
    skipped_non_utf8: List[str] = field(default_factory=list)


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library (``sysconfig`` ``stdlib``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_stdlib_files(root: Optional[Path] = None) -> List[Path]:
    """All ``*.py`` files of the standard library, sorted, excluding ``site-packages``.

    Args:
        root: stdlib directory; defaults to :func:`stdlib_root`.

    Returns:
        Absolute paths, sorted by POSIX path relative to ``root`` (deterministic across
        runs and file systems). Directory symlinks are not followed.

    Raises:
        CorpusError: if ``root`` is not a directory.
    """
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise CorpusError(f"{root}: standard library directory not found")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        dirnames[:] = [
            d
            for d in dirnames
            if d != "__pycache__" and not (rel_dir == Path(".") and d == "site-packages")
        ]
        found.extend((rel_dir / f).as_posix() for f in filenames if f.endswith(".py"))
    return [root / rel for rel in sorted(found)]


def iter_py_documents(
    paths: Sequence[Path], stats: Optional[CorpusStats] = None
) -> Iterator[str]:
    """Yield the text of each UTF-8 file in ``paths`` (in the given order).

    Files that fail to decode as UTF-8 are skipped and recorded in
    ``stats.skipped_non_utf8``; text is returned exactly as stored (no newline
    translation, so ``\\r\\n`` survives). Empty files yield ``""``.

    Raises:
        OSError: if a file cannot be read.
    """
    stats = stats if stats is not None else CorpusStats()
    for path in paths:
        data = Path(path).read_bytes()
        stats.files += 1
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            stats.skipped_non_utf8.append(str(path))
            continue
        stats.documents += 1
        stats.bytes += len(data)
        yield text


def iter_stdlib_documents(
    root: Optional[Path] = None,
    max_files: Optional[int] = None,
    stats: Optional[CorpusStats] = None,
) -> Iterator[str]:
    """Yield the default corpus: stdlib ``.py`` files (see module docstring).

    Args:
        root: stdlib directory; defaults to :func:`stdlib_root`.
        max_files: if set, only the first ``max_files`` files of the sorted list are read
            (non-UTF-8 ones among them are still skipped, so fewer documents may result).
        stats: optional counters, updated in place.
    """
    paths = list_stdlib_files(root)
    if max_files is not None:
        paths = paths[:max_files]
    yield from iter_py_documents(paths, stats)


def iter_jsonl_documents(
    path: Path,
    key: str = "text",
    stats: Optional[CorpusStats] = None,
) -> Iterator[str]:
    """Yield ``record[key]`` for each line of a JSONL file (one JSON object per line).

    Blank (whitespace-only) lines are skipped. The file must be UTF-8.

    Args:
        path: the ``.jsonl`` file.
        key: field holding the document text (Megatron's ``--json-keys``; default ``text``).
        stats: optional counters, updated in place.

    Raises:
        CorpusError: ``"<path>:<line>: ..."`` for invalid UTF-8 or JSON, a line that is not an
            object, a missing ``key``, or a value that is not a string.
        OSError: if the file cannot be opened.
    """
    stats = stats if stats is not None else CorpusStats()
    with open(path, "rb") as f:
        stats.files += 1
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                msg = f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})"
                raise CorpusError(msg) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                raise CorpusError(f"{where}: invalid JSON ({e.msg}, column {e.pos + 1})") from None
            if not isinstance(record, dict):
                raise CorpusError(
                    f"{where}: expected a JSON object like {{{json.dumps(key)}: ...}}, "
                    f"got {type(record).__name__}"
                )
            if key not in record:
                keys = ", ".join(sorted(map(str, record))[:8]) or "none"
                raise CorpusError(
                    f"{where}: missing key {json.dumps(key)} (keys present: {keys}); "
                    f"pick the field with --json-key"
                )
            text = record[key]
            if not isinstance(text, str):
                raise CorpusError(
                    f"{where}: value of {json.dumps(key)} is {type(text).__name__}, "
                    "expected a string"
                )
            try:
                nbytes = len(text.encode("utf-8"))
            except UnicodeEncodeError as e:
                raise CorpusError(
                    f"{where}: text is not valid Unicode ({e.reason} at character {e.start}, "
                    "e.g. a lone \\ud800 surrogate escape); fix or drop that record"
                ) from None
            stats.documents += 1
            stats.bytes += nbytes
            yield text


def iter_jsonl_files(
    paths: Sequence[Path], key: str = "text", stats: Optional[CorpusStats] = None
) -> Iterator[str]:
    """Yield the documents of several JSONL files, in the given file order.

    Raises:
        CorpusError: see :func:`iter_jsonl_documents`.
    """
    stats = stats if stats is not None else CorpusStats()
    for path in paths:
        yield from iter_jsonl_documents(path, key, stats)
