"""Caches of what a model's buckets determine (layouts, block tables), sized by the model.

docs/kernels.md ("GPU contract"). A bounded LRU cache smaller than the layouts one step uses
misses on every bucket of every step (more than 256 buckets, or the parameter all-gather's
``buckets x DP`` shard layouts): each miss rebuilds a table on the host and copies it to the
device, a host sync per bucket. These caches keep every entry a step uses, once: their size is
set by the model's buckets, which do not change during training, and
:func:`clear` (called by :func:`loco_megatron.uninstall`) drops them with the model.
"""

import functools
from typing import Callable, Dict, List

import torch

#: attribute (True) of a tensor that stays on the host whatever device the data is on (a
#: block table's ``spans``): reading it is no device sync
#: (:class:`loco_megatron.emulation.host_sync.HostSyncCounter` skips it)
HOST_ATTR = "_loco_host"

_CACHES: List[Callable] = []
_CLEARERS: List[Callable[[], None]] = []


def per_model(fn: Callable) -> Callable:
    """``functools.lru_cache(maxsize=None)`` of ``fn``, emptied by :func:`clear`. Arguments
    must be hashable (frozen layouts, device strings)."""
    cached = functools.lru_cache(maxsize=None)(fn)
    _CACHES.append(cached)
    return cached


def on_clear(fn: Callable[[], None]) -> Callable[[], None]:
    """Call ``fn`` in :func:`clear` too (a per-model buffer kept elsewhere); returns it."""
    _CLEARERS.append(fn)
    return fn


def clear() -> None:
    """Empty every :func:`per_model` cache and run the :func:`on_clear` functions (the model
    they described is gone)."""
    for cached in _CACHES:
        cached.cache_clear()
    for fn in _CLEARERS:
        fn()


def sizes() -> Dict[str, int]:
    """``{function name: entries}`` of every :func:`per_model` cache."""
    return {f"{c.__module__}.{c.__qualname__}": c.cache_info().currsize for c in _CACHES}


def host_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Mark ``tensor`` as living on the host (:data:`HOST_ATTR`); returns it."""
    setattr(tensor, HOST_ATTR, True)
    return tensor
