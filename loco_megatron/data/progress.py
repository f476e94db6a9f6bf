"""Progress display on stderr: a ``tqdm`` bar on a terminal, periodic plain lines in logs.

``tqdm`` redraws with carriage returns, which turns batch-job logs into one huge line;
when stderr is not a terminal a ``[loco-data] <phase>: ...`` line is printed at most
every ``interval`` seconds instead, plus one at the end.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


class Progress:
    """Count units of work for one phase; use as a context manager.

    Args:
        phase: short label, e.g. ``"tokenize"``.
        total: expected units (documents or files), or ``None`` if unknown.
        unit: name of the counted unit, e.g. ``"docs"``.
        interval: seconds between plain lines when stderr is not a terminal.
        stream: output stream (default ``sys.stderr``).
    """

    def __init__(
        self,
        phase: str,
        total: Optional[int] = None,
        unit: str = "docs",
        interval: float = 10.0,
        stream: Optional[TextIO] = None,
    ) -> None:
        self.phase, self.total, self.unit, self.interval = phase, total, unit, interval
        self.stream = stream if stream is not None else sys.stderr
        self.count = 0
        self.extra = ""
        self._start = self._last = time.monotonic()
        self._bar = None
        self._printed: Optional[int] = None
        if self.stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=f"[loco-data] {phase}", unit=f" {unit}",
                             file=self.stream, dynamic_ncols=True, mininterval=0.5)

    def set(self, count: int, extra: str = "") -> None:
        """Report ``count`` units done so far; ``extra`` (e.g. ``"2.1M tokens"``) is shown too."""
        self.extra = extra
        if self._bar is not None:
            self._bar.update(count - self.count)
            if extra:
                self._bar.set_postfix_str(extra, refresh=False)
        else:
            now = time.monotonic()
            if now - self._last >= self.interval:
                self._last = now
                self._line(count)
        self.count = count

    def _line(self, count: int) -> None:
        self._printed = count
        of = f"/{self.total}" if self.total is not None else ""
        extra = f", {self.extra}" if self.extra else ""
        elapsed = time.monotonic() - self._start
        print(f"[loco-data] {self.phase}: {count}{of} {self.unit}{extra} ({elapsed:.0f} s)",
              file=self.stream, flush=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._bar is not None:
            self._bar.close()
        elif exc_type is None and self._printed != self.count:
            self._line(self.count)


def human(n: float) -> str:
    """``1234567 -> '1.23M'``: compact count for progress lines."""
    for suffix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(int(n))
