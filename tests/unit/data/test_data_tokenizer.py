"""Byte-level BPE: exact round trip, saved directory loads in Megatron with the right eod."""

from __future__ import annotations

import json

import pytest

from loco_megatron.data.tokenizer import (
    EOD_TOKEN,
    MIN_VOCAB_SIZE,
    eod_id,
    load_tokenizer,
    train_bpe_tokenizer,
)

TRICKY = [
    "def f(x):\n    return x . y  ,  'é' \t\n\n  ünïcode ✓ 🎉\r\n",
    "    # leading spaces, trailing spaces   \n\n\n",
    "a=b,c ! d ? e 's n't",
    "",
]


def test_vocab_and_special_token(small_tokenizer, small_vocab):
    assert small_tokenizer.get_vocab_size() == small_vocab
    assert eod_id(small_tokenizer) == small_tokenizer.token_to_id(EOD_TOKEN) == 0


def test_round_trip_exact(small_tokenizer, small_docs):
    for text in small_docs[:20] + TRICKY:
        ids = small_tokenizer.encode(text).ids
        assert small_tokenizer.decode(ids, skip_special_tokens=False) == text


def test_vocab_size_too_small(small_docs):
    with pytest.raises(ValueError, match="at least 257"):
        train_bpe_tokenizer(small_docs[:2], MIN_VOCAB_SIZE - 1)


def test_saved_directory(tokenizer_dir, small_tokenizer):
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["eos_token"] == EOD_TOKEN
    assert config["clean_up_tokenization_spaces"] is False
    reloaded = load_tokenizer(tokenizer_dir)
    assert reloaded.to_str() == small_tokenizer.to_str()


def test_megatron_hf_tokenizer_loads(
    megatron_tokenizer, small_tokenizer, small_docs, small_vocab
):
    """Loaded the way build_tokenizer() does for --tokenizer-type HuggingFaceTokenizer."""
    assert megatron_tokenizer.eod == eod_id(small_tokenizer)
    assert megatron_tokenizer.vocab_size == small_vocab
    for text in small_docs[:10] + TRICKY:
        ids = megatron_tokenizer.tokenize(text)
        assert ids == small_tokenizer.encode(text).ids  # no BOS/EOS added on the way
        assert megatron_tokenizer.detokenize(ids) == text  # no space clean-up on decode


def test_load_megatron_tokenizer_missing_dir(tmp_path):
    from loco_megatron.data.tokenizer import load_megatron_tokenizer

    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_megatron_tokenizer(tmp_path / "nope")
