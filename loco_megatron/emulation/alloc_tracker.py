"""LoCo's live tensor bytes on the CPU emulation: what it would hold on a GPU, allocation by
allocation, with overlap on (megatron's backward hooks included).

docs/kernels.md ("GPU contract", memory). :class:`AllocationTracker` is a
:class:`~.hook_modes.HookReentrantMode`: every torch call's output whose storage is new (not
one of the call's inputs' storages) and whose caller (:func:`~.hook_modes.caller`) is
``loco_megatron`` code is recorded with its storage's bytes. The tracker keeps a reference to
each recorded storage and, before each new record (and on :meth:`sweep`), drops those nobody
else holds (``torch._C._storage_Use_Count``): a storage is live while any tensor, a closure, a
``torch.distributed`` work or a cache holds it, exactly as on a GPU. Memory allocated natively
(the C kernels' per-block workspace, gloo's and NCCL's own buffers) is not a tensor and is not
seen.
"""

import time
from typing import Dict, List, Tuple

import torch

from .hook_modes import HookReentrantMode, caller, tensors


class AllocationTracker(HookReentrantMode):
    """``with AllocationTracker() as t:`` records LoCo's tensor allocations (module doc).

    Attributes:
        live_bytes: bytes of LoCo's recorded storages alive at the last record or sweep.
        peak_bytes: the largest ``live_bytes`` since entering or :meth:`reset_peak`.
        peak_live: ``[(file:line, bytes)]`` of the storages alive at that peak.
    """

    PATCH_SET = "loco-allocation-tracker"

    def __init__(self):
        super().__init__()
        self._live: Dict[int, Tuple[torch.UntypedStorage, int, str]] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_live: List[Tuple[str, int]] = []

    def sweep(self) -> int:
        """Forget the recorded storages only the tracker still holds; returns ``live_bytes``."""
        for ptr, (storage, nbytes, _) in list(self._live.items()):
            if torch._C._storage_Use_Count(storage._cdata) <= 1:
                del self._live[ptr]
                self.live_bytes -= nbytes
        return self.live_bytes

    def settle(self, quiet: int = 5, interval_s: float = 0.02, timeout_s: float = 5.0) -> int:
        """:meth:`sweep` until ``live_bytes`` is unchanged over ``quiet`` sweeps ``interval_s``
        apart (at most ``timeout_s`` seconds); returns ``live_bytes``. A ``torch.distributed``
        worker thread may hold a finished work's tensors a moment after ``wait()`` returned
        (gloo marks a work complete before its worker thread drops it): on a loaded machine a
        lone :meth:`sweep` can count them."""
        last, same, end = self.sweep(), 0, time.monotonic() + timeout_s
        while same < quiet and time.monotonic() < end:
            time.sleep(interval_s)
            now = self.sweep()
            same = same + 1 if now == last else 0
            last = now
        return last

    def reset_peak(self) -> None:
        """Start a new peak from what is live now (e.g. at the start of a step)."""
        self.sweep()
        self.peak_bytes = self.live_bytes
        self.peak_live = self.live()

    def live(self) -> List[Tuple[str, int]]:
        """``[(file:line, bytes)]`` of the recorded storages alive at the last sweep."""
        return [(where, n) for _, n, where in self._live.values()]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = None
        for t in tensors(out):
            if t.device.type == "meta" or t.is_sparse:
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or ptr in self._live:
                continue
            if inputs is None:
                inputs = {x.untyped_storage().data_ptr() for x in tensors((args, kwargs))
                          if x.device.type != "meta" and not x.is_sparse}
            if ptr in inputs:
                continue  # a view or an in-place result: no new memory
            owner, where = caller(2)
            if owner != "loco":
                continue
            self.sweep()
            self._live[ptr] = (storage, nbytes, where)
            self.live_bytes += nbytes
            if self.live_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes
                self.peak_live = self.live()
        return out
