"""The store's reader: :class:`ExperienceStore` (open / create, snapshot of commit records, reads, statistics,
``verify``) and :func:`copy_episodes`."""

from __future__ import annotations

import json
import time
import warnings
from collections import Counter
from collections.abc import Iterable, Sequence

import fsspec
import numpy as np
import zarr

from experience_dict.stats import IMAGE_STRIDE, merge_sketches
from experience_dict.store.codecs import IMAGE_CODECS, LOSSY_IMAGE_CODECS, LOSSY_MEAN_TOL, LUMA
from experience_dict.store.schema import (
    _META_ATTR,
    INLINE_ARRAYS,
    LOWDIM,
    READABLE_SCHEMA_VERSIONS,
    SCHEMA_VERSION,
    CorruptChunkError,
    EpisodeMeta,
    SchemaVersionError,
    SpecMismatchError,
    StoreError,
    StoreNotFoundError,
    StoreUnreachableError,
    _is_image,
    _layout,
    _packable,
    _parse_spec,
    _per_channel,
    _sketch_columns,
    _unpack_sketch,
    check_record,
    decode_inline_rows,
    place_episode_rows,
    unreachable,
)
from experience_dict.store.storage import (
    _atomic_write,
    _ls_fresh,
    _ls_json,
    _zarr_store,
)
from experience_dict.store.writer import EpisodeWriter


def _columns(rows: np.ndarray, cols: tuple[int, int, bool]) -> np.ndarray:
    """One packed feature's columns ``(lo, hi, scalar)`` of ``lowdim`` rows ``(T, D)``: ``(T,)`` for a scalar
    feature, else ``(T, hi - lo)``, C-contiguous."""
    lo, hi, scalar = cols
    return np.ascontiguousarray(rows[:, lo] if scalar else rows[:, lo:hi])


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
            raise StoreNotFoundError(f"no experience store at {self.url!r} ({type(e).__name__})") from e
        except Exception as e:  # noqa: BLE001 - an endpoint down: one named error, not the backend's traceback
            if not unreachable(e):
                raise
            raise StoreUnreachableError(f"store {self.url!r} cannot be reached ({type(e).__name__}: {e}); nothing "
                                        "in it is known to be damaged: retry once its storage is back") from None
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
        self.unreadable_records: dict[str, str] = {}
        """Commit records that could not be read: ``{path: why}`` (their episodes are left out, named once in the
        log and by :meth:`verify`; the rest of the store stays readable)."""
        self._seen_annotations: dict[str, tuple] = {}
        self._arrays: dict[tuple[str, str], zarr.Array] = {}
        self._inline: dict[str, dict] = {}   # episode id -> {array: encoded rows} (rows in the commit record)
        self._inline_shards: set[str] = set()   # shards with such episodes
        self._shard_end: dict[str, int] = {}   # shard -> end of its last committed row in the snapshot
        self._present: dict[tuple[str, str], set[int]] = {}   # (shard, array) -> chunks seen on storage
        self.refresh()

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def create_or_open(cls, url: str, spec: dict, control_hz: float | None = None,
                       progress_keys: Sequence[str] | None = None, chunk_bytes: int = 1 << 20,
                       max_chunk_rows: int = 1024, image_clevel: int = 1, image_codec: str = "delta-zstd",
                       image_crf: int = 18, image_pix_fmt: str = "yuv420p") -> ExperienceStore:
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
            image_codec: how new stores encode camera frames (:data:`experience_dict.store.codecs.IMAGE_CODECS`):
                ``delta-zstd`` (lossless: each frame minus the one before, then Blosc/zstd; the default),
                ``zstd`` (lossless: Blosc/zstd on the frames as they are, the store's format before 2026-12-05) or
                ``h264`` (lossy: each chunk one H.264 stream at CRF ``image_crf``; frames read back approximately).
            image_crf: libx264's constant rate factor for ``image_codec="h264"`` (0-51, lower is better).
            image_pix_fmt: the H.264 pixel format for ``image_codec="h264"``: ``yuv420p`` (chroma at half
                resolution; needs even frame sizes) or ``yuv444p`` (full chroma; any size, ~1.5x the bytes).

        Raises:
            SpecMismatchError: the store exists with a different feature spec (names the key, expected and
                given) or the spec is malformed.
            SchemaVersionError: the store exists with a schema version this code cannot append to.
            ValueError: an unknown ``image_codec`` or ``image_pix_fmt``, or an ``image_crf`` outside 0..51.
            SpecMismatchError: (a new store) ``h264`` with ``yuv420p`` and a camera of odd height or width; nothing
                is created.
        """
        if image_codec not in IMAGE_CODECS:
            raise ValueError(f"image_codec must be one of {IMAGE_CODECS}, given {image_codec!r}")
        if not 0 <= int(image_crf) <= 51:
            raise ValueError(f"image_crf must be 0..51 (libx264's constant rate factor), given {image_crf}")
        if image_pix_fmt not in ("yuv420p", "yuv444p"):
            raise ValueError(f"image_pix_fmt must be yuv420p or yuv444p, given {image_pix_fmt!r}")
        parsed = _parse_spec(spec, control_hz, progress_keys)
        zstore = _zarr_store(str(url), read_only=False)
        try:
            zarr.open_group(zstore, mode="r")
            exists = True
        except (FileNotFoundError, zarr.errors.GroupNotFoundError):
            exists = False
        if not exists and image_codec == "h264" and image_pix_fmt == "yuv420p":
            odd = {k: f["shape"][:2] for k, f in parsed["features"].items()
                   if _is_image(f) and (f["shape"][0] % 2 or f["shape"][1] % 2)}
            if odd:
                k, hw = next(iter(odd.items()))
                raise SpecMismatchError(f"store {url}: image_codec h264 with pix_fmt yuv420p needs even frame sizes; "
                                        f"{k} is {hw[0]}x{hw[1]} (set store.image_pix_fmt=yuv444p, an even "
                                        "obs.image_size, or another store.image_codec)")
        if not exists:
            meta = {"schema_version": SCHEMA_VERSION, "created": time.time(),
                    "chunk_bytes": int(chunk_bytes), "max_chunk_rows": int(max_chunk_rows),
                    "image_clevel": int(image_clevel), "image_codec": str(image_codec), "image_crf": int(image_crf),
                    "image_pix_fmt": str(image_pix_fmt),
                    **parsed,
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
            try:
                self._arrays[k] = zarr.open_array(self._zstore, path=f"shards/{shard}/{name}", mode="r")
            except Exception as e:  # noqa: BLE001 - named and re-raised (a truncated zarr.json: JSONDecodeError)
                eps = [x.episode_id for x in self.episodes(shard=shard, quarantined=None)]
                raise CorruptChunkError(
                    f"store {self.url!r}, shard {shard!r}, array {name!r}: its metadata (shards/{shard}/{name}/"
                    f"zarr.json) cannot be read ({type(e).__name__}: {e}) - episodes {eps}. Check the store with "
                    f"`python -m experience_dict.store verify {self.url}`; store.on_corrupt=skip leaves such "
                    "episodes out of training") from None
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
                try:
                    rec = check_record(json.loads(self.fs.cat_file(path)), path)
                    meta = EpisodeMeta(**rec["episode"])
                    if path.rsplit("/", 1)[-1] != f"{meta.episode_id}.json" or meta.shard != w:
                        raise ValueError(f"it holds episode {meta.episode_id!r} of shard {meta.shard!r}")
                    sketch = self._decode_sketch(rec["sketch"], path)
                except Exception as e:  # noqa: BLE001 - named, the episode left out, the rest kept
                    why = f"{type(e).__name__}: {e}"
                    if self.unreadable_records.get(path) != why:
                        import logging

                        logging.getLogger("fleetmind.store").warning(
                            "store %r: commit record %s cannot be read (%s); its episode is left out (its data is "
                            "untouched in the shard), every other episode stays readable. `python -m "
                            "experience_dict.store verify %s` lists it", self.url, path, why, self.url)
                    self.unreadable_records[path] = why
                    continue
                self.unreadable_records.pop(path, None)
                self._episodes[meta.episode_id] = meta
                self._sketches[meta.episode_id] = sketch
                if rec.get("inline"):
                    self._inline[meta.episode_id] = rec["inline"]
                    self._inline_shards.add(meta.shard)
                self._shard_end[meta.shard] = max(self._shard_end.get(meta.shard, 0), meta.start + meta.length)
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
            out[key] = rows[name] if cols is None else _columns(rows[name], cols)
            self.check_rows(ep, key, out[key])
        return out

    def check_rows(self, ep: EpisodeMeta, key: str, values: np.ndarray) -> None:
        """Check an episode's rows of ``key`` against the statistics sketch its commit record holds: the count,
        the exact per-dimension min and max, and the mean (relative 1e-6). A chunk file that holds valid bytes
        of another place (copied or restored over it: its own checksum passes) gives rows that disagree. Images of
        a store with a lossy image codec (``image_codec="h264"``) are checked for the count and for the mean per
        luma (BT.601, of the per-channel means) within :data:`LOSSY_MEAN_TOL` grey levels only.

        Args:
            values: ``(T, *shape)`` rows of ``key`` of ``ep`` as read.
        Raises:
            CorruptChunkError: the rows disagree; names store, shard, array, episode and the chunks it spans.
        """
        sk = (self._sketches.get(ep.episode_id) or {}).get(key)
        if sk is None:
            return
        shape = self.features[key]["shape"]
        if len(shape) == 3 and values.dtype == np.uint8:   # images: the sketch's every-4th-pixel subsample
            flat = values[:, ::IMAGE_STRIDE, ::IMAGE_STRIDE].reshape(-1, shape[-1])
        elif _per_channel(self.features[key]):   # point clouds (and colours): per coordinate over every point
            flat = values.reshape(-1, shape[-1])
        else:
            flat = values.reshape(len(values), -1)
        why = None
        lossy = len(shape) == 3 and self.meta.get("image_codec") in LOSSY_IMAGE_CODECS
        if flat.shape[0] != int(sk["n"]):
            why = f"{flat.shape[0]} values per dimension, the record says {int(sk['n'])}"
        elif flat.size and lossy:   # frames come back approximately: only the means, within the codec's error
            gap = flat.astype(np.float64).mean(0) - np.asarray(sk["mean"], np.float64)
            luma = abs(float(gap @ LUMA)) if gap.shape == LUMA.shape else float(np.abs(gap).max())
            if luma > LOSSY_MEAN_TOL:
                why = (f"its mean differs from the record's by {luma:.1f} grey levels of luma, over the lossy codec's "
                       f"{LOSSY_MEAN_TOL}")
        elif flat.size:
            x = flat.astype(np.float64)
            with np.errstate(invalid="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)   # an all-NaN dimension (no signal)
                lo, hi = np.nanmin(x, 0), np.nanmax(x, 0)
                mean = np.nanmean(x, 0)
            want_lo, want_hi = np.asarray(sk["min"], np.float64), np.asarray(sk["max"], np.float64)
            want_mean = np.asarray(sk["mean"], np.float64)
            # a NaN in the record says nothing (earlier writers' sketches: NaN max / mean where a column held NaN)
            same = lambda a, b: ((a == b) | np.isnan(b)).all()
            fin = np.isfinite(mean) & np.isfinite(want_mean)
            if not (same(np.float32(lo).astype(np.float64), want_lo) and same(np.float32(hi).astype(np.float64), want_hi)):
                why = "its min / max differ from the record's"
            elif not np.allclose(mean[fin], want_mean[fin], rtol=1e-6, atol=1e-9 * (1 + np.abs(want_hi - want_lo)[fin])):
                why = "its mean differs from the record's"
        if why:
            name = self._where[key][0]
            cr = int(self._array(ep.shard, name).chunks[0])
            chunks = list(range(ep.start // cr, (ep.start + ep.length - 1) // cr + 1))
            raise CorruptChunkError(
                f"store {self.url!r}, shard {ep.shard!r}, array {name!r}: episode {ep.episode_id!r}'s rows of "
                f"{key!r} (rows {ep.start}..{ep.start + ep.length - 1}, chunks {chunks}) disagree with the "
                f"statistics its commit record holds ({why}): a chunk holds data of another place. Check the store "
                f"with `python -m experience_dict.store verify {self.url}`; store.on_corrupt=skip leaves such "
                "episodes out of training")

    # -- guarded reads --------------------------------------------------------------------------
    def read(self, shard: str, key: str, lo: int, hi: int) -> np.ndarray:
        """Rows ``lo .. hi-1`` of feature ``key`` in ``shard`` (the spec's dtype; packed keys as their columns).

        Raises:
            CorruptChunkError: a chunk cannot be read; the message names store, shard, array, chunk and the
                episodes with rows in it.
        """
        name, cols = self._where[key]
        if name not in self._inline_arrays(shard):
            return self._guarded_read(lambda reopen: self.array(shard, key, reopen=reopen), shard, name, lo, hi)
        rows = self._read_array(shard, name, lo, hi)
        return rows if cols is None else _columns(rows, cols)

    def _inline_arrays(self, shard: str) -> frozenset[str]:
        """Arrays of ``shard`` whose newest rows may live in commit records (not yet in a sealed chunk)."""
        return INLINE_ARRAYS if shard in self._inline_shards else frozenset()

    def _sealed(self, shard: str, name: str) -> int:
        """Rows of array ``name`` of ``shard`` that are in its Zarr chunks: every chunk wholly below the shard's
        last committed row was written (sealed) before the commit record that went past it."""
        cr = int(self._array(shard, name).chunks[0])
        return self._shard_end.get(shard, 0) // cr * cr

    def _read_array(self, shard: str, name: str, lo: int, hi: int) -> np.ndarray:
        """Rows ``lo .. hi-1`` of array ``name`` of ``shard``: from its chunks, and past the sealed chunks of an
        object-store shard from the episodes' commit records (zeros between episodes, as in a chunk)."""
        get = lambda reopen: self._array(shard, name, reopen=reopen)
        if name not in self._inline_arrays(shard):
            return self._guarded_read(get, shard, name, lo, hi)
        sealed = self._sealed(shard, name)
        if hi <= sealed:
            return self._guarded_read(get, shard, name, lo, hi)
        arr = get(False)
        out = np.zeros((hi - lo, *arr.shape[1:]), arr.dtype)
        if lo < sealed:
            out[:sealed - lo] = self._guarded_read(get, shard, name, lo, sealed)
        a = max(lo, sealed)
        place_episode_rows(out[a - lo:], a, ((ep.start, ep.length, lambda ep=ep: self._episode_rows(ep, name))
                                             for ep in self.episodes(shard=shard, quarantined=None)))
        return out

    def _episode_rows(self, ep: EpisodeMeta, name: str) -> np.ndarray:
        """All rows of ``ep`` in array ``name``: decoded from its commit record when it carries them, else read."""
        enc = (self._inline.get(ep.episode_id) or {}).get(name)
        if enc is None:
            return self._guarded_read(lambda reopen: self._array(ep.shard, name, reopen=reopen), ep.shard, name,
                                      ep.start, ep.start + ep.length)
        return decode_inline_rows(enc, f"store {self.url!r}, shard {ep.shard!r}, array {name!r}, episode "
                                       f"{ep.episode_id!r}")

    def _guarded_read(self, get, shard: str, name: str, lo: int, hi: int) -> np.ndarray:
        """``get(reopen)[lo:hi]``, reopening an array that has fewer rows (a newer commit); a failed read raises
        ``CorruptChunkError`` naming the bad chunks of array ``name``."""
        arr = get(False)
        if arr.shape[0] < hi:
            arr = get(True)
        try:
            rows = arr[lo:hi]
            # Zarr reads a missing chunk file as its fill value (zeros); every chunk holding committed rows was
            # written, so a missing one is damage, named like a corrupt one
            missing = self._missing_chunks(shard, name, lo, hi)
            if missing:
                raise FileNotFoundError(f"chunk file {missing[0]} is missing")
            return rows
        except Exception as e:  # noqa: BLE001 - named and re-raised
            raise self._corrupt(shard, name, lo, hi, e) from None

    def _chunk_key(self, shard: str, name: str, c: int) -> str:
        """Storage key of chunk ``c`` (along rows) of array ``name`` of ``shard``."""
        arr = self._array(shard, name)
        return f"shards/{shard}/{name}/" + arr.metadata.encode_chunk_key((c,) + (0,) * (arr.ndim - 1))

    def _missing_chunks(self, shard: str, name: str, lo: int, hi: int) -> list[str]:
        """Storage keys of the chunks of array ``name`` over rows ``lo .. hi-1`` that hold committed rows but
        whose file is absent. Each chunk is looked up once per store handle (a file seen stays trusted; its
        bytes are checked by the codecs' crc32c on every read)."""
        if name in self._inline_arrays(shard):   # past the sealed chunks the rows are in commit records
            hi = min(hi, self._sealed(shard, name))
        hi = min(hi, self._shard_end.get(shard, 0))
        if hi <= lo:
            return []
        cr = int(self._array(shard, name).chunks[0])
        seen = self._present.setdefault((shard, name), set())
        out = []
        for c in range(lo // cr, (hi - 1) // cr + 1):
            if c in seen:
                continue
            key = self._chunk_key(shard, name, c)
            if self.fs.exists(self._p(key)):
                seen.add(c)
            else:
                out.append(key)
        return out

    def _bad_chunks(self, shard: str, name: str, lo: int, hi: int) -> list[tuple[int, int, int, str]]:
        """``[(chunk, first row, end row, error)]`` of the chunks of array ``name`` over rows ``lo .. hi-1`` that
        fail to read."""
        arr = self._array(shard, name, reopen=True)
        cr, out = arr.chunks[0], []
        if name in self._inline_arrays(shard):   # rows past the sealed chunks: the commit records' copies
            sealed = self._sealed(shard, name)
            for ep in self.episodes(shard=shard, quarantined=None):
                if ep.start + ep.length > max(lo, sealed) and ep.start < hi:
                    try:
                        self._episode_rows(ep, name)
                    except Exception as e:  # noqa: BLE001 - collected
                        out.append((None, ep.start, ep.start + ep.length, f"{type(e).__name__}: {e}"))
            hi = min(hi, sealed)
            if hi <= lo:
                return out
        for c in range(lo // cr, (max(hi, lo + 1) - 1) // cr + 1):
            a, b = c * cr, min((c + 1) * cr, arr.shape[0])
            try:
                arr[a:b]
                self._present.get((shard, name), set()).discard(c)   # look the file up again
                if self._missing_chunks(shard, name, a, b):
                    raise FileNotFoundError(f"chunk file {self._chunk_key(shard, name, c)} is missing")
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
        # readable chunks that hold another place's data: the rows disagree with the record
        for i, why in self._rows_mismatches([x for x in eps if x.episode_id not in out], keys).items():
            out.setdefault(i, why)
        return out

    def _rows_mismatches(self, episodes: Sequence[EpisodeMeta], keys: Sequence[str] | None = None) -> dict[str, str]:
        """``{episode_id: reason}`` for the ``episodes`` whose rows of ``keys`` (default: all) cannot be read or
        disagree with their commit record's statistics (:meth:`check_rows`). One read per shard and array covers
        every episode (a lowdim chunk holds many episodes); when that read fails, each episode is read alone."""
        keys = list(keys) if keys is not None else self.keys
        by_array: dict[str, list[str]] = {}
        for k in keys:
            by_array.setdefault(self._where[k][0], []).append(k)
        out: dict[str, str] = {}
        for shard in sorted({e.shard for e in episodes}):
            mine = [e for e in episodes if e.shard == shard]
            lo, hi = min(e.start for e in mine), max(e.start + e.length for e in mine)
            for name, ks in by_array.items():
                try:
                    rows = self._read_array(shard, name, lo, hi)
                except CorruptChunkError:
                    rows = None
                for e in mine:
                    if e.episode_id in out:
                        continue
                    try:
                        block = (rows[e.start - lo:e.start + e.length - lo] if rows is not None else
                                 self._read_array(shard, name, e.start, e.start + e.length))
                        for k in ks:
                            cols = self._where[k][1]
                            self.check_rows(e, k, block if cols is None else _columns(block, cols))
                    except CorruptChunkError as err:
                        out[e.episode_id] = str(err)
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
    def episode_hz(self, meta: EpisodeMeta) -> float:
        """The control rate ``meta``'s episode was recorded at, Hz: its own (a mixed fleet) or the store's."""
        return float(meta.control_hz) if meta.control_hz is not None else float(self.control_hz)

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
            "error", "episodes": [ids]}], "corrupt_episodes": [ids], "unreadable_records": [paths] (commit records
            that cannot be read: their episodes left out), "non_finite": [{"shard", "key", "rows",
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
                # an object-store shard's newest rows of an inline array are in commit records, not chunks
                in_chunks = self._sealed(shard, name) if name in self._inline_arrays(shard) else end
                if arr.shape[0] < in_chunks:
                    problems.append({"shard": shard, "key": name, "chunk": None,
                                     "error": f"array has {arr.shape[0]} rows, commits reference {in_chunks}",
                                     "episodes": [x.episode_id for x in eps if x.start + x.length > arr.shape[0]]})
                    end_k = arr.shape[0]
                else:
                    end_k = in_chunks
                cr = arr.chunks[0]
                blocks = [(c * cr, min((c + 1) * cr, end_k), c) for c in range((end_k + cr - 1) // cr)]
                blocks += [(x.start, x.start + x.length, None) for x in eps
                           if in_chunks < end and x.start + x.length > in_chunks]
                for lo, hi, c in blocks:
                    hit = [eps[i].episode_id for i in np.nonzero((starts < hi) & (ends > lo))[0]]
                    checked += 1
                    try:
                        if c is None:   # one episode's rows, from its commit record
                            ep = next(x for x in eps if x.start == lo)
                            block, hit = self._episode_rows(ep, name), [ep.episode_id]
                        else:
                            ckey = self._chunk_key(shard, name, c)
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
        flagged = {i for p in problems for i in p["episodes"]}
        # readable chunks holding another place's data
        for i, err in self._rows_mismatches([e for e in self.episodes(quarantined=None)
                                             if e.episode_id not in flagged]).items():
            problems.append({"shard": self._episodes[i].shard, "key": None, "chunk": None, "error": err,
                             "episodes": [i]})
        for rel in ["zarr.json", "shards/zarr.json", *(f"shards/{s}/zarr.json" for s in self.shards())]:
            try:   # the group metadata: zarr opens a group through it (a truncated one fails the next open)
                meta = json.loads(self.fs.cat_file(self._p(*rel.split("/"))))
                if meta.get("node_type") != "group":
                    raise ValueError(f"node_type {meta.get('node_type')!r}, expected 'group'")
            except FileNotFoundError:
                if rel == "zarr.json":
                    problems.append({"shard": None, "key": "zarr.json", "chunk": None, "episodes": [],
                                     "error": "the store's root group metadata zarr.json is missing"})
            except Exception as e:  # noqa: BLE001 - reported, not raised
                problems.append({"shard": rel.split("/")[1] if rel.count("/") == 2 else None, "key": rel,
                                 "chunk": None, "episodes": [],
                                 "error": f"group metadata {rel} cannot be read ({type(e).__name__}: {e})"})
        for path, why in sorted(self.unreadable_records.items()):
            shard, name = path.rsplit("/", 2)[-2:]
            problems.append({"shard": shard, "key": "commits", "chunk": None, "episodes": [],
                             "error": f"commit record {path} cannot be read ({why}): episode {name[:-5]} is left "
                                      "out; its rows are untouched in the shard"})
        unreadable = {p.rsplit("/", 1)[-1][:-5] for p in self.unreadable_records}
        for shard in self.shards():   # commit records are numbered 0, 1, ... per writer: a gap is a lost record
            have = {int(e.episode_id.rsplit("-", 1)[1]) for e in self.episodes(shard=shard, quarantined=None)}
            have |= {int(i.rsplit("-", 1)[1]) for i in unreadable if i.rsplit("-", 1)[0] == shard
                     and i.rsplit("-", 1)[1].isdigit()}
            lost = sorted(set(range(max(have) + 1)) - have) if have else []
            if lost:
                problems.append({"shard": shard, "key": "commits", "chunk": None, "episodes": [],
                                 "error": f"commit records of episodes {[f'{shard}-{i:06d}' for i in lost]} are "
                                          "missing (the writer numbers its commits 0, 1, ...): their rows are "
                                          "in the shard but no record makes them visible"})
        bad = sorted({i for p in problems for i in p["episodes"]})
        unflagged = sorted({i for p in non_finite for i in p["episodes"] if not self._episodes[i].quarantined})
        return {"ok": not problems and not unflagged, "episodes": len(self._episodes), "chunks_checked": checked,
                "problems": problems, "corrupt_episodes": bad, "unreadable_records": sorted(self.unreadable_records),
                "non_finite": non_finite,
                "non_finite_episodes": unflagged,
                "quarantined_episodes": sorted(e.episode_id for e in self._episodes.values() if e.quarantined)}




def copy_episodes(src: ExperienceStore, dst_url: str, episodes: Sequence[EpisodeMeta],
                  writer_id: str = "copy") -> dict[str, str]:
    """Copy committed ``episodes`` of ``src`` into the store at ``dst_url`` (created with ``src``'s spec, control
    rate, progress keys and layout, its image codec included, if absent), step by step through an
    :class:`EpisodeWriter` (so the copy is checksummed and committed like any fleet episode), metadata kept: unit, embodiment, task, policy version,
    reset seed, demo flag, start time, ``extra``, success, termination and failure onset. Used to build a
    store from a subset of another (e.g. a frozen fleet store without its failure retries, to re-explore).

    Returns:
        ``{source episode id: new episode id}`` (ids are the copy's writer's: ``"<writer_id>-<counter>"``).

    Raises:
        ValueError: a quarantined episode (its non-finite steps are not copied). SpecMismatchError: the
        destination exists with another spec. CorruptChunkError: a source chunk fails its checksum (nothing
        of that episode is committed).
    """
    layout = {k: src.meta[k] for k in ("chunk_bytes", "max_chunk_rows", "image_clevel", "image_crf", "image_pix_fmt")
              if k in src.meta}
    dst = ExperienceStore.create_or_open(dst_url, src.spec, control_hz=src.control_hz,
                                         progress_keys=src.progress_keys,
                                         image_codec=src.meta.get("image_codec", "zstd"), **layout)
    obs_keys = [k for k in src.keys if k.startswith("observation.")]
    prog_keys = [f"progress.{k}" for k in src.progress_keys]
    w = dst.writer(writer_id)
    ids = {}
    try:
        for m in episodes:
            if m.quarantined:
                raise ValueError(f"copy_episodes: episode {m.episode_id!r} is quarantined (non-finite steps)")
            d = src.load_episode(m.episode_id)
            w.begin_episode(unit_id=m.unit_id, embodiment=m.embodiment, task=m.task, control_hz=src.episode_hz(m),
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
