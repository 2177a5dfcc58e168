"""Versioned policy checkpoints on any fsspec URL, published atomically and verified by sha256.

Layout under the registry root (a local directory, ``memory://...``, ``s3://...``, ...)::

    <root>/v000001/model.safetensors       # the checkpoint's files (safetensors weights, JSON config, stats)
    <root>/v000001/config.json
    <root>/v000001/MANIFEST.json           # written LAST: a version exists only once its manifest does
    <root>/staging/<uuid>/...              # files being published (never read by fetch)

Publishing on a local filesystem writes the files aside (``staging/``), moves them to ``v<N>/`` (an atomic
rename claims the number) and then writes ``MANIFEST.json`` (itself written to a temporary name and renamed).
On object storage (``s3://``), which has no atomic rename, the number is claimed by a conditional write of
``v<N>/.claim`` (``If-None-Match: *``: one publisher wins, the others take the next number), the files are
uploaded into ``v<N>/`` and the manifest is one PUT. Either way a reader never sees a half-published version:
a version without a manifest is invisible. The manifest records every file's sha256 and size; ``fetch`` hashes what it
downloads and refuses (``ChecksumMismatchError``) a checkpoint whose bytes differ from the manifest, before
anything is loaded. Pickle-based files (``.pt``, ``.pkl``, ``.bin`` ...) are refused at publish time:
weights are safetensors, metadata is JSON.

Two racing publishers cannot overwrite each other's version on a local filesystem or on S3 (conditional
writes); on a filesystem with neither, one publisher at a time is assumed (the learner).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from experience_dict.atomic import atomic_dir

MANIFEST = "MANIFEST.json"
FORMAT = "fleetmind-checkpoint/1"
PICKLE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".bin", ".joblib")
_VERSION_RE = re.compile(r"^v(\d{6,})$")
_CHUNK = 1 << 20


class RegistryError(RuntimeError):
    """A registry operation failed (missing version, bad checkpoint directory, bad metadata)."""


class ChecksumMismatchError(RegistryError, ValueError):
    """A checkpoint's bytes do not match its manifest (tampered or corrupted): it is refused, never loaded."""


def sha256_file(path: str | os.PathLike, fs: fsspec.AbstractFileSystem | None = None) -> tuple[str, int]:
    """Return ``(hex sha256, size in bytes)`` of one file, streamed in 1 MiB chunks."""
    fs = fs or LocalFileSystem()
    h, n = hashlib.sha256(), 0
    with fs.open(str(path), "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n


def _checkpoint_files(checkpoint_dir: Path) -> list[str]:
    """Relative POSIX paths of every file under ``checkpoint_dir``; refuses pickles and a stray manifest."""
    if not checkpoint_dir.is_dir():
        raise RegistryError(f"checkpoint_dir {str(checkpoint_dir)!r} is not a directory")
    files = sorted(p.relative_to(checkpoint_dir).as_posix() for p in checkpoint_dir.rglob("*") if p.is_file())
    if not files:
        raise RegistryError(f"checkpoint_dir {str(checkpoint_dir)!r} holds no files")
    for rel in files:
        if rel.lower().endswith(PICKLE_SUFFIXES):
            raise RegistryError(
                f"checkpoint file {rel!r} looks like a pickle ({', '.join(PICKLE_SUFFIXES)}); the registry only "
                "takes safetensors weights and JSON metadata"
            )
    return [f for f in files if f != MANIFEST]


def verify_checkpoint_dir(local_dir: str | os.PathLike) -> dict[str, Any]:
    """Check a local checkpoint directory against its ``MANIFEST.json``; return the manifest.

    Raises:
        RegistryError: no manifest in ``local_dir``, or a file listed in it is missing.
        ChecksumMismatchError: a file's sha256 or size differs from the manifest.
    """
    local_dir = Path(local_dir)
    mpath = local_dir / MANIFEST
    if not mpath.is_file():
        raise RegistryError(f"{str(local_dir)!r} has no {MANIFEST}; not a registry checkpoint")
    manifest = json.loads(mpath.read_text())
    for rel, entry in manifest["files"].items():
        p = local_dir / rel
        if not p.is_file():
            raise RegistryError(f"checkpoint v{manifest['version']:06d}: file {rel!r} is missing in {str(local_dir)!r}")
        digest, size = sha256_file(p)
        _check(manifest["version"], rel, entry, digest, size)
    return manifest


def _check(version: int, rel: str, entry: dict, digest: str, size: int) -> None:
    if digest != entry["sha256"] or size != entry["size"]:
        raise ChecksumMismatchError(
            f"checkpoint v{version:06d} file {rel!r}: sha256 {digest[:16]}... ({size} bytes) does not match the "
            f"manifest's {entry['sha256'][:16]}... ({entry['size']} bytes); refusing a tampered or corrupted "
            "checkpoint"
        )


class CheckpointRegistry:
    """Versioned, verified policy checkpoints at an fsspec URL (contract: docs/INTERFACES.md, fleet/).

    Args:
        url: registry root, e.g. ``"outputs/registry"``, ``"memory://reg"``, ``"s3://bucket/reg"``.
        storage_options: passed to ``fsspec.core.url_to_fs`` (credentials, endpoint ...).

    Versions are integers 1, 2, 3 ... in publish order.
    """

    def __init__(self, url: str | os.PathLike, **storage_options: Any):
        self.url = str(url)
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **storage_options)
        self.root = self.root.rstrip("/")

    # ------------------------------------------------------------------ paths
    def _vdir(self, version: int) -> str:
        return f"{self.root}/v{version:06d}"

    def _version_dirs(self) -> list[int]:
        self.fs.invalidate_cache(self.root)
        if not self.fs.exists(self.root):
            return []
        out = []
        for p in self.fs.ls(self.root, detail=False):
            m = _VERSION_RE.match(p.rstrip("/").rsplit("/", 1)[-1])
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    # ------------------------------------------------------------------ reading
    def versions(self) -> list[int]:
        """All published versions (those with a manifest), ascending."""
        return [v for v in self._version_dirs() if self.fs.exists(f"{self._vdir(v)}/{MANIFEST}")]

    def latest_version(self) -> int | None:
        """The newest published version, or ``None`` when nothing is published yet."""
        for v in reversed(self._version_dirs()):
            if self.fs.exists(f"{self._vdir(v)}/{MANIFEST}"):
                return v
        return None

    def manifest(self, version: int) -> dict[str, Any]:
        """The manifest of ``version``: ``{"format", "version", "created", "files": {rel: {"sha256","size"}},
        "metadata"}``. Raises ``RegistryError`` when the version is not published."""
        path = f"{self._vdir(int(version))}/{MANIFEST}"
        self.fs.invalidate_cache(self._vdir(int(version)))
        if not self.fs.exists(path):
            raise RegistryError(f"registry {self.url!r}: version {version} is not published (have {self.versions()})")
        with self.fs.open(path, "rb") as f:
            return json.loads(f.read())

    def fetch(self, version: int | None, local_dir: str | os.PathLike) -> Path:
        """Download ``version`` (``None``: latest) into ``local_dir`` and verify every file's sha256.

        The files are downloaded to a temporary sibling directory, verified, and only then renamed to
        ``local_dir`` (with ``MANIFEST.json`` beside them), so ``local_dir`` never holds unverified bytes.
        An existing ``local_dir`` that verifies against the same version is reused.

        Returns:
            ``Path(local_dir)``.
        Raises:
            RegistryError: nothing published / the version does not exist / a listed file is missing.
            ChecksumMismatchError: a downloaded file does not match the manifest (nothing is left in
                ``local_dir``).
        """
        if version is None:
            version = self.latest_version()
            if version is None:
                raise RegistryError(f"registry {self.url!r} has no published version yet")
        manifest = self.manifest(version)
        local_dir = Path(local_dir)
        if (local_dir / MANIFEST).is_file():
            try:
                cached = verify_checkpoint_dir(local_dir)
                if cached["version"] == version and cached["files"] == manifest["files"]:
                    return local_dir
            except RegistryError:
                pass
            shutil.rmtree(local_dir)
        with atomic_dir(local_dir, replace=False) as tmp:   # another process fetching it meanwhile: theirs is kept
            for rel, entry in manifest["files"].items():
                src = f"{self._vdir(version)}/{rel}"
                if not self.fs.exists(src):
                    raise RegistryError(f"checkpoint v{version:06d}: file {rel!r} listed in the manifest is missing")
                dst = tmp / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                h, n = hashlib.sha256(), 0
                with self.fs.open(src, "rb") as fi, open(dst, "wb") as fo:
                    while chunk := fi.read(_CHUNK):
                        h.update(chunk)
                        n += len(chunk)
                        fo.write(chunk)
                _check(version, rel, entry, h.hexdigest(), n)
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        return local_dir

    # ------------------------------------------------------------------ writing
    def _publish_local(self, checkpoint_dir: Path, files: list[str]) -> tuple[int, str]:
        """Local filesystem: copy into ``staging/<uuid>``, then claim ``v<N>`` by an atomic rename (fails when
        another publisher took that number: retry with the next)."""
        staging = f"{self.root}/staging/{uuid.uuid4().hex}"
        self.fs.makedirs(staging, exist_ok=True)
        for rel in files:
            dst = f"{staging}/{rel}"
            if "/" in rel:
                self.fs.makedirs(dst.rsplit("/", 1)[0], exist_ok=True)
            self.fs.put_file(str(checkpoint_dir / rel), dst)
        for _ in range(20):
            existing = self._version_dirs()
            version = (existing[-1] if existing else 0) + 1
            vdir = self._vdir(version)
            try:
                os.rename(staging, vdir)  # atomic; fails if vdir exists and is non-empty
                return version, vdir
            except OSError:
                continue
        raise RegistryError(f"registry {self.url!r}: could not claim a version number after 20 tries")

    def _publish_object_store(self, checkpoint_dir: Path, files: list[str]) -> tuple[int, str]:
        """Object storage (no atomic rename): claim ``v<N>`` by creating ``v<N>/.claim`` with a conditional
        write (S3 ``If-None-Match: *``: exactly one publisher creates it; the others get FileExistsError and
        try the next number), then upload the files into ``v<N>/``; the caller's single-object manifest PUT
        publishes the version. Filesystems without conditional writes fall back to exists-then-write (one
        publisher at a time)."""
        claim = json.dumps({"claimed": time.time(), "by": uuid.uuid4().hex}).encode()
        for _ in range(20):
            existing = self._version_dirs()
            version = (existing[-1] if existing else 0) + 1
            vdir = self._vdir(version)
            try:
                self.fs.pipe_file(f"{vdir}/.claim", claim, mode="create")
            except FileExistsError:
                continue
            except TypeError:   # no conditional-write support in this filesystem
                if self.fs.exists(vdir):
                    continue
                self.fs.pipe_file(f"{vdir}/.claim", claim)
            for rel in files:
                self.fs.put_file(str(checkpoint_dir / rel), f"{vdir}/{rel}")
            return version, vdir
        raise RegistryError(f"registry {self.url!r}: could not claim a version number after 20 tries")

    def publish(self, checkpoint_dir: str | os.PathLike, metadata: dict[str, Any] | None = None) -> int:
        """Publish the files of ``checkpoint_dir`` as the next version, atomically; return the version.

        Args:
            checkpoint_dir: local directory (e.g. from ``policy.save_pretrained``) with safetensors and JSON
                files; subdirectories are kept.
            metadata: JSON-able dict stored in the manifest (e.g. ``{"step": 2000, "train_loss": 0.1}``).
        Raises:
            RegistryError: not a directory / empty / holds a pickle-format file / metadata is not JSON-able.
        """
        checkpoint_dir = Path(checkpoint_dir)
        files = _checkpoint_files(checkpoint_dir)
        try:
            metadata = json.loads(json.dumps(metadata or {}))
        except (TypeError, ValueError) as e:
            raise RegistryError(f"publish metadata must be JSON-able: {e}") from e
        entries = {}
        for rel in files:
            digest, size = sha256_file(checkpoint_dir / rel)
            entries[rel] = {"sha256": digest, "size": size}

        if isinstance(self.fs, LocalFileSystem):
            version, vdir = self._publish_local(checkpoint_dir, files)
        else:
            version, vdir = self._publish_object_store(checkpoint_dir, files)
        manifest = {
            "format": FORMAT,
            "version": version,
            "created": time.time(),
            "files": entries,
            "metadata": metadata,
        }
        data = json.dumps(manifest, indent=1).encode()
        if isinstance(self.fs, LocalFileSystem):
            tmp = f"{vdir}/.{MANIFEST}.{uuid.uuid4().hex[:8]}"
            with self.fs.open(tmp, "wb") as f:
                f.write(data)
            self.fs.mv(tmp, f"{vdir}/{MANIFEST}")  # the version becomes visible here (atomic rename)
        else:
            self.fs.pipe_file(f"{vdir}/{MANIFEST}", data)   # one PUT: an object is visible whole or not at all
        return version


def checkpoint_with_critic(src: str | Path, out_dir: str | Path, critic_from: str | Path | None = None) -> str:
    """Copy the ``pretrained_model`` directory ``src`` to ``out_dir`` without its success critic, and with
    ``critic_from``'s critic files when given (the weights of one checkpoint, the critic of another). The registry
    manifest is not copied (the file set changed; the copy loads as an unversioned policy). Written to a
    temporary sibling and renamed, so ``out_dir`` never holds half a checkpoint. Returns ``str(out_dir)``.

    Raises:
        ValueError: ``critic_from`` has no complete success critic (``fert.critic.enabled`` false?).
    """
    import shutil

    from policies.critic import CRITIC_FILES

    src = Path(src)
    if critic_from is not None and not all((Path(critic_from) / f).is_file() for f in CRITIC_FILES):
        raise ValueError(f"checkpoint {str(critic_from)!r} has no success critic ({CRITIC_FILES}; "
                         "fert.critic.enabled is false?)")
    out = Path(out_dir)
    with atomic_dir(out) as tmp:
        for f in src.iterdir():
            if f.is_file() and f.name not in (*CRITIC_FILES, MANIFEST):
                shutil.copy2(f, tmp / f.name)
        if critic_from is not None:
            for f in CRITIC_FILES:
                shutil.copy2(Path(critic_from) / f, tmp / f)
    return str(out)
