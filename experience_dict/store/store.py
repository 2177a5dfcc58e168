"""The fleet's Zarr experience store: many writers, crash-safe commits, snapshot readers.

Layout under the store URL (any fsspec URL; a plain path or ``file://`` uses zarr's ``LocalStore``)::

    zarr.json                               root group; attributes["fleetmind"] = store metadata (schema
                                            version, observation/action spec, control_hz, progress keys)
    shards/<writer_id>/<key>/...            one appendable Zarr array per feature key, rows = steps
    commits/<writer_id>/<episode_id>.json   one commit record per episode  <- the commit point
    annotations/<writer_id>/<episode_id>.json   failure-onset annotations (written by failure analysis)
    locks/<writer_id>.lock                  (local filesystems) flock held by the live writer

Why this is crash-safe (zarr 3 needs one writer per array, see DESIGN.md):

- Each writer id owns its shard; no two processes append to one array (enforced with ``flock`` on local
  filesystems; elsewhere writer ids must be unique, e.g. one per fleet unit).
- ``commit`` first writes the episode's rows to every array of the shard as whole chunks (the writer keeps
  the committed rows of each array's partly filled last chunk in memory, so nothing is read back; ``resize``
  when the capacity, grown geometrically, is exceeded), waits for every chunk write, then writes the
  episode's commit record as one atomic write (temp file + ``os.replace`` locally, a single PUT on object
  stores). Readers only ever look at rows named by commit records, so an episode is visible exactly when
  its record exists. Every chunk file is written through a temp file + atomic rename (as zarr's
  ``LocalStore`` does; locally the writer encodes chunks with the array's own zarr codecs and swaps them in
  with ``renameat2(RENAME_EXCHANGE)`` where available), so rewriting a partly filled boundary chunk never
  exposes a torn chunk that holds committed rows.
- A writer killed at any point leaves at most rows past its last committed row (and stray ``*.partial``
  temp files). Reopening the writer truncates every array of its shard back to the committed row count.
- Committed rows are never rewritten with different values, so a reader's snapshot (the set of commit
  records it has read) stays valid while writers append; :meth:`ExperienceStore.refresh` reads new records.

Durability against power loss would also need ``fsync`` of chunks; the guarantee here is against process
death (SIGKILL), which is what a fleet unit, the learner or the store writer meets in practice.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import json
import os
import re
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import fsspec
import numpy as np
import zarr
from fsspec.implementations.local import LocalFileSystem
from zarr.abc.codec import SupportsSyncCodec
from zarr.codecs import BloscCodec, Crc32cCodec
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync as zarr_sync

from experience_dict.stats import episode_sketch, merge_sketches

SCHEMA_VERSION = 1
# docs/INTERFACES.md: info["progress"] has exactly these keys for every task (sim.PROGRESS_KEYS); the default
# progress schema when neither ``progress_keys`` nor the spec declares one (experience_dict must not import sim)
DEFAULT_PROGRESS_KEYS = ("near_object", "grasp_success", "grasp_reward", "in_place_reward", "obj_to_target",
                         "unscaled_reward")
_WRITER_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_META_ATTR = "fleetmind"
_PLAIN_SCALARS = frozenset({float, int, bool, np.float32, np.float64, np.int32, np.int64, np.bool_})


class StoreError(Exception):
    """Base class of experience-store errors."""


class SchemaVersionError(StoreError):
    """The store was written with another schema version than this code reads."""


class SpecMismatchError(StoreError, ValueError):
    """A step, or a spec given to ``create_or_open``, does not match the store's spec."""


class WriterBusyError(StoreError):
    """Another live process holds the writer id (its shard) of this store."""


@dataclasses.dataclass
class EpisodeMeta:
    """Metadata of one committed episode (JSON in its commit record).

    Attributes:
        episode_id: ``"<writer_id>-<counter:06d>"``, unique across the fleet (writer ids are unique).
        unit_id: the robot unit that ran the episode.
        embodiment: robot type, e.g. ``"sawyer"``.
        task: task name, e.g. ``"push-v3"``.
        policy_version: version of the policy that acted; demonstrations use ``-1`` (scripted expert).
        seed: the env reset seed.
        start_time: wall-clock start of the episode, Unix seconds.
        length: number of steps T.
        success: whether the task succeeded.
        failure_onset: step index where the failure began (set later by failure analysis), else ``None``.
        is_demo: whether the episode is an expert demonstration.
        shard: writer id whose arrays hold the steps.
        start: first row of the episode in the shard's arrays (rows ``start .. start+length-1``).
        extra: free-form JSON-able metadata given to ``begin_episode`` (e.g. the unit's variation).
    """

    episode_id: str
    unit_id: int
    embodiment: str
    task: str
    policy_version: int
    seed: int
    start_time: float
    length: int
    success: bool
    failure_onset: int | None
    is_demo: bool
    shard: str
    start: int
    extra: dict = dataclasses.field(default_factory=dict)


# ----------------------------------------------------------------------------- helpers


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def _atomic_write(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so a reader sees either nothing/the old file or the whole new file.

    Local: temp file in the same directory + ``os.replace`` (POSIX rename is atomic). Other filesystems:
    one ``pipe_file`` call, i.e. a single PUT on object stores (atomic there) or one dict assignment in
    ``memory://``.
    """
    parent = path.rsplit("/", 1)[0]
    if _is_local(fs):
        os.makedirs(parent, exist_ok=True)
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    else:
        fs.makedirs(parent, exist_ok=True)
        fs.pipe_file(path, data)


def _ls_json(fs: fsspec.AbstractFileSystem, path: str, detail: bool = False):
    """``*.json`` entries directly under ``path`` (``[]`` if it does not exist); temp files are skipped."""
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        return []
    out = [e for e in entries if e["type"] == "file" and e["name"].endswith(".json")]
    return out if detail else [e["name"] for e in out]


def _zarr_store(url: str, read_only: bool) -> zarr.abc.store.Store:
    fs, path = fsspec.core.url_to_fs(url)
    if _is_local(fs):
        return zarr.storage.LocalStore(path, read_only=read_only)
    return zarr.storage.FsspecStore.from_url(url, read_only=read_only)


def _parse_spec(spec: dict, control_hz: float | None, progress_keys: Sequence[str] | None) -> dict:
    """Normalise an env spec (``env.spec_dict()``) into the store's array schema.

    Returns ``{"features": {key: {"shape", "dtype", ...}}, "control_hz", "progress_keys", "spec"}`` where
    features cover every ``observation.*`` key, ``action``, ``reward`` and ``progress.<k>``.
    """
    if not isinstance(spec, dict):
        raise SpecMismatchError(f"spec must be a dict (env.spec_dict()), given {type(spec).__name__}")
    features: dict[str, dict] = {}
    for key, val in spec.items():
        if key.startswith("observation.") or key == "action":
            if not isinstance(val, dict) or "shape" not in val or "dtype" not in val:
                raise SpecMismatchError(f"spec[{key!r}] needs 'shape' and 'dtype', given {val!r}")
            features[key] = {**val, "shape": [int(s) for s in val["shape"]], "dtype": np.dtype(val["dtype"]).str}
    if "action" not in features:
        raise SpecMismatchError(f"spec has no 'action' entry; keys given: {sorted(spec)}")
    if not any(k.startswith("observation.") for k in features):
        raise SpecMismatchError(f"spec has no 'observation.*' entry; keys given: {sorted(spec)}")
    if progress_keys is None:
        progress_keys = spec.get("progress_keys")
    if progress_keys is None:
        progress_keys = [k[len("progress."):] for k in spec if k.startswith("progress.")] or DEFAULT_PROGRESS_KEYS
    progress_keys = [str(k) for k in progress_keys]
    features["reward"] = {"shape": [], "dtype": np.dtype(np.float32).str}
    for k in progress_keys:
        features[f"progress.{k}"] = {"shape": [], "dtype": np.dtype(np.float32).str}
    hz = control_hz if control_hz is not None else spec.get("control_hz")
    if hz is None:
        raise SpecMismatchError("control_hz is neither given nor in spec['control_hz']")
    return {"features": features, "control_hz": float(hz), "progress_keys": progress_keys,
            "spec": json.loads(json.dumps(spec, default=str))}


def _is_image(feat: dict) -> bool:
    return np.dtype(feat["dtype"]) == np.uint8 and len(feat["shape"]) == 3


def _chunk_rows(feat: dict, chunk_bytes: int, max_chunk_rows: int) -> int:
    row_bytes = int(np.prod(feat["shape"], dtype=np.int64)) * np.dtype(feat["dtype"]).itemsize
    return int(np.clip(chunk_bytes // max(row_bytes, 1), 1, max_chunk_rows))


def _load_renameat2():
    try:
        return ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not glibc >= 2.28 / not Linux
        return None


_RENAMEAT2 = _load_renameat2()


def _replace(tmp: str, path: str) -> None:
    """Atomically put file ``tmp`` at ``path`` (readers see the old or the new file, never a torn one).

    ``os.replace`` over an existing file makes ext4 (default ``auto_da_alloc``) start writeback of the new
    file inside the rename, which costs milliseconds per file under I/O load; a commit replaces the partly
    filled last chunk of every array. ``renameat2(RENAME_EXCHANGE)`` swaps the two names just as atomically
    without that flush; the old file, now at ``tmp``, is then unlinked (a kill in between leaves a stray
    ``*.partial``, removed when the writer reopens). Falls back to ``os.replace`` where unsupported.
    """
    if _RENAMEAT2 is not None and os.path.exists(path):
        if _RENAMEAT2(-100, os.fsencode(tmp), -100, os.fsencode(path), 2) == 0:  # AT_FDCWD, RENAME_EXCHANGE
            os.unlink(tmp)
            return
    os.replace(tmp, path)


def _sync_chunk_encoder(arr: zarr.Array):
    """A function encoding one whole chunk of ``arr`` (``(chunk_rows, *shape)`` array) to the bytes zarr stores.

    Runs the array's own codec chain (bytes -> Blosc -> crc32c here) through zarr's synchronous codec interface
    (``zarr.abc.codec.SupportsSyncCodec``) in the calling thread, so the result is exactly what zarr's async
    pipeline would write. Returns ``None`` when a codec has no synchronous form (callers then use zarr's
    ``setitem``).
    """
    aa = arr.async_array
    codecs = list(aa.codec_pipeline)
    if not all(isinstance(c, SupportsSyncCodec) for c in codecs):
        return None
    spec0 = aa.metadata.get_chunk_spec((0,) * arr.ndim, aa.config, default_buffer_prototype())
    specs, spec = [], spec0
    for c in codecs:  # each codec sees the spec resolved by the codecs before it, as in zarr's pipeline
        specs.append(spec)
        spec = c.resolve_metadata(spec)

    def encode(block: np.ndarray):
        buf = spec0.prototype.nd_buffer.from_numpy_array(block)
        for c, s in zip(codecs, specs):
            buf = c._encode_sync(buf, s)
            if buf is None:
                raise StoreError(f"codec {c} dropped a chunk of {arr.path}")
        return buf.as_buffer_like()

    return encode


# ----------------------------------------------------------------------------- store


class ExperienceStore:
    """Handle on a fleet experience store: a snapshot reader plus a factory of shard writers.

    Use :meth:`create_or_open` (writers; creates the store if missing) or :meth:`open` (readers). Readers
    hold a snapshot of committed episodes; :meth:`refresh` picks up episodes committed since.

    Args (prefer the classmethods):
        url: fsspec URL or local path of the store root.
        read_only: refuse :meth:`writer` (set by :meth:`open`).
    """

    def __init__(self, url: str, read_only: bool = True):
        self.url = str(url).rstrip("/")
        self.read_only = read_only
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.root = self.root.rstrip("/")
        self._zstore = _zarr_store(self.url, read_only=read_only)
        try:
            group = zarr.open_group(self._zstore, mode="r")
            meta = group.attrs.get(_META_ATTR)
        except (FileNotFoundError, zarr.errors.GroupNotFoundError, KeyError) as e:
            raise FileNotFoundError(f"no experience store at {self.url!r} ({type(e).__name__})") from e
        if meta is None:
            raise StoreError(f"{self.url!r} is a Zarr group but not an experience store (no '{_META_ATTR}' attrs)")
        version = meta.get("schema_version")
        if version != SCHEMA_VERSION:
            raise SchemaVersionError(
                f"store {self.url!r} has schema_version={version!r}; this code reads schema_version="
                f"{SCHEMA_VERSION}")
        self.meta: dict = meta
        self.features: dict[str, dict] = meta["features"]
        self.control_hz: float = meta["control_hz"]
        self.progress_keys: list[str] = meta["progress_keys"]
        self.spec: dict = meta["spec"]
        self._episodes: dict[str, EpisodeMeta] = {}
        self._sketches: dict[str, dict] = {}
        self._seen_commits: set[str] = set()
        self._seen_annotations: dict[str, tuple] = {}
        self._arrays: dict[tuple[str, str], zarr.Array] = {}
        self.refresh()

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def create_or_open(cls, url: str, spec: dict, control_hz: float | None = None,
                       progress_keys: Sequence[str] | None = None, chunk_bytes: int = 1 << 20,
                       max_chunk_rows: int = 8192, image_clevel: int = 1) -> ExperienceStore:
        """Open the store at ``url`` for writing, creating it from ``spec`` if it does not exist.

        Args:
            url: fsspec URL or local directory.
            spec: the env's ``spec_dict()``: ``{"observation.<...>": {"shape", "dtype", "names", "unit"},
                "action": {...}, "control_hz": float, ...}``. Progress keys come from ``progress_keys``, else
                ``spec["progress_keys"]``, else the spec's ``progress.<k>`` entries, else
                :data:`DEFAULT_PROGRESS_KEYS` (the contract's ``sim.PROGRESS_KEYS``).
            control_hz: control frequency in Hz (default: ``spec["control_hz"]``).
            progress_keys: names of the scalar progress signals stored as ``progress.<k>`` per step.
            chunk_bytes: target uncompressed chunk size along time (bytes) for new arrays.
            max_chunk_rows: cap on rows per chunk (keeps small-feature chunks small so commits stay cheap).
            image_clevel: Blosc/zstd level for image arrays (other arrays use level 3 with byte shuffle).

        Raises:
            SpecMismatchError: the store exists with a different feature spec (names the key, expected and
                given) or the spec is malformed.
            SchemaVersionError: the store exists with another schema version.
        """
        parsed = _parse_spec(spec, control_hz, progress_keys)
        zstore = _zarr_store(str(url), read_only=False)
        try:
            zarr.open_group(zstore, mode="r")
            exists = True
        except (FileNotFoundError, zarr.errors.GroupNotFoundError):
            exists = False
        if not exists:
            meta = {"schema_version": SCHEMA_VERSION, "created": time.time(),
                    "chunk_bytes": int(chunk_bytes), "max_chunk_rows": int(max_chunk_rows),
                    "image_clevel": int(image_clevel), **parsed}
            try:
                zarr.create_group(zstore, attributes={_META_ATTR: meta}, overwrite=False)
            except zarr.errors.ContainsGroupError:
                pass  # another process created it first: fall through and check compatibility
        store = cls(url, read_only=False)
        store._check_compatible(parsed)
        return store

    @classmethod
    def open(cls, url: str) -> ExperienceStore:
        """Open an existing store as a snapshot reader (no shard writers; annotations still allowed).

        Raises:
            FileNotFoundError: no store at ``url``.
            SchemaVersionError: the store has another schema version.
        """
        return cls(url, read_only=True)

    def _check_compatible(self, parsed: dict) -> None:
        mine, given = self.features, parsed["features"]
        for key in sorted(set(mine) | set(given)):
            if key not in given:
                raise SpecMismatchError(f"store {self.url!r} has feature {key!r} "
                                        f"(shape {mine[key]['shape']}, dtype {mine[key]['dtype']}); the given spec lacks it")
            if key not in mine:
                raise SpecMismatchError(f"given spec has feature {key!r} that store {self.url!r} lacks")
            for field in ("shape", "dtype"):
                if mine[key][field] != given[key][field]:
                    raise SpecMismatchError(f"feature {key!r}: store has {field} {mine[key][field]}, "
                                            f"given spec has {given[key][field]}")

    def __getstate__(self) -> dict:
        # picklable for DataLoader workers: no zarr handles, the snapshot travels as plain data
        state = self.__dict__.copy()
        state["_arrays"] = {}
        state.pop("_zstore")
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._zstore = _zarr_store(self.url, read_only=self.read_only)

    # -- paths ----------------------------------------------------------------------------------
    def _p(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    def shards(self) -> list[str]:
        """Writer ids that have committed at least one episode in the current snapshot."""
        return sorted({e.shard for e in self._episodes.values()})

    def array(self, shard: str, key: str, reopen: bool = False) -> zarr.Array:
        """The Zarr array of ``key`` in ``shard`` (opened lazily, cached; rows beyond commits are junk)."""
        k = (shard, key)
        if reopen or k not in self._arrays:
            self._arrays[k] = zarr.open_array(self._zstore, path=f"shards/{shard}/{key}", mode="r")
        return self._arrays[k]

    # -- snapshot -------------------------------------------------------------------------------
    def refresh(self) -> int:
        """Read commit records and annotations written since the last refresh.

        Returns:
            the number of newly visible episodes.
        """
        new = 0
        try:
            writers = [p.rsplit("/", 1)[-1] for p in self.fs.ls(self._p("commits"), detail=False)]
        except FileNotFoundError:
            writers = []
        for w in sorted(writers):
            for path in sorted(_ls_json(self.fs, self._p("commits", w))):
                if path in self._seen_commits:
                    continue
                rec = json.loads(self.fs.cat_file(path))
                meta = EpisodeMeta(**rec["episode"])
                self._episodes[meta.episode_id] = meta
                self._sketches[meta.episode_id] = rec["sketch"]
                self._seen_commits.add(path)
                new += 1
        self._episodes = dict(sorted(self._episodes.items(), key=lambda kv: (kv[1].shard, kv[1].start)))
        try:
            ann_writers = [p.rsplit("/", 1)[-1] for p in self.fs.ls(self._p("annotations"), detail=False)]
        except FileNotFoundError:
            ann_writers = []
        for w in ann_writers:
            for e in _ls_json(self.fs, self._p("annotations", w), detail=True):
                sig = (e.get("size"), e.get("mtime", e.get("LastModified", e.get("created"))), e.get("ETag"))
                if self._seen_annotations.get(e["name"]) == sig and sig != (None, None, None):
                    continue
                ann = json.loads(self.fs.cat_file(e["name"]))
                if ann["episode_id"] in self._episodes:
                    self._episodes[ann["episode_id"]].failure_onset = ann["failure_onset"]
                    self._seen_annotations[e["name"]] = sig
        return new

    def episodes(self, task: str | Iterable[str] | None = None, unit_id: int | Iterable[int] | None = None,
                 success: bool | None = None, is_demo: bool | None = None,
                 policy_version: int | Iterable[int] | None = None, shard: str | None = None) -> list[EpisodeMeta]:
        """Committed episodes of the snapshot matching every given filter (``None`` = any).

        ``task``, ``unit_id`` and ``policy_version`` accept one value or a collection of values. Order:
        by shard, then commit order.
        """
        def _set(v):
            return None if v is None else ({v} if isinstance(v, (str, int)) else set(v))

        tasks, units, versions = _set(task), _set(unit_id), _set(policy_version)
        return [e for e in self._episodes.values()
                if (tasks is None or e.task in tasks) and (units is None or e.unit_id in units)
                and (success is None or e.success == success) and (is_demo is None or e.is_demo == is_demo)
                and (versions is None or e.policy_version in versions) and (shard is None or e.shard == shard)]

    def episode(self, episode_id: str) -> EpisodeMeta:
        """Metadata of one episode. Raises ``KeyError`` if it is not in the snapshot."""
        try:
            return self._episodes[episode_id]
        except KeyError:
            raise KeyError(f"episode {episode_id!r} is not in the snapshot of {self.url!r} "
                           f"({len(self._episodes)} episodes; call refresh() for new commits)") from None

    def __len__(self) -> int:
        return len(self._episodes)

    @property
    def keys(self) -> list[str]:
        """All per-step feature keys: ``observation.*``, ``action``, ``reward``, ``progress.*``."""
        return list(self.features)

    def load_episode(self, episode_id: str, keys: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Steps of one committed episode.

        Args:
            episode_id: id of a committed episode in the snapshot.
            keys: feature keys to load (default: all of :attr:`keys`).

        Returns:
            ``{key: (T, *shape) array}`` with the spec's dtype (images ``(T, H, W, C)`` uint8).

        Raises:
            KeyError: unknown episode or key.
            ValueError: a chunk fails its crc32c checksum (corruption).
        """
        ep = self.episode(episode_id)
        out = {}
        for key in keys if keys is not None else self.keys:
            if key not in self.features:
                raise KeyError(f"unknown key {key!r}; store keys: {self.keys}")
            arr = self.array(ep.shard, key)
            if arr.shape[0] < ep.start + ep.length:
                arr = self.array(ep.shard, key, reopen=True)
            out[key] = arr[ep.start:ep.start + ep.length]
        return out

    # -- annotations ----------------------------------------------------------------------------
    def set_failure_onset(self, episode_id: str, step: int | None) -> None:
        """Record where a failed episode's failure began (or ``None`` to clear).

        Written atomically as ``annotations/<shard>/<episode_id>.json``; commit records are never rewritten.
        Meant for one annotating process (failure analysis); the last write wins.

        Raises:
            KeyError: unknown episode. ValueError: ``step`` outside ``[0, length)``.
        """
        ep = self.episode(episode_id)
        if step is not None:
            step = int(step)
            if not 0 <= step < ep.length:
                raise ValueError(f"failure_onset for {episode_id!r} must be in [0, {ep.length}), given {step}")
        data = json.dumps({"episode_id": episode_id, "failure_onset": step, "time": time.time()}).encode()
        path = self._p("annotations", ep.shard, f"{episode_id}.json")
        _atomic_write(self.fs, path, data)
        ep.failure_onset = step
        self._seen_annotations.pop(path, None)

    # -- statistics -----------------------------------------------------------------------------
    def stats(self, keys: Sequence[str] | None = None,
              episodes: Sequence[EpisodeMeta] | None = None) -> dict[str, dict[str, list[float]]]:
        """Normalization statistics per key, merged from the per-episode sketches (reads no array data).

        Args:
            keys: feature keys (default: every key). Scalar keys give lists of length 1; image keys give
                per-channel statistics in pixel units (0..255).
            episodes: subset to use (default: every episode of the snapshot).

        Returns:
            ``{key: {"min", "max", "mean", "std", "q01", "q99": per-dimension lists, "count": int}}``;
            min/max/mean/std exact, q01/q99 within 0.5 % rank (see :mod:`experience_dict.stats`).

        Raises:
            KeyError: unknown key. ValueError: no episodes.
        """
        eps = list(self._episodes.values()) if episodes is None else list(episodes)
        out = {}
        for key in keys if keys is not None else self.keys:
            if key not in self.features:
                raise KeyError(f"unknown key {key!r}; store keys: {self.keys}")
            out[key] = merge_sketches([self._sketches[e.episode_id][key] for e in eps])
        return out

    # -- writing --------------------------------------------------------------------------------
    def writer(self, writer_id: str) -> EpisodeWriter:
        """The writer of shard ``writer_id`` (one per fleet unit); recovers the shard after a crash.

        Raises:
            StoreError: the store was opened read-only. ValueError: bad writer id.
            WriterBusyError: another live process holds this writer id (local filesystems).
        """
        if self.read_only:
            raise StoreError(f"store {self.url!r} was opened read-only; use ExperienceStore.create_or_open")
        return EpisodeWriter(self, writer_id)

    # -- summaries ------------------------------------------------------------------------------
    def info(self) -> dict:
        """Summary: episodes per task / unit / success / demo / policy version, steps, bytes per shard."""
        eps = list(self._episodes.values())
        shard_bytes = {}
        for s in self.shards():
            try:
                shard_bytes[s] = int(self.fs.du(self._p("shards", s)))
            except (FileNotFoundError, NotImplementedError):
                shard_bytes[s] = None
        return {
            "url": self.url, "schema_version": SCHEMA_VERSION, "control_hz": self.control_hz,
            "features": {k: {"shape": f["shape"], "dtype": f["dtype"]} for k, f in self.features.items()},
            "episodes": len(eps), "steps": int(sum(e.length for e in eps)),
            "per_task": dict(Counter(e.task for e in eps)),
            "per_unit": {str(k): v for k, v in Counter(e.unit_id for e in eps).items()},
            "per_success": {str(k): v for k, v in Counter(e.success for e in eps).items()},
            "per_is_demo": {str(k): v for k, v in Counter(e.is_demo for e in eps).items()},
            "per_policy_version": {str(k): v for k, v in Counter(e.policy_version for e in eps).items()},
            "success_rate_per_task": {t: float(np.mean([e.success for e in eps if e.task == t]))
                                      for t in sorted({e.task for e in eps})},
            "bytes_per_shard": shard_bytes,
            "bytes": int(sum(v for v in shard_bytes.values() if v)),
        }

    def verify(self) -> dict:
        """Read every chunk holding committed rows, check crc32c checksums and that no chunk is missing.

        Returns:
            ``{"ok": bool, "episodes": n, "chunks_checked": n, "problems": [{"shard", "key", "chunk",
            "error", "episodes": [ids]}], "corrupt_episodes": [ids]}``; a problem lists every committed
            episode with rows in the bad chunk.
        """
        problems: list[dict] = []
        checked = 0
        for shard in self.shards():
            eps = self.episodes(shard=shard)
            end = max(e.start + e.length for e in eps)
            starts = np.array([e.start for e in eps])
            ends = starts + np.array([e.length for e in eps])
            for key in self.keys:
                try:
                    arr = self.array(shard, key, reopen=True)
                except Exception as e:  # noqa: BLE001 - reported, not raised
                    problems.append({"shard": shard, "key": key, "chunk": None, "error": f"cannot open array: {e}",
                                     "episodes": [x.episode_id for x in eps]})
                    continue
                if arr.shape[0] < end:
                    problems.append({"shard": shard, "key": key, "chunk": None,
                                     "error": f"array has {arr.shape[0]} rows, commits reference {end}",
                                     "episodes": [x.episode_id for x in eps if x.start + x.length > arr.shape[0]]})
                    end_k = arr.shape[0]
                else:
                    end_k = end
                cr = arr.chunks[0]
                for c in range((end_k + cr - 1) // cr):
                    lo, hi = c * cr, min((c + 1) * cr, end_k)
                    hit = [eps[i].episode_id for i in np.nonzero((starts < hi) & (ends > lo))[0]]
                    ckey = f"shards/{shard}/{key}/" + arr.metadata.encode_chunk_key((c,) + (0,) * (arr.ndim - 1))
                    checked += 1
                    try:
                        if not self.fs.exists(self._p(ckey)):
                            raise FileNotFoundError(f"chunk file {ckey} is missing")
                        arr[lo:hi]
                    except Exception as e:  # noqa: BLE001 - reported, not raised
                        problems.append({"shard": shard, "key": key, "chunk": c, "error": f"{type(e).__name__}: {e}",
                                         "episodes": hit})
        bad = sorted({i for p in problems for i in p["episodes"]})
        return {"ok": not problems, "episodes": len(self._episodes), "chunks_checked": checked,
                "problems": problems, "corrupt_episodes": bad}


# ----------------------------------------------------------------------------- writer


class EpisodeWriter:
    """Appends episodes to one shard (``shards/<writer_id>``); one live writer per id.

    Steps are buffered in memory (preallocated per-key row buffers); :meth:`commit` writes them to the
    shard's arrays and then writes the commit record (the atomic commit point). Opening a writer recovers
    the shard: rows past the last committed row (a crash mid-commit) are truncated and temp files removed.
    Usable as a context manager (releases the writer lock).

    Write path (why it is fast): the writer keeps the committed rows of each array's last, partly filled
    chunk in memory (read once at open), so a commit writes whole chunks only -- never a read-modify-write.
    On a local filesystem each chunk is encoded synchronously with the array's own zarr codecs (bytes ->
    Blosc/zstd -> crc32c) and written as temp file + ``os.replace``, exactly as zarr's ``LocalStore`` does,
    without a thread hop per codec and chunk; elsewhere (``memory://``, object stores) the same chunk-aligned
    blocks go through zarr's async ``setitem`` for all arrays at once. Rows after the episode's last row in
    its last chunk are written as zeros; they are past the committed count, so readers never see them.
    """

    _BUF_ROWS = 256  # initial capacity of the per-key step buffers (doubled when full)

    def __init__(self, store: ExperienceStore, writer_id: str):
        if not isinstance(writer_id, str) or not _WRITER_ID_RE.match(writer_id):
            raise ValueError(f"writer_id must match {_WRITER_ID_RE.pattern}, given {writer_id!r}")
        self.store, self.writer_id = store, writer_id
        self.fs = store.fs
        self._lock = None
        if _is_local(self.fs):
            import fcntl

            os.makedirs(store._p("locks"), exist_ok=True)
            self._lock = open(store._p("locks", f"{writer_id}.lock"), "w")  # noqa: SIM115 - held while open
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._lock.close()
                raise WriterBusyError(f"writer {writer_id!r} of {store.url!r} is held by another live process") from None
        feats = store.features
        # validation tables, built once (add_step runs per step)
        self._obs_keys = [k for k in feats if k.startswith("observation.")]
        self._shape = {k: tuple(f["shape"]) for k, f in feats.items()}
        self._dtype = {k: np.dtype(f["dtype"]) for k, f in feats.items()}
        self._progress_keys = list(store.progress_keys)
        self._progress_set = set(self._progress_keys)
        self._image = {k: _is_image(f) for k, f in feats.items()}
        self._arrays: dict[str, zarr.Array] = {}
        self._tail: dict[str, np.ndarray] = {}  # committed rows of each array's last, partly filled chunk
        self._episode: dict | None = None
        self._n = 0  # steps buffered in the open episode
        self._scalar_keys = ["reward", *[f"progress.{k}" for k in self._progress_keys]]
        self._rows = {k: np.empty((self._BUF_ROWS, *self._shape[k]), self._dtype[k])
                      for k in feats if k not in self._scalar_keys}
        self._scalar_rows = np.empty((self._BUF_ROWS, len(self._scalar_keys)), np.float32)  # one row per step
        self._recover()
        encoders = {k: _sync_chunk_encoder(a) for k, a in self._arrays.items()}
        self._encoders = encoders if _is_local(self.fs) and all(encoders.values()) else None
        self._made_dirs: set[str] = set()
        self._pool: ThreadPoolExecutor | None = None

    # -- recovery -------------------------------------------------------------------------------
    def _recover(self) -> None:
        recs = [json.loads(self.fs.cat_file(p))["episode"]
                for p in _ls_json(self.fs, self.store._p("commits", self.writer_id))]
        self._end = max((r["start"] + r["length"] for r in recs), default=0)
        self._counter = max((int(r["episode_id"].rsplit("-", 1)[1]) + 1 for r in recs), default=0)
        meta = self.store.meta
        for key, feat in self.store.features.items():
            path = f"shards/{self.writer_id}/{key}"
            try:
                arr = zarr.open_array(self.store._zstore, path=path, mode="r+")
            except (FileNotFoundError, zarr.errors.ArrayNotFoundError, zarr.errors.NodeNotFoundError):
                rows = _chunk_rows(feat, meta["chunk_bytes"], meta["max_chunk_rows"])
                if _is_image(feat):  # one Blosc block per chunk: consecutive frames share content, so zstd
                    # finds matches across frames (about 4x the ratio of Blosc's automatic small blocks at
                    # clevel 1 on 96x96 renders) and encodes / decodes faster too (scripts/bench_store.py)
                    block = rows * int(np.prod(feat["shape"]))
                    comp = BloscCodec(cname="zstd", clevel=meta["image_clevel"], shuffle="noshuffle", blocksize=block)
                else:
                    comp = BloscCodec(cname="zstd", clevel=3, shuffle="shuffle")
                arr = zarr.create_array(
                    self.store._zstore, name=path, shape=(0, *feat["shape"]), dtype=feat["dtype"],
                    chunks=(rows, *feat["shape"]), compressors=[comp, Crc32cCodec()], fill_value=0,
                    chunk_key_encoding={"name": "default", "separator": "."},  # c.<i>.0..: no directory per chunk
                    config={"write_empty_chunks": True}, overwrite=True)
            if arr.shape[0] != self._end:  # rows past the last commit: a crash mid-commit
                arr.resize((self._end, *arr.shape[1:]))
            cr = arr.chunks[0]
            lo = self._end // cr * cr
            self._tail[key] = arr[lo:self._end] if self._end > lo else np.empty((0, *feat["shape"]), feat["dtype"])
            self._arrays[key] = arr
        if _is_local(self.fs):  # stray temp files of writes cut short by a kill
            shard_dir = self.store._p("shards", self.writer_id)
            for dirpath, _, files in os.walk(shard_dir):
                for f in files:
                    if f.endswith(".partial"):
                        os.unlink(os.path.join(dirpath, f))
            commit_dir = self.store._p("commits", self.writer_id)
            if os.path.isdir(commit_dir):
                for f in os.listdir(commit_dir):
                    if f.endswith(".tmp"):
                        os.unlink(os.path.join(commit_dir, f))

    @property
    def committed_rows(self) -> int:
        """Rows (steps) of this shard covered by commit records."""
        return self._end

    # -- episode --------------------------------------------------------------------------------
    def begin_episode(self, unit_id: int, embodiment: str, task: str, policy_version: int, seed: int,
                      is_demo: bool = False, start_time: float | None = None, extra: dict | None = None) -> None:
        """Start buffering a new episode (see :class:`EpisodeMeta` for the fields).

        Raises:
            StoreError: an episode is already open (commit or abort it first).
        """
        if self._episode is not None:
            raise StoreError(f"writer {self.writer_id!r}: an episode is already open; commit() or abort() it")
        self._episode = {"unit_id": int(unit_id), "embodiment": str(embodiment), "task": str(task),
                         "policy_version": int(policy_version), "seed": int(seed), "is_demo": bool(is_demo),
                         "start_time": float(time.time() if start_time is None else start_time),
                         "extra": json.loads(json.dumps(extra or {}))}
        self._n = 0

    def add_step(self, obs: dict[str, np.ndarray], action: np.ndarray, reward: float,
                 progress: dict[str, float] | None = None) -> None:
        """Buffer one step after validating it against the store spec (nothing is buffered on error).

        Args:
            obs: ``{observation key: array}`` with exactly the spec's observation keys, shapes and dtypes
                (state float32 ``(D,)``; images uint8 ``(H, W, C)``). Values are copied.
            action: ``(A,)`` float32.
            reward: scalar (stored float32).
            progress: ``{k: float}`` with exactly the store's progress keys.

        Raises:
            StoreError: no open episode.
            SpecMismatchError: missing / unexpected key, wrong shape or dtype (message names key, expected
                and given).
        """
        if self._episode is None:
            raise StoreError(f"writer {self.writer_id!r}: add_step() before begin_episode()")
        if not isinstance(obs, dict):
            raise SpecMismatchError(f"obs must be a dict of arrays, given {type(obs).__name__}")
        obs_keys = self._obs_keys
        if len(obs) != len(obs_keys) or any(k not in obs for k in obs_keys):
            missing = [k for k in obs_keys if k not in obs]
            if missing:
                raise SpecMismatchError(f"obs is missing key {missing[0]!r} (expected keys {obs_keys}, given {sorted(obs)})")
            extra = [k for k in obs if k not in self._shape]
            if extra:
                raise SpecMismatchError(f"obs has unexpected key {extra[0]!r} not in the store spec (expected {obs_keys})")
        progress = {} if progress is None else progress
        if progress.keys() != self._progress_set:
            raise SpecMismatchError(f"progress keys: expected {sorted(self._progress_keys)}, given {sorted(progress)}")
        shape, dtype = self._shape, self._dtype
        for key in obs_keys:
            v = obs[key]
            if not isinstance(v, np.ndarray) or v.shape != shape[key] or v.dtype != dtype[key]:
                self._check(key, v)
        if not isinstance(action, np.ndarray) or action.shape != shape["action"] or action.dtype != dtype["action"]:
            self._check("action", action)
        scalars = [reward, *[progress[k] for k in self._progress_keys]]  # reward, progress.* (float32 columns)
        if not all(type(v) in _PLAIN_SCALARS for v in scalars):
            for key, v in zip(self._scalar_keys, scalars):
                self._scalar(key, v)
        n = self._n
        if n == len(self._rows["action"]):  # grow every step buffer (amortised O(1) per step)
            self._rows = {k: np.concatenate([b, np.empty_like(b)]) for k, b in self._rows.items()}
            self._scalar_rows = np.concatenate([self._scalar_rows, np.empty_like(self._scalar_rows)])
        rows = self._rows
        for key in obs_keys:
            rows[key][n] = obs[key]
        rows["action"][n] = action
        self._scalar_rows[n] = scalars
        self._n = n + 1

    def _check(self, key: str, value: Any) -> None:  # raises the error naming key, expected and given
        if not isinstance(value, np.ndarray):
            raise SpecMismatchError(f"{key!r}: expected np.ndarray of shape {self._shape[key]} dtype "
                                    f"{self._dtype[key]}, given {type(value).__name__}")
        if value.shape != self._shape[key] or value.dtype != self._dtype[key]:
            raise SpecMismatchError(f"{key!r}: expected shape {self._shape[key]} dtype {self._dtype[key]}, "
                                    f"given shape {value.shape} dtype {value.dtype}")

    @staticmethod
    def _scalar(key: str, value: Any) -> Any:
        if isinstance(value, (float, int, np.floating, np.integer)):
            return value
        arr = np.asarray(value)
        if arr.shape != () or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
            raise SpecMismatchError(f"{key!r}: expected a real scalar, given {value!r} (shape {arr.shape}, dtype {arr.dtype})")
        return arr

    def abort(self) -> None:
        """Drop the open episode (if any); nothing is written."""
        self._episode, self._n = None, 0

    @property
    def open_steps(self) -> int:
        """Steps buffered in the open episode (0 if none)."""
        return self._n if self._episode is not None else 0

    def commit(self, success: bool) -> str:
        """Append the open episode to the shard and make it visible (atomic commit record).

        Args:
            success: whether the task succeeded.

        Returns:
            the new episode id ``"<writer_id>-<counter:06d>"``.

        Raises:
            StoreError: no open episode, or it has no steps.
        """
        if self._episode is None:
            raise StoreError(f"writer {self.writer_id!r}: commit() without an open episode")
        length = self.open_steps
        if length == 0:
            raise StoreError(f"writer {self.writer_id!r}: cannot commit an episode with 0 steps")
        data = {k: b[:length] for k, b in self._rows.items()}
        data.update({k: np.ascontiguousarray(self._scalar_rows[:length, j]) for j, k in enumerate(self._scalar_keys)})
        data = {k: data[k] for k in self._arrays}  # feature order
        start, end = self._end, self._end + length
        pending, tails = self._append_rows(start, end, data)  # 1) rows, invisible: no record names them yet
        try:
            sketch = {k: episode_sketch(v, is_image=self._image[k]) for k, v in data.items()}
            episode_id = f"{self.writer_id}-{self._counter:06d}"
            meta = EpisodeMeta(episode_id=episode_id, length=length, success=bool(success), failure_onset=None,
                               shard=self.writer_id, start=start, **self._episode)
            record = json.dumps({"episode": dataclasses.asdict(meta), "sketch": sketch}).encode()
        finally:
            wait(pending)  # every chunk written (or failed) before anything else happens
        for f in pending:
            f.result()  # re-raises a failed chunk write: no commit record, the episode stays open
        self._write_record(episode_id, record)  # 2) the commit point
        self._end, self._counter, self._tail = end, self._counter + 1, tails
        self._episode, self._n = None, 0
        return episode_id

    def _append_rows(self, start: int, end: int, data: dict[str, np.ndarray]) -> tuple[list, dict[str, np.ndarray]]:
        """Start writing rows ``start..end-1`` of every array as whole chunks.

        Capacity grows geometrically (whole chunks), so ``zarr.json`` is rarely rewritten; rows past the
        committed count are junk to readers and truncated on recovery.

        Returns:
            ``(pending, tails)``: futures of chunk writes still in flight (local filesystems: chunks are
            encoded and written by a small thread pool -- Blosc and file I/O release the GIL -- while the
            caller computes the episode's statistics; wait for them before the commit record), and each
            array's rows of its new last, partly filled chunk.
        """
        jobs, tails = [], {}
        for key, arr in self._arrays.items():
            cr = arr.chunks[0]
            c0, c1 = start // cr, -(-end // cr)  # chunks [c0, c1) hold the new rows
            if arr.shape[0] < c1 * cr:
                arr.resize((max(c1, -(-2 * arr.shape[0] // cr)) * cr, *arr.shape[1:]))
            for c in range(c0, c1):
                lo, hi = c * cr, (c + 1) * cr
                if start <= lo and hi <= end:  # a chunk inside the episode: a view, no copy
                    chunk = data[key][lo - start:hi - start]
                else:  # edge chunk: committed rows before the episode (tail), its rows, zeros after
                    chunk = np.zeros((cr, *self._shape[key]), self._dtype[key])
                    head = self._tail[key] if c == c0 else chunk[:0]
                    chunk[:len(head)] = head
                    a, b = max(start, lo), min(end, hi)
                    chunk[a - lo:b - lo] = data[key][a - start:b - start]
                jobs.append((key, arr, c, chunk))
            last = end // cr * cr  # first row of the new last chunk
            if end == last:
                tails[key] = data[key][:0].copy()
            elif last >= start:
                tails[key] = data[key][last - start:].copy()
            else:  # the episode ends in the chunk it started in
                tails[key] = np.concatenate([self._tail[key], data[key]])
        if self._encoders is None:  # zarr's async path, all arrays at once (memory://, object stores)
            async def _write_all() -> None:
                await asyncio.gather(*(arr.async_array.setitem(slice(c * arr.chunks[0], (c + 1) * arr.chunks[0]), chunk)
                                       for _, arr, c, chunk in jobs))

            zarr_sync(_write_all())
            return [], tails
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="store-writer")
        jobs.sort(key=lambda j: -j[3].nbytes)  # big (image) chunks first
        return [self._pool.submit(self._write_chunk, key, arr, c, chunk) for key, arr, c, chunk in jobs], tails

    def _write_chunk(self, key: str, arr: zarr.Array, c: int, chunk: np.ndarray) -> None:
        ckey = arr.metadata.encode_chunk_key((c,) + (0,) * (arr.ndim - 1))
        self._put_local(self.store._p("shards", self.writer_id, key, ckey), self._encoders[key](chunk))

    def _put_local(self, path: str, data) -> None:
        """Temp file + ``os.replace`` (as zarr's ``LocalStore``; strays ``*.partial`` removed on recovery)."""
        parent = path.rsplit("/", 1)[0]
        if parent not in self._made_dirs:
            os.makedirs(parent, exist_ok=True)
            self._made_dirs.add(parent)
        tmp = f"{path}.{uuid.uuid4().hex}.partial"
        with open(tmp, "wb") as f:
            f.write(data)
        _replace(tmp, path)

    def _write_record(self, episode_id: str, record: bytes) -> None:
        _atomic_write(self.fs, self.store._p("commits", self.writer_id, f"{episode_id}.json"), record)

    def close(self) -> None:
        """Drop any open episode and release the writer lock."""
        self.abort()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __enter__(self) -> EpisodeWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
