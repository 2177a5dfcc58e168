"""Atomic replacement of a local file: write a temp file beside it, then ``os.replace`` it into place.

A leaf module (standard library only) so every package (``experience_dict``, ``fleet``, ``policies``,
``scripts``) can import it without import cycles or the store's dependencies.
"""

from __future__ import annotations

import os
import uuid


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
