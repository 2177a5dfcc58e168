"""Progress bars that do not flood a log file.

tqdm redraws its bar ~15 times a second; on a terminal each redraw overwrites the line, but when stderr goes to
a file (``make run > run.log 2>&1``, CI, a cluster's job log) every redraw is appended: the main job wrote
99 KB in its first two minutes. :func:`calm_progress` sets tqdm's own environment defaults (``TQDM_MININTERVAL``,
read by tqdm when it is imported, since tqdm 4.66) so that, off a terminal, a bar redraws at most every
``interval_s`` seconds. Processes started afterwards (Ray workers, spawned evaluation processes) inherit it. The
environment is read once, when tqdm is imported; an entry point whose imports already loaded tqdm (the typed config
groups import modules that use it) also gets the interval as the default of ``tqdm.std.tqdm``'s ``mininterval``
(``functools.partialmethod``, tqdm's documented way to change a default), which every tqdm class inherits. A value
already in the environment is kept.
"""

from __future__ import annotations

import os
import sys

LOG_INTERVAL_S = 30.0


def calm_progress(interval_s: float = LOG_INTERVAL_S, stream=None) -> bool:
    """Off a terminal (``stream``, default stderr, is not a TTY) set ``TQDM_MININTERVAL`` to ``interval_s``
    seconds unless already set, and, when tqdm is already imported, make it ``tqdm.std.tqdm``'s default
    ``mininterval`` (a bar that passes its own ``mininterval`` keeps it); returns whether it did."""
    stream = sys.stderr if stream is None else stream
    try:
        tty = bool(stream.isatty())
    except (AttributeError, ValueError):   # a closed or replaced stream
        tty = False
    if tty or "TQDM_MININTERVAL" in os.environ:
        return False
    os.environ["TQDM_MININTERVAL"] = str(float(interval_s))
    if "tqdm.std" in sys.modules:   # imported already: the environment was read at import; set the default itself
        from functools import partialmethod

        import tqdm.std

        tqdm.std.tqdm.__init__ = partialmethod(tqdm.std.tqdm.__init__, mininterval=float(interval_s))
    return True


class _Tee:
    """A text stream that writes to ``stream`` and, line by line, to a logging ``FileHandler``'s file."""

    def __init__(self, stream, handler) -> None:
        self._stream, self._handler, self._buf = stream, handler, ""

    def write(self, s: str) -> int:
        n = self._stream.write(s)
        self._buf += s
        if "\n" in self._buf:
            done, self._buf = self._buf.rsplit("\n", 1)
            with self._handler.lock:   # the handler's own lock: no line of a log record is cut in two
                self._handler.stream.write(done + "\n")
                self._handler.stream.flush()
        return n

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


class tee_stdout_to_log:
    """Context manager: what is printed to stdout also goes to the run's log file (the root logger's last
    ``logging.FileHandler``: Hydra's ``<run dir>/<job>.log``), so the log holds the stage lines, learning curve and
    tables, not only the logging records. Without such a handler it does nothing."""

    def __enter__(self):
        import logging

        self._old = None
        fh = next((h for h in reversed(logging.getLogger().handlers) if isinstance(h, logging.FileHandler)), None)
        if fh is not None and fh.stream is not None:
            self._old, sys.stdout = sys.stdout, _Tee(sys.stdout, fh)
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            tee, sys.stdout = sys.stdout, self._old
            if tee._buf:   # an unfinished last line: to the log as a line of its own
                with tee._handler.lock:
                    tee._handler.stream.write(tee._buf + "\n")
                    tee._handler.stream.flush()
