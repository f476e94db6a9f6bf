"""CUDA streams and events of the CPU emulation: objects with identity and a current stream.

docs/architecture.md (CPU emulation of CUDA). Work runs at once on the CPU, so streams order
nothing here; but code that places work on streams (megatron's communication stream, LoCo's
side stream, ``loco_megatron/streams.py``) must see ``torch.cuda.current_stream()`` change under
``torch.cuda.stream(s)``, tell streams apart and record events on them. A listener
(:class:`~.stream_log.StreamLog`, while entered) is told of every event record and stream wait,
to check on the CPU the ordering the code would have on a GPU.
"""

import itertools
import threading
from typing import Optional

_names = itertools.count()
_local = threading.local()
#: the object told of records and waits (``on_record(event, stream)``,
#: ``on_wait(stream, event)``), or None
_listener = [None]


class EmulatedStream:
    """Stand-in for ``torch.cuda.Stream``: a name, the current stream under
    ``torch.cuda.stream(self)`` (or ``with self:``), waits and records reported to the
    listener."""

    def __init__(self, device=None, priority: int = 0, name: Optional[str] = None, **kwargs):
        self.name = name or f"stream{next(_names)}"
        self.priority = priority

    def __repr__(self):
        return f"<emulated stream {self.name}>"

    def wait_event(self, event) -> None:
        if _listener[0] is not None and getattr(event, "stream", None) is not None:
            _listener[0].on_wait(self, event)

    def wait_stream(self, stream) -> None:
        self.wait_event(stream.record_event())

    def record_event(self, event=None):
        event = event if event is not None else EmulatedEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self):
        _stack().append(self)
        return self

    def __exit__(self, *exc):
        _stack().pop()


class EmulatedEvent:
    """Stand-in for ``torch.cuda.Event``: ``record`` marks the recording stream's position
    (the listener keeps it in ``mark``); everything has completed already."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False):
        self.stream, self.mark = None, None

    def record(self, stream=None) -> None:
        self.stream = stream if stream is not None else current_stream()
        self.mark = None
        if _listener[0] is not None:
            _listener[0].on_record(self, self.stream)

    def wait(self, stream=None) -> None:
        (stream if stream is not None else current_stream()).wait_event(self)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other) -> float:
        return 0.0


#: the stream every thread starts on (``torch.cuda.default_stream()``)
DEFAULT_STREAM = EmulatedStream(name="default")


def _stack():
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = [DEFAULT_STREAM]
    return stack


def current_stream(device=None) -> EmulatedStream:
    """``torch.cuda.current_stream``: the innermost ``torch.cuda.stream`` context's stream."""
    return _stack()[-1]


def default_stream(device=None) -> EmulatedStream:
    """``torch.cuda.default_stream``."""
    return DEFAULT_STREAM


class stream:  # noqa: N801 - torch.cuda.stream's name
    """``torch.cuda.stream(s)``: ``s`` is the current stream inside (None: no change). Reusable,
    like torch's ``StreamContext`` (megatron enters one twice in ``start_grad_sync``)."""

    def __init__(self, s=None):
        self.stream = s

    def __enter__(self):
        if self.stream is not None:
            self.stream.__enter__()
        return self.stream

    def __exit__(self, *exc):
        if self.stream is not None:
            self.stream.__exit__(*exc)


def set_listener(listener) -> None:
    """Report records and waits to ``listener`` (None: to nobody)."""
    _listener[0] = listener
