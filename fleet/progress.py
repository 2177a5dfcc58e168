"""Progress bars that do not flood a log file.

tqdm redraws its bar ~15 times a second; on a terminal each redraw overwrites the line, but when stderr goes to
a file (``make run > run.log 2>&1``, CI, a cluster's job log) every redraw is appended: the main job wrote
99 KB in its first two minutes. :func:`calm_progress` sets tqdm's own environment defaults (``TQDM_MININTERVAL``,
read by tqdm when it is imported, since tqdm 4.66) so that, off a terminal, a bar redraws at most every
``interval_s`` seconds. Entry points call it before tqdm is imported; processes started afterwards (Ray workers,
spawned evaluation processes) inherit it. A value already in the environment is kept.
"""

from __future__ import annotations

import os
import sys

LOG_INTERVAL_S = 30.0


def calm_progress(interval_s: float = LOG_INTERVAL_S, stream=None) -> bool:
    """Off a terminal (``stream``, default stderr, is not a TTY) set ``TQDM_MININTERVAL`` to ``interval_s``
    seconds unless already set; returns whether it did. Call before ``import tqdm``."""
    stream = sys.stderr if stream is None else stream
    try:
        tty = bool(stream.isatty())
    except (AttributeError, ValueError):   # a closed or replaced stream
        tty = False
    if tty or "TQDM_MININTERVAL" in os.environ:
        return False
    os.environ["TQDM_MININTERVAL"] = str(float(interval_s))
    return True
