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
- ``commit`` first appends the episode's rows to every array of the shard (chunk writes; ``resize`` when the
  capacity, grown geometrically, is exceeded), then
  writes the episode's commit record as one atomic write (temp file + ``os.replace`` locally, a single PUT
  on object stores). Readers only ever look at rows named by commit records, so an episode is visible
  exactly when its record exists. Zarr's ``LocalStore`` also writes every chunk and ``zarr.json`` through a
  temp file + rename, so rewriting a partly filled boundary chunk never exposes a torn chunk that holds
  committed rows.
- A writer killed at any point leaves at most rows past its last committed row (and stray ``*.partial``
  temp files). Reopening the writer truncates every array of its shard back to the committed row count.
- Committed rows are never rewritten with different values, so a reader's snapshot (the set of commit
  records it has read) stays valid while writers append; :meth:`ExperienceStore.refresh` reads new records.

Durability against power loss would also need ``fsync`` of chunks; the guarantee here is against process
death (SIGKILL), which is what a fleet unit, the learner or the store writer meets in practice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import fsspec
import numpy as np
import zarr
from fsspec.implementations.local import LocalFileSystem
from zarr.codecs import BloscCodec, Crc32cCodec
from zarr.core.sync import sync as zarr_sync

from experience_dict.stats import episode_sketch, merge_sketches

SCHEMA_VERSION = 1
# docs/INTERFACES.md: info["progress"] has exactly these keys for every task (sim.PROGRESS_KEYS); the default
# progress schema when neither ``progress_keys`` nor the spec declares one (experience_dict must not import sim)
DEFAULT_PROGRESS_KEYS = ("near_object", "grasp_success", "grasp_reward", "in_place_reward", "obj_to_target",
                         "unscaled_reward")
_WRITER_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_META_ATTR = "fleetmind"


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
                    ckey = f"shards/{shard}/{key}/" + "/".join(["c", str(c)] + ["0"] * (arr.ndim - 1))
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

    Steps are buffered in memory; :meth:`commit` appends them to the shard's arrays and then writes the
    commit record (the atomic commit point). Opening a writer recovers the shard: rows past the last
    committed row (a crash mid-commit) are truncated and temp files removed.
    Usable as a context manager (releases the writer lock).
    """

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
        self._group = zarr.open_group(store._zstore, mode="a")
        self._arrays: dict[str, zarr.Array] = {}
        self._episode: dict | None = None
        self._buf: dict[str, list[np.ndarray]] = {}
        self._recover()

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
                image = _is_image(feat)
                comp = (BloscCodec(cname="zstd", clevel=meta["image_clevel"], shuffle="noshuffle") if image
                        else BloscCodec(cname="zstd", clevel=3, shuffle="shuffle"))
                arr = zarr.create_array(
                    self.store._zstore, name=path, shape=(0, *feat["shape"]), dtype=feat["dtype"],
                    chunks=(_chunk_rows(feat, meta["chunk_bytes"], meta["max_chunk_rows"]), *feat["shape"]),
                    compressors=[comp, Crc32cCodec()], fill_value=0, config={"write_empty_chunks": True},
                    overwrite=True)
            if arr.shape[0] != self._end:  # rows past the last commit: a crash mid-commit
                arr.resize((self._end, *arr.shape[1:]))
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
        self._buf = {k: [] for k in self.store.features}

    def add_step(self, obs: dict[str, np.ndarray], action: np.ndarray, reward: float,
                 progress: dict[str, float] | None = None) -> None:
        """Buffer one step after validating it against the store spec (nothing is buffered on error).

        Args:
            obs: ``{observation key: array}`` with exactly the spec's observation keys, shapes and dtypes
                (state float32 ``(D,)``; images uint8 ``(H, W, C)``).
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
        feats = self.store.features
        obs_keys = [k for k in feats if k.startswith("observation.")]
        if not isinstance(obs, dict):
            raise SpecMismatchError(f"obs must be a dict of arrays, given {type(obs).__name__}")
        missing = [k for k in obs_keys if k not in obs]
        if missing:
            raise SpecMismatchError(f"obs is missing key {missing[0]!r} (expected keys {obs_keys}, given {sorted(obs)})")
        extra = [k for k in obs if k not in feats]
        if extra:
            raise SpecMismatchError(f"obs has unexpected key {extra[0]!r} not in the store spec (expected {obs_keys})")
        progress = {} if progress is None else progress
        if set(progress) != set(self.store.progress_keys):
            raise SpecMismatchError(f"progress keys: expected {sorted(self.store.progress_keys)}, given {sorted(progress)}")
        step: dict[str, np.ndarray] = {}
        for key in obs_keys:
            step[key] = self._check(key, obs[key])
        step["action"] = self._check("action", action)
        step["reward"] = self._scalar("reward", reward)
        for k in self.store.progress_keys:
            step[f"progress.{k}"] = self._scalar(f"progress.{k}", progress[k])
        for key, v in step.items():
            self._buf[key].append(v)

    def _check(self, key: str, value: Any) -> np.ndarray:
        feat = self.store.features[key]
        if not isinstance(value, np.ndarray):
            raise SpecMismatchError(f"{key!r}: expected np.ndarray of shape {tuple(feat['shape'])} dtype "
                                    f"{np.dtype(feat['dtype'])}, given {type(value).__name__}")
        if value.shape != tuple(feat["shape"]) or value.dtype != np.dtype(feat["dtype"]):
            raise SpecMismatchError(f"{key!r}: expected shape {tuple(feat['shape'])} dtype {np.dtype(feat['dtype'])}, "
                                    f"given shape {value.shape} dtype {value.dtype}")
        return value.copy()

    @staticmethod
    def _scalar(key: str, value: Any) -> np.ndarray:
        if isinstance(value, (float, int, np.floating, np.integer)):
            return np.float32(value)
        arr = np.asarray(value)
        if arr.shape != () or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
            raise SpecMismatchError(f"{key!r}: expected a real scalar, given {value!r} (shape {arr.shape}, dtype {arr.dtype})")
        return arr.astype(np.float32)

    def abort(self) -> None:
        """Drop the open episode (if any); nothing is written."""
        self._episode, self._buf = None, {}

    @property
    def open_steps(self) -> int:
        """Steps buffered in the open episode (0 if none)."""
        return len(self._buf.get("action", [])) if self._episode is not None else 0

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
        data = {k: np.stack(v) for k, v in self._buf.items()}
        start, end = self._end, self._end + length
        # 1) append rows (invisible: no record names them yet). Capacity grows geometrically, so zarr.json is
        #    rarely rewritten; rows past the committed count are junk to readers and truncated on recovery.
        for arr in self._arrays.values():
            if arr.shape[0] < end:
                cr = arr.chunks[0]
                cap = -(-max(end, 2 * arr.shape[0]) // cr) * cr
                arr.resize((cap, *arr.shape[1:]))

        async def _write_all() -> None:  # every array's chunks concurrently, in one trip to zarr's loop
            await asyncio.gather(*(a.async_array.setitem(slice(start, end), data[k]) for k, a in self._arrays.items()))

        zarr_sync(_write_all())
        sketch = {k: episode_sketch(v, is_image=_is_image(self.store.features[k])) for k, v in data.items()}
        episode_id = f"{self.writer_id}-{self._counter:06d}"
        meta = EpisodeMeta(episode_id=episode_id, length=length, success=bool(success), failure_onset=None,
                           shard=self.writer_id, start=start, **self._episode)
        record = json.dumps({"episode": dataclasses.asdict(meta), "sketch": sketch}).encode()
        self._write_record(episode_id, record)  # 2) the commit point
        self._end, self._counter = end, self._counter + 1
        self._episode, self._buf = None, {}
        return episode_id

    def _write_record(self, episode_id: str, record: bytes) -> None:
        _atomic_write(self.fs, self.store._p("commits", self.writer_id, f"{episode_id}.json"), record)

    def close(self) -> None:
        """Drop any open episode and release the writer lock."""
        self.abort()
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __enter__(self) -> EpisodeWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

