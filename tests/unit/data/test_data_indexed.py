"""Indexed dataset: read back with megatron-core, token sequences compared exactly."""

from __future__ import annotations

import numpy

from loco_megatron.data.indexed import token_dtype, write_indexed_dataset
from loco_megatron.data.tokenizer import eod_id


def test_written_sequences_match_tokenizer(tmp_path, small_tokenizer, small_docs):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = small_docs[:25] + ["", "x\n"]  # the empty document is skipped
    eod = eod_id(small_tokenizer)
    seen = []
    stats = write_indexed_dataset(docs, small_tokenizer, tmp_path / "ds", eod, batch_size=4,
                                  progress=lambda s: seen.append(s.documents))
    expected = [small_tokenizer.encode(d).ids + [eod] for d in docs if d]
    assert stats.documents == len(expected) and stats.empty_skipped == docs.count("")
    assert stats.tokens == sum(map(len, expected))
    assert stats.dtype == "uint16" and seen[-1] == len(expected)

    ds = IndexedDataset(str(tmp_path / "ds"))
    assert len(ds) == len(expected)
    assert ds.index.dtype == numpy.uint16
    numpy.testing.assert_array_equal(ds.document_indices, numpy.arange(len(expected) + 1))
    for i, ids in enumerate(expected):
        got = ds[i]
        assert got.dtype == numpy.uint16
        assert got.tolist() == ids


def test_token_dtype_follows_megatron():
    assert token_dtype(8192) is numpy.uint16
    assert token_dtype(70000) is numpy.int32
