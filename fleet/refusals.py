"""One line for a refusal: the scripts' driver-side handling of errors that say *why* a run cannot go on.

A refusal is one of the project's own errors that no retry can fix: the store refused (``StoreError``: another
live fleet holds a shard, a corrupt chunk, a full disk), the registry refused (``RegistryError``: a missing or
tampered checkpoint), the acting policy cannot be built (``PolicyLoadError``), a bad config (``ConfigError``).
When one crosses Ray, Ray wraps it (``RayTaskError``, ``ActorDiedError``) in tens of lines of remote traceback,
and Hydra adds its own. ``one_line_refusals`` prints the cause alone on stderr, writes the whole traceback to the
run's log file (Hydra's ``<run dir>/<script>.log``), and exits with status 2. Anything else propagates as before.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

REFUSAL_EXIT = 2


def refusal_types() -> tuple[type[BaseException], ...]:
    """The project's refusal error classes (imported lazily: this module is imported by scripts before Ray and
    torch; a class whose module cannot be imported in this environment, e.g. the deploy environment without Ray,
    cannot have been raised and is left out)."""
    import importlib

    out = []
    for mod, name in (("configs.schema", "ConfigError"), ("experience_dict.store", "StoreError"),
                      ("fleet.registry", "RegistryError"), ("fleet.worker", "PolicyLoadError")):
        try:
            out.append(getattr(importlib.import_module(mod), name))
        except ImportError:
            continue
    return tuple(out)


def unwrap(exc: BaseException) -> BaseException:
    """The refusal inside ``exc``: follows the exceptions Ray wraps (``RayTaskError.cause``,
    ``ActorDiedError.cause``) and explicit ``raise ... from`` links, outermost first, and returns the first
    project refusal (``refusal_types``) met; ``exc`` itself when there is none."""
    kinds = refusal_types()
    seen: set[int] = set()
    e = exc
    while id(e) not in seen:
        seen.add(id(e))
        carried = getattr(e, "cause", None)       # Ray's wrapper: its own text is the remote traceback
        if isinstance(carried, BaseException):
            e = carried
            continue
        if isinstance(e, kinds):
            return e
        if not isinstance(e.__cause__, BaseException):
            break
        e = e.__cause__
    return exc


def _file_handlers() -> list[logging.FileHandler]:
    return [h for h in logging.root.handlers if isinstance(h, logging.FileHandler) and h.baseFilename != os.devnull]


def log_trace(exc: BaseException) -> list[str]:
    """Append ``exc``'s full traceback to the root logger's file handlers only (the console stays clean);
    returns those files' paths (empty when the run has no log file)."""
    handlers = _file_handlers()
    record = logging.LogRecord("fleetmind.refusal", logging.ERROR, __file__, 0, "refused: %s\n%s",
                               (type(exc).__name__, "".join(traceback.format_exception(exc))), None)
    for h in handlers:
        h.handle(record)
    return [h.baseFilename for h in handlers]


@contextmanager
def one_line_refusals(prog: str) -> Iterator[None]:
    """Run the body; a refusal (``refusal_types``, bare or wrapped by Ray) becomes one line on stderr,
    ``<prog>: <ErrorType>: <message> (full trace: <log file>)``, and ``SystemExit(2)``; the traceback goes to the
    run's log file. Other exceptions propagate unchanged.

    Raises:
        SystemExit: status 2 on a refusal.
    """
    try:
        yield
    except Exception as e:   # filtered below; anything else is re-raised as it was
        cause = unwrap(e)
        if not isinstance(cause, refusal_types()):
            raise
        files = log_trace(e)
        print(f"{prog}: {type(cause).__name__}: {str(cause).strip()}" + (f" (full trace: {files[0]})" if files else ""),
              file=sys.stderr, flush=True)
        raise SystemExit(REFUSAL_EXIT) from None
