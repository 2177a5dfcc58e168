"""Filesystem helpers of the store: local or fsspec, atomic writes, fresh listings, the zarr store of a URL,
and ``renameat2`` (an atomic swap of a chunk file with its spare on Linux)."""

from __future__ import annotations

import ctypes
import os
from typing import Any

import fsspec
import zarr
from fsspec.implementations.local import LocalFileSystem

from experience_dict.atomic import atomic_write_bytes


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def configure_storage(store_cfg: Any) -> None:
    """Apply ``store.storage_options`` (``{option: value}``, e.g. ``endpoint_url``, ``key``, ``secret`` for
    ``s3://``) as this process's fsspec defaults for the protocol of ``store.url``, so every store handle
    opened in the process (readers, writers, zarr's ``FsspecStore``) reaches the right server.

    Every process that opens the store calls it with the config it was given: the scripts at start-up, fleet
    workers, the learner, the vectorised evaluation. Options set through the environment (``AWS_ENDPOINT_URL``,
    ``AWS_ACCESS_KEY_ID``, ...) need nothing here. A local path or no options: nothing to do.

    Args:
        store_cfg: the ``store`` config group (mapping with ``url`` and optionally ``storage_options``).
    Raises:
        ValueError: ``storage_options`` is not a mapping.
    """
    if not store_cfg:
        return
    opts = store_cfg.get("storage_options") if hasattr(store_cfg, "get") else None
    if not opts:
        return
    if not hasattr(opts, "items"):
        raise ValueError(f"store.storage_options: expected a mapping of fsspec options, given {opts!r}")
    url = str(store_cfg.get("url") or "")
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if protocol in ("file", "memory"):
        return
    conf = fsspec.config.conf.setdefault(protocol, {})
    conf.update({str(k): v for k, v in dict(opts).items()})
    # cached filesystem instances were built with the old defaults
    fsspec.get_filesystem_class(protocol).clear_instance_cache()


_MADE_DIRS: set[tuple[Any, str]] = set()


def _atomic_write(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so a reader sees either nothing/the old file or the whole new file.

    Local: :func:`experience_dict.atomic.atomic_write_bytes` (temp file in the same directory +
    ``os.replace``; POSIX rename is atomic). Other filesystems: one ``pipe_file`` call, i.e. a single PUT on
    object stores (atomic there) or one dict assignment in ``memory://``.
    """
    parent = path.rsplit("/", 1)[0]
    if _is_local(fs):
        os.makedirs(parent, exist_ok=True)
        atomic_write_bytes(path, data)
    else:
        key = (getattr(fs, "_fs_token", None) or id(fs), parent)   # fsspec token: one per filesystem config
        if key not in _MADE_DIRS:   # object stores have no directories: one call per parent (s3fs: a HEAD)
            fs.makedirs(parent, exist_ok=True)
            _MADE_DIRS.add(key)
        fs.pipe_file(path, data)


def _ls_fresh(fs: fsspec.AbstractFileSystem, path: str, detail: bool = False):
    """``fs.ls`` past the filesystem's listings cache (s3fs, gcsfs, ... cache directory listings: a reader
    would otherwise never see a commit record written after its first listing)."""
    fs.invalidate_cache(path)
    return fs.ls(path, detail=detail)


def _ls_json(fs: fsspec.AbstractFileSystem, path: str, detail: bool = False):
    """``*.json`` entries directly under ``path`` (``[]`` if it does not exist); temp files are skipped."""
    try:
        entries = _ls_fresh(fs, path, detail=True)
    except FileNotFoundError:
        return []
    out = [e for e in entries if e["type"] == "file" and e["name"].endswith(".json")]
    return out if detail else [e["name"] for e in out]


def _zarr_store(url: str, read_only: bool) -> zarr.abc.store.Store:
    fs, path = fsspec.core.url_to_fs(url)
    if _is_local(fs):
        return zarr.storage.LocalStore(path, read_only=read_only)
    return zarr.storage.FsspecStore.from_url(url, read_only=read_only)




def _load_renameat2():
    try:
        return ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not glibc >= 2.28 / not Linux
        return None


_RENAMEAT2 = _load_renameat2()
