"""The fleet's Zarr experience store: many writers, crash-safe commits, snapshot readers.

Layout under the store URL (any fsspec URL; a plain path or ``file://`` uses zarr's ``LocalStore``)::

    zarr.json                               root group; attributes["fleetmind"] = store metadata (schema
                                            version, observation/action spec, control_hz, progress keys,
                                            packed_keys)
    shards/<writer_id>/lowdim/...           one appendable (rows, D) float32 Zarr array holding every float32
                                            feature of at most one dimension as columns, in ``packed_keys``
                                            order: state vectors, ``action``, ``reward``, ``progress.<k>``
    shards/<writer_id>/<key>/...            one appendable Zarr array per other feature key (images); rows = steps
                                            (episode ``start`` rows are multiples of the biggest image array's
                                            chunk rows; rows between episodes are zero padding)
    commits/<writer_id>/<episode_id>.json   one commit record per episode  <- the commit point
    annotations/<writer_id>/<episode_id>.json   failure-onset annotations (written by failure analysis)
    locks/<writer_id>.lock                  (local filesystems) flock held by the live writer

Schema versions: 2 (this layout) is written; 1 (one array per feature key, statistics sketches as JSON lists)
is still read, but not appended to (:class:`SchemaVersionError`). The public API is the same for both:
per-step *feature keys* (``reward``, ``progress.<k>`` included), whatever array holds them.

Why this is crash-safe (zarr 3 needs one writer per array, see docs/DEPENDENCIES.md):

- Each writer id owns its shard; no two processes append to one array (enforced with ``flock`` on local
  filesystems; elsewhere writer ids must be unique, e.g. one per fleet unit).
- Rows are written as whole chunks. On a local filesystem a chunk is encoded and written (by a small thread
  pool) as soon as the open episode's steps fill it; ``commit`` writes the rest (the last, partly filled
  chunk, zero-padded), waits for every chunk write, then writes the episode's commit record as one atomic
  write (temp file + ``os.replace`` locally, a single PUT on object stores). Readers only ever look at rows
  named by commit records, so an episode is visible exactly when its record exists.
- A chunk that already holds committed rows (the shard's partly filled last chunk) is only ever replaced
  through a temp file + atomic rename (``renameat2(RENAME_EXCHANGE)`` with a per-array spare file where
  available, else ``os.replace``), so a reader never sees it torn; chunks holding only uncommitted rows are
  written in place (no reader reads them).
- A writer killed at any point leaves at most rows past its last committed row (and stray ``*.partial``
  temp files). Reopening the writer truncates every array of its shard back to the committed row count
  (which deletes chunks wholly past it).
- Committed rows are never rewritten with different values, so a reader's snapshot (the set of commit
  records it has read) stays valid while writers append; :meth:`ExperienceStore.refresh` reads new records.

Durability against power loss would also need ``fsync`` of chunks; the guarantee here is against process
death (SIGKILL), which is what a fleet unit, the learner or the store writer meets in practice.
"""

from __future__ import annotations

import asyncio
import base64
import ctypes
import dataclasses
import json
import math
import operator
import os
import re
import socket
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Self

import fsspec
import numpy as np
import zarr
from fsspec.implementations.local import LocalFileSystem
from zarr.abc.codec import SupportsSyncCodec
from zarr.codecs import BloscCodec, Crc32cCodec
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync as zarr_sync

from experience_dict.stats import IMAGE_STRIDE, episode_sketch, merge_sketches

SCHEMA_VERSION = 2  # written by this code; READABLE_SCHEMA_VERSIONS are read
READABLE_SCHEMA_VERSIONS = (1, 2)
LOWDIM = "lowdim"  # schema 2: the array holding every float32 feature of at most one dimension, as columns
# docs/INTERFACES.md: info["progress"] has exactly these keys for every task (sim.PROGRESS_KEYS); the default
# progress schema when neither ``progress_keys`` nor the spec declares one (experience_dict must not import sim)
DEFAULT_PROGRESS_KEYS = ("near_object", "grasp_success", "grasp_reward", "in_place_reward", "obj_to_target",
                         "unscaled_reward")
_WRITER_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_META_ATTR = "fleetmind"
_PLAIN_SCALARS = frozenset({float, int, bool, np.float32, np.float64, np.int32, np.int64, np.bool_})
_SKETCH_FIELDS = ("mean", "m2", "min", "max")  # then "q" (G x D)


class StoreError(Exception):
    """Base class of experience-store errors."""


class SchemaVersionError(StoreError):
    """The store was written with a schema version this code cannot read (or, for writers, cannot append to)."""


class SpecMismatchError(StoreError, ValueError):
    """A step, or a spec given to ``create_or_open``, does not match the store's spec."""


class NonFiniteError(SpecMismatchError):
    """A step holds a NaN/inf observation or action value (or an infinite reward/progress value)."""


class CorruptChunkError(StoreError, ValueError):
    """A chunk of a store array cannot be read (checksum mismatch, truncated or missing file). The message names
    the store, shard, array, chunk (and its rows) and the episodes with rows in it."""


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
        termination: why the episode ended, given to ``commit`` (e.g. ``"terminated"``, ``"truncated"``,
            ``"non_finite_observation"``, ``"sim_unstable"``; None: not recorded, as in older stores).
        quarantined: the episode holds non-finite observation/action values accepted by a writer opened with
            ``non_finite="quarantine"``; it is never a success and ``episodes()`` leaves it out by default.
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
    termination: str | None = None
    quarantined: bool = False


# ----------------------------------------------------------------------------- helpers


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


def _packable(feat: dict) -> bool:
    """Whether a feature goes into the schema 2 ``lowdim`` array: float32 of at most one dimension."""
    return np.dtype(feat["dtype"]) == np.float32 and len(feat["shape"]) <= 1


def _layout(meta: dict) -> tuple[dict[str, dict], dict[str, tuple[str, tuple[int, int, bool] | None]]]:
    """Arrays of every shard and where each feature key lives, from the store metadata.

    Returns:
        ``(arrays, where)``: ``arrays`` maps array name -> ``{"shape", "dtype"}`` (per row); ``where`` maps
        feature key -> ``(array name, columns)`` where ``columns`` is ``None`` when the key has its own
        array, else ``(lo, hi, scalar)``: the key is columns ``lo:hi`` of that array (``scalar``: shape
        ``()``, column ``lo``). Schema 2: the keys of ``meta["packed_keys"]`` are consecutive columns of
        :data:`LOWDIM`; schema 1: every key has its own array.
    """
    feats = meta["features"]
    if meta["schema_version"] == 1:
        return ({k: {"shape": list(f["shape"]), "dtype": f["dtype"]} for k, f in feats.items()},
                {k: (k, None) for k in feats})
    packed = meta["packed_keys"]
    arrays = {k: {"shape": list(f["shape"]), "dtype": f["dtype"]} for k, f in feats.items() if k not in packed}
    where: dict[str, tuple] = {k: (k, None) for k in arrays}
    lo = 0
    for k in packed:
        d = int(np.prod(feats[k]["shape"], dtype=np.int64))
        where[k] = (LOWDIM, (lo, lo + d, len(feats[k]["shape"]) == 0))
        lo += d
    arrays[LOWDIM] = {"shape": [lo], "dtype": np.dtype(np.float32).str}
    return arrays, {k: where[k] for k in feats}


def _is_image(feat: dict) -> bool:
    return np.dtype(feat["dtype"]) == np.uint8 and len(feat["shape"]) == 3


def _chunk_rows(feat: dict, chunk_bytes: int, max_chunk_rows: int) -> int:
    row_bytes = int(np.prod(feat["shape"], dtype=np.int64)) * np.dtype(feat["dtype"]).itemsize
    return int(np.clip(chunk_bytes // max(row_bytes, 1), 1, max_chunk_rows))


def _pack_sketch(sketch: dict) -> dict:
    """An :func:`~experience_dict.stats.episode_sketch` as compact JSON (schema 2 commit records).

    Returns ``{"n": int, "d": D, "f64": base64 of little-endian float64 [mean (D), m2 (D), min (D), max (D),
    q (G x D, row-major)]}``: exact (min / max / q hold float32 values, mean / m2 float64) and ~30x faster
    to write and read than JSON lists of floats.
    """
    flat = np.concatenate([np.asarray(sketch[f], dtype="<f8").reshape(-1) for f in (*_SKETCH_FIELDS, "q")])
    return {"n": int(sketch["n"]), "d": len(sketch["mean"]), "f64": base64.b64encode(flat.tobytes()).decode("ascii")}


def _unpack_sketch(packed: dict, where: str) -> dict:
    """Inverse of :func:`_pack_sketch`: ``{"n", "mean", "m2", "min", "max": (D,), "q": (G, D)}`` float64 arrays.

    Raises:
        StoreError: the packed sketch is malformed (``where`` names the record and key).
    """
    try:
        d, v = int(packed["d"]), np.frombuffer(base64.b64decode(packed["f64"], validate=True), dtype="<f8")
        g = len(v) // d - len(_SKETCH_FIELDS) if d > 0 else -1
        if g < 2 or len(v) != (len(_SKETCH_FIELDS) + g) * d:
            raise ValueError(f"{len(v)} values for D={d}")
    except (KeyError, TypeError, ValueError) as e:
        raise StoreError(f"malformed statistics sketch in {where}: {type(e).__name__}: {e}") from None
    out = {"n": int(packed["n"])}
    for i, f in enumerate(_SKETCH_FIELDS):
        out[f] = v[i * d:(i + 1) * d]
    out["q"] = v[len(_SKETCH_FIELDS) * d:].reshape(g, d)
    return out


def _sketch_columns(sketch: dict, lo: int, hi: int) -> dict:
    """Dimensions ``lo:hi`` of an unpacked sketch: the sketch of the feature stored in those columns."""
    return {"n": sketch["n"], **{f: sketch[f][lo:hi] for f in _SKETCH_FIELDS}, "q": sketch["q"][:, lo:hi]}


def _image_pixels(frames: np.ndarray) -> np.ndarray:
    """The pixels image statistics use: every ``IMAGE_STRIDE``-th row and column of uint8 ``(T, H, W, C)``
    C-contiguous frames, as ``(T * ceil(H/S) * ceil(W/S), C)`` uint8 (frame-major, as ``frames[:, ::S, ::S]``).

    Gathered as ``C``-byte items (a ``V<C>`` view) rather than numpy's byte-by-byte strided copy (about 2x
    faster for 96x96x3).
    """
    t, h, w, c = frames.shape
    px = frames.reshape(t, h, w * c).view(f"V{c}")  # (T, H, W) items of C bytes
    return np.ascontiguousarray(px[:, ::IMAGE_STRIDE, ::IMAGE_STRIDE]).view(np.uint8).reshape(-1, c)


def _image_sketch(pixels: np.ndarray) -> dict:
    """``episode_sketch(frames, is_image=True)`` from ``pixels = _image_pixels(frames)`` (concatenated over
    parts of the episode in order), identically: :func:`~experience_dict.stats.episode_sketch` pools the
    ``(N, C)`` pixels as they are, and on ``(T, H, W, C)`` frames it takes exactly these pixels."""
    return episode_sketch(pixels, is_image=True)


def _load_renameat2():
    try:
        return ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not glibc >= 2.28 / not Linux
        return None


_RENAMEAT2 = _load_renameat2()


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


class _ColumnView:
    """Columns ``lo:hi`` of a 2-d Zarr array (rows, D), read like the array of one feature (schema 2 ``lowdim``).

    Supports what readers of :meth:`ExperienceStore.array` use: ``shape`` (``(rows,)`` for a scalar feature,
    else ``(rows, hi - lo)``), ``chunks``, ``ndim``, ``dtype`` and row selection ``view[rows]`` (slice, int or
    index array) returning a C-contiguous numpy array.
    """

    def __init__(self, arr: zarr.Array, lo: int, hi: int, scalar: bool):
        self.array, self.lo, self.hi, self.scalar = arr, lo, hi, scalar

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.array.shape[0],) if self.scalar else (self.array.shape[0], self.hi - self.lo)

    @property
    def chunks(self) -> tuple[int, ...]:
        return (self.array.chunks[0],) if self.scalar else (self.array.chunks[0], self.hi - self.lo)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    def __getitem__(self, rows) -> np.ndarray:
        if isinstance(rows, tuple):
            raise IndexError(f"columns {self.lo}:{self.hi} of {self.array.path}: select rows only, given {rows!r}")
        block = self.array[rows]
        return np.ascontiguousarray(block[..., self.lo] if self.scalar else block[..., self.lo:self.hi])

    def __len__(self) -> int:
        return self.shape[0]


# ----------------------------------------------------------------------------- store


class ExperienceStore:
    """Handle on a fleet experience store: a snapshot reader plus a factory of shard writers.

    Use :meth:`create_or_open` (writers; creates the store if missing) or :meth:`open` (readers). Readers
    hold a snapshot of committed episodes; :meth:`refresh` picks up episodes committed since.

    Args (prefer the classmethods):
        url: fsspec URL or local path of the store root.
        read_only: refuse :meth:`writer` (set by :meth:`open`).

    Raises:
        FileNotFoundError: no store at ``url``. StoreError: a Zarr group that is not an experience store.
        SchemaVersionError: a schema version not in :data:`READABLE_SCHEMA_VERSIONS`.
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
        if version not in READABLE_SCHEMA_VERSIONS:
            raise SchemaVersionError(
                f"store {self.url!r} has schema_version={version!r}; this code reads schema_version in "
                f"{list(READABLE_SCHEMA_VERSIONS)} and writes schema_version={SCHEMA_VERSION}")
        self.meta: dict = meta
        self.schema_version: int = version
        self.features: dict[str, dict] = meta["features"]
        self.control_hz: float = meta["control_hz"]
        self.progress_keys: list[str] = meta["progress_keys"]
        self.spec: dict = meta["spec"]
        self._layout, self._where = _layout(meta)
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
                       max_chunk_rows: int = 1024, image_clevel: int = 1) -> ExperienceStore:
        """Open the store at ``url`` for writing, creating it from ``spec`` if it does not exist.

        Args:
            url: fsspec URL or local directory.
            spec: the env's ``spec_dict()``: ``{"observation.<...>": {"shape", "dtype", "names", "unit"},
                "action": {...}, "control_hz": float, ...}``. Progress keys come from ``progress_keys``, else
                ``spec["progress_keys"]``, else the spec's ``progress.<k>`` entries, else
                :data:`DEFAULT_PROGRESS_KEYS` (the contract's ``sim.PROGRESS_KEYS``).
            control_hz: control frequency in Hz (default: ``spec["control_hz"]``).
            progress_keys: names of the scalar progress signals stored as ``progress.<k>`` per step.
            chunk_bytes: target uncompressed chunk size along time (bytes) for new arrays (1 MiB: 37 rows of
                a 96x96x3 image).
            max_chunk_rows: cap on rows per chunk (small features). A commit re-encodes the shard's partly
                filled last chunk of every array, so this bounds the commit cost of small features
                (1024 rows of the 17-d environment state: ~70 kB, scripts/bench_store.py).
            image_clevel: Blosc/zstd level for image arrays (other arrays use Blosc/lz4 level 5 with byte shuffle).

        Raises:
            SpecMismatchError: the store exists with a different feature spec (names the key, expected and
                given) or the spec is malformed.
            SchemaVersionError: the store exists with a schema version this code cannot append to.
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
                    "image_clevel": int(image_clevel), **parsed,
                    "packed_keys": [k for k, f in parsed["features"].items() if _packable(f)]}
            try:
                zarr.create_group(zstore, attributes={_META_ATTR: meta}, overwrite=False)
            except zarr.errors.ContainsGroupError:
                pass  # another process created it first: fall through and check compatibility
        store = cls(url, read_only=False)
        store._check_writable()
        store._check_compatible(parsed)
        return store

    @classmethod
    def open(cls, url: str) -> ExperienceStore:
        """Open an existing store as a snapshot reader (no shard writers; annotations still allowed).

        Raises:
            FileNotFoundError: no store at ``url``.
            SchemaVersionError: the store has a schema version this code cannot read.
        """
        return cls(url, read_only=True)

    def _check_writable(self) -> None:
        if self.schema_version != SCHEMA_VERSION:
            raise SchemaVersionError(
                f"store {self.url!r} has schema_version={self.schema_version}; this code reads it but appends "
                f"only to schema_version={SCHEMA_VERSION} stores (low-dimensional features packed into one "
                f"'{LOWDIM}' array); write new episodes to a new store")

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

    def _array(self, shard: str, name: str, reopen: bool = False) -> zarr.Array:
        """Array ``name`` (see :func:`_layout`) of ``shard``, opened lazily and cached."""
        k = (shard, name)
        if reopen or k not in self._arrays:
            self._arrays[k] = zarr.open_array(self._zstore, path=f"shards/{shard}/{name}", mode="r")
        return self._arrays[k]

    def array(self, shard: str, key: str, reopen: bool = False) -> zarr.Array | _ColumnView:
        """Rows of feature ``key`` in ``shard``: its Zarr array (opened lazily, cached; rows beyond commits are
        junk), or for a key packed in ``lowdim`` (schema 2: state vectors, action, reward, progress) a
        read-only view of its columns with the ``shape`` / ``chunks`` / row indexing of an array of its own.

        Raises:
            KeyError: unknown key.
        """
        if key not in self._where:
            raise KeyError(f"unknown key {key!r}; store keys: {self.keys}")
        name, cols = self._where[key]
        arr = self._array(shard, name, reopen)
        return arr if cols is None else _ColumnView(arr, *cols)

    # -- snapshot -------------------------------------------------------------------------------
    def _decode_sketch(self, sketch: dict, path: str) -> dict[str, dict]:
        """Commit-record sketches -> ``{feature key: sketch}`` (schema 2: one packed sketch per array, split
        into the features' columns)."""
        if self.schema_version == 1:
            return sketch
        arrays = {name: _unpack_sketch(packed, f"{path} [{name!r}]") for name, packed in sketch.items()}
        return {k: arrays[name] if cols is None else _sketch_columns(arrays[name], cols[0], cols[1])
                for k, (name, cols) in self._where.items()}

    def refresh(self) -> int:
        """Read commit records and annotations written since the last refresh.

        Returns:
            the number of newly visible episodes.
        """
        new = 0
        try:
            writers = [p.rsplit("/", 1)[-1] for p in _ls_fresh(self.fs, self._p("commits"))]
        except FileNotFoundError:
            writers = []
        for w in sorted(writers):
            for path in sorted(_ls_json(self.fs, self._p("commits", w))):
                if path in self._seen_commits:
                    continue
                rec = json.loads(self.fs.cat_file(path))
                meta = EpisodeMeta(**rec["episode"])
                self._episodes[meta.episode_id] = meta
                self._sketches[meta.episode_id] = self._decode_sketch(rec["sketch"], path)
                self._seen_commits.add(path)
                new += 1
        self._episodes = dict(sorted(self._episodes.items(), key=lambda kv: (kv[1].shard, kv[1].start)))
        try:
            ann_writers = [p.rsplit("/", 1)[-1] for p in _ls_fresh(self.fs, self._p("annotations"))]
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
                 policy_version: int | Iterable[int] | None = None, shard: str | None = None,
                 quarantined: bool | None = False) -> list[EpisodeMeta]:
        """Committed episodes of the snapshot matching every given filter (``None`` = any).

        ``task``, ``unit_id`` and ``policy_version`` accept one value or a collection of values.
        ``quarantined``: by default (False) episodes holding non-finite values (written with
        ``non_finite="quarantine"``) are left out; True lists only them, None both. Order: by shard, then
        commit order.
        """
        def _set(v):
            return None if v is None else ({v} if isinstance(v, (str, int)) else set(v))

        tasks, units, versions = _set(task), _set(unit_id), _set(policy_version)
        return [e for e in self._episodes.values()
                if (tasks is None or e.task in tasks) and (units is None or e.unit_id in units)
                and (success is None or e.success == success) and (is_demo is None or e.is_demo == is_demo)
                and (versions is None or e.policy_version in versions) and (shard is None or e.shard == shard)
                and (quarantined is None or e.quarantined == quarantined)]

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
            ``{key: (T, *shape) array}`` with the spec's dtype (images ``(T, H, W, C)`` uint8), C-contiguous.

        Raises:
            KeyError: unknown episode or key.
            CorruptChunkError (a ValueError): a chunk fails its crc32c checksum or is missing; the message names
                store, shard, array, chunk and episodes.
        """
        ep = self.episode(episode_id)
        keys = list(keys) if keys is not None else self.keys
        for key in keys:
            if key not in self.features:
                raise KeyError(f"unknown key {key!r}; store keys: {self.keys}")
        rows: dict[str, np.ndarray] = {}  # per array, read once (schema 2: one read for every lowdim key)
        out = {}
        for key in keys:
            name, cols = self._where[key]
            if name not in rows:
                rows[name] = self._read_array(ep.shard, name, ep.start, ep.start + ep.length)
            if cols is None:
                out[key] = rows[name]
            else:
                lo, hi, scalar = cols
                out[key] = np.ascontiguousarray(rows[name][:, lo] if scalar else rows[name][:, lo:hi])
        return out

    # -- guarded reads --------------------------------------------------------------------------
    def read(self, shard: str, key: str, lo: int, hi: int) -> np.ndarray:
        """Rows ``lo .. hi-1`` of feature ``key`` in ``shard`` (the spec's dtype; packed keys as their columns).

        Raises:
            CorruptChunkError: a chunk cannot be read; the message names store, shard, array, chunk and the
                episodes with rows in it.
        """
        return self._guarded_read(lambda reopen: self.array(shard, key, reopen=reopen), shard, self._where[key][0],
                                  lo, hi)

    def _read_array(self, shard: str, name: str, lo: int, hi: int) -> np.ndarray:
        return self._guarded_read(lambda reopen: self._array(shard, name, reopen=reopen), shard, name, lo, hi)

    def _guarded_read(self, get, shard: str, name: str, lo: int, hi: int) -> np.ndarray:
        """``get(reopen)[lo:hi]``, reopening an array that has fewer rows (a newer commit); a failed read raises
        ``CorruptChunkError`` naming the bad chunks of array ``name``."""
        arr = get(False)
        if arr.shape[0] < hi:
            arr = get(True)
        try:
            return arr[lo:hi]
        except Exception as e:  # noqa: BLE001 - named and re-raised
            raise self._corrupt(shard, name, lo, hi, e) from None

    def _bad_chunks(self, shard: str, name: str, lo: int, hi: int) -> list[tuple[int, int, int, str]]:
        """``[(chunk, first row, end row, error)]`` of the chunks of array ``name`` over rows ``lo .. hi-1`` that
        fail to read."""
        arr = self._array(shard, name, reopen=True)
        cr, out = arr.chunks[0], []
        for c in range(lo // cr, (max(hi, lo + 1) - 1) // cr + 1):
            a, b = c * cr, min((c + 1) * cr, arr.shape[0])
            try:
                arr[a:b]
            except Exception as e:  # noqa: BLE001 - collected
                out.append((c, a, b, f"{type(e).__name__}: {e}"))
        return out

    def _corrupt(self, shard: str, name: str, lo: int, hi: int, err: BaseException) -> CorruptChunkError:
        try:
            bad = self._bad_chunks(shard, name, lo, hi)
        except Exception:  # noqa: BLE001 - the array itself cannot be opened
            bad = []
        bad = bad or [(None, lo, hi, f"{type(err).__name__}: {err}")]
        eps = self.episodes(shard=shard, quarantined=None)
        where = "; ".join(
            f"chunk {c} (rows {a}..{b - 1}): {e} - episodes "
            f"{[x.episode_id for x in eps if x.start < b and x.start + x.length > a]}" for c, a, b, e in bad)
        return CorruptChunkError(f"store {self.url!r}, shard {shard!r}, array {name!r}: {where}. Check the store with "
                                 f"`python -m experience_dict.store verify {self.url}`; store.on_corrupt=skip leaves "
                                 "such episodes out of training")

    def corrupt_episodes(self, episodes: Sequence[EpisodeMeta] | None = None,
                         keys: Sequence[str] | None = None) -> dict[str, str]:
        """``{episode_id: reason}`` for the ``episodes`` (default: all) with rows in a chunk of ``keys``'
        arrays (default: all) that cannot be read. Reads every chunk those episodes touch."""
        eps = list(self.episodes(quarantined=None) if episodes is None else episodes)
        names = sorted({self._where[k][0] for k in (keys if keys is not None else self.keys)})
        out: dict[str, str] = {}
        for shard in sorted({e.shard for e in eps}):
            mine = [e for e in eps if e.shard == shard]
            lo, hi = min(e.start for e in mine), max(e.start + e.length for e in mine)
            for name in names:
                try:
                    bad = self._bad_chunks(shard, name, lo, hi)
                except Exception as e:  # noqa: BLE001 - the array cannot be opened: every episode of it
                    bad = [(None, lo, hi, f"cannot open array: {e}")]
                for c, a, b, err in bad:
                    for x in mine:
                        if x.start < b and x.start + x.length > a:
                            out.setdefault(x.episode_id, f"shard {shard!r}, array {name!r}, chunk {c}: {err}")
        return out

    def readable(self, episodes: Sequence[EpisodeMeta], keys: Sequence[str] | None = None,
                 on_corrupt: str = "raise") -> list[EpisodeMeta]:
        """``episodes`` whose data can be read (``store.on_corrupt``): ``"raise"`` returns them all (a corrupt
        chunk then raises ``CorruptChunkError`` naming itself when read); ``"skip"`` reads every chunk they touch
        first, leaves out the episodes with rows in a bad one and logs how many and why.

        Raises:
            ValueError: an unknown ``on_corrupt``.
        """
        if on_corrupt not in ("raise", "skip"):
            raise ValueError(f"store.on_corrupt: expected 'raise' or 'skip', given {on_corrupt!r}")
        episodes = list(episodes)
        if on_corrupt == "raise":
            return episodes
        bad = self.corrupt_episodes(episodes, keys)
        if bad:
            import logging

            first = next(iter(bad.items()))
            logging.getLogger("fleetmind.store").warning(
                "store.on_corrupt=skip: %d of %d episodes left out (unreadable chunks), e.g. %s: %s",
                len(bad), len(episodes), *first)
        return [e for e in episodes if e.episode_id not in bad]

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
            episodes: subset to use (default: every episode of the snapshot but the quarantined ones).

        Returns:
            ``{key: {"min", "max", "mean", "std", "q01", "q99": per-dimension lists, "count": int}}``;
            min/max/mean/std exact, q01/q99 within 0.5 % rank (see :mod:`experience_dict.stats`).

        Raises:
            KeyError: unknown key. ValueError: no episodes.
        """
        eps = self.episodes() if episodes is None else list(episodes)
        out = {}
        for key in keys if keys is not None else self.keys:
            if key not in self.features:
                raise KeyError(f"unknown key {key!r}; store keys: {self.keys}")
            out[key] = merge_sketches([self._sketches[e.episode_id][key] for e in eps])
        return out

    # -- writing --------------------------------------------------------------------------------
    def writer(self, writer_id: str, non_finite: str = "raise") -> EpisodeWriter:
        """The writer of shard ``writer_id`` (one per fleet unit); recovers the shard after a crash.

        ``non_finite``: what ``add_step`` does with a NaN/inf observation or action value (or an infinite
        reward/progress value; NaN reward/progress means "no signal", e.g. on a real arm, and is accepted):
        ``"raise"`` (default) refuses the step with ``NonFiniteError``; ``"quarantine"`` accepts it and commits
        the episode as a quarantined failure (``EpisodeMeta.quarantined``).

        Raises:
            StoreError: the store was opened read-only. ValueError: bad writer id.
            SchemaVersionError: the store has an older schema version (read-only for this code).
            WriterBusyError: another live process holds this writer id (local filesystems).
        """
        if self.read_only:
            raise StoreError(f"store {self.url!r} was opened read-only; use ExperienceStore.create_or_open")
        self._check_writable()
        return EpisodeWriter(self, writer_id, non_finite=non_finite)

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
            "url": self.url, "schema_version": self.schema_version, "control_hz": self.control_hz,
            "features": {k: {"shape": f["shape"], "dtype": f["dtype"]} for k, f in self.features.items()},
            "arrays": {k: {**v, "keys": [f for f, (a, _) in self._where.items() if a == k]} for k, v in self._layout.items()},
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
            "error", "episodes": [ids]}], "corrupt_episodes": [ids], "non_finite": [{"shard", "key", "rows",
            "episodes"}], "non_finite_episodes": [ids], "quarantined_episodes": [ids]}``; a problem's ``key``
            is the array (a feature key, or ``"lowdim"``, which holds the packed keys in schema 2) and it lists
            every committed episode with rows in the bad chunk. ``non_finite`` lists observation/action values
            that are NaN/inf; ``ok`` is False when a chunk is bad or a non-quarantined episode holds them.
        """
        problems: list[dict] = []
        non_finite: list[dict] = []
        checked = 0
        finite_cols: dict[str, list] = {}   # array -> [(float observation / action key, its columns or None)]
        for k, (name, cols) in self._where.items():
            if (k.startswith("observation.") or k == "action") and \
                    np.issubdtype(np.dtype(self.features[k]["dtype"]), np.floating):
                finite_cols.setdefault(name, []).append((k, None if cols is None else cols[:2]))
        for shard in self.shards():
            eps = self.episodes(shard=shard, quarantined=None)
            if not eps:
                continue
            end = max(e.start + e.length for e in eps)
            starts = np.array([e.start for e in eps])
            ends = starts + np.array([e.length for e in eps])
            bad_rows: dict[str, list] = {}   # key -> [non-finite rows, episode ids]
            for name in self._layout:
                try:
                    arr = self._array(shard, name, reopen=True)
                except Exception as e:  # noqa: BLE001 - reported, not raised
                    problems.append({"shard": shard, "key": name, "chunk": None, "error": f"cannot open array: {e}",
                                     "episodes": [x.episode_id for x in eps]})
                    continue
                if arr.shape[0] < end:
                    problems.append({"shard": shard, "key": name, "chunk": None,
                                     "error": f"array has {arr.shape[0]} rows, commits reference {end}",
                                     "episodes": [x.episode_id for x in eps if x.start + x.length > arr.shape[0]]})
                    end_k = arr.shape[0]
                else:
                    end_k = end
                cr = arr.chunks[0]
                for c in range((end_k + cr - 1) // cr):
                    lo, hi = c * cr, min((c + 1) * cr, end_k)
                    hit = [eps[i].episode_id for i in np.nonzero((starts < hi) & (ends > lo))[0]]
                    ckey = f"shards/{shard}/{name}/" + arr.metadata.encode_chunk_key((c,) + (0,) * (arr.ndim - 1))
                    checked += 1
                    try:
                        if not self.fs.exists(self._p(ckey)):
                            raise FileNotFoundError(f"chunk file {ckey} is missing")
                        block = arr[lo:hi]
                    except Exception as e:  # noqa: BLE001 - reported, not raised
                        problems.append({"shard": shard, "key": name, "chunk": c, "error": f"{type(e).__name__}: {e}",
                                         "episodes": hit})
                        continue
                    # the block just read: its float observation / action columns must be finite
                    for key, cols in finite_cols.get(name, ()):
                        sub = block if cols is None else block[:, cols[0]:cols[1]]
                        for r in lo + np.flatnonzero(~np.isfinite(sub.reshape(len(sub), -1)).all(axis=1)):
                            ep = np.flatnonzero((starts <= r) & (ends > r))
                            if len(ep):   # rows outside committed episodes (alignment padding) do not count
                                nf = bad_rows.setdefault(key, [0, set()])
                                nf[0] += 1
                                nf[1].add(eps[ep[0]].episode_id)
            non_finite += [{"shard": shard, "key": k, "rows": n, "episodes": sorted(ids)}
                           for k in self.features if k in bad_rows for n, ids in [bad_rows[k]]]
        bad = sorted({i for p in problems for i in p["episodes"]})
        unflagged = sorted({i for p in non_finite for i in p["episodes"] if not self._episodes[i].quarantined})
        return {"ok": not problems and not unflagged, "episodes": len(self._episodes), "chunks_checked": checked,
                "problems": problems, "corrupt_episodes": bad, "non_finite": non_finite,
                "non_finite_episodes": unflagged,
                "quarantined_episodes": sorted(e.episode_id for e in self._episodes.values() if e.quarantined)}


# ----------------------------------------------------------------------------- writer


class _Column:
    """Write state of one array of a shard (see :class:`EpisodeWriter`).

    ``buf[i]`` holds shard row ``lo + i``. ``lo`` is the first row of the first chunk the open episode must
    write: the chunk holding its first row, or an earlier one that still lacks rows between episodes. So
    ``buf`` starts with the committed rows of that chunk (the *tail*, read once when the writer opens and
    then carried over from commit to commit), then zeros for the rows between episodes, then the open
    episode's rows. ``len(buf)`` is a multiple of ``cr`` (rows per chunk), so every chunk the episode
    writes is a contiguous view of ``buf``. ``next_c``: first chunk not yet handed to the chunk writers;
    ``capacity``: the array's row count (``arr.shape[0]``); ``spare``: the file a chunk holding committed
    rows is written to before being swapped in (and where its old version lands, reused next time).
    """

    __slots__ = ("arr", "buf", "capacity", "cr", "dir", "encode", "image", "lo", "name", "ndim", "next_c", "spare")

    def __init__(self, name: str, arr: zarr.Array, end: int, start: int, image: bool, directory: str,
                 buf_rows: int, tag: str):
        self.name, self.arr, self.image, self.dir = name, arr, image, directory
        self.cr, self.capacity, self.ndim = int(arr.chunks[0]), int(arr.shape[0]), arr.ndim
        self.lo = self._first_chunk(end, start) * self.cr
        self.next_c = self.lo // self.cr
        rows = -(-max(buf_rows, start - self.lo + 1) // self.cr) * self.cr
        self.buf = np.empty((rows, *arr.shape[1:]), np.dtype(arr.dtype))
        self.buf.fill(0)  # rows between end and start are zeros; touched now, not in the first episode
        if end > self.lo:
            self.buf[:end - self.lo] = arr[self.lo:end]
        self.encode = _sync_chunk_encoder(arr)
        self.spare = f"{directory}/spare.{tag}.partial"  # removed on recovery like every *.partial

    def _first_chunk(self, end: int, start: int) -> int:
        # chunks from here on hold rows >= start, or only rows between end and start (never written yet)
        return min(-(-end // self.cr), start // self.cr)

    def place(self, end: int, start: int, buf_rows: int = 0) -> None:
        """Lay the buffer out for an episode starting at row ``start`` after committed rows ``[0, end)``:
        keep the committed rows of the new first chunk (they are in ``buf`` already, unless just opened),
        zero the rows between ``end`` and ``start``."""
        lo = self._first_chunk(end, start) * self.cr
        old, old_lo = self.buf, self.lo
        rows = -(-max(buf_rows, len(old), start - lo + 1) // self.cr) * self.cr
        if rows > len(old):
            self.buf = np.zeros((rows, *old.shape[1:]), old.dtype)
        if end > lo and (self.buf is not old or lo != old_lo):
            self.buf[:end - lo] = old[lo - old_lo:end - old_lo]
        self.buf[max(end, lo) - lo:start - lo] = 0
        self.lo, self.next_c = lo, lo // self.cr


class EpisodeWriter:
    """Appends episodes to one shard (``shards/<writer_id>``); one live writer per id.

    Steps are buffered in memory; :meth:`commit` makes sure every row of the episode is written to the
    shard's arrays and then writes the commit record (the atomic commit point). Opening a writer recovers
    the shard: rows past the last committed row (a crash mid-episode or mid-commit) are truncated and temp
    files removed.
    Usable as a context manager (releases the writer lock).

    Write path (why it is fast; ``scripts/bench_store.py`` measures it against ``numpy.save``):

    - Each array's steps go straight into a preallocated buffer laid out like the array's chunks (the
      committed rows of the partly filled last chunk first, kept from the previous commit, so nothing is
      ever read back), so every chunk is a view: no per-commit concatenation, no read-modify-write.
    - On a local filesystem a chunk is handed to a small thread pool as soon as the steps fill it (during
      the episode, i.e. while the robot acts); the pool encodes it with the array's own zarr codecs (bytes
      -> Blosc/zstd -> crc32c, exactly what zarr writes; Blosc and file I/O release the GIL), writes the
      file and, for images, gathers the pixels of the statistics sketch while the chunk is in cache.
      ``commit`` only adds each array's last, partly filled chunk (zero-padded), computes the statistics
      sketches while those are written, and writes one small commit record. Elsewhere (``memory://``,
      object stores) the same chunk-aligned blocks go through zarr's async ``setitem`` at commit.
    - Episodes start on a chunk boundary of the biggest image array, so its chunks are written once each
      (never re-encoded with the previous episode's last rows) to new files. The one chunk a commit
      rewrites (the partly filled last chunk of ``lowdim``) is swapped in through a spare file that is
      overwritten, not created, each time: creating a file costs several times more than overwriting one
      on ext4 here.
    - Schema 2 keeps every low-dimensional float32 feature (state vectors, action, reward, each
      ``progress.<k>``) as columns of one ``lowdim`` array: one chunk, one sketch and one file per commit
      instead of one per key (10 on Meta-World); sketches are stored packed (:func:`_pack_sketch`).
    - Arrays grow geometrically (``zarr.json`` is rarely rewritten); zarr arrays and codecs are opened once.

    Raises (constructor):
        ValueError: bad writer id. WriterBusyError: another live process holds the id (local filesystems).
    """

    _BUF_ROWS = 256  # initial capacity of the per-array step buffers, rounded up to whole chunks (doubled when full)
    _POOL_WORKERS = min(4, os.cpu_count() or 1)
    _ALIGN = True  # start episodes on image chunk boundaries (False: right after the previous episode)
    _MIN_ROWS = 16384  # capacity of a new array (rows past the commits are never read; shape is metadata)

    def __init__(self, store: ExperienceStore, writer_id: str, non_finite: str = "raise"):
        if not isinstance(writer_id, str) or not _WRITER_ID_RE.match(writer_id):
            raise ValueError(f"writer_id must match {_WRITER_ID_RE.pattern}, given {writer_id!r}")
        if non_finite not in ("raise", "quarantine"):
            raise ValueError(f"non_finite: expected 'raise' or 'quarantine', given {non_finite!r}")
        self.non_finite = non_finite
        self.store, self.writer_id = store, writer_id
        self.fs = store.fs
        self._lock = None
        if _is_local(self.fs):
            import fcntl

            os.makedirs(store._p("locks"), exist_ok=True)
            lock_path = store._p("locks", f"{writer_id}.lock")
            self._lock = open(lock_path, "a+")  # noqa: SIM115 - held while open; "a+": the holder's note survives
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._lock.close()
                try:
                    holder = Path(lock_path).read_text().strip() or "unknown"
                except OSError:
                    holder = "unknown"
                raise WriterBusyError(f"writer {writer_id!r} of {store.url!r} is held by another live process "
                                      f"({holder})") from None
            self._lock.seek(0)
            self._lock.truncate()
            self._lock.write(f"pid {os.getpid()} on {socket.gethostname()} since "
                             f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            self._lock.flush()
        feats = store.features
        # validation tables, built once (add_step runs per step)
        self._obs_keys = [k for k in feats if k.startswith("observation.")]
        self._shape = {k: tuple(f["shape"]) for k, f in feats.items()}
        self._dtype = {k: np.dtype(f["dtype"]) for k, f in feats.items()}
        self._progress_keys = list(store.progress_keys)
        self._progress_set = set(self._progress_keys)
        self._progress_of = ((lambda p: ()) if not self._progress_keys else
                             (lambda p, g=operator.itemgetter(*self._progress_keys): (g(p),)) if len(self._progress_keys) == 1
                             else operator.itemgetter(*self._progress_keys))  # progress dict -> values in key order
        self._scalar_keys = ["reward", *[f"progress.{k}" for k in self._progress_keys]]
        self._episode: dict | None = None
        self._n = 0  # steps buffered in the open episode
        self._pending: list[Future] = []  # chunk writes of the open episode in flight
        self._remote: list[tuple[_Column, int, np.ndarray]] = []  # non-local: chunks to write at commit
        self._pixels: list[tuple[str, Future]] = []  # image chunk writes of the open episode, in order
        self._pool: ThreadPoolExecutor | None = None
        self._tmp_tag = uuid.uuid4().hex[:12]
        self._commit_dir_made = False
        self._cols: dict[str, _Column] = {}
        self._recover()
        self._local = _is_local(self.fs) and all(c.encode is not None for c in self._cols.values())
        # where add_step puts each value: a key's own array, or columns of the lowdim row
        where = store._where
        self._obs_set = frozenset(self._obs_keys)
        self._obs_check = [(k, self._shape[k], self._dtype[k]) for k in self._obs_keys]
        self._obs_own = [(k, self._cols[k]) for k in self._obs_keys if where[k][1] is None]
        self._obs_low = [(k, slice(*where[k][1][:2])) for k in self._obs_keys if where[k][1] is not None]
        self._act_shape, self._act_dtype = self._shape["action"], self._dtype["action"]
        self._act_col = self._cols["action"] if where["action"][1] is None else None
        self._act_sl = None if self._act_col else slice(*where["action"][1][:2])
        self._low = self._cols[LOWDIM]
        cols = [where[k][1][0] for k in self._scalar_keys]  # reward, progress.*: consecutive packed columns
        if any(where[k][0] != LOWDIM for k in self._scalar_keys) or cols != list(range(cols[0], cols[0] + len(cols))):
            raise StoreError(f"store {store.url!r}: reward and progress keys are not consecutive lowdim columns")
        self._sc_sl = slice(cols[0], cols[0] + len(cols))
        # lowdim row columns that must be finite (float observation keys and the action, when packed)
        fin = [c for k, sl in self._obs_low if np.issubdtype(self._dtype[k], np.floating)
               for c in range(sl.start, sl.stop)]
        if self._act_sl is not None:
            fin += list(range(self._act_sl.start, self._act_sl.stop))
        fin = sorted(fin)
        # a contiguous run of columns is checked through a view (no per-step allocation)
        self._fin_idx = (slice(fin[0], fin[-1] + 1) if fin and fin == list(range(fin[0], fin[-1] + 1))
                         else np.array(fin, np.intp))
        self._fin_own = [k for k, _ in self._obs_own if np.issubdtype(self._dtype[k], np.floating)]
        self._plan()

    # -- recovery -------------------------------------------------------------------------------
    def _recover(self) -> None:
        recs = [json.loads(self.fs.cat_file(p))["episode"]
                for p in _ls_json(self.fs, self.store._p("commits", self.writer_id))]
        self._end = max((r["start"] + r["length"] for r in recs), default=0)
        self._counter = max((int(r["episode_id"].rsplit("-", 1)[1]) + 1 for r in recs), default=0)
        meta = self.store.meta
        arrays: dict[str, zarr.Array] = {}
        for name, feat in self.store._layout.items():
            path = f"shards/{self.writer_id}/{name}"
            try:
                arr = zarr.open_array(self.store._zstore, path=path, mode="r+")
            except (FileNotFoundError, zarr.errors.ArrayNotFoundError, zarr.errors.NodeNotFoundError):
                rows = _chunk_rows(feat, meta["chunk_bytes"], meta["max_chunk_rows"])
                if _is_image(feat):  # one Blosc block per chunk: consecutive frames share content, so zstd
                    # finds matches across frames (about 4x the ratio of Blosc's automatic small blocks at
                    # clevel 1 on 96x96 renders) and encodes / decodes faster too (scripts/bench_store.py)
                    block = rows * int(np.prod(feat["shape"]))
                    comp = BloscCodec(cname="zstd", clevel=meta["image_clevel"], shuffle="noshuffle", blocksize=block)
                else:  # lowdim: a commit re-encodes its partly filled last chunk; lz4 is ~10x faster than
                    # zstd level 3 there for ~8 % more bytes (byte-shuffled float32 state / action rows)
                    comp = BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")
                # locally created with its first capacity (rows past the commits are never read; elsewhere
                # _truncate would shrink it again)
                capacity = -(-self._MIN_ROWS // rows) * rows if _is_local(self.fs) else 0
                arr = zarr.create_array(
                    self.store._zstore, name=path, shape=(capacity, *feat["shape"]), dtype=feat["dtype"],
                    chunks=(rows, *feat["shape"]), compressors=[comp, Crc32cCodec()], fill_value=0,
                    chunk_key_encoding={"name": "default", "separator": "."},  # c.<i>.0..: no directory per chunk
                    config={"write_empty_chunks": True}, overwrite=True)
            self._truncate(arr, self.store._p("shards", self.writer_id, name))  # rows of a crash mid-episode
            arrays[name] = arr
        # episodes start on a chunk boundary of the image array with the biggest rows, so its chunks are
        # written once, never re-encoded with the previous episode's tail (rows in between are zero padding)
        images = [a for name, a in arrays.items() if _is_image(self.store._layout[name])]
        biggest = max(images, key=lambda a: int(np.prod(a.shape[1:])) * a.dtype.itemsize, default=None)
        self._align = int(biggest.chunks[0]) if biggest is not None and self._ALIGN else 1
        self._start = -(-self._end // self._align) * self._align
        for name, arr in arrays.items():
            self._cols[name] = _Column(name, arr, self._end, self._start, _is_image(self.store._layout[name]),
                                       self.store._p("shards", self.writer_id, name), self._BUF_ROWS, self._tmp_tag)
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

    def _truncate(self, arr: zarr.Array, directory: str) -> None:
        """Delete every chunk of ``arr`` wholly past the committed rows (written by a writer killed mid-episode
        or mid-commit), so they can never be read as committed rows later.

        Locally the chunk files are found by listing the array's directory and the shape (capacity) is kept:
        rows past the commits are never read, and zarr's own ``resize`` would try to delete every chunk key
        of the old shape (the capacity grows geometrically: thousands of keys that were never written).
        Elsewhere ``resize`` to the committed rows does it.
        """
        if not _is_local(self.fs):
            if arr.shape[0] != self._end:
                arr.resize((self._end, *arr.shape[1:]))
            return
        first = -(-self._end // arr.chunks[0])  # first chunk holding no committed row
        with os.scandir(directory) as entries:
            for entry in entries:
                parts = entry.name.split(".")
                if parts[0] == "c" and entry.name[-1].isdigit() and parts[1].isdigit() and int(parts[1]) >= first:
                    os.unlink(entry.path)
        if arr.shape[0] < self._end:  # (never from this writer: it grows an array before writing past it)
            zarr_sync(arr.async_array.resize((self._end, *arr.shape[1:]), delete_outside_chunks=False))

    @property
    def committed_rows(self) -> int:
        """Rows of this shard up to the end of its last committed episode (padding between episodes included)."""
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

        On a local filesystem, a step that fills a chunk of an array hands that chunk to the background
        chunk writers (invisible to readers until :meth:`commit`).

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
        if obs.keys() != self._obs_set:
            obs_keys = self._obs_keys
            missing = [k for k in obs_keys if k not in obs]
            if missing:
                raise SpecMismatchError(f"obs is missing key {missing[0]!r} (expected keys {obs_keys}, given {sorted(obs)})")
            extra = [k for k in obs if k not in self._obs_set]
            raise SpecMismatchError(f"obs has unexpected key {extra[0]!r} not in the store spec (expected {obs_keys})")
        progress = {} if progress is None else progress
        if progress.keys() != self._progress_set:
            raise SpecMismatchError(f"progress keys: expected {sorted(self._progress_keys)}, given {sorted(progress)}")
        for key, shape, dtype in self._obs_check:
            v = obs[key]
            if type(v) is not np.ndarray or v.shape != shape or v.dtype != dtype:
                self._check(key, v)
        if type(action) is not np.ndarray or action.shape != self._act_shape or action.dtype != self._act_dtype:
            self._check("action", action)
        scalars = (reward, *self._progress_of(progress))  # reward, progress.* (float32 columns)
        if not _PLAIN_SCALARS.issuperset(map(type, scalars)):
            for key, v in zip(self._scalar_keys, scalars):
                self._scalar(key, v)
        n = self._n
        if n == self._room:  # a step buffer is full: double it (amortised O(1) per step)
            self._grow()
        row = self._start + n
        for key, col in self._obs_own:
            col.buf[row - col.lo] = obs[key]
        low = self._low
        lr = low.buf[row - low.lo]  # this step's lowdim row (a view)
        for key, sl in self._obs_low:
            lr[sl] = obs[key]
        if self._act_col is None:
            lr[self._act_sl] = action
        else:
            self._act_col.buf[row - self._act_col.lo] = action
        lr[self._sc_sl] = scalars
        # finite observations/actions: a NaN or inf anywhere makes the sum non-finite (one reduction per step)
        if not (math.isfinite(np.add.reduce(lr[self._fin_idx], dtype=np.float64))
                and (self._act_col is None or math.isfinite(np.add.reduce(action, None, np.float64)))
                and (not self._fin_own or all(np.isfinite(obs[k]).all() for k in self._fin_own))
                and not any(map(math.isinf, scalars))):
            self._non_finite(obs, action, scalars)     # raises, or flags the episode (quarantine)
        self._n = n = n + 1
        if n >= self._next_full:  # this step filled a chunk of some array: write it in the background
            self._stream()

    def _non_finite(self, obs: dict, action: np.ndarray, scalars: tuple) -> None:
        """A step with a non-finite value: raise ``NonFiniteError`` naming it, or quarantine the episode."""
        bad = [k for k in self._obs_keys if np.issubdtype(self._dtype[k], np.floating) and not np.isfinite(obs[k]).all()]
        bad += ["action"] if not np.isfinite(action).all() else []
        bad += [k for k, v in zip(self._scalar_keys, scalars) if np.isinf(v)]
        if self.non_finite == "quarantine":
            self._episode["quarantined"] = True
            return
        ep = self._episode
        raise NonFiniteError(f"writer {self.writer_id!r}: step {self._n} of the open episode (unit {ep['unit_id']}, "
                             f"task {ep['task']!r}, seed {ep['seed']}) holds non-finite values in {bad}; nothing was "
                             "buffered (end the episode, or open the writer with non_finite='quarantine')")

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

    def _plan(self) -> None:
        """Recompute ``_room`` (steps the open episode can buffer before a buffer must grow) and ``_next_full``
        (open-episode step count at which the next chunk of some array is complete; never when not local)."""
        cols, start = self._cols.values(), self._start
        self._room = min(len(c.buf) - (start - c.lo) for c in cols)
        self._next_full = min((c.next_c + 1) * c.cr - start for c in cols) if self._local else 1 << 62

    def _grow(self) -> None:
        for col in self._cols.values():
            if len(col.buf) - (self._start - col.lo) <= self._n:
                buf = np.zeros((2 * len(col.buf), *col.buf.shape[1:]), col.buf.dtype)
                buf[:len(col.buf)] = col.buf  # chunks in flight keep their views of the old buffer
                col.buf = buf
        self._plan()

    def _stream(self) -> None:
        """Hand every chunk the open episode has filled to the chunk writers."""
        upto = self._start + self._n
        for col in self._cols.values():
            while (col.next_c + 1) * col.cr <= upto:
                self._submit(col, col.next_c, gather=col.image)
                col.next_c += 1
        self._plan()

    def _submit(self, col: _Column, c: int, gather: bool = False) -> None:
        """Write chunk ``c`` of ``col`` from its buffer (local: in the pool; else queued for commit); ``gather``:
        the pool also returns the statistics' pixels of the open episode's rows in the chunk."""
        lo = c * col.cr
        if col.capacity < lo + col.cr:  # geometric growth from _MIN_ROWS: zarr.json is rarely rewritten
            col.capacity = max(c + 1, 2 * (col.capacity // col.cr), -(-self._MIN_ROWS // col.cr)) * col.cr
            col.arr.resize((col.capacity, *col.arr.shape[1:]))
        block = col.buf[lo - col.lo:lo - col.lo + col.cr]
        if not self._local:
            self._remote.append((col, c, block))
            return
        path = f"{col.dir}/{col.arr.metadata.encode_chunk_key((c,) + (0,) * (col.ndim - 1))}"
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self._POOL_WORKERS, thread_name_prefix="store-writer")
        # a chunk holding committed rows is swapped in atomically; a chunk of uncommitted rows only is not
        # read by anyone, so it is written in place (a torn one is deleted by the truncation on recovery)
        rows = None
        if gather:  # while the chunk is in cache
            rows = (max(self._start, lo) - lo, min(self._start + self._n, lo + col.cr) - lo)
        fut = self._pool.submit(self._write_chunk, col, path, block, lo < self._end, rows)
        self._pending.append(fut)
        if rows is not None:
            self._pixels.append((col.name, fut))

    def _write_chunk(self, col: _Column, path: str, block: np.ndarray, atomic: bool,
                     rows: tuple[int, int] | None = None) -> np.ndarray | None:
        """Encode ``block`` and write it to ``path`` (pool thread; at most one atomic write per array in flight).

        Returns ``_image_pixels(block[rows[0]:rows[1]])`` when ``rows`` is given (while the chunk is in cache),
        else ``None``.

        Atomic: the bytes go to the array's spare file, which is then swapped with ``path``
        (``renameat2(RENAME_EXCHANGE)``, so readers see the old or the new chunk, never a torn one); the old
        chunk, now at the spare path, is overwritten next time (no file created or unlinked per commit: on
        this project's ext4 disk creating a file cost ~0.7-1 ms of CPU, overwriting one ~0.3 ms). Without
        ``renameat2`` the spare is moved with ``os.replace`` (and created again next time).
        """
        data = col.encode(block)
        if atomic:
            with open(col.spare, "wb") as f:
                f.write(data)
            if _RENAMEAT2 is None or _RENAMEAT2(-100, os.fsencode(col.spare), -100, os.fsencode(path), 2) != 0:
                os.replace(col.spare, path)  # AT_FDCWD, RENAME_EXCHANGE failed: not supported, or no old chunk
        else:
            with open(path, "wb") as f:
                f.write(data)
        return _image_pixels(block[rows[0]:rows[1]]) if rows is not None and rows[1] > rows[0] else None

    def _write_remote(self) -> None:
        """Non-local filesystems: every queued chunk through zarr's async ``setitem``, all arrays at once."""
        jobs, self._remote = self._remote, []

        async def _write_all() -> None:
            await asyncio.gather(*(col.arr.async_array.setitem(slice(c * col.cr, (c + 1) * col.cr), block)
                                   for col, c, block in jobs))

        zarr_sync(_write_all())

    def _rewind(self) -> None:
        """Wait for writes in flight and mark every chunk of the open episode unwritten (abort / failed commit)."""
        wait(self._pending)
        self._pending, self._remote, self._pixels = [], [], []
        for col in self._cols.values():
            col.next_c = col.lo // col.cr
        self._plan()

    def abort(self) -> None:
        """Drop the open episode (if any); nothing becomes visible (chunks written so far hold uncommitted rows)."""
        self._rewind()
        self._episode, self._n = None, 0

    @property
    def open_steps(self) -> int:
        """Steps buffered in the open episode (0 if none)."""
        return self._n if self._episode is not None else 0

    def commit(self, success: bool, termination: str | None = None) -> str:
        """Write the rest of the open episode to the shard and make it visible (atomic commit record).

        Args:
            success: whether the task succeeded (a quarantined episode is committed as a failure).
            termination: why the episode ended (``EpisodeMeta.termination``; a quarantined episode without one
                gets ``"non_finite"``).

        Returns:
            the new episode id ``"<writer_id>-<counter:06d>"``.

        Raises:
            StoreError: no open episode, or it has no steps.
            OSError (or the error of a failed chunk write): nothing is visible and the episode stays open
                (``commit`` may be retried, or ``abort`` called).
        """
        if self._episode is None:
            raise StoreError(f"writer {self.writer_id!r}: commit() without an open episode")
        length = self.open_steps
        if length == 0:
            raise StoreError(f"writer {self.writer_id!r}: cannot commit an episode with 0 steps")
        start, end = self._start, self._start + length
        episode_id = f"{self.writer_id}-{self._counter:06d}"
        streamed = {name: col.next_c for name, col in self._cols.items()}  # chunks written during the episode
        try:
            for col in self._cols.values():  # 1) rows, invisible: no record names them yet
                c_end = -(-end // col.cr)
                col.buf[end - col.lo:c_end * col.cr - col.lo] = 0  # rows after the episode in its last chunk
                for c in range(col.next_c, c_end):
                    self._submit(col, c)
                col.next_c = c_end
            if self._remote:
                self._write_remote()
            try:  # statistics sketches while the last chunks are written
                sketch = {name: _pack_sketch(self._sketch(col, start, end, streamed[name] * col.cr))
                          for name, col in self._cols.items()}
            finally:
                wait(self._pending)  # every chunk written (or failed) before anything else happens
            for f in self._pending:
                f.result()  # re-raises a failed chunk write: no commit record, the episode stays open
            ep = dict(self._episode)
            quarantined = bool(ep.pop("quarantined", False))
            if quarantined:
                success, termination = False, termination or "non_finite"
            meta = EpisodeMeta(episode_id=episode_id, length=length, success=bool(success), failure_onset=None,
                               shard=self.writer_id, start=start, termination=termination, quarantined=quarantined,
                               **ep)
            record = json.dumps({"episode": dataclasses.asdict(meta), "sketch": sketch}).encode()
            self._write_record(episode_id, record)  # 2) the commit point
        except BaseException:
            self._rewind()
            raise
        self._pending, self._pixels = [], []
        self._end, self._start = end, -(-end // self._align) * self._align
        for col in self._cols.values():  # the new last chunk's committed rows move to the buffer start
            col.place(self._end, self._start)
        self._counter += 1
        self._episode, self._n = None, 0
        self._plan()
        return episode_id

    def _sketch(self, col: _Column, start: int, end: int, streamed: int) -> dict:
        """Statistics sketch of rows ``start..end-1`` of ``col``. Images: the pixels of rows before ``streamed``
        come from the chunk writers (gathered while each chunk was in cache), the rest from the buffer."""
        if not col.image:
            return episode_sketch(col.buf[start - col.lo:end - col.lo])
        a = max(start, streamed)
        parts = [f.result() for name, f in self._pixels if name == col.name]
        if end > a:
            parts.append(_image_pixels(col.buf[a - col.lo:end - col.lo]))
        return _image_sketch(np.concatenate([p for p in parts if p is not None]))

    def _write_record(self, episode_id: str, record: bytes) -> None:
        """The commit point: the episode's record, written atomically (see :func:`_atomic_write`)."""
        path = self.store._p("commits", self.writer_id, f"{episode_id}.json")
        if not _is_local(self.fs):
            _atomic_write(self.fs, path, record)
            return
        if not self._commit_dir_made:
            os.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            self._commit_dir_made = True
        tmp = f"{path}.{self._tmp_tag}.tmp"  # one live writer per shard; strays removed on recovery
        with open(tmp, "wb") as f:
            f.write(record)
        os.replace(tmp, path)

    def close(self) -> None:
        """Drop any open episode and release the writer lock."""
        self.abort()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def copy_episodes(src: ExperienceStore, dst_url: str, episodes: Sequence[EpisodeMeta],
                  writer_id: str = "copy") -> dict[str, str]:
    """Copy committed ``episodes`` of ``src`` into the store at ``dst_url`` (created with ``src``'s spec, control
    rate and progress keys if absent), step by step through an :class:`EpisodeWriter` (so the copy is
    checksummed and committed like any fleet episode), metadata kept: unit, embodiment, task, policy version,
    reset seed, demo flag, start time, ``extra``, success, termination and failure onset. Used to build a
    store from a subset of another (e.g. a frozen fleet store without its failure retries, to re-explore).

    Returns:
        ``{source episode id: new episode id}`` (ids are the copy's writer's: ``"<writer_id>-<counter>"``).

    Raises:
        ValueError: a quarantined episode (its non-finite steps are not copied). SpecMismatchError: the
        destination exists with another spec. CorruptChunkError: a source chunk fails its checksum (nothing
        of that episode is committed).
    """
    dst = ExperienceStore.create_or_open(dst_url, src.spec, control_hz=src.control_hz,
                                         progress_keys=src.progress_keys)
    obs_keys = [k for k in src.keys if k.startswith("observation.")]
    prog_keys = [f"progress.{k}" for k in src.progress_keys]
    w = dst.writer(writer_id)
    ids = {}
    try:
        for m in episodes:
            if m.quarantined:
                raise ValueError(f"copy_episodes: episode {m.episode_id!r} is quarantined (non-finite steps)")
            d = src.load_episode(m.episode_id)
            w.begin_episode(unit_id=m.unit_id, embodiment=m.embodiment, task=m.task,
                            policy_version=m.policy_version, seed=m.seed, is_demo=m.is_demo,
                            start_time=m.start_time, extra=m.extra)
            for t in range(int(m.length)):
                w.add_step({k: d[k][t] for k in obs_keys}, d["action"][t], float(d["reward"][t]),
                           {k[len("progress."):]: float(d[k][t]) for k in prog_keys})
            ids[m.episode_id] = w.commit(success=bool(m.success), termination=m.termination)
    except BaseException:
        w.abort()
        raise
    finally:
        w.close()
    dst.refresh()
    for old, new in ids.items():
        onset = src.episode(old).failure_onset
        if onset is not None:
            dst.set_failure_onset(new, onset)
    return ids
