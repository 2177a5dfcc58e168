"""The store's schema: versions, errors, episode metadata, the array layout of an env spec, statistics
sketch packing (see :mod:`experience_dict.store.store` for the layout and its guarantees)."""

from __future__ import annotations

import base64
import dataclasses
import json
import re
import zlib
from collections.abc import Sequence

import numpy as np

from experience_dict.stats import IMAGE_STRIDE, pixel_histogram

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


def unreachable(err: BaseException) -> bool:
    """Whether ``err`` says the storage cannot be reached (a connection refused or timed out: the builtin
    ``ConnectionError``, botocore's ``EndpointConnectionError`` / ``ConnectTimeoutError``, aiohttp's
    ``ClientConnectorError``), as opposed to bad data."""
    names = {c.__name__ for c in type(err).__mro__}
    return isinstance(err, (ConnectionError, TimeoutError)) or bool(names & {
        "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ClientConnectorError",
        "ServerDisconnectedError", "ConnectionClosedError"})


class StoreUnreachableError(StoreError, OSError):
    """The store's storage cannot be reached (an object-store endpoint down, a lost network mount). Nothing is
    known to be damaged: the message names the store and the backend's error; retry once it is back."""


class StoreWriteError(StoreError, OSError):
    """Writing an episode to the store failed (a full disk: ``errno`` ENOSPC, a lost mount, a denied file). The
    message names the store, the writer, the episode and the file; nothing committed before is touched, and
    the episode stays open (``commit`` again, or ``abort``)."""


class StoreNotFoundError(StoreError, FileNotFoundError):
    """No experience store at the URL (a ``FileNotFoundError`` too, as before)."""


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
        control_hz: the episode's own control rate, Hz, when it differs from the store's ``control_hz`` (a mixed
            fleet: Meta-World's Sawyer at 80 Hz and the SO-100 twin at 30 Hz in one store); None: the store's.
            :meth:`ExperienceStore.episode_hz` resolves it.
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
    control_hz: float | None = None


# ----------------------------------------------------------------------------- helpers

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


def _is_points(feat: dict) -> bool:
    """A point cloud: float32 ``(N, 3)`` coordinates on a ``grid_m`` grid (``observation.point_cloud``). Its
    statistics are per coordinate (x, y, z) over every point, as an image's are per channel."""
    return (feat.get("grid_m") is not None and np.dtype(feat["dtype"]) == np.float32 and len(feat["shape"]) == 2 and int(feat["shape"][-1]) == 3)


def _is_point_colors(feat: dict) -> bool:
    """The colours of a point cloud's points: uint8 ``(N, 3)`` RGB named ``["point", "rgb"]``
    (``observation.point_colors``). Its statistics are per channel over every point, as a point cloud's are per
    coordinate."""
    return (np.dtype(feat["dtype"]) == np.uint8 and len(feat["shape"]) == 2 and int(feat["shape"][-1]) == 3
            and list(feat.get("names") or [])[:1] == ["point"])


def _per_channel(feat: dict) -> bool:
    """A feature whose statistics are per channel over its rows' points (:func:`_is_points`,
    :func:`_is_point_colors`) rather than per element."""
    return _is_points(feat) or _is_point_colors(feat)


def _chunk_rows(feat: dict, chunk_bytes: int, max_chunk_rows: int) -> int:
    row_bytes = int(np.prod(feat["shape"], dtype=np.int64)) * np.dtype(feat["dtype"]).itemsize
    return int(np.clip(chunk_bytes // max(row_bytes, 1), 1, max_chunk_rows))


def seal_record(rec: dict) -> bytes:
    """A commit record as written: its JSON with ``"crc32"``, the zlib CRC-32 of the JSON of the other fields, so a
    record that still parses but changed (a flipped bit in a number, a sketch, a task name) is named on read."""
    body = json.dumps(rec)
    return json.dumps({**rec, "crc32": zlib.crc32(body.encode())}).encode()


def check_record(rec: dict, where: str) -> dict:
    """Inverse of :func:`seal_record` on a parsed record: the record without its ``"crc32"`` (records of earlier
    writers carry none and pass).

    Raises:
        StoreError: the CRC-32 does not match (``where`` names the file).
    """
    if "crc32" not in rec:
        return rec
    body = {k: v for k, v in rec.items() if k != "crc32"}
    got = zlib.crc32(json.dumps(body).encode())
    if got != rec["crc32"]:
        raise StoreError(f"commit record {where}: its CRC-32 is {got}, the record says {rec['crc32']} (changed after "
                         "it was written)")
    return body


def _pack_sketch(sketch: dict) -> dict:
    """An :func:`~experience_dict.stats.episode_sketch` as compact JSON (schema 2 commit records).

    Returns ``{"n": int, "d": D, "f64": base64 of little-endian float64 [mean (D), m2 (D), min (D), max (D),
    q (G x D, row-major)]}`` and, when the values hold NaNs, ``"nan"``: per-dimension NaN counts: exact (min / max / q hold float32 values, mean / m2 float64) and ~30x faster
    to write and read than JSON lists of floats.
    """
    flat = np.concatenate([np.asarray(sketch[f], dtype="<f8").reshape(-1) for f in (*_SKETCH_FIELDS, "q")])
    out = {"n": int(sketch["n"]), "d": len(sketch["mean"]), "f64": base64.b64encode(flat.tobytes()).decode("ascii")}
    if sketch.get("nan") is not None:   # per-dimension NaN counts (the statistics skip NaN)
        out["nan"] = [int(x) for x in sketch["nan"]]
    return out


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
        nan = np.asarray(packed["nan"], dtype=np.int64) if packed.get("nan") is not None else None
        if nan is not None and nan.shape != (d,):
            raise ValueError(f"{nan.shape} NaN counts for D={d}")
    except (KeyError, TypeError, ValueError) as e:
        raise StoreError(f"malformed statistics sketch in {where}: {type(e).__name__}: {e}") from None
    out = {"n": int(packed["n"])}
    for i, f in enumerate(_SKETCH_FIELDS):
        out[f] = v[i * d:(i + 1) * d]
    out["q"] = v[len(_SKETCH_FIELDS) * d:].reshape(g, d)
    if nan is not None:
        out["nan"] = nan
    return out


def _sketch_columns(sketch: dict, lo: int, hi: int) -> dict:
    """Dimensions ``lo:hi`` of an unpacked sketch: the sketch of the feature stored in those columns."""
    out = {"n": sketch["n"], **{f: sketch[f][lo:hi] for f in _SKETCH_FIELDS}, "q": sketch["q"][:, lo:hi]}
    if sketch.get("nan") is not None:
        out["nan"] = sketch["nan"][lo:hi]
    return out


def _image_pixels(frames: np.ndarray) -> np.ndarray:
    """The pixels image statistics use: every ``IMAGE_STRIDE``-th row and column of uint8 ``(T, H, W, C)``
    C-contiguous frames, as ``(T * ceil(H/S) * ceil(W/S), C)`` uint8 (frame-major, as ``frames[:, ::S, ::S]``).

    Gathered as ``C``-byte items (a ``V<C>`` view) rather than numpy's byte-by-byte strided copy (about 2x
    faster for 96x96x3).
    """
    t, h, w, c = frames.shape
    px = frames.reshape(t, h, w * c).view(f"V{c}")  # (T, H, W) items of C bytes
    return np.ascontiguousarray(px[:, ::IMAGE_STRIDE, ::IMAGE_STRIDE]).view(np.uint8).reshape(-1, c)


def _image_histogram(frames: np.ndarray) -> np.ndarray:
    """The ``(256, C)`` :func:`~experience_dict.stats.pixel_histogram` of the pixels image statistics use
    (:func:`_image_pixels`) of uint8 ``(T, H, W, C)`` frames. Histograms of consecutive parts of an episode sum to
    the episode's, and :func:`~experience_dict.stats.histogram_sketch` of that sum is exactly
    ``episode_sketch(frames, is_image=True)``."""
    return pixel_histogram(_image_pixels(frames))


# -- rows carried in commit records (object stores) --------------------------------------------------------------
# On filesystems without an atomic rename (object stores, memory://) a commit is one PUT: the episode's rows of the
# arrays in INLINE_ARRAYS travel inside its commit record, and the array's chunks are written only once full
# (sealed). Readers take an episode's rows from its record whenever it has them (docs/STORAGE.md).
INLINE_ARRAYS = frozenset({LOWDIM})


def place_episode_rows(out: np.ndarray, lo: int, episodes) -> np.ndarray:
    """Lay episodes' rows into ``out`` (rows ``lo .. lo + len(out) - 1`` of a shard array; rows between episodes
    stay as they are, zeros in a fresh buffer). ``episodes``: iterable of ``(start, length, get_rows)``, where
    ``get_rows()`` returns the episode's ``(length, ...)`` rows; only the episodes overlapping ``out`` are read.
    Returns ``out``."""
    hi = lo + len(out)
    for start, length, get_rows in episodes:
        if start + length <= lo or start >= hi:
            continue
        a, b = max(start, lo), min(start + length, hi)
        out[a - lo:b - lo] = get_rows()[a - start:b - start]
    return out


def _inline_codec():
    import numcodecs

    return numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.SHUFFLE)


def encode_inline_rows(rows: np.ndarray) -> dict:
    """``(T, *shape)`` rows -> the JSON form a commit record carries: ``{"shape", "dtype", "crc32", "data"}``
    (Blosc/lz4 with byte shuffle, base64; ``crc32`` of the raw bytes, zlib's)."""
    import zlib

    rows = np.ascontiguousarray(rows)
    return {"shape": list(rows.shape), "dtype": str(rows.dtype), "crc32": zlib.crc32(rows.view(np.uint8).ravel()),
            "data": base64.b64encode(_inline_codec().encode(rows)).decode("ascii")}


def decode_inline_rows(d: dict, where: str) -> np.ndarray:
    """The rows of :func:`encode_inline_rows`' output, checked against its crc32.

    Raises:
        CorruptChunkError: the data does not decode, has the wrong size or fails its checksum (``where`` names it).
    """
    import zlib

    try:
        dtype, shape = np.dtype(d["dtype"]), tuple(int(s) for s in d["shape"])
        raw = _inline_codec().decode(base64.b64decode(d["data"]))
        rows = np.frombuffer(raw, dtype=dtype).reshape(shape)
    except Exception as e:  # noqa: BLE001 - named and re-raised
        raise CorruptChunkError(f"{where}: the rows in the commit record do not decode ({type(e).__name__}: {e})") from None
    if zlib.crc32(rows.view(np.uint8).ravel()) != int(d["crc32"]):
        raise CorruptChunkError(f"{where}: the rows in the commit record fail their crc32 checksum")
    return rows
