"""Train a byte-level BPE tokenizer locally and save it for Megatron's HuggingFaceTokenizer.

Training uses HF ``tokenizers`` (GPT-2 style byte-level BPE: ``ByteLevel`` pre-tokenizer
with the GPT-2 split regex, no prefix space, all 256 byte symbols in the initial
alphabet, so any text round-trips exactly: ``decode(encode(x)) == x``). The only special
token is the end-of-document token :data:`EOD_TOKEN` (id 0).

The saved directory holds ``tokenizer.json`` and ``tokenizer_config.json``
(``tokenizer_class: PreTrainedTokenizerFast``, ``eos_token: <|endoftext|>``,
``clean_up_tokenization_spaces: false``), which ``transformers.AutoTokenizer`` loads
from disk without network access. In Megatron use it with::

    --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR

Megatron's ``eod`` is then the id of ``eos_token``; its ``vocab_size`` is
``len(AutoTokenizer)`` = the trained vocabulary size (the special token included).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional, Union

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOD_TOKEN = "<|endoftext|>"
"""End-of-document special token; Megatron's ``tokenizer.eod``."""

SPECIAL_TOKENS = (EOD_TOKEN,)
DEFAULT_VOCAB_SIZE = 8192
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
"""Smallest vocabulary that holds the 256 byte symbols plus the special tokens."""

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

PathLike = Union[str, Path]


def check_vocab_size(vocab_size: int) -> None:
    """Raise ``ValueError`` unless ``vocab_size >= MIN_VOCAB_SIZE`` (257)."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab size {vocab_size} is too small: a byte-level BPE needs at least "
            f"{MIN_VOCAB_SIZE} (256 bytes + {len(SPECIAL_TOKENS)} special token)"
        )


def train_bpe_tokenizer(
    documents: Iterable[str],
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    *,
    length: Optional[int] = None,
    show_progress: bool = False,
) -> Tokenizer:
    """Train a byte-level BPE tokenizer on ``documents``.

    Args:
        documents: iterable of document strings (consumed once, streamed in batches by
            the Rust trainer).
        vocab_size: target vocabulary size, special token included. The result can be
            smaller when the corpus does not have enough distinct pairs to merge.
        length: number of documents, only for the trainer's progress bar.
        show_progress: show ``tokenizers``' own progress bar (on stderr).

    Returns:
        An in-memory ``tokenizers.Tokenizer``; ``token_to_id(EOD_TOKEN) == 0``.

    Raises:
        ValueError: if ``vocab_size < MIN_VOCAB_SIZE``.
    """
    check_vocab_size(vocab_size)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer, length=length)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out_dir: PathLike) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir`` (created).

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        ValueError: if ``tokenizer`` lacks the :data:`EOD_TOKEN` special token.
    """
    if tokenizer.token_to_id(EOD_TOKEN) is None:
        raise ValueError(f"tokenizer has no {EOD_TOKEN!r} token; train it with train_bpe_tokenizer")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / TOKENIZER_FILE))
    config = {
        # transformers 4.x and 5.x both map this to the "fast" (tokenizers-backed) class.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOD_TOKEN,
        # Never "clean up" spaces before punctuation on decode: that corrupts code.
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    (out / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


def load_tokenizer(tokenizer_dir: PathLike) -> Tokenizer:
    """Load the ``tokenizers.Tokenizer`` saved by :func:`save_tokenizer`.

    Raises:
        FileNotFoundError: if ``DIR/tokenizer.json`` does not exist.
    """
    path = Path(tokenizer_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no tokenizer here (run python -m loco_megatron.data.prepare)"
        )
    return Tokenizer.from_file(str(path))


def eod_id(tokenizer: Tokenizer) -> int:
    """Id of :data:`EOD_TOKEN` in ``tokenizer``; ``ValueError`` if absent."""
    token_id = tokenizer.token_to_id(EOD_TOKEN)
    if token_id is None:
        raise ValueError(f"tokenizer has no {EOD_TOKEN!r} token")
    return token_id


def load_megatron_tokenizer(tokenizer_dir: PathLike):
    """Load ``tokenizer_dir`` as Megatron does for ``--tokenizer-type HuggingFaceTokenizer``.

    Mirrors ``megatron.core.tokenizers.utils.build_tokenizer.build_tokenizer``:
    ``MegatronTokenizer.from_pretrained(tokenizer_path=DIR, metadata_path={'library':
    'huggingface'})`` (which calls ``transformers.AutoTokenizer.from_pretrained(DIR)``).
    Imports megatron-core lazily (several seconds).

    Returns:
        Megatron's text tokenizer (``.eod``, ``.vocab_size``, ``.tokenize``, ``.detokenize``).

    Raises:
        FileNotFoundError: if ``DIR/tokenizer.json`` does not exist (checked first, so a
            wrong path is never looked up on the Hugging Face Hub).
    """
    path = Path(tokenizer_dir).resolve()
    if not (path / TOKENIZER_FILE).is_file():
        raise FileNotFoundError(f"{path / TOKENIZER_FILE}: no tokenizer here")
    from megatron.core.tokenizers import MegatronTokenizer

    return MegatronTokenizer.from_pretrained(
        tokenizer_path=str(path), metadata_path={"library": "huggingface"}
    )
