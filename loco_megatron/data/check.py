"""Check ``--data-path`` (and ``--train/valid/test-data-path``) before ranks start.

Megatron-LM reads ``PREFIX.idx`` / ``PREFIX.bin`` only once every rank has started and the
model is built, and a missing or damaged file then ends in a bare ``FileNotFoundError``,
``bad header`` assertion or numpy buffer error. :func:`check_data_args` opens every prefix
with megatron-core's own index reader
(``megatron.core.datasets.indexed_dataset._IndexReader``; blends parsed by
the blend format of ``megatron.core.datasets.utils.get_blend_from_list``) in about a second and raises a
:class:`DataPathError` naming the flag, the file and what to do. ``run_pretrain.sh`` runs it
through ``python -m loco_megatron.cli.preflight``.
"""

import argparse
import logging
import os
import warnings
from typing import Iterable, List

DATA_FLAGS = ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path")
#: prefixes megatron-core reads from object storage (``megatron.core.datasets.object_storage_utils``
#: ``is_object_storage_path``: S3 and the Multi-Storage Client), not from the local filesystem
REMOTE_SCHEMES = ("s3://", "msc://")
FIX = ("--data-path takes the prefix of a Megatron indexed dataset (PREFIX.bin + PREFIX.idx, "
       "without the extension): build one with `python -m loco_megatron.data.prepare` or "
       "Megatron-LM's tools/preprocess_data.py, or drop --data-path to train on the default "
       "corpus")


class DataPathError(ValueError):
    """A ``--data-path`` prefix whose files are missing or damaged; names flag and file."""


def prefixes(argv: Iterable[str]) -> List[tuple]:
    """``[(flag, prefix)]`` of every dataset prefix on the command line, weights dropped as
    ``megatron.core.datasets.utils.get_blend_from_list`` drops them (an even-length list whose
    even entries all parse as floats is ``weight prefix ...``), without importing megatron-core
    (seconds of start-up) for the common case of a missing file."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in DATA_FLAGS:
        parser.add_argument(flag, nargs="*", default=None)
    known, _ = parser.parse_known_args(list(argv))
    out = []
    for flag in DATA_FLAGS:
        values = getattr(known, flag[2:].replace("-", "_"))
        if values is None:
            continue
        if not values:
            raise DataPathError(f"{flag} needs at least one dataset prefix. {FIX}.")
        if len(values) % 2 == 0 and all(_is_float(v) for v in values[::2]):
            values = values[1::2]
        out += [(flag, p.strip()) for p in values]
    return out


def _is_float(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def check_prefix(flag: str, prefix: str) -> None:
    """Raise :class:`DataPathError` unless ``prefix.idx`` reads as a Megatron index and
    ``prefix.bin`` holds every token it points to."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    missing = [p for p in (idx, bin_) if not os.path.isfile(p)]
    if missing:
        hint = (f" (it names a file: drop the {os.path.splitext(prefix)[1]} extension)"
                if prefix.endswith((".bin", ".idx")) else "")
        raise DataPathError(f"{flag} {prefix}: {' and '.join(missing)} not found{hint}. {FIX}.")
    import numpy

    # megatron-core's import-time notes (no TE/apex, no CUDA runtime on CPU) and its "could not
    # determine rank" warning would bury the one line this check prints
    quiet = logging.getLogger("torch.utils.cpp_extension")
    level, quiet.level = quiet.level, logging.ERROR
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets.indexed_dataset import _IndexReader

            index = _IndexReader(idx, multimodal=False)
            n = len(index.sequence_lengths)
            end = 0 if n == 0 else int(index.sequence_pointers[-1]) + \
                int(index.sequence_lengths[-1]) * numpy.dtype(index.dtype).itemsize
    except Exception as e:  # AssertionError (header/version), ValueError (short buffer), ...
        raise DataPathError(
            f"{flag} {prefix}: {idx} is not a readable Megatron index file ({type(e).__name__}: "
            f"{e}); it is truncated or corrupted. {_rebuild()}") from e
    finally:
        quiet.setLevel(level)
    size = os.path.getsize(bin_)
    if end > size:
        raise DataPathError(f"{flag} {prefix}: {bin_} holds {size} bytes but {idx} points to "
                            f"{end}: the .bin file is truncated, or the .idx (its token dtype "
                            f"or pointers) does not belong to it. {_rebuild()}")


def _rebuild() -> str:
    from .cache import default_cache_root

    return (f"Rebuild the dataset: the default corpus by deleting {default_cache_root()} "
            f"(run_pretrain.sh prepares it again), your own data with Megatron-LM's "
            f"tools/preprocess_data.py or `python -m loco_megatron.data.prepare`; or restore "
            f"the files.")


def check_data_args(argv: Iterable[str]) -> None:
    """Check every local dataset prefix of ``argv`` (a no-op with ``--mock-data``, with
    ``--sft``, whose ``--data-path`` names a JSON-lines file that megatron.training's
    ``SFTDataset`` reads, or with no data flag; object-storage prefixes, :data:`REMOTE_SCHEMES`,
    are left to megatron-core).

    Raises:
        DataPathError: a prefix with a missing, truncated or corrupted ``.idx`` / ``.bin``.
    """
    argv = list(argv)
    if "--mock-data" in argv or "--sft" in argv:
        return
    for flag, prefix in prefixes(argv):
        if not prefix.startswith(REMOTE_SCHEMES):
            check_prefix(flag, prefix)
