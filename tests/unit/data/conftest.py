"""Shared fixtures for tests/unit/data: a small real corpus and a tokenizer trained on it.

Kept small so the whole directory runs in well under a minute on 2 CPU cores: the first
60 standard-library files (sorted), a 512-token vocabulary.
"""

from __future__ import annotations

import pytest

from loco_megatron.data.corpus import CorpusStats, iter_py_documents, list_stdlib_files
from loco_megatron.data.tokenizer import save_tokenizer, train_bpe_tokenizer

SMALL_VOCAB = 512
N_FILES = 60


@pytest.fixture(scope="session")
def small_vocab() -> int:
    """Vocabulary size of ``small_tokenizer``."""
    return SMALL_VOCAB


@pytest.fixture(scope="session")
def small_docs() -> list:
    """Text of the first N_FILES stdlib .py files (UTF-8 ones)."""
    docs = list(iter_py_documents(list_stdlib_files()[:N_FILES], CorpusStats()))
    assert len(docs) > 10
    return docs


@pytest.fixture(scope="session")
def small_tokenizer(small_docs, small_vocab):
    """A byte-level BPE (vocab SMALL_VOCAB) trained on ``small_docs``."""
    return train_bpe_tokenizer(small_docs, small_vocab)


@pytest.fixture(scope="session")
def tokenizer_dir(small_tokenizer, tmp_path_factory):
    """``small_tokenizer`` saved for Megatron's HuggingFaceTokenizer."""
    return save_tokenizer(small_tokenizer, tmp_path_factory.mktemp("tok") / "tokenizer")


@pytest.fixture(scope="session")
def megatron_tokenizer(tokenizer_dir):
    """``tokenizer_dir`` loaded through megatron-core (slow import, once per session)."""
    from loco_megatron.data.tokenizer import load_megatron_tokenizer

    return load_megatron_tokenizer(tokenizer_dir)
