"""Build (or reuse) the tokenizer + Megatron indexed dataset for a corpus.  CLI and API.

Usage::

    python -m loco_megatron.data.prepare [--jsonl FILE ...] [--json-key text]
        [--out DIR] [--vocab-size 8192] [--max-docs N] [--force]

Without ``--jsonl`` the corpus is the running Python's standard library (``corpus.py``).
Output directory (default ``$LOCO_DATA_DIR/<corpus>-v<vocab>``, ``$LOCO_DATA_DIR``
defaulting to ``~/.cache/loco_megatron/data``)::

    tokenizer/{tokenizer.json,tokenizer_config.json}   -> --tokenizer-model
    text_document.{bin,idx}                            -> --data-path <dir>/text_document
    manifest.json                                      (completion marker, stats)

Progress goes to stderr. On success stdout gets exactly one line (shell-quoted values)::

    DATA_PREFIX=<dir>/text_document TOKENIZER_DIR=<dir>/tokenizer

A second run with the same inputs (paths, sizes, mtimes) and options reuses the cache
and only prints that line. Errors: a message on stderr, no traceback, exit status 2 for
bad arguments, 1 for bad input data.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

from . import cache
from .corpus import CorpusError, CorpusStats
from .progress import Progress, human
from .sources import Source, make_source
from .tokenizer import DEFAULT_VOCAB_SIZE, MIN_VOCAB_SIZE, eod_id, load_megatron_tokenizer
from .tokenizer import save_tokenizer, train_bpe_tokenizer

TOKENIZER_SUBDIR = "tokenizer"
DATA_NAME = "text_document"


class PrepareError(RuntimeError):
    """The build cannot proceed; the message names the input/flag and what to do."""


@dataclass
class PreparedData:
    """Result of :func:`prepare_data`: paths for ``--data-path`` / ``--tokenizer-model``."""

    data_prefix: Path
    tokenizer_dir: Path
    manifest: dict = field(default_factory=dict)
    built: bool = False  # False: an existing complete cache was reused

    def stdout_line(self) -> str:
        return (f"DATA_PREFIX={shlex.quote(str(self.data_prefix))} "
                f"TOKENIZER_DIR={shlex.quote(str(self.tokenizer_dir))}")


def _log(msg: str) -> None:
    print(f"[loco-data] {msg}", file=sys.stderr, flush=True)


def prepare_data(jsonl: Sequence[Path] = (), json_key: str = "text",
                 out_dir: Optional[Path] = None, vocab_size: int = DEFAULT_VOCAB_SIZE,
                 force: bool = False, max_docs: Optional[int] = None) -> PreparedData:
    """Build the tokenizer and indexed dataset for a corpus, or reuse a complete cache.

    Raises:
        PrepareError: empty corpus, bad vocab size, unusable ``out_dir``.
        CorpusError: missing or malformed JSONL (message names file and line).
        OSError: unreadable input or unwritable output directory.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise PrepareError(f"--vocab-size {vocab_size}: must be at least {MIN_VOCAB_SIZE} "
                           "(256 byte tokens + <|endoftext|>)")
    if max_docs is not None and max_docs < 1:
        raise PrepareError(f"--max-docs {max_docs}: must be a positive number")
    source = make_source(jsonl, json_key, max_docs)
    if out_dir is None:
        out_dir = cache.default_cache_root() / f"{source.name}-v{vocab_size}"
    out = Path(out_dir).expanduser().resolve()
    result = PreparedData(out / DATA_NAME, out / TOKENIZER_SUBDIR)
    if not source.files:
        raise PrepareError(f"corpus {source.name}: no input files found")
    fp = cache.fingerprint(source.params(vocab_size), source.files)
    with cache.build_lock(out):
        manifest = None if force else cache.is_complete(out, fp)
        if manifest is not None:
            _log(f"cache hit: {out} ({manifest['documents']} docs, {human(manifest['tokens'])} "
                 f"tokens, vocab {manifest['vocab_size']}); --force rebuilds")
            result.manifest = manifest
            return result
        try:
            with cache.staging_dir(out) as stage:
                result.manifest = _build(source, vocab_size, fp, stage)
                cache.publish(stage, out)
        except cache.CacheError as e:
            raise PrepareError(f"--out: {e}") from None
    result.built = True
    return result


def _build(source: Source, vocab_size: int, fp: str, stage: Path) -> dict:
    """Train, verify and write everything into ``stage``; returns the manifest written."""
    t0 = time.monotonic()
    _log(f"building {source.name}: {len(source.files)} input file(s), vocab {vocab_size}")
    by_files = source.json_key is None and source.max_docs is None  # else count docs
    stats = CorpusStats()
    with Progress("read+train", len(source.files) if by_files else source.max_docs,
                  "files" if by_files else "docs") as bar:
        def counted() -> Iterator[str]:
            for doc in source.documents(stats):
                yield doc
                bar.set(stats.files if by_files else stats.documents,
                        f"{stats.documents} docs, {stats.bytes / 1e6:.1f} MB")
        tok = train_bpe_tokenizer(counted(), vocab_size)
    if stats.documents == 0:
        raise PrepareError(f"corpus {source.name} has no documents: "
                           + (f"the --jsonl files hold no records; write one "
                              f'{{"{source.json_key}": ...}} object per line'
                              if source.json_key else "no UTF-8 .py file was found"))
    if stats.skipped_non_utf8:
        _log(f"skipped {len(stats.skipped_non_utf8)} non-UTF-8 files")
    eod = eod_id(tok)
    tok_dir = save_tokenizer(tok, stage / TOKENIZER_SUBDIR)
    _log(f"tokenizer trained: vocab {tok.get_vocab_size()} ({time.monotonic() - t0:.1f} s); "
         "checking it loads in Megatron (importing megatron.core)")
    mtok = load_megatron_tokenizer(tok_dir)
    if mtok.eod != eod or mtok.vocab_size != tok.get_vocab_size():
        raise PrepareError(f"Megatron loads the tokenizer with eod={mtok.eod}, vocab_size="
                           f"{mtok.vocab_size}; expected {eod}, {tok.get_vocab_size()}")
    from .indexed import write_indexed_dataset

    with Progress("tokenize", stats.documents, "docs") as bar:
        written = write_indexed_dataset(
            source.documents(CorpusStats()), tok, stage / DATA_NAME, eod,
            progress=lambda s: bar.set(s.documents + s.empty_skipped, f"{human(s.tokens)} tokens"))
    if written.documents == 0:
        raise PrepareError(f"corpus {source.name}: every document is empty (no text to train on)")
    import tokenizers

    manifest = {
        "format_version": cache.FORMAT_VERSION, "fingerprint": fp, "corpus": source.name,
        "params": source.params(vocab_size), "input_files": len(source.files),
        "documents": written.documents, "tokens": written.tokens,
        "empty_documents_skipped": written.empty_skipped,
        "skipped_non_utf8": stats.skipped_non_utf8, "text_bytes": stats.bytes,
        "vocab_size": tok.get_vocab_size(), "eod_id": eod, "dtype": written.dtype,
        "data_prefix": DATA_NAME, "tokenizer_dir": TOKENIZER_SUBDIR,
        "files": [f"{TOKENIZER_SUBDIR}/tokenizer.json", f"{TOKENIZER_SUBDIR}/tokenizer_config.json",
                  f"{DATA_NAME}.bin", f"{DATA_NAME}.idx"],
        "python": sys.version.split()[0], "tokenizers": tokenizers.__version__,
        "build_seconds": round(time.monotonic() - t0, 1),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    cache.write_manifest(stage, manifest)
    _log(f"built: {written.documents} docs, {written.tokens} tokens ({written.dtype}), "
         f"{manifest['build_seconds']} s")
    return manifest


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loco_megatron.data.prepare",
        description="Train a byte-level BPE tokenizer and write a Megatron indexed dataset "
                    "(default corpus: this Python's standard library). Cached; prints "
                    "'DATA_PREFIX=... TOKENIZER_DIR=...' on stdout.")
    p.add_argument("--jsonl", nargs="+", action="extend", type=Path, default=[], metavar="FILE",
                   help="JSONL corpus file(s), one {\"text\": ...} object per line")
    p.add_argument("--json-key", default="text", help="JSONL field with the text (default: text)")
    p.add_argument("--out", type=Path, help="output directory (default: $LOCO_DATA_DIR or "
                   "~/.cache/loco_megatron/data, plus /<corpus>-v<vocab>)")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                   help=f"BPE vocabulary size incl. <|endoftext|> (default {DEFAULT_VOCAB_SIZE})")
    p.add_argument("--max-docs", type=int, help="use only the first N documents (quick tests)")
    p.add_argument("--force", action="store_true", help="rebuild even if a complete cache exists")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point; returns the exit status (see module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.vocab_size < MIN_VOCAB_SIZE:
        parser.error(f"--vocab-size {args.vocab_size}: must be at least {MIN_VOCAB_SIZE} "
                     "(256 byte tokens + <|endoftext|>)")
    for f in args.jsonl:
        if not f.is_file():
            parser.error(f"--jsonl {f}: no such file (pass existing JSONL files, or omit --jsonl "
                         "for the standard-library corpus)")
    if args.max_docs is not None and args.max_docs < 1:
        parser.error(f"--max-docs {args.max_docs}: must be a positive number")
    try:
        # stdout carries only the result line; megatron.core's import-time notices about
        # optional GPU packages (Transformer Engine, Apex, absl) are irrelevant here.
        with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*(Transformer Engine|absl\.logging)")
            result = prepare_data(args.jsonl, args.json_key, args.out, args.vocab_size,
                                  args.force, args.max_docs)
    except (PrepareError, CorpusError, OSError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted; nothing was cached", file=sys.stderr)
        return 130
    print(result.stdout_line(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
