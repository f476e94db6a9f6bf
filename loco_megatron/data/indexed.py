"""Tokenize documents and write Megatron's indexed dataset (``PREFIX.bin`` / ``PREFIX.idx``).

Same on-disk result as Megatron-LM's ``tools/preprocess_data.py --append-eod`` with one
JSON key: megatron-core's ``IndexedDatasetBuilder`` with token dtype
``DType.optimal_dtype(vocab_size)`` (``numpy.uint16`` below 65,500 tokens, else
``numpy.int32``), one sequence per document = ``tokenizer.encode(text).ids + [eod]``,
``end_document()`` after each. Read it back with
``megatron.core.datasets.indexed_dataset.IndexedDataset(PREFIX)`` or ``--data-path PREFIX``.

Difference from preprocess_data.py: a document that encodes to zero tokens (empty text)
is skipped entirely (counted in :class:`IndexedStats`), where preprocess_data.py would
write an empty document with no tokens and no EOD.

Encoding uses ``tokenizers``' batch encoder (Rust, multi-threaded; ``TOKENIZERS_PARALLELISM``
and ``RAYON_NUM_THREADS`` control it). Ids equal what Megatron's ``HuggingFaceTokenizer``
``tokenize()`` returns for the same directory (checked in tests/unit/data).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Union

import numpy
import torch
from tokenizers import Tokenizer

PathLike = Union[str, Path]
ProgressFn = Callable[["IndexedStats"], None]
"""Called after each batch with the running :class:`IndexedStats`."""


@dataclass
class IndexedStats:
    """What :func:`write_indexed_dataset` wrote.

    Attributes:
        documents: documents (= sequences) written.
        tokens: tokens written, EOD tokens included.
        empty_skipped: input documents skipped because they encode to no tokens.
        dtype: numpy dtype name of the stored tokens (``"uint16"`` or ``"int32"``).
    """

    documents: int = 0
    tokens: int = 0
    empty_skipped: int = 0
    dtype: str = ""


def token_dtype(vocab_size: int) -> type:
    """The token dtype Megatron picks for ``vocab_size`` (``DType.optimal_dtype``)."""
    from megatron.core.datasets.indexed_dataset import DType

    return DType.optimal_dtype(vocab_size)


def write_indexed_dataset(
    documents: Iterable[str],
    tokenizer: Tokenizer,
    prefix: PathLike,
    eod: int,
    *,
    batch_size: int = 128,
    progress: Optional[ProgressFn] = None,
) -> IndexedStats:
    """Encode ``documents`` and write ``PREFIX.bin`` and ``PREFIX.idx``.

    Args:
        documents: iterable of document strings (consumed once).
        tokenizer: the trained ``tokenizers.Tokenizer`` (no special tokens are added by
            its post-processing; ``<|endoftext|>`` written literally in the text is
            encoded as the EOD id, as with Megatron's HuggingFaceTokenizer).
        prefix: output path prefix; its directory must exist. Existing files are replaced.
        eod: end-of-document id appended to each document.
        batch_size: documents per ``encode_batch_fast`` call.
        progress: optional callback, see :data:`ProgressFn`.

    Returns:
        :class:`IndexedStats`.

    Raises:
        ValueError: if ``eod`` is outside the tokenizer's vocabulary.
        Exceptions of ``documents`` propagate; the ``.bin`` may then be partial and the
        ``.idx`` missing (write into a temporary directory; see ``cache.py``).
    """
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    if not 0 <= eod < vocab_size:
        raise ValueError(f"eod id {eod} outside the vocabulary [0, {vocab_size})")
    dtype = token_dtype(vocab_size)
    prefix = str(prefix)
    stats = IndexedStats(dtype=numpy.dtype(dtype).name)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    try:
        docs = iter(documents)
        while True:
            batch = list(itertools.islice(docs, batch_size))
            if not batch:
                break
            for ids in _encode_batch(tokenizer, batch):
                if not ids:
                    stats.empty_skipped += 1
                    continue
                ids.append(eod)
                builder.add_item(torch.tensor(ids, dtype=torch.int64))
                builder.end_document()
                stats.documents += 1
                stats.tokens += len(ids)
            if progress is not None:
                progress(stats)
    except BaseException:
        data_file = getattr(builder, "data_file", None)  # the open .bin; no public close()
        if data_file is not None:
            data_file.close()
        raise
    builder.finalize(prefix + ".idx")
    return stats


def _encode_batch(tokenizer: Tokenizer, batch: list) -> list:
    """Token ids (lists of int) of each text in ``batch``; no special tokens added."""
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # fast: no offsets
    return [enc.ids for enc in encode(batch, add_special_tokens=False)]
