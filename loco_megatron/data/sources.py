"""Which corpus to prepare: its cache name, input files, document stream and build params.

Two kinds (docs/architecture.md): the default corpus, the running Python's standard library
(``python3.12-stdlib``, read by :func:`corpus.iter_py_documents`), or user JSONL files
(``jsonl-<first file stem>-<hash of key and absolute paths>``). With ``max_docs`` only
the first ``max_docs`` documents are used and ``-n<max_docs>`` is appended to the name,
so capped and full builds have separate cache directories.
"""

from __future__ import annotations

import hashlib
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Union

from .corpus import CorpusError, CorpusStats, iter_jsonl_files, iter_py_documents, list_stdlib_files


@dataclass
class Source:
    """A corpus to prepare.

    Attributes:
        name: cache-directory-safe corpus name, e.g. ``python3.12-stdlib``.
        files: input files in corpus order (absolute paths).
        json_key: JSONL field holding the text; ``None`` for ``.py`` source files.
        max_docs: use only the first ``max_docs`` documents; ``None`` for all.
    """

    name: str
    files: List[Path]
    json_key: Optional[str] = None
    max_docs: Optional[int] = None

    def documents(self, stats: Optional[CorpusStats] = None) -> Iterator[str]:
        """A fresh stream of the documents in corpus order; updates ``stats``.

        Raises:
            CorpusError: malformed JSONL (file and line named).
        """
        stats = stats if stats is not None else CorpusStats()
        if self.json_key is None:
            docs = iter_py_documents(self.files, stats)
        else:
            docs = iter_jsonl_files(self.files, self.json_key, stats)
        return itertools.islice(docs, self.max_docs) if self.max_docs is not None else docs

    def params(self, vocab_size: int) -> dict:
        """Build parameters that, with the input files' identity, fingerprint a build."""
        return {"corpus": self.name, "json_key": self.json_key, "max_docs": self.max_docs,
                "vocab_size": vocab_size}


def make_source(
    jsonl: Sequence[Union[str, Path]] = (),
    json_key: str = "text",
    max_docs: Optional[int] = None,
) -> Source:
    """The stdlib corpus if ``jsonl`` is empty, else those JSONL files.

    Raises:
        CorpusError: if a JSONL file does not exist, or the stdlib directory is missing.
    """
    if isinstance(jsonl, (str, Path)):
        jsonl = [jsonl]
    cap = f"-n{max_docs}" if max_docs is not None else ""
    if not jsonl:
        version = "{}.{}".format(*sys.version_info[:2])
        return Source(f"python{version}-stdlib{cap}", list_stdlib_files(), None, max_docs)
    files = [Path(p).expanduser().resolve() for p in jsonl]
    for f in files:
        if not f.is_file():
            raise CorpusError(f"--jsonl {f}: no such file")
    digest = hashlib.sha256("\n".join([json_key, *map(str, files)]).encode()).hexdigest()[:10]
    return Source(f"jsonl-{files[0].stem}-{digest}{cap}", files, json_key, max_docs)
