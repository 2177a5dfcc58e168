"""The store's writer: :class:`EpisodeWriter` (one shard per writer id; chunks written while the episode runs;
the commit record is the commit point; recovery truncates to the last commit)."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import math
import operator
import os
import socket
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Protocol, Self

import numpy as np
import zarr
from fsspec import AbstractFileSystem
from zarr.codecs import BloscCodec, Crc32cCodec

from experience_dict.stats import episode_sketch, histogram_sketch
from experience_dict.store.codecs import FrameDeltaCodec, PointGridCodec, VideoChunkCodec, grid_indices
from experience_dict.store.schema import (
    _PLAIN_SCALARS,
    _WRITER_ID_RE,
    INLINE_ARRAYS,
    LOWDIM,
    EpisodeMeta,
    NonFiniteError,
    SpecMismatchError,
    StoreError,
    StoreWriteError,
    WriterBusyError,
    _chunk_rows,
    _image_histogram,
    _is_image,
    _is_points,
    _pack_sketch,
    _per_channel,
    decode_inline_rows,
    encode_inline_rows,
    place_episode_rows,
    seal_record,
    unreachable,
)
from experience_dict.store.storage import (
    _RENAMEAT2,
    _atomic_write,
    _is_local,
    _ls_json,
)
from experience_dict.store.zarr_compat import sync_chunk_encoder, zarr_sync

# ----------------------------------------------------------------------------- writer


class WritableStore(Protocol):
    """What :class:`EpisodeWriter` uses of the store it appends to: its URL, filesystem, Zarr store and paths
    (``_p``), its metadata and feature spec, and the layout of its arrays (``schema._layout``).

    ``ExperienceStore`` opened for writing (``ExperienceStore.create_or_open(...).writer(...)``) is the one
    implementation. The writer names this interface, not the reader's class: the reader imports the writer (to
    open one), so the writer does not import the reader.
    """

    url: str
    fs: AbstractFileSystem
    meta: dict
    features: dict[str, dict]
    progress_keys: list[str]
    _layout: dict[str, dict]
    _where: dict[str, tuple[str, tuple[int, int, bool] | None]]
    _zstore: zarr.abc.store.Store

    def _p(self, *parts: str) -> str: ...


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
                 buf_rows: int, tag: str, read_rows=None):
        self.name, self.arr, self.image, self.dir = name, arr, image, directory
        self.cr, self.capacity, self.ndim = int(arr.chunks[0]), int(arr.shape[0]), arr.ndim
        self.lo = self._first_chunk(end, start) * self.cr
        self.next_c = self.lo // self.cr
        rows = -(-max(buf_rows, start - self.lo + 1) // self.cr) * self.cr
        self.buf = np.empty((rows, *arr.shape[1:]), np.dtype(arr.dtype))
        self.buf.fill(0)  # rows between end and start are zeros; touched now, not in the first episode
        if end > self.lo:  # the committed rows of the first chunk (read_rows: from the commit records)
            self.buf[:end - self.lo] = arr[self.lo:end] if read_rows is None else read_rows(self.lo, end)
        self.encode = sync_chunk_encoder(arr, on_drop=lambda c: StoreError(f"codec {c} dropped a chunk of {arr.path}"))
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
      file and, for images, counts the statistics sketch's pixels (a histogram per channel) while the chunk
      is in cache.
      ``commit`` only adds each array's last, partly filled chunk (zero-padded), computes the statistics
      sketches while those are written, and writes one small commit record. Elsewhere (``memory://``,
      object stores) the same chunk-aligned blocks go through zarr's async ``setitem`` at commit, except for
      ``lowdim`` (``INLINE_ARRAYS``): its rows travel inside the commit record (Blosc/lz4, crc32, base64), and a
      ``lowdim`` chunk is written only once the episodes have filled it (sealed, before the record that goes
      past it), so a state-only commit is one PUT (there is no atomic rename to make two writes one). Readers
      take rows past a shard's sealed chunks from the records; a reopened writer rebuilds its partly filled
      chunk from them.
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

    def __init__(self, store: WritableStore, writer_id: str, non_finite: str = "raise"):
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
        try:
            self._recover()
        except BaseException:   # a writer that cannot resume holds nothing: the next try is not refused as busy
            if self._lock is not None:
                self._lock.close()
                self._lock = None
            raise
        self._local = _is_local(self.fs) and all(c.encode is not None for c in self._cols.values())
        # where add_step puts each value: a key's own array, or columns of the lowdim row
        where = store._where
        self._obs_set = frozenset(self._obs_keys)
        self._obs_check = [(k, self._shape[k], self._dtype[k]) for k in self._obs_keys]
        self._obs_own = [(k, self._cols[k]) for k in self._obs_keys if where[k][1] is None]
        feats = self.store.meta["features"]
        self._grids = {k: float(feats[k]["grid_m"]) for k, _ in self._obs_own if _is_points(feats[k])}
        self._per_channel = frozenset(k for k, _ in self._obs_own if _per_channel(feats[k]))
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
        records = []
        for p in _ls_json(self.fs, self.store._p("commits", self.writer_id)):
            try:
                records.append(json.loads(self.fs.cat_file(p)))
                int(records[-1]["episode"]["start"]) + int(records[-1]["episode"]["length"])
            except (ValueError, KeyError, TypeError) as e:   # where its rows end is unknown: appending could lose them
                raise StoreError(f"store {self.store.url!r}: writer {self.writer_id!r} cannot resume: its commit record "
                                 f"{p} cannot be read ({type(e).__name__}: {e}), so where its episode's rows end is "
                                 "unknown. Readers skip that episode; restore or move the record aside to resume "
                                 "this writer, or write under another writer id") from None
        recs = [r["episode"] for r in records]
        # without an atomic rename (object stores, memory://) a commit is one PUT: the rows of INLINE_ARRAYS travel
        # in the commit record and their chunks are written once full (sealed); see commit()
        self._inline = frozenset() if _is_local(self.fs) else INLINE_ARRAYS
        self._end = max((r["start"] + r["length"] for r in recs), default=0)
        self._counter = max((int(r["episode_id"].rsplit("-", 1)[1]) + 1 for r in recs), default=0)
        meta = self.store.meta
        arrays: dict[str, zarr.Array] = {}
        for name, feat in self.store._layout.items():
            path = f"shards/{self.writer_id}/{name}"
            try:
                arr = zarr.open_array(self.store._zstore, path=path, mode="r+")
            except (FileNotFoundError, zarr.errors.ArrayNotFoundError, zarr.errors.NodeNotFoundError):
                arr = None
            except Exception as e:  # noqa: BLE001 - a truncated or damaged zarr.json (JSONDecodeError, ...): named
                raise StoreError(f"store {self.store.url!r}: writer {self.writer_id!r} cannot resume: the metadata of "
                                 f"its array {name!r} ({path}/zarr.json) cannot be read ({type(e).__name__}: {e}). Its "
                                 "committed rows are untouched; restore that file (or write under another writer id), "
                                 f"then check with `python -m experience_dict.store verify {self.store.url}`") from None
            if arr is None and self._end > 0:   # committed rows, but no metadata: creating it anew would erase them
                raise StoreError(f"store {self.store.url!r}: writer {self.writer_id!r} cannot resume: its array "
                                 f"{name!r} has no metadata ({path}/zarr.json missing) although {len(recs)} committed "
                                 "episodes have rows there. Restore that file (or write under another writer id)")
            if arr is None:
                rows = _chunk_rows(feat, meta["chunk_bytes"], meta["max_chunk_rows"])
                filters, serializer = (), "auto"
                if _is_image(feat):  # one Blosc block per chunk: consecutive frames share content, so zstd
                    # finds matches across frames (about 4x the ratio of Blosc's automatic small blocks at
                    # clevel 1 on 96x96 renders) and encodes / decodes faster too (scripts/bench_store.py)
                    block = rows * int(np.prod(feat["shape"]))
                    comp = BloscCodec(cname="zstd", clevel=meta["image_clevel"], shuffle="noshuffle", blocksize=block)
                    codec = meta.get("image_codec", "zstd")   # stores made before the key: frames as they are
                    if codec == "delta-zstd":   # lossless: each frame minus the one before (codecs.py)
                        filters = (FrameDeltaCodec(),)
                    elif codec == "h264":   # lossy: a chunk is one H.264 stream, then only the checksum
                        serializer, comp = VideoChunkCodec(crf=meta["image_crf"],   # set with the codec
                                                           pix_fmt=meta.get("image_pix_fmt", "yuv420p")), None
                elif _is_points(meta["features"].get(name, {})):   # 0.1 mm int16 grid indices, byte-shuffled zstd
                    serializer = PointGridCodec(grid_m=float(meta["features"][name]["grid_m"]))
                    comp = BloscCodec(cname="zstd", clevel=3, shuffle="shuffle", typesize=2)
                else:  # lowdim: a commit re-encodes its partly filled last chunk; lz4 is ~10x faster than
                    # zstd level 3 there for ~8 % more bytes (byte-shuffled float32 state / action rows)
                    comp = BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")
                # locally created with its first capacity (rows past the commits are never read; elsewhere
                # _truncate would shrink it again)
                capacity = -(-self._MIN_ROWS // rows) * rows if _is_local(self.fs) else 0
                arr = zarr.create_array(
                    self.store._zstore, name=path, shape=(capacity, *feat["shape"]), dtype=feat["dtype"],
                    chunks=(rows, *feat["shape"]), filters=filters, serializer=serializer,
                    compressors=[c for c in (comp, Crc32cCodec()) if c is not None], fill_value=0,
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
                                       self.store._p("shards", self.writer_id, name), self._BUF_ROWS, self._tmp_tag,
                                       read_rows=(lambda a, b, arr=arr, name=name: self._record_rows(arr, name, records, a, b))
                                       if name in self._inline else None)
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

    def _record_rows(self, arr: zarr.Array, name: str, records: list[dict], lo: int, hi: int) -> np.ndarray:
        """Committed rows ``lo .. hi-1`` of inline array ``name`` (the partly filled chunk a reopened writer carries
        on): from the commit records that hold them (zeros between episodes), else from the array."""
        def rows(r: dict):
            e = r["episode"]
            enc = (r.get("inline") or {}).get(name)
            if enc is None:
                return arr[e["start"]:e["start"] + e["length"]]
            return decode_inline_rows(enc, f"store {self.store.url!r}, shard {self.writer_id!r}, episode {e['episode_id']!r}")

        return place_episode_rows(np.zeros((hi - lo, *arr.shape[1:]), arr.dtype), lo,
                                  ((int(r["episode"]["start"]), int(r["episode"]["length"]), lambda r=r: rows(r))
                                   for r in records))

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
                      is_demo: bool = False, start_time: float | None = None, extra: dict | None = None,
                      control_hz: float | None = None) -> None:
        """Start buffering a new episode (see :class:`EpisodeMeta` for the fields). ``control_hz``: the rate the
        episode was recorded at, Hz (None, or the store's own rate: the store's; another rate is kept in the
        episode's metadata, so one store can hold a mixed fleet).

        Raises:
            StoreError: an episode is already open (commit or abort it first).
            ValueError: ``control_hz`` not a positive finite number.
        """
        if self._episode is not None:
            raise StoreError(f"writer {self.writer_id!r}: an episode is already open; commit() or abort() it")
        self._episode = {"unit_id": int(unit_id), "embodiment": str(embodiment), "task": str(task),
                         "policy_version": int(policy_version), "seed": int(seed), "is_demo": bool(is_demo),
                         "start_time": float(time.time() if start_time is None else start_time),
                         "extra": json.loads(json.dumps(extra or {}))}
        if control_hz is not None:
            hz = float(control_hz)
            if not (np.isfinite(hz) and hz > 0):
                self._episode = None
                raise ValueError(f"writer {self.writer_id!r}: control_hz must be a positive number of Hz, given "
                                 f"{control_hz!r}")
            if hz != float(self.store.control_hz):
                self._episode["control_hz"] = hz
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
        snapped = {key: self._snap(key, obs[key], grid) for key, grid in self._grids.items()}
        for key, col in self._obs_own:
            col.buf[row - col.lo] = snapped[key] if key in snapped else obs[key]
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
        the pool also returns the statistics' pixel histogram of the open episode's rows in the chunk."""
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

        Returns ``_image_histogram(block[rows[0]:rows[1]])`` (the statistics' pixel counts of those rows) when
        ``rows`` is given, counted here while the chunk is in cache and off the commit's path; else ``None``.

        Atomic: the bytes go to the array's spare file, which is then swapped with ``path``
        (``renameat2(RENAME_EXCHANGE)``, so readers see the old or the new chunk, never a torn one); the old
        chunk, now at the spare path, is overwritten next time (no file created or unlinked per commit: on
        this project's ext4 disk creating a file cost ~0.7-1 ms of CPU, overwriting one ~0.3 ms). Without
        ``renameat2`` the spare is moved with ``os.replace`` (and created again next time).
        """
        data = col.encode(block)
        try:
            if atomic:
                with open(col.spare, "wb") as f:
                    f.write(data)
                if _RENAMEAT2 is None or _RENAMEAT2(-100, os.fsencode(col.spare), -100, os.fsencode(path), 2) != 0:
                    os.replace(col.spare, path)  # AT_FDCWD, RENAME_EXCHANGE failed: not supported, or no old chunk
            else:
                with open(path, "wb") as f:
                    f.write(data)
        except OSError as e:
            if e.filename is None:   # a failed write() names no file: name the chunk
                e.filename = path
            raise
        return _image_histogram(block[rows[0]:rows[1]]) if rows is not None and rows[1] > rows[0] else None

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
                # inline arrays: only the chunks the episode filled (sealed); the rest is in the record
                for c in range(col.next_c, end // col.cr if col.name in self._inline else c_end):
                    self._submit(col, c)
                col.next_c = c_end
            if self._remote:
                self._write_remote()
            try:  # statistics sketches while the last chunks are written: low-dim arrays first (from the
                # buffer), then images (their histograms wait on the chunk writers)
                sketch = {name: _pack_sketch(self._sketch(col, start, end, streamed[name] * col.cr))
                          for name, col in sorted(self._cols.items(), key=lambda item: item[1].image)}
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
            episode = dataclasses.asdict(meta)
            if episode.get("control_hz") is None:   # the store's rate: the record as before mixed fleets
                episode.pop("control_hz", None)
            rec = {"episode": episode, "sketch": sketch}
            if self._inline:
                rec["inline"] = {n: encode_inline_rows(self._cols[n].buf[start - self._cols[n].lo:end - self._cols[n].lo])
                                 for n in self._inline if n in self._cols}
            record = seal_record(rec)
            self._write_record(episode_id, record)  # 2) the commit point
        except StoreError:
            self._rewind()
            raise
        except Exception as e:  # noqa: BLE001 - OSError, and an object store's own (botocore: an endpoint down)
            self._rewind()
            code, filename = getattr(e, "errno", None), getattr(e, "filename", None)
            what = "no space left on the device" if code == errno.ENOSPC else (
                "the storage endpoint cannot be reached" if unreachable(e) else (getattr(e, "strerror", None) or str(e)))
            raise StoreWriteError(
                code, f"store {self.store.url!r}, writer {self.writer_id!r}: writing episode {episode_id} "
                f"({length} steps) failed: {what} (file {filename or 'unknown'}; {type(e).__name__}: {e}). "
                "Nothing committed is lost; the episode is not visible and stays open: free space (or bring the "
                "storage back) and commit() again, or abort()", filename) from e
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

    def _snap(self, key: str, v: np.ndarray, grid: float) -> np.ndarray:
        """A point cloud ``v`` on its feature's ``grid`` (metres), so that ``PointGridCodec`` stores it exactly.

        Raises:
            SpecMismatchError: a coordinate beyond the int16 grid (nothing is buffered).
        """
        try:
            return (grid_indices(v, grid) * grid).astype(np.float32)
        except ValueError as e:
            raise SpecMismatchError(f"obs[{key!r}]: {e}") from None

    def _sketch(self, col: _Column, start: int, end: int, streamed: int) -> dict:
        """Statistics sketch of rows ``start..end-1`` of ``col``. Images: the pixel histograms of rows before
        ``streamed`` come from the chunk writers (counted while each chunk was in cache), the rest from the
        buffer; their sum gives the sketch. Point clouds and their colours: per coordinate / channel over every point."""
        if not col.image:
            return episode_sketch(col.buf[start - col.lo:end - col.lo], is_image=col.name in self._per_channel)
        a = max(start, streamed)
        parts = [f.result() for name, f in self._pixels if name == col.name]
        if end > a:
            parts.append(_image_histogram(col.buf[a - col.lo:end - col.lo]))
        return histogram_sketch(sum(p for p in parts if p is not None))

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
