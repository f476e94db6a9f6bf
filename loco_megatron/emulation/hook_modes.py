"""Function modes that also see megatron's backward hooks, and the caller a call is owed to.

torch runs autograd hooks without the function-mode stack, so on its own a ``TorchFunctionMode``
sees nothing of what megatron's backward hooks run with ``overlap_grad_reduce`` on
(``register_grad_ready`` -> ``start_grad_sync``: LoCo's compress, its all-to-all launch, the
NaN/Inf poll, the hierarchical inter-node stage of earlier buckets). While entered, a
:class:`HookReentrantMode` wraps the megatron-core methods of :data:`HOOK_ENTRIES` so that a call
made outside the mode (from a hook) runs under the modes it was entered on: itself, and the CPU
emulation's (``is_cuda``, ``device="cuda"``), which torch drops in hooks as well. The two modes
of the GPU contract build on it: :class:`~.host_sync.HostSyncCounter` (host syncs) and
:class:`~.alloc_tracker.AllocationTracker` (LoCo's live bytes).
"""

import functools
import importlib
import os
import sys
from typing import Optional

import torch
from torch.overrides import (TorchFunctionMode, _get_current_function_mode_stack, _pop_mode,
                             _push_mode)

from ..patching import PatchSet

#: ``(module, class, methods)`` of megatron-core that its autograd hooks call
#: (distributed_data_parallel.py ``_make_backward_post_hook``: ``register_grad_ready``, which
#: calls ``start_grad_sync`` on the last gradient of a bucket group)
HOOK_ENTRIES = (("megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBucketGroup",
                 ("register_grad_ready", "start_grad_sync", "finish_grad_sync")),)
PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../loco_megatron
_SKIP = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(torch.__file__))
_TIMERS = os.path.join("megatron", "core", "timers.py")


def caller(depth: int = 3) -> tuple:
    """``(owner, "file:line")`` of the innermost caller, from ``depth`` frames up, outside
    torch, this emulation package and megatron-core's ``timers.py`` (a timer's synchronize
    belongs to whoever starts the timer): ``owner`` is ``"loco"`` for ``loco_megatron`` code,
    else ``"other"``."""
    frame = sys._getframe(depth)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_SKIP) and not path.endswith(_TIMERS):
            owner = "loco" if path.startswith(PKG + os.sep) else "other"
            return owner, f"{os.path.relpath(path, os.path.dirname(PKG))}:{frame.f_lineno}"
        frame = frame.f_back
    return "other", "?"


def tensors(obj):
    """Every tensor in ``obj`` (nested lists, tuples and dict values)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors(o)


class HookReentrantMode(TorchFunctionMode):
    """A ``TorchFunctionMode`` that also runs in megatron's backward hooks (module doc).

    Subclasses add their own patches in :meth:`more_patches`; ``PATCH_SET`` names the
    :class:`~loco_megatron.patching.PatchSet` (docs/architecture.md, patch sets)."""

    PATCH_SET = "loco-hook-reentrant-mode"

    def __init__(self):
        super().__init__()
        self._patches: Optional[PatchSet] = None
        self._stack: list = []  # the function modes entered when this mode was

    def more_patches(self, patches: PatchSet) -> None:
        """Add patches to this mode's set at ``__enter__`` (default: none)."""

    def _reentering(self, method):
        """``method``, run under the mode stack this mode was entered on (the CPU emulation's
        mode below it included) when it is called outside it (from a hook)."""
        @functools.wraps(method)
        def call(*args, **kwargs):
            if self in _get_current_function_mode_stack():
                return method(*args, **kwargs)
            for mode in self._stack:
                _push_mode(mode)
            try:
                return method(*args, **kwargs)
            finally:
                for _ in self._stack:
                    _pop_mode()
        return call

    def __enter__(self):
        self._patches = PatchSet(self.PATCH_SET, strict=False)
        for module, cls, methods in HOOK_ENTRIES:
            try:
                owner = getattr(importlib.import_module(module), cls)
            except (ImportError, AttributeError):
                continue  # no megatron-core here: nothing runs from its hooks
            for name in methods:
                if hasattr(owner, name):
                    self._patches.wrap(owner, name, self._reentering)
        self.more_patches(self._patches)
        super().__enter__()
        self._stack = _get_current_function_mode_stack()  # bottom first, this mode last
        return self

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.restore()
            self._patches = None
