"""Count, on the CPU, what would stall the host or copy pageable memory to a GPU.

docs/kernels.md ("GPU contract"). On a GPU, LoCo's steady-state step must not wait for the
device (a host sync stalls the launch queue and, with overlap on, serialises communication with
compute) nor build tensors from host data (a pageable host-to-device copy per call). Neither
can be seen on a machine without a GPU, so :class:`HostSyncCounter`, a ``TorchFunctionMode``
entered above the CPU emulation (:mod:`.cpu_cuda`), records every call that would do one of
them on a GPU:

``sync``
    ``Tensor.item``, ``.tolist``, ``.cpu``, ``.numpy``, ``bool()`` / ``int()`` / ``float()`` /
    ``index()`` of a tensor, ``nonzero``, ``argwhere``, ``masked_select``, ``unique``,
    ``unique_consecutive``, ``bincount``, one-argument ``torch.where``, ``torch.equal``,
    ``allclose``, ``is_nonzero``, formatting a tensor (``repr``, ``str``, ``format``),
    ``repeat_interleave`` with tensor repeats and no ``output_size``, boolean-mask indexing,
    slicing by a tensor (``x[:n]`` with ``n`` a tensor), device-to-host copies (``.to('cpu')``,
    ``host.copy_(x)`` without ``non_blocking=True``), and ``torch.cuda.synchronize`` /
    ``Stream.synchronize`` / ``Event.synchronize`` (through the emulation's stand-ins);
``h2d``
    ``torch.tensor`` / ``torch.as_tensor`` of Python data asked for a CUDA device, ``.cuda()`` or
    ``.to(cuda)`` of a tensor known to live on the host (see below), ``copy_`` of a host tensor
    into a device tensor (``.to(x.device)`` is not seen: under the emulation every device is
    the CPU);
``host_build``
    ``torch.tensor`` / ``torch.as_tensor`` of Python data on the host: on a GPU it is either
    copied to the device next (a cache miss of a block table) or per-step host work.

A tensor "lives on the host" when it was built from Python data inside the window or by a factory
asked for ``device="cpu"`` or ``pin_memory=True``, or computed from such tensors only, or carries
the attribute :data:`HOST_ATTR` (LoCo's CPU-side tables, e.g. a block table's ``spans``):
operations on those are not device syncs. Only the string ``"cpu"`` names the host in ``.to``:
under the emulation a device tensor's ``.device`` is the CPU too.

Like every :class:`~.hook_modes.HookReentrantMode` it also runs in megatron's backward hooks
(what they run with ``overlap_grad_reduce`` on: LoCo's compress, its all-to-all launch, the NaN/Inf
poll, the hierarchical inter-node stage). Every event is attributed to the innermost caller
outside torch, this emulation package and megatron-core's ``timers.py``
(:func:`~.hook_modes.caller`): ``owner`` is ``"loco"`` for ``loco_megatron`` code, else
``"other"``.
"""

import collections
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from ..patching import PatchSet
from .cpu_cuda import _CPU, _is_cuda_device
from .hook_modes import HookReentrantMode, caller as _caller, tensors as _tensors

_T = torch.Tensor
#: method or function -> the name an event carries (``sync`` category)
_SYNC_CALLS = {
    _T.item: "item", _T.tolist: "tolist", _T.cpu: "cpu", _T.numpy: "numpy",
    _T.__bool__: "bool", _T.__int__: "int", _T.__float__: "float", _T.__index__: "index",
    _T.nonzero: "nonzero", torch.nonzero: "nonzero", torch.argwhere: "argwhere",
    _T.argwhere: "argwhere", torch.masked_select: "masked_select",
    _T.masked_select: "masked_select", torch.unique: "unique", _T.unique: "unique",
    torch.unique_consecutive: "unique_consecutive", _T.unique_consecutive: "unique_consecutive",
    torch.bincount: "bincount", _T.bincount: "bincount", torch.equal: "equal", _T.equal: "equal",
    torch.allclose: "allclose", _T.allclose: "allclose", torch.is_nonzero: "is_nonzero",
    _T.is_nonzero: "is_nonzero", _T.__repr__: "format", _T.__format__: "format",
}
#: factories whose ``device="cpu"`` / ``pin_memory=True`` output lives on the host
_HOST_FACTORIES = (torch.empty, torch.zeros, torch.ones, torch.full, torch.arange,
                   torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like)
_FACTORIES = {torch.tensor: "tensor", torch.as_tensor: "as_tensor"}
_INDEXING = (_T.__getitem__, _T.__setitem__)
_REPEAT = (torch.repeat_interleave, _T.repeat_interleave)
#: attribute (set to True) of a tensor that lives on the host whatever the device (CPU tables)
HOST_ATTR = "_loco_host"


@dataclass(frozen=True)
class Event:
    """One counted call: ``category`` (``sync``, ``h2d``, ``host_build``), ``op`` (the call),
    ``owner`` (``loco`` or ``other``) and ``where`` (``file:line`` of the attributed caller)."""

    category: str
    op: str
    owner: str
    where: str


def _host_device(d) -> bool:
    return isinstance(d, str) and d == "cpu" or d is _CPU


def _tensor_slice(index) -> bool:
    """``x[a:b]`` with a tensor bound (its ``__index__`` reads the device)."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, slice) and any(isinstance(b, torch.Tensor)
                                             for b in (p.start, p.stop, p.step)) for p in parts)


class HostSyncCounter(HookReentrantMode):
    """Records :class:`Event` s while entered (``with HostSyncCounter() as c:``); see the
    module doc for what counts. Needs no GPU; meant for the CPU emulation, where every tensor
    stands for a device tensor unless it lives on the host.

    Attributes:
        events: every :class:`Event`, in order.
    """

    PATCH_SET = "loco-host-sync-counter"

    def __init__(self):
        super().__init__()
        self.events: List[Event] = []
        self._host: Dict[int, weakref.ref] = {}

    # -- host tensors ------------------------------------------------------------------
    def mark_host(self, tensor: torch.Tensor) -> None:
        """``tensor`` lives on the host: reading it is no device sync."""
        self._host[id(tensor)] = weakref.ref(tensor)

    def _on_host(self, tensor) -> bool:
        if getattr(tensor, HOST_ATTR, False):
            return True
        ref = self._host.get(id(tensor))
        return ref is not None and ref() is tensor

    def _record(self, category: str, op: str) -> None:
        owner, where = _caller(3)
        self.events.append(Event(category, op, owner, where))

    def count(self, owner: Optional[str] = None, category: Optional[str] = None) -> int:
        """Events of ``owner`` and ``category`` (None: any)."""
        return sum(1 for e in self.events if (owner is None or e.owner == owner)
                   and (category is None or e.category == category))

    def summary(self, owner: Optional[str] = None) -> Dict[str, int]:
        """``{"category op @ where": count}`` of ``owner``'s events (for failure messages)."""
        return dict(collections.Counter(f"{e.category} {e.op} @ {e.where}" for e in self.events
                                        if owner is None or e.owner == owner))

    # -- the mode ----------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [self._on_host(t) for t in _tensors((args, kwargs))]
        host_input = bool(inputs) and all(inputs)  # a host op (device inputs make it a device op)
        if func in _FACTORIES and args and not isinstance(args[0], torch.Tensor):
            cuda = _is_cuda_device(kwargs.get("device"))
            self._record("h2d" if cuda else "host_build", _FACTORIES[func])
            out = func(*args, **kwargs)
            if not cuda:
                self.mark_host(out)
            return out
        if func in _HOST_FACTORIES and (kwargs.get("pin_memory") or _host_device(
                kwargs.get("device"))):
            out = func(*args, **kwargs)
            self.mark_host(out)
            return out
        if func is _T.copy_ and len(args) > 1 and inputs[1] and not inputs[0]:
            self._record("h2d", "copy_ from the host")  # a device tensor takes host data
        elif func is _T.copy_ and len(args) > 1 and inputs[0] and not inputs[1]:
            if not (kwargs.get("non_blocking") or args[2:3] == (True,)):
                self._record("sync", "copy_ to the host")  # the host waits for the device
        elif not host_input:
            if func in _SYNC_CALLS:
                self._record("sync", _SYNC_CALLS[func])
            elif func is torch.where and len(args) + len(kwargs) == 1:
                self._record("sync", "where(condition)")
            elif func is _T.to and any(_host_device(a) for a in list(args[1:]) + [
                    kwargs.get("device")]):
                self._record("sync", "to(cpu)")
            elif func in _INDEXING and len(args) > 1 and _tensor_slice(args[1]):
                self._record("sync", "slicing by a tensor")
            elif func in _INDEXING and len(args) > 1 and any(
                    t.dtype == torch.bool for t in _tensors(args[1])):
                self._record("sync", "boolean-mask indexing")
            elif func in _REPEAT and "output_size" not in kwargs and len(args) > 1 \
                    and isinstance(args[1], torch.Tensor) and args[1].numel() > 1:
                self._record("sync", "repeat_interleave without output_size")
        elif func is _T.cuda or (func is _T.to and any(
                _is_cuda_device(a) for a in list(args[1:]) + [kwargs.get("device")])):
            self._record("h2d", "to(cuda)" if func is _T.to else "cuda")
        out = func(*args, **kwargs)
        if host_input:
            for t in _tensors(out):
                self.mark_host(t)
        return out

    def _device_sync(self, op):
        def sync(*args, **kwargs):
            self._record("sync", op)
        return sync

    def more_patches(self, patches: PatchSet) -> None:
        """The device syncs of the emulation's stand-ins: ``torch.cuda.synchronize``,
        ``Stream.synchronize``, ``Event.synchronize``."""
        from . import cpu_cuda

        patches.replace(torch.cuda, "synchronize", self._device_sync("cuda.synchronize"))
        if cpu_cuda.is_active():
            for cls, name in ((cpu_cuda._Stream, "Stream"), (cpu_cuda._Event, "Event")):
                patches.replace(cls, "synchronize",
                                lambda self_, _op=f"{name}.synchronize", c=self:
                                c._record("sync", _op))
