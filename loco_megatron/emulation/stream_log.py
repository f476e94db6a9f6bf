"""Record, on the CPU, which stream every kernel and collective would run on, and check the order.

docs/kernels.md ("Streams"). Under the CPU emulation of CUDA everything runs at once, so a missing
wait never shows as a wrong value. :class:`StreamLog` (a :class:`~.hook_modes.HookReentrantMode`
entered above the emulation) replays the GPU's rules instead:

* every torch call that writes memory is a kernel on the current stream
  (:func:`~.stream_model.current_stream`): its tensor arguments are read, in-place targets,
  ``out=`` and new results written (views and queries launch nothing); LoCo's fused kernels
  (``loco_megatron.kernels.compress_bucket``, ``decompress_shard``, ``apply_chunks``) are one
  kernel each, reading and writing what their contract says;
* a collective (``all_to_all_single``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
  ``all_reduce``) runs on its process group's own stream (NCCL's: one per group), which first
  waits for the current stream; ``work.wait()`` makes the then-current stream wait for it, and a
  synchronous collective makes the issuing stream wait at once;
* ``Event.record``, ``Stream.wait_event`` and ``wait_stream`` order streams as on a GPU.

Order is tracked with vector clocks (stream -> how many of each stream's operations are
known complete). Every access is checked against the earlier accesses to overlapping bytes
from other streams: a read after a write, or a write after a read or write, that is not
ordered after it is a **hazard** (``hazards``: what a GPU could run in the wrong order). Each
wait also lists the collectives it newly makes the waiting stream depend on (``covers``), so a
test can see a wait that queues behind a transfer it does not need.

A new tensor (an allocation) forgets the history of the bytes it takes: the caching allocator's
cross-stream reuse is not modelled (loco_megatron/streams.py keeps lifetimes by construction).
"""

import bisect
import functools
import inspect
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..patching import PatchSet
from . import stream_model
from .hook_modes import _SKIP, PKG, HookReentrantMode, tensors

#: torch.distributed collectives and the positions of ``(read, written)`` tensor arguments
_COLLECTIVES = {"all_to_all_single": ((1,), (0,)), "all_gather_into_tensor": ((1,), (0,)),
                "reduce_scatter_tensor": ((1,), (0,)), "all_reduce": ((0,), (0,))}
_INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
                    "__idiv__", "__ior__", "__iand__", "__ixor__", "__ilshift__", "__irshift__"}


@dataclass
class Op:
    """One recorded operation: ``kind`` (``kernel``, ``collective``, ``wait``), the ``stream``
    it ran on (or, for a wait, the stream that waited), ``seq`` (its position on the stream),
    ``name``, ``where`` (``file:line`` of the caller outside torch and the emulation); for a
    collective its ``group`` ranks and ``peers`` (the group ranks it sends to); for a wait the
    ``target`` (the collective a ``work.wait()`` waits for, else None) and ``covers`` (the
    collectives the wait newly orders the stream after)."""

    kind: str
    stream: object
    seq: int
    name: str
    frames: tuple  # (file, line) of the innermost frames, resolved by ``where``
    group: Tuple[int, ...] = ()
    peers: Tuple[int, ...] = ()
    target: Optional["Op"] = None
    covers: List["Op"] = field(default_factory=list)

    @property
    def where(self) -> str:
        """``file:line`` of the caller outside torch and the emulation."""
        return where(self.frames)


def _frames(depth: int = 2, count: int = 12) -> tuple:
    """The (file, line) of up to ``count`` frames from ``depth`` up (cheap: no path work)."""
    frame, out = sys._getframe(depth), []
    while frame is not None and len(out) < count:
        out.append((frame.f_code.co_filename, frame.f_lineno))
        frame = frame.f_back
    return tuple(out)


def where(frames: tuple) -> str:
    """The first of ``frames`` outside torch and this emulation package, as ``file:line``."""
    for path, line in frames:
        path = os.path.abspath(path)
        if not path.startswith(_SKIP):
            return f"{os.path.relpath(path, os.path.dirname(PKG))}:{line}"
    return "?"


def _span(t: torch.Tensor) -> Optional[Tuple[int, int]]:
    """The bytes ``[lo, hi)`` a tensor's elements lie in (None when empty)."""
    if t.numel() == 0:
        return None
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0)
    lo = t.data_ptr()
    return lo, lo + extent * t.element_size()


class _Work:
    """A collective's work, whose ``wait()`` the log sees."""

    def __init__(self, work, log: "StreamLog", op: Op):
        self._work, self._log, self._op = work, log, op

    def wait(self, *args, **kwargs):
        self._log._wait(stream_model.current_stream(), self._log._marks[id(self._op)],
                        target=self._op)
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


class StreamLog(HookReentrantMode):
    """The stream log (module doc). Enter it with the CPU emulation active; read ``ops``
    and ``hazards`` after.

    Attributes:
        ops: every :class:`Op`, in issue order.
        hazards: one line per unordered access pair (empty when the order is right).
    """

    PATCH_SET = "loco-stream-log"

    def __init__(self):
        super().__init__()
        self.ops: List[Op] = []
        self.hazards: List[str] = []
        self._clock: Dict[object, Dict[object, int]] = {}
        self._seq: Dict[object, int] = {}
        self._marks: Dict[int, Dict[object, int]] = {}  # id(op) -> clock right after it
        self._memory: Dict[int, List[tuple]] = {}  # storage base -> [(lo, hi, write, op)]
        self._bases: List[int] = []  # the keys of _memory, sorted
        self._nccl: Dict[object, object] = {}  # process group -> its stream
        self._collectives: List[Op] = []

    # --- ordering -------------------------------------------------------------------------
    def _vc(self, stream) -> Dict[object, int]:
        return self._clock.setdefault(stream, {})

    def _issue(self, stream, kind: str, name: str, **info) -> Op:
        seq = self._seq[stream] = self._seq.get(stream, 0) + 1
        self._vc(stream)[stream] = seq
        op = Op(kind, stream, seq, name, _frames(), **info)
        self.ops.append(op)
        self._marks[id(op)] = dict(self._vc(stream))
        return op

    def _wait(self, stream, mark: Optional[Dict[object, int]], target: Optional[Op] = None):
        if not mark:
            return
        clock = self._vc(stream)
        before = dict(clock)
        for s, n in mark.items():
            if n > clock.get(s, 0):
                clock[s] = n
        op = Op("wait", stream, self._seq.get(stream, 0), "wait", _frames(), target=target)
        op.covers = [c for c in self._collectives
                     if before.get(c.stream, 0) < c.seq <= clock.get(c.stream, 0)]
        self.ops.append(op)

    def ordered_before(self, op: Op, kind: str = "collective") -> List[Op]:
        """The recorded operations of ``kind`` that ``op`` (a kernel or collective) is ordered
        after: on a GPU it cannot start before they end."""
        mark = self._marks[id(op)]
        return [c for c in self.ops if c.kind == kind and c is not op
                and c.seq <= mark.get(c.stream, 0)]

    def on_record(self, event, stream) -> None:
        """(listener) ``event`` recorded on ``stream``: it marks the stream's clock now."""
        event.mark = dict(self._vc(stream))

    def on_wait(self, stream, event) -> None:
        """(listener) ``stream`` waits for ``event``."""
        self._wait(stream, event.mark)

    # --- memory ---------------------------------------------------------------------------
    def _access(self, op: Op, t: torch.Tensor, write: bool) -> None:
        span = _span(t)
        if span is None:
            return
        base = t.untyped_storage().data_ptr()
        clock = self._vc(op.stream)
        entries = self._memory.get(base)
        if entries is None:
            entries = self._memory[base] = []
            bisect.insort(self._bases, base)
        for lo, hi, was_write, prev in entries:
            if lo < span[1] and span[0] < hi and prev.stream is not op.stream \
                    and (write or was_write) and clock.get(prev.stream, 0) < prev.seq:
                kind = ("write after write" if was_write else "write after read") if write \
                    else "read before its producer's event"
                self.hazards.append(
                    f"{op.name} on {op.stream.name} at {op.where}: {kind}: {prev.name} on "
                    f"{prev.stream.name} at {prev.where} is not ordered before it")
        # what this access covers needs no more checks: a later access ordered after it is
        # ordered after them (a write's were checked against it, a read's are on its stream)
        entries[:] = [e for e in entries if not (span[0] <= e[0] and e[1] <= span[1] and (
            write or (not e[2] and e[3].stream is op.stream)))]
        entries.append((span[0], span[1], write, op))

    def _allocated(self, t: torch.Tensor) -> None:
        """A new tensor: its bytes' earlier history belongs to freed memory (entries of the
        storages that start inside it, or just before it and reach into it)."""
        span = _span(t)
        if span is None:
            return
        j = bisect.bisect_left(self._bases, span[1]) - 1
        while j >= 0:
            base = self._bases[j]
            entries = self._memory[base]
            kept = [e for e in entries if e[1] <= span[0] or span[1] <= e[0]]
            if base < span[0] and len(kept) == len(entries):
                break  # the first storage before the tensor that does not reach into it
            if kept:
                self._memory[base] = kept
            else:
                del self._memory[base]
                del self._bases[j]
            j -= 1

    def kernel(self, name: str, reads, writes, new=()) -> Op:
        """Record a kernel on the current stream reading ``reads`` and writing ``writes``
        (tensors; ``new``: freshly allocated outputs, also written)."""
        for t in new:
            self._allocated(t)
        op = self._issue(stream_model.current_stream(), "kernel", name)
        for t in reads:
            self._access(op, t, False)
        for t in list(writes) + list(new):
            self._access(op, t, True)
        return op

    # --- torch calls ----------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        inputs = list(tensors(list(args) + list(kwargs.values())))
        storages = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
        inplace = (name.endswith("_") and not name.startswith("__")) or name in _INPLACE_DUNDERS
        written = list(tensors(kwargs.get("out")))
        if inplace and args and isinstance(args[0], torch.Tensor):
            written.append(args[0])
        new = [t for t in tensors(out) if t.numel() and not inplace
               and t.untyped_storage().data_ptr() not in storages]
        if written or new:
            self.kernel(name, [t for t in inputs if all(t is not w for w in written)],
                        written, new)
        return out

    # --- patches --------------------------------------------------------------------------
    def _nccl_stream(self, group):
        group = group if group is not None else dist.group.WORLD
        stream = self._nccl.get(group)
        if stream is None:
            ranks = tuple(dist.get_process_group_ranks(group))
            stream = self._nccl[group] = stream_model.EmulatedStream(
                name=f"nccl{len(self._nccl)}{list(ranks)}")
        return stream

    def _collective(self, name, fn, positions):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arg = list(bound.arguments.values())
            group, async_op = bound.arguments.get("group"), bound.arguments.get("async_op")
            current, nccl = stream_model.current_stream(), self._nccl_stream(group)
            self._wait(nccl, dict(self._vc(current)))  # NCCL's stream waits for the current
            splits = bound.arguments.get("input_split_sizes")
            ranks = tuple(dist.get_process_group_ranks(
                group if group is not None else dist.group.WORLD))
            peers = tuple(r for r, n in enumerate(splits) if n) if splits else tuple(
                range(len(ranks)))
            op = self._issue(nccl, "collective", name, group=ranks, peers=peers)
            self._collectives.append(op)
            for i in positions[0]:
                self._access(op, arg[i], False)
            for i in positions[1]:
                self._access(op, arg[i], True)
            work = fn(*args, **kwargs)
            if async_op:
                return _Work(work, self, op) if work is not None else None
            self._wait(current, self._marks[id(op)], target=op)
            return work
        return call

    def _fused(self, name, fn, reads, writes):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            a = bound.arguments
            result = fn(*args, **kwargs)
            produced = [t for t in tensors(result)] if isinstance(result, tuple) else []
            self.kernel(f"loco {name}", [t for k in reads for t in _held(a.get(k))],
                        [t for k in writes for t in _held(a.get(k.rstrip(".")), k.endswith("."))],
                        produced)
            return result
        return call

    def more_patches(self, patches: PatchSet) -> None:
        """The collectives, LoCo's fused kernels, and the stream model's listener."""
        for name, positions in _COLLECTIVES.items():
            patches.wrap(dist, name, lambda fn, n=name, p=positions: self._collective(n, fn, p))
        from .. import kernels

        for name, reads, writes in (("compress_bucket", ("g", "table", "err"), ("err.",)),
                                    ("decompress_shard", ("payload", "scales", "table"),
                                     ("out",)),
                                    ("apply_chunks", ("payload", "scales", "table", "out"),
                                     ("out",))):
            patches.wrap(kernels, name, lambda fn, n=name, r=reads, w=writes:
                         self._fused(n, fn, r, w))
        stream_model.set_listener(self)

    def __exit__(self, *exc):
        stream_model.set_listener(None)
        return super().__exit__(*exc)


def _held(obj, stored_only: bool = False):
    """The tensors ``obj`` is or holds (a tensor, or an object's tensor attributes: an error
    buffer, a block table); ``stored_only``: an error buffer's stored error only (``codes``,
    ``scales``, ``values``), not its tables."""
    if obj is None:
        return []
    if isinstance(obj, torch.Tensor):
        return [obj]
    held = {k: v for k, v in vars(obj).items() if isinstance(v, torch.Tensor)}
    return [v for k, v in held.items() if not stored_only or k in _STORED]


#: the attributes of an :class:`~loco_megatron.error_buffer.ErrorBuffer` the compress writes
_STORED = ("codes", "scales", "values")
