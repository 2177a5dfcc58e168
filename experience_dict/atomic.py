"""Atomic replacement of a local file or directory: write a temp file (or build a temp directory) beside it, then
rename it into place (:func:`atomic_write_bytes`, :func:`atomic_write_text`, :func:`atomic_dir`).

A leaf module (standard library only) so every package (``experience_dict``, ``fleet``, ``policies``,
``scripts``) can import it without import cycles or the store's dependencies.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, fsync: bool = False) -> None:
    """Replace the local file ``path`` with ``data`` atomically.

    The bytes go to a temp file in the same directory (``.<name>.<uuid hex>.tmp``: hidden, unique per call, and
    ending in ``.tmp`` so listings of ``*.json`` and the store's recovery skip it), which is then renamed over
    ``path`` with ``os.replace`` (an atomic rename on POSIX within one filesystem). Readers see the old file (or
    none) or the whole new one, never a torn one. On any error, the temp file is removed and ``path`` is left as
    it was. The parent directory is not created.

    Args:
        path: the file to write (local filesystem).
        data: its new content.
        fsync: also ``fsync`` the temp file before the rename (durable across a power loss, not only atomic
            for other processes). Off by default: the callers need atomicity only.
    Raises:
        OSError: the temp file could not be created or written (e.g. a missing parent directory,
            ``FileNotFoundError``), or the rename failed.
    """
    path = os.fspath(path)
    head, name = os.path.split(path)
    tmp = os.path.join(head, f".{name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:   # never created (or already gone): the original error is the one to raise
            pass
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str, *, encoding: str = "utf-8",
                      fsync: bool = False) -> None:
    """:func:`atomic_write_bytes` of ``text`` encoded with ``encoding`` (no newline translation).

    Raises:
        UnicodeEncodeError: ``text`` cannot be encoded (nothing is written).
        OSError: as :func:`atomic_write_bytes`.
    """
    atomic_write_bytes(path, text.encode(encoding), fsync=fsync)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike[str], *, replace: bool = True) -> Iterator[Path]:
    """Build a local directory out of sight, then put it at ``path`` in one rename.

    Yields a fresh hidden sibling (``.<name>.<uuid hex>.tmp``, created) to fill; when the block ends without an
    error it is renamed to ``path``, so a reader sees no directory or a whole one, never a half-written one. On
    any error the temp directory is removed and ``path`` is left as it was.

    Args:
        path: the directory to create (its parent is created if missing).
        replace: an existing ``path`` is removed just before the rename (a reader may then find no directory
            for that moment, never a partial one). False: if ``path`` exists by then (another process made it),
            the new one is discarded and ``path`` kept.
    Raises:
        OSError: the temp directory could not be created, or the rename failed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.mkdir()
    try:
        yield tmp
        if path.exists():
            if not replace:
                shutil.rmtree(tmp)
                return
            shutil.rmtree(path)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
