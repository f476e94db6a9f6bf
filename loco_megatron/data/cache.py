"""Cache directory handling for prepared data: location, fingerprint, manifest, atomic publish.

A cache directory is *complete* iff it holds ``manifest.json`` whose ``fingerprint``
matches the requested build and every file the manifest lists exists. The manifest is
written last, into a private staging directory (``.<name>.tmp-XXXX`` next to the
target), which is then renamed onto the target: an interrupted build leaves at most a
staging directory (removed by the next build), never a target that looks complete.
Concurrent builders of the same target serialize on ``.<name>.lock`` (``fcntl.flock``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

PathLike = Union[str, Path]

MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1
"""Bump when the layout or tokenization changes, so old caches are rebuilt."""

ENV_DATA_DIR = "LOCO_DATA_DIR"


class CacheError(RuntimeError):
    """The target directory cannot be used as a cache; the message says why and what to do."""


def default_cache_root() -> Path:
    """``$LOCO_DATA_DIR`` if set, else ``~/.cache/loco_megatron/data``.

    Each corpus/vocabulary gets its own sub-directory ``<corpus-name>-v<vocab>`` below it.
    """
    env = os.environ.get(ENV_DATA_DIR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "loco_megatron" / "data"


def fingerprint(params: dict, files: Sequence[PathLike]) -> str:
    """SHA-256 (hex) of the build parameters and each input file's identity.

    A file's identity is (absolute path, size in bytes, mtime in ns) from ``os.stat`` —
    like ``make``, contents are not hashed, so multi-GB JSONL inputs cost nothing to check.

    Args:
        params: JSON-serializable build parameters (vocab size, json key, caps, ...).
        files: input files, in corpus order.

    Raises:
        OSError: if a file cannot be stat'ed.
    """
    ids = []
    for f in files:
        st = os.stat(f)
        ids.append([str(Path(f).resolve()), st.st_size, st.st_mtime_ns])
    blob = json.dumps({"format": FORMAT_VERSION, "params": params, "files": ids}, sort_keys=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def read_manifest(out_dir: PathLike) -> Optional[dict]:
    """The parsed ``manifest.json`` of ``out_dir``, or ``None`` if absent or unreadable."""
    try:
        with open(Path(out_dir) / MANIFEST_FILE) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def is_complete(out_dir: PathLike, expected_fingerprint: str) -> Optional[dict]:
    """``out_dir``'s manifest if it is a complete cache for ``expected_fingerprint``, else None."""
    manifest = read_manifest(out_dir)
    if manifest is None or manifest.get("fingerprint") != expected_fingerprint:
        return None
    if not all((Path(out_dir) / rel).exists() for rel in manifest.get("files", [])):
        return None
    return manifest


def write_manifest(out_dir: PathLike, manifest: dict) -> Path:
    """Write ``manifest.json`` (the completion marker) into ``out_dir``; call it last."""
    path = Path(out_dir) / MANIFEST_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


@contextlib.contextmanager
def build_lock(out_dir: PathLike) -> Iterator[None]:
    """Hold an exclusive lock for building ``out_dir`` (blocks while another build runs).

    Creates the parent directory. The lock file ``.<name>.lock`` stays behind (harmless).
    """
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def staging_dir(out_dir: PathLike) -> Iterator[Path]:
    """Yield a fresh empty directory next to ``out_dir``; removed if the block raises.

    Call inside :func:`build_lock`. Leftover staging directories of killed builds are
    deleted first. On success the caller must :func:`publish` it.

    Raises:
        CacheError: if ``out_dir`` exists, is not empty and is not a cache (no manifest),
            so that a mistyped ``--out`` never deletes unrelated files.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and read_manifest(out) is None)):
        raise CacheError(
            f"{out} exists and is not a loco_megatron data cache (no {MANIFEST_FILE}); "
            "choose another output directory or remove it"
        )
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    stage = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    stage.mkdir()  # unlike tempfile.mkdtemp (mode 0700), honours the umask
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def publish(stage: PathLike, out_dir: PathLike) -> Path:
    """Move the finished ``stage`` directory to ``out_dir``, replacing an old cache there.

    ``out_dir`` is either absent or the previous complete cache at every instant (it is
    briefly absent while an old cache is swapped out); it never holds a partial build.
    """
    out = Path(out_dir)
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.rename(out, old / "cache")
    os.rename(stage, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out
