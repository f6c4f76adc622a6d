"""What a long answer is doing, told to whoever asked.

The library never prints: a function that takes more than a moment (``gpulab.fit``,
``gpulab.serve``, ``what_fits``) takes an optional ``progress(fraction, text)`` callback, a
no-op when left out, and calls it before each costly part ("fake run at batch 3 ...").
``StreamProgress`` is the writer the ``gpulab`` command installs on stderr (never stdout, which
holds the answer): on a terminal one line rewritten in place, elsewhere (a pipe, a log file) one
plain line per message.
"""
from __future__ import annotations

import shutil
import time
from typing import Callable, TextIO

__all__ = ["Progress", "StreamProgress", "report"]

Progress = Callable[[float, str], None] | None   # (fraction done in [0, 1], what is being done)


def report(progress: Progress, fraction: float, text: str) -> None:
    """Tell ``progress`` (if any) what is being done now."""
    if progress is not None:
        progress(min(1.0, max(0.0, fraction)), text)


class StreamProgress:
    """A progress callback writing to ``stream``: ``gpulab: [  3.1 s] fake run at batch 3 ...``.

    On a terminal (``tty``, by default ``stream.isatty()``) the line is rewritten in place
    (carriage return, the text cut to the terminal's width, erase to the end of the line) and
    ``close()`` erases it, so what follows (an answer, an error) starts on a clean line.
    Elsewhere each message is a line of its own and ``close()`` writes nothing."""

    def __init__(self, stream: TextIO, *, tty: bool | None = None, prefix: str = "gpulab: "):
        self.stream, self.prefix = stream, prefix
        self.tty = bool(stream.isatty()) if tty is None else tty
        self.t0 = time.perf_counter()
        self.shown = False       # a line is on the terminal, not yet erased
        self.messages: list[str] = []

    def __call__(self, fraction: float, text: str) -> None:
        self.messages.append(text)
        line = f"{self.prefix}[{time.perf_counter() - self.t0:5.1f} s] {text}"
        try:
            if self.tty:
                width = shutil.get_terminal_size((100, 20)).columns - 1
                self.stream.write("\r" + line[:max(10, width)] + "\x1b[K")
                self.shown = True
            else:
                self.stream.write(line + "\n")
            self.stream.flush()
        except (OSError, ValueError):   # a closed or broken stderr: the answer still matters more
            pass

    def close(self) -> None:
        """Erase the line left on a terminal."""
        if self.shown:
            try:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
            except (OSError, ValueError):
                pass
            self.shown = False
