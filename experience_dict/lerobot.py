"""LeRobotDataset v3.0 <-> experience store: export store episodes as a LeRobot dataset, import one into a store.

Command line::

    python -m experience_dict.lerobot export STORE DIR [--repo-id R] [--episodes ID ...] [--task T ...]
                                                       [--success-only | --failures-only] [--video | --no-video]
    python -m experience_dict.lerobot import DIR STORE [--repo-id R] [--episodes I ...] [--unit-id U]
                                                       [--embodiment E] [--demonstration | --no-demonstration]

Both print a JSON summary on stdout (progress bars on stderr). Datasets are written with LeRobot's own
``LeRobotDataset.create`` / ``add_frame`` / ``save_episode`` / ``finalize`` and read with
``LeRobotDataset(repo_id, root=DIR)``, offline (the CLI sets ``HF_HUB_OFFLINE=1``; nothing is downloaded).
lerobot is imported only inside these functions, so ``import experience_dict`` never imports it; without it
they raise ``ImportError`` naming the extra (``pip install 'fleetmind[lerobot]'`` / ``make install``).

Mapping (store -> dataset; import is the inverse):

===========================================  ====================================================================
store                                        LeRobotDataset v3.0
===========================================  ====================================================================
``observation.*`` float/int ``(D,)``          same key, same dtype, shape, ``names`` from the store spec
``observation.images.<camera>`` uint8 HWC    same key, dtype ``video`` (AV1, LeRobot's encoder) or ``image``
                                             (PNG, lossless), shape ``(H, W, C)``, names ``[height, width, channels]``
``action`` ``(A,)``                          ``action``
``reward`` (per step)                        ``next.reward`` ``(1,)`` float32
``progress.<k>`` (per step)                  ``progress.<k>`` ``(1,)`` float32
episode ``success``                          ``next.success`` ``(1,)`` bool per frame: export sets it on the last frame
                                             of a successful episode only (the store keeps no per-step success);
                                             import takes ``any(next.success)``, as the fleet's episode success is
                                             "succeeded at some step" (``info["success"]`` or-ed over steps)
episode ``task`` (e.g. ``push-v3``)          the frame's ``task`` string (``--task-string NAME=STRING``, else the
                                             episode's imported LeRobot string, else the store name)
``control_hz`` (Hz)                          ``fps`` (must be an integer: LeRobot stores ``int`` fps)
===========================================  ====================================================================

Export also writes ``meta/fleetmind.json`` into the dataset (format ``fleetmind-lerobot/1``: the store's spec,
progress keys, ``tasks`` {LeRobot string: store task name} and every episode's :class:`EpisodeMeta` fields), so
store -> dataset -> store restores task names, unit ids, seeds, policy versions, demo flags, success, failure
onsets and ``extra``. Import records where each episode came from in ``extra["lerobot"]`` (repo id, episode
index, task string), so dataset -> store -> dataset restores the task strings.

What a plain LeRobot dataset lacks on import (no ``meta/fleetmind.json``):

- ``reward``: ``next.reward`` if present, else NaN for every step.
- progress signals: ``progress.<k>`` columns if present; every other progress key of the store is NaN for every
  step (the store requires one float32 per key and step; NaN means "not measured", and failure analysis
  (:func:`fleet.fert.failure.progress_score`) skips non-finite signals, falling back to the last W steps). A
  new store gets the dataset's ``progress.*`` keys, or the default schema (:data:`DEFAULT_PROGRESS_KEYS`, all NaN)
  when it has none, so it stays compatible with fleet stores.
- success: ``any(next.success)``; without that column, ``--success-if-unknown`` (default: the demonstration
  flag, i.e. demonstrations count as successful).
- unit id ``-1`` (:data:`EXTERNAL_UNIT_ID`: not a fleet unit), embodiment = ``info.json``'s ``robot_type``,
  seed ``-1``, demonstration ``True`` with policy version ``-1`` (the scripted-expert / teleoperation convention);
  command-line values override these and the sidecar's.

Video decoding: LeRobot 0.6.1's default decoder is torchcodec when it imports, which then fails at decode time
without the system's FFmpeg libraries, so each episode's frames are decoded with PyAV (a lerobot dependency that
bundles FFmpeg with libdav1d for AV1) in one pass from the episode's ``from_timestamp``, matched to the frame
timestamps with the dataset's ``tolerance_s``, as LeRobot's decoders do (LeRobot's per-frame
``lerobot.datasets.video_utils.decode_video_frames_pyav`` gives the same frames). Frames come back as RGB uint8
(FFmpeg's swscale yuv420p -> rgb24); AV1 at LeRobot's default CRF 30 costs about 3 grey levels of mean absolute
error.

Import is resumable: episodes already in the writer's shard with the same (repo id, episode index, length) are
skipped, so re-running after an interruption adds only what is missing. Everything (dataset format, features vs
the store spec) is checked before the first commit. A dataset at another fps than the store's ``control_hz`` keeps
its rate in each imported episode's metadata (``EpisodeMeta.control_hz``: one store, a mixed fleet); an export
takes episodes of one rate only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from experience_dict.atomic import atomic_write_text
from experience_dict.store import (
    DEFAULT_PROGRESS_KEYS,
    EpisodeMeta,
    ExperienceStore,
    SpecMismatchError,
    StoreError,
)

log = logging.getLogger(__name__)

INSTALL_HINT = "install it with `pip install 'fleetmind[lerobot]'` (Python 3.12) or `make install`"
SIDECAR = "meta/fleetmind.json"
SIDECAR_FORMAT = "fleetmind-lerobot/1"
EXTERNAL_UNIT_ID = -1  # unit id of imported episodes that come from no fleet unit (override with --unit-id)
DEMO_POLICY_VERSION = -1  # docs/INTERFACES.md: demonstrations carry policy version -1
REWARD_KEY = "next.reward"
SUCCESS_KEY = "next.success"
_IMAGE_DTYPES = ("image", "video")
_LEROBOT_COLUMNS = ("timestamp", "frame_index", "episode_index", "index", "task_index")
_WRITER_ID_BAD = re.compile(r"[^A-Za-z0-9_.-]+")


class LeRobotInteropError(ValueError):
    """A dataset or store cannot be converted: not a LeRobotDataset v3.0, fps / feature conflicts, bad filters."""


# ----------------------------------------------------------------------------- lerobot (lazy)


class _ShortTorchcodecNote(logging.Filter):
    """LeRobot logs a ~100-line traceback (every FFmpeg version torchcodec tried) when torchcodec is installed but
    FFmpeg's shared libraries are not, then decodes videos with PyAV (``lerobot.utils.import_utils
    .get_safe_default_video_backend``). That record is replaced by one line, said once per process."""

    said = False

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if "libtorchcodec" not in msg and "Falling back to 'pyav'" not in msg:
            return True
        if not _ShortTorchcodecNote.said:
            _ShortTorchcodecNote.said = True
            log.info("LeRobot: torchcodec cannot be loaded here (FFmpeg's shared libraries are missing); video frames "
                     "decode with PyAV instead (LeRobot's fallback)")
        return False


def _lerobot_dataset_cls():
    """``lerobot.datasets.lerobot_dataset.LeRobotDataset``, imported on first use (LeRobot's torchcodec traceback
    replaced by one line: :class:`_ShortTorchcodecNote`).

    Raises:
        ImportError: lerobot is not installed; the message names the extra that installs it.
    """
    lr_log = logging.getLogger("lerobot.utils.import_utils")
    if not any(isinstance(f, _ShortTorchcodecNote) for f in lr_log.filters):
        lr_log.addFilter(_ShortTorchcodecNote())
    try:
        from lerobot.datasets.lerobot_dataset import LeRobotDataset
    except ImportError as e:
        raise ImportError(f"LeRobotDataset interop needs lerobot 0.6.1, which cannot be imported here "
                          f"({e}); {INSTALL_HINT}") from e
    return LeRobotDataset


SVTAV1_MIN_WIDTH = 25
"""Narrowest frame (pixels) the bundled SVT-AV1 encodes: at 24 px and below it raises SIGFPE and kills the process
(PyAV 15.1 / libavcodec 61.19, measured on this machine, any height)."""


def _codec_kwargs(vcodec: str) -> dict:
    """``LeRobotDataset.create``'s video codec argument: ``rgb_encoder=RGBEncoderConfig(vcodec=...)``
    (``lerobot.configs.video``, LeRobot 0.6; its other defaults are CRF 30 and GOP 2)."""
    from lerobot.configs.video import RGBEncoderConfig

    return {"rgb_encoder": RGBEncoderConfig(vcodec=vcodec)}


# ----------------------------------------------------------------------------- features


def _dtype_name(dtype: Any) -> str:
    return np.dtype(dtype).name


def _is_image_feature(feat: Mapping) -> bool:
    return np.dtype(feat["dtype"]) == np.uint8 and len(feat["shape"]) == 3


def store_to_lerobot_features(store: ExperienceStore, video: bool = True) -> dict[str, dict]:
    """LeRobot ``features`` for ``LeRobotDataset.create`` from a store's per-step features.

    Args:
        store: the store (its ``features`` give shapes and dtypes, its ``spec`` per-dimension ``names``).
        video: store images as ``video`` (AV1 mp4, lossy) instead of ``image`` (PNG in parquet, lossless).

    Returns:
        ``{key: {"dtype", "shape", "names"}}``: every ``observation.*`` key and ``action`` as in the store (images
        ``(H, W, C)`` with names ``[height, width, channels]``), ``next.reward`` and ``progress.<k>`` as ``(1,)``
        float32 and ``next.success`` as ``(1,)`` bool.
    """
    out: dict[str, dict] = {}
    for key, feat in store.features.items():
        if not (key.startswith("observation.") or key == "action"):
            continue
        shape = tuple(int(s) for s in feat["shape"])
        if _is_image_feature(feat):
            out[key] = {"dtype": "video" if video else "image", "shape": shape,
                        "names": ["height", "width", "channels"]}
            continue
        names = (store.spec.get(key) or {}).get("names")
        if not (isinstance(names, list) and len(shape) == 1 and len(names) == shape[0]):
            names = None
        out[key] = {"dtype": _dtype_name(feat["dtype"]), "shape": shape or (1,), "names": names}
    out[REWARD_KEY] = {"dtype": "float32", "shape": (1,), "names": None}
    for k in store.progress_keys:
        out[f"progress.{k}"] = {"dtype": "float32", "shape": (1,), "names": None}
    out[SUCCESS_KEY] = {"dtype": "bool", "shape": (1,), "names": None}
    return out


def is_depth_feature(ft: Mapping) -> bool:
    """Whether a LeRobot feature is a depth map (``info.is_depth_map``, or LeRobot's legacy ``video.is_depth_map``)."""
    info = ft.get("info") or {}
    return bool(info.get("is_depth_map") or info.get("video.is_depth_map"))


def decode_depth_frames(video_path: str | Path, timestamps: Sequence[float], tolerance_s: float,
                        info: Mapping | None) -> np.ndarray:
    """``(T, H, W, 1)`` float32 metres: a LeRobot depth video's frames at ``timestamps`` (seconds in the file),
    decoded and de-quantised by LeRobot's own functions (``decode_video_frames(is_depth=True)``,
    ``dequantize_depth`` with the encoder settings of the feature's ``info``).

    Raises:
        FileNotFoundError: no such video."""
    from lerobot.configs.video import encoder_config_from_video_info
    from lerobot.datasets.depth_utils import dequantize_depth
    from lerobot.datasets.video_utils import decode_video_frames

    if not os.path.isfile(str(video_path)):
        raise FileNotFoundError(f"video file {str(video_path)!r} is missing")
    q = decode_video_frames(video_path, [float(t) for t in timestamps], tolerance_s, backend="pyav", is_depth=True)
    enc = encoder_config_from_video_info(dict(info or {}))
    d = dequantize_depth(q, depth_min=enc.depth_min, depth_max=enc.depth_max, shift=enc.shift, use_log=enc.use_log,
                         output_unit="m")
    return np.ascontiguousarray(d.permute(0, 2, 3, 1).numpy(), dtype=np.float32)


def lerobot_to_store_spec(features: Mapping[str, Mapping], fps: float) -> dict:
    """A store spec (``ExperienceStore.create_or_open``'s ``spec``) from a LeRobot dataset's ``features``.

    ``observation.*`` and ``action`` keys become store features with the same dtype and shape (``(1,)`` stays
    ``(1,)``); ``image``/``video`` features become uint8 ``(H, W, C)`` (a ``[channels, height, width]`` layout is
    transposed), except depth maps (LeRobot's ``info.is_depth_map``, e.g. a RealSense's ``<camera>_depth``), which
    become float32 ``(H, W, 1)`` metres. Other columns (``next.*``, ``progress.*``, LeRobot's index columns) are not
    observations.

    Raises:
        LeRobotInteropError: no ``action`` or no observation feature, or an observation of an unsupported dtype
            (e.g. ``string``), naming the key.
    """
    spec: dict[str, Any] = {}
    for key, ft in features.items():
        if not (key.startswith("observation.") or key == "action"):
            continue
        dtype, shape, names = ft["dtype"], [int(s) for s in ft["shape"]], ft.get("names")
        if dtype in _IMAGE_DTYPES:
            if len(shape) != 3:
                raise LeRobotInteropError(f"image feature {key!r}: expected a 3-d shape, given {shape}")
            if isinstance(names, list) and names and str(names[0]).startswith("channel"):
                shape = [shape[1], shape[2], shape[0]]
            if is_depth_feature(ft):
                spec[key] = {"shape": [shape[0], shape[1], 1], "dtype": "float32",
                             "names": ["height", "width", "depth"], "unit": "m (a depth map; LeRobot's is_depth_map)"}
                continue
            spec[key] = {"shape": shape, "dtype": "uint8", "names": ["height", "width", "channel"], "unit": "rgb"}
            continue
        try:
            np_dtype = np.dtype(dtype)
        except TypeError:
            np_dtype = None
        if np_dtype is None or not (np.issubdtype(np_dtype, np.number) or np_dtype == np.bool_):
            raise LeRobotInteropError(f"feature {key!r} has dtype {dtype!r}; the store holds numeric arrays and "
                                      "uint8 images only")
        spec[key] = {"shape": shape, "dtype": np_dtype.name,
                     "names": names if isinstance(names, list) else None}
    if "action" not in spec:
        raise LeRobotInteropError(f"dataset has no 'action' feature (features: {sorted(features)})")
    if not any(k.startswith("observation.") for k in spec):
        raise LeRobotInteropError(f"dataset has no 'observation.*' feature (features: {sorted(features)})")
    spec["control_hz"] = float(fps)
    return spec


def _check_fits_store(spec: Mapping, fps: float, store: ExperienceStore, root: Path) -> None:
    """Raise :class:`LeRobotInteropError` unless the dataset's features match an existing store (a dataset at
    another fps than the store's is imported with its rate in each episode's metadata, as a mixed fleet's)."""
    if not (float(fps) > 0 and math.isfinite(float(fps))):
        raise LeRobotInteropError(f"dataset {str(root)!r} has fps {fps}; expected a positive rate")
    mine = {k: f for k, f in store.features.items() if k.startswith("observation.") or k == "action"}
    given = {k: v for k, v in spec.items() if k.startswith("observation.") or k == "action"}
    for key in sorted(set(mine) | set(given)):
        if key not in given:
            raise LeRobotInteropError(f"store {store.url!r} has feature {key!r} (shape {mine[key]['shape']}, dtype "
                                      f"{_dtype_name(mine[key]['dtype'])}); dataset {str(root)!r} lacks it")
        if key not in mine:
            raise LeRobotInteropError(f"dataset {str(root)!r} has feature {key!r} that store {store.url!r} lacks "
                                      f"(store features: {sorted(mine)})")
        a, b = mine[key], given[key]
        if list(a["shape"]) != list(b["shape"]) or np.dtype(a["dtype"]) != np.dtype(b["dtype"]):
            raise LeRobotInteropError(f"feature {key!r}: store {store.url!r} has shape {list(a['shape'])} dtype "
                                      f"{_dtype_name(a['dtype'])}, dataset {str(root)!r} has shape "
                                      f"{list(b['shape'])} dtype {_dtype_name(b['dtype'])}")


# ----------------------------------------------------------------------------- video


def decode_episode_frames(video_path: str | Path, timestamps: Sequence[float], tolerance_s: float) -> np.ndarray:
    """Decode the frames of ``video_path`` at ``timestamps`` (seconds in the file) with PyAV in one pass.

    Seeks to the key frame at or before the first timestamp, decodes forward to the last one and picks, for
    every timestamp, the decoded frame nearest in presentation time (as LeRobot's ``decode_video_frames``).

    Args:
        video_path: an mp4 of the dataset (``root / meta.get_video_file_path(ep, key)``).
        timestamps: non-empty, seconds from the start of the file (episode ``from_timestamp`` + frame timestamp).
        tolerance_s: largest allowed gap between a timestamp and its frame (LeRobot's ``tolerance_s``, 1e-4 s).

    Returns:
        ``(T, H, W, 3)`` uint8 RGB frames.

    Raises:
        FileNotFoundError: no such video. LeRobotInteropError: a timestamp has no frame within ``tolerance_s``.
    """
    import av

    video_path = str(video_path)
    if not os.path.isfile(video_path):
        raise FileNotFoundError(f"video file {video_path!r} is missing")
    ts = np.asarray(timestamps, dtype=np.float64)
    first, last = float(ts.min()), float(ts.max())

    def _decode(seek: bool) -> tuple[list[float], list[np.ndarray]]:
        times, frames = [], []
        with av.open(video_path) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            if seek and first > 0:
                container.seek(int(first / stream.time_base), stream=stream, backward=True, any_frame=False)
            for frame in container.decode(stream):
                if frame.time is None:
                    continue
                if frame.time < first - tolerance_s:
                    continue
                times.append(float(frame.time))
                frames.append(frame.to_ndarray(format="rgb24"))
                if frame.time >= last - tolerance_s:
                    break
        return times, frames

    times, frames = _decode(seek=True)
    if not times or times[0] > first + tolerance_s:  # the seek landed past the first frame: decode from the start
        times, frames = _decode(seek=False)
    if not times:
        raise LeRobotInteropError(f"{video_path!r}: no frame decoded in [{first:.4f}, {last:.4f}] s")
    loaded = np.asarray(times)
    idx = np.clip(np.searchsorted(loaded, ts), 1, len(loaded) - 1) if len(loaded) > 1 else np.zeros(len(ts), int)
    if len(loaded) > 1:
        idx = np.where(np.abs(loaded[idx - 1] - ts) <= np.abs(loaded[idx] - ts), idx - 1, idx)
    gap = np.abs(loaded[idx] - ts)
    if np.any(gap > tolerance_s):
        bad = int(np.argmax(gap > tolerance_s))
        raise LeRobotInteropError(f"{video_path!r}: no frame within {tolerance_s} s of timestamp {ts[bad]:.6f} s "
                                  f"(nearest {loaded[idx[bad]]:.6f} s)")
    return np.stack([frames[i] for i in idx])


# ----------------------------------------------------------------------------- helpers


def _parse_pairs(pairs: Iterable[str] | None, what: str) -> dict[str, str]:
    """``["KEY=VALUE", ...]`` -> ``{KEY: VALUE}``, split at the last ``=`` (a task string KEY may contain ``=``).

    Raises:
        LeRobotInteropError: an item without ``=`` or with an empty side, naming the option ``what``.
    """
    out = {}
    for p in pairs or []:
        if "=" not in p:
            raise LeRobotInteropError(f"{what}: expected KEY=VALUE, given {p!r}")
        k, v = p.rsplit("=", 1)
        if not k or not v:
            raise LeRobotInteropError(f"{what}: expected KEY=VALUE with both sides non-empty, given {p!r}")
        out[k] = v
    return out


def _default_writer_id(repo_id: str) -> str:
    return ("lerobot-" + _WRITER_ID_BAD.sub(".", repo_id).strip(".-"))[:128]


def _json_safe(x: Any) -> Any:
    return json.loads(json.dumps(x, default=lambda o: o.item() if isinstance(o, np.generic) else str(o)))


def read_sidecar(root: str | Path) -> dict | None:
    """The ``meta/fleetmind.json`` a fleetmind export wrote into a dataset, or ``None`` if there is none.

    Raises:
        LeRobotInteropError: the file exists but is not JSON of format ``fleetmind-lerobot/1``.
    """
    path = Path(root) / SIDECAR
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LeRobotInteropError(f"{str(path)!r} is not valid JSON: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != SIDECAR_FORMAT:
        raise LeRobotInteropError(f"{str(path)!r}: expected format {SIDECAR_FORMAT!r}, given "
                                  f"{meta.get('format') if isinstance(meta, dict) else type(meta).__name__!r}")
    return meta


def check_dataset_dir(root: str | Path) -> dict:
    """Check that ``root`` holds a LeRobotDataset v3.0 before loading it; returns its ``meta/info.json``.

    Raises:
        LeRobotInteropError: not a directory, no ``meta/info.json``, another ``codebase_version``, or no data
            parquet files (naming what is missing).
    """
    root = Path(root)
    if not root.is_dir():
        raise LeRobotInteropError(f"{str(root)!r} is not a directory (expected a LeRobotDataset v3.0 root)")
    info_path = root / "meta" / "info.json"
    if not info_path.is_file():
        raise LeRobotInteropError(f"{str(root)!r} is not a LeRobotDataset: {str(info_path)!r} is missing")
    try:
        info = json.loads(info_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LeRobotInteropError(f"{str(info_path)!r} is not valid JSON: {e}") from e
    version = info.get("codebase_version") if isinstance(info, dict) else None
    if version != "v3.0":
        raise LeRobotInteropError(f"{str(root)!r} has codebase_version {version!r}; only 'v3.0' is read (convert "
                                  "older datasets with lerobot's lerobot/datasets/v30/convert_dataset_v21_to_v30.py)")
    for need in ("fps", "features"):
        if need not in info:
            raise LeRobotInteropError(f"{str(info_path)!r} has no {need!r} entry")
    if not any((root / "data").glob("*/*.parquet")) or not any((root / "meta" / "episodes").glob("*/*.parquet")):
        raise LeRobotInteropError(f"{str(root)!r} has no data/*/*.parquet or meta/episodes/*/*.parquet files")
    return info


# ----------------------------------------------------------------------------- export


def export_dataset(store_url: str, out_dir: str | Path, repo_id: str | None = None,
                   episode_ids: Sequence[str] | None = None, task: str | Sequence[str] | None = None,
                   unit_id: int | Sequence[int] | None = None, success: bool | None = None,
                   is_demo: bool | None = None, video: bool = True, task_strings: Mapping[str, str] | None = None,
                   vcodec: str = "libsvtav1", progress: bool = True) -> dict:
    """Write store episodes as a new LeRobotDataset v3.0 at ``out_dir`` (LeRobot's own writer).

    Args:
        store_url: the experience store (opened read-only).
        out_dir: dataset root to create; must not exist (or be an empty directory).
        repo_id: dataset repo id recorded by LeRobot (default ``"local/<out_dir name>"``); nothing is pushed.
        episode_ids: store episode ids to export, in this order (default: every episode); the filters below
            still apply to them.
        task, unit_id, success, is_demo: filters as in :meth:`ExperienceStore.episodes` (``None`` = any).
        video: images as AV1 video (``True``, LeRobot's default, lossy) or PNG images (``False``, lossless).
        task_strings: ``{store task name: LeRobot task string}`` (e.g. a language instruction); other tasks use
            the episode's imported LeRobot string (``extra["lerobot"]["task"]``), else the store name.
        vcodec: LeRobot's video codec (``libsvtav1``, ``h264``, ...).
        progress: show a tqdm bar (stderr).

    Returns:
        summary ``{"dataset", "repo_id", "store", "episodes", "frames", "fps", "video", "tasks": {string: name},
        "features": [keys], "seconds"}``.

    Raises:
        ImportError: lerobot is missing. FileNotFoundError: no store. FileExistsError: ``out_dir`` is not empty.
        KeyError: an unknown episode id. LeRobotInteropError: no episode selected, selected episodes recorded at
            different rates (a mixed fleet's store: export one rate at a time), non-integer ``control_hz``
            (LeRobot's fps is an int) or a task string mapped from two store task names.
        On any error after the dataset was created, ``out_dir`` is removed again (no half-written dataset).
    """
    t0 = time.time()
    out_dir = Path(out_dir)
    store = ExperienceStore.open(store_url)
    if episode_ids:
        eps = [store.episode(e) for e in episode_ids]
        keep = {e.episode_id for e in store.episodes(task=task, unit_id=unit_id, success=success, is_demo=is_demo)}
        eps = [e for e in eps if e.episode_id in keep]
    else:
        eps = store.episodes(task=task, unit_id=unit_id, success=success, is_demo=is_demo)
    if not eps:
        raise LeRobotInteropError(f"no episode of store {store.url!r} ({len(store)} episodes) matches the selection "
                                  f"(episodes={list(episode_ids or [])}, task={task}, unit_id={unit_id}, "
                                  f"success={success}, is_demo={is_demo})")
    rates = sorted({store.episode_hz(e) for e in eps})
    if len(rates) > 1:   # a mixed fleet's store (e.g. Meta-World at 80 Hz, the SO-100 twin at 30 Hz)
        raise LeRobotInteropError(f"the selected episodes were recorded at {rates} Hz; a LeRobotDataset has one fps: "
                                  "export one rate at a time (select by task or by episodes)")
    fps = rates[0]
    if fps != round(fps) or fps <= 0:
        raise LeRobotInteropError(f"store control_hz {fps} is not a positive integer; LeRobotDataset stores an "
                                  "integer fps")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{str(out_dir)!r} exists and is not an empty directory; choose a new dataset root")
    task_strings = dict(task_strings or {})
    strings = {}
    for e in eps:
        lr = e.extra.get("lerobot") if isinstance(e.extra, dict) else None
        strings[e.episode_id] = task_strings.get(e.task) or (lr.get("task") if isinstance(lr, dict) else None) or e.task
    tasks: dict[str, str] = {}
    for e in eps:
        s = strings[e.episode_id]
        if tasks.setdefault(s, e.task) != e.task:
            raise LeRobotInteropError(f"task string {s!r} would stand for store tasks {tasks[s]!r} and {e.task!r}; "
                                      "give distinct strings with task_strings / --task-string NAME=STRING")
    features = store_to_lerobot_features(store, video=video)
    if video and "svtav1" in str(vcodec):
        narrow = {k: f["shape"] for k, f in features.items() if f.get("dtype") == "video"
                  and f["shape"][1] < SVTAV1_MIN_WIDTH}
        if narrow:   # SVT-AV1 dies with SIGFPE under them (measured: 24 px wide crashes, 25 px encodes)
            raise LeRobotInteropError(f"camera images {narrow} are narrower than SVT-AV1 encodes "
                                      f"({SVTAV1_MIN_WIDTH} px; below it the encoder crashes the process): export "
                                      "with vcodec='h264' (--vcodec h264) or as images (video=False, --no-video)")
    obs_keys = [k for k in store.features if k.startswith("observation.")]
    progress_keys = list(store.progress_keys)
    embodiments = sorted({e.embodiment for e in eps})
    repo_id = repo_id or f"local/{out_dir.name}"

    LeRobotDataset = _lerobot_dataset_cls()
    from tqdm.auto import tqdm

    if out_dir.is_dir():
        out_dir.rmdir()  # empty: LeRobot creates the root itself
    ds = LeRobotDataset.create(repo_id=repo_id, fps=round(fps), features=features, root=out_dir,
                               robot_type=embodiments[0] if len(embodiments) == 1 else None, use_videos=video,
                               **_codec_kwargs(vcodec))
    frames = 0
    try:
        bar = tqdm(eps, desc="export", unit="ep", disable=not progress)
        for e in bar:
            data = store.load_episode(e.episode_id)
            s = strings[e.episode_id]
            T = e.length
            for t in range(T):
                frame = {k: data[k][t] if data[k].ndim > 1 else data[k][t:t + 1] for k in obs_keys}
                frame["action"] = data["action"][t]
                frame[REWARD_KEY] = data["reward"][t:t + 1].astype(np.float32)
                for k in progress_keys:
                    frame[f"progress.{k}"] = data[f"progress.{k}"][t:t + 1].astype(np.float32)
                frame[SUCCESS_KEY] = np.array([bool(e.success) and t == T - 1])
                frame["task"] = s
                ds.add_frame(frame)
            ds.save_episode()
            frames += T
            bar.set_postfix(frames=frames, refresh=False)
        ds.finalize()
        images_dir = out_dir / "images"  # LeRobot's temporary PNG folders, empty once encoded / embedded
        if images_dir.is_dir() and not any(p.is_file() for p in images_dir.rglob("*")):
            shutil.rmtree(images_dir)
        sidecar = {
            "format": SIDECAR_FORMAT, "created": time.time(), "source": {"store": store.url},
            "control_hz": fps, "spec": store.spec, "progress_keys": progress_keys,
            "features": {**{k: k for k in obs_keys}, "action": "action", "reward": REWARD_KEY,
                         **{f"progress.{k}": f"progress.{k}" for k in progress_keys}, "success": SUCCESS_KEY},
            "tasks": tasks,
            "episodes": [{"episode_index": i, **{f.name: getattr(e, f.name) for f in dataclasses.fields(EpisodeMeta)
                                                 if f.name not in ("shard", "start")}}
                         for i, e in enumerate(eps)],
        }
        atomic_write_text(out_dir / SIDECAR, json.dumps(_json_safe(sidecar), indent=1))
    except BaseException:
        try:
            ds.finalize()
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    return {"dataset": str(out_dir), "repo_id": repo_id, "store": store.url, "episodes": len(eps), "frames": frames,
            "fps": round(fps), "video": bool(video), "tasks": tasks, "features": sorted(features),
            "seconds": round(time.time() - t0, 2)}


# ----------------------------------------------------------------------------- import


def import_dataset(root: str | Path, store_url: str, repo_id: str | None = None,
                   episodes: Sequence[int] | None = None, writer_id: str | None = None, unit_id: int | None = None,
                   embodiment: str | None = None, demonstration: bool | None = None,
                   policy_version: int | None = None, task_names: Mapping[str, str] | None = None,
                   success_if_unknown: bool | None = None, progress: bool = True) -> dict:
    """Append the episodes of a LeRobotDataset v3.0 to a store (created from the dataset's features if missing).

    Args:
        root: dataset root (read with ``LeRobotDataset(repo_id, root=root)``; offline).
        store_url: the store to append to; created with the dataset's features and ``control_hz = fps`` if it
            does not exist (with the exported spec when ``meta/fleetmind.json`` has one).
        repo_id: the dataset's repo id (default ``"local/<root name>"``); recorded in ``extra["lerobot"]``.
        episodes: dataset episode indices to import (default: all), in dataset order.
        writer_id: store shard to write (default ``"lerobot-<repo id>"``, ``/`` -> ``.``).
        unit_id, embodiment, demonstration, policy_version: episode metadata; ``None`` takes the value from
            ``meta/fleetmind.json`` if present, else ``-1`` / ``info.json`` ``robot_type`` (``"unknown"``) /
            ``True`` / ``-1`` for demonstrations and ``0`` otherwise.
        task_names: ``{LeRobot task string: store task name}``; other strings use the sidecar's mapping, else the
            string itself.
        success_if_unknown: success of episodes without ``next.success`` and sidecar (default: the demo flag).
        progress: show a tqdm bar (stderr).

    Returns:
        summary ``{"store", "dataset", "repo_id", "writer_id", "episodes" (imported), "frames", "episode_ids",
        "skipped" (dataset indices already imported), "tasks": {string: name}, "created_store", "seconds"}``.

    Raises:
        ImportError: lerobot is missing. LeRobotInteropError: ``root`` is not a loadable LeRobotDataset v3.0, an
            unknown episode index, features differ from the store
            spec, or the data is inconsistent (all checked before the first commit, except per-episode decoding
            errors; episodes committed before such an error stay, and a re-run skips them).
        WriterBusyError: another process holds ``writer_id``.
    """
    t0 = time.time()
    root = Path(root)
    info = check_dataset_dir(root)
    sidecar = read_sidecar(root)
    repo_id = repo_id or f"local/{root.resolve().name}"
    LeRobotDataset = _lerobot_dataset_cls()
    try:
        ds = LeRobotDataset(repo_id, root=root, video_backend="pyav")
    except Exception as e:
        raise LeRobotInteropError(f"{str(root)!r} could not be loaded as a LeRobotDataset v3.0 "
                                  f"({type(e).__name__}: {e})") from e
    meta = ds.meta
    fps = float(meta.fps)
    features = meta.features
    spec = lerobot_to_store_spec(features, fps)
    obs_keys = [k for k in spec if k.startswith("observation.")]
    image_keys = [k for k in obs_keys if features[k]["dtype"] in _IMAGE_DTYPES]
    n_eps = meta.total_episodes
    sel = list(range(n_eps)) if episodes is None else [int(i) for i in episodes]
    bad = [i for i in sel if not 0 <= i < n_eps]
    if bad:
        raise LeRobotInteropError(f"episode index {bad[0]} is not in dataset {str(root)!r} (0..{n_eps - 1})")

    side_eps = {int(x["episode_index"]): x for x in (sidecar or {}).get("episodes", [])}
    side_tasks = dict((sidecar or {}).get("tasks", {}))
    task_names = dict(task_names or {})

    # the store: check an existing one against the dataset before anything is written
    try:
        existing = ExperienceStore.open(store_url)
    except FileNotFoundError:
        existing = None
    if existing is not None:
        _check_fits_store(spec, fps, existing, root)
        store_spec, hz, pkeys = existing.spec, existing.control_hz, list(existing.progress_keys)
    else:
        side_spec = (sidecar or {}).get("spec")
        if isinstance(side_spec, dict):  # the exported spec (names, units, action bounds) if it still fits
            side_spec_obs = {k: v for k, v in side_spec.items() if k.startswith("observation.") or k == "action"}
            mine = {k: v for k, v in spec.items() if k.startswith("observation.") or k == "action"}
            if side_spec_obs.keys() == mine.keys() and all(
                    list(side_spec_obs[k]["shape"]) == mine[k]["shape"]
                    and np.dtype(side_spec_obs[k]["dtype"]) == np.dtype(mine[k]["dtype"]) for k in mine):
                spec = {**side_spec, "control_hz": fps}
        store_spec, hz = spec, fps
        pkeys = (sidecar or {}).get("progress_keys")
        if pkeys is None:
            pkeys = [k[len("progress."):] for k in features if k.startswith("progress.")] or list(DEFAULT_PROGRESS_KEYS)
    try:
        store = ExperienceStore.create_or_open(store_url, spec=store_spec, control_hz=hz, progress_keys=pkeys)
    except SpecMismatchError as e:
        raise LeRobotInteropError(f"dataset {str(root)!r} does not fit store {store_url!r}: {e}") from e
    pkeys = list(store.progress_keys)
    missing_progress = [k for k in pkeys if f"progress.{k}" not in features]
    unused = sorted(k for k in features if k not in spec and k not in _LEROBOT_COLUMNS and k != REWARD_KEY
                    and k != SUCCESS_KEY and k[len("progress."):] not in pkeys)
    if unused:
        log.warning("dataset %s: columns %s have no place in the store and are not imported", root, unused)

    writer_id = writer_id or _default_writer_id(repo_id)
    done = {}
    for e in store.episodes(shard=writer_id):
        lr = e.extra.get("lerobot") if isinstance(e.extra, dict) else None
        if isinstance(lr, dict) and lr.get("repo_id") == repo_id:
            done[(int(lr.get("episode_index", -1)), e.length)] = e.episode_id

    from tqdm.auto import tqdm

    hf = ds.hf_dataset.with_format("numpy")
    ep_table = meta.episodes
    task_of_index = {int(i): str(t) for t, i in zip(meta.tasks.index, meta.tasks["task_index"])}
    robot_type = info.get("robot_type") or "unknown"
    imported, skipped, frames, created = [], [], 0, {}
    onsets: dict[str, int] = {}
    # the source store's episode ids -> this store's, so a retry's ``retry_of`` names its episode here; an episode
    # is imported after the one it retries (a chain in dataset order or not)
    src_id = {i: str(side_eps[i]["episode_id"]) for i in side_eps if side_eps[i].get("episode_id") is not None}
    new_id = {src_id[i]: eid for (i, _), eid in done.items() if i in src_id}
    by_src = {v: k for k, v in src_id.items()}

    def depth(i: int, seen: int = 0) -> int:
        parent = ((side_eps.get(i) or {}).get("extra") or {}).get("retry_of")
        return 0 if parent not in by_src or seen > len(sel) else 1 + depth(by_src[parent], seen + 1)

    position = {i: k for k, i in enumerate(sel)}
    sel = sorted(sel, key=lambda i: (depth(i), position[i]))
    writer = store.writer(writer_id)
    try:
        bar = tqdm(sel, desc="import", unit="ep", disable=not progress)
        for ep in bar:
            row = ep_table[ep]
            lo, hi = int(row["dataset_from_index"]), int(row["dataset_to_index"])
            T = hi - lo
            if (ep, T) in done:
                skipped.append(ep)
                continue
            cols = hf[lo:hi]
            if (len(cols["episode_index"]) != T or np.any(cols["episode_index"] != ep)
                    or np.any(cols["frame_index"] != np.arange(T))):
                raise LeRobotInteropError(f"dataset {str(root)!r}: rows {lo}..{hi - 1} are not episode {ep}'s frames "
                                          "0..T-1 in order")
            steps = {}
            for k in obs_keys + ["action"]:
                if k in image_keys:
                    continue
                steps[k] = np.ascontiguousarray(np.asarray(cols[k]).reshape(T, *spec[k]["shape"]),
                                                dtype=spec[k]["dtype"])
            for k in image_keys:
                if spec[k]["dtype"] == "float32":   # a depth map: metres, de-quantised as LeRobot does
                    if features[k]["dtype"] == "video":
                        from_ts = float(row[f"videos/{k}/from_timestamp"])
                        steps[k] = decode_depth_frames(root / meta.get_video_file_path(ep, k),
                                                       from_ts + np.asarray(cols["timestamp"], np.float64),
                                                       ds.tolerance_s, features[k].get("info"))
                    else:
                        steps[k] = np.asarray(cols[k], np.float32).reshape(T, *spec[k]["shape"])
                    continue
                if features[k]["dtype"] == "video":
                    from_ts = float(row[f"videos/{k}/from_timestamp"])
                    path = root / meta.get_video_file_path(ep, k)
                    imgs = decode_episode_frames(path, from_ts + np.asarray(cols["timestamp"], np.float64),
                                                 ds.tolerance_s)
                else:
                    imgs = np.asarray(cols[k])
                if imgs.shape != (T, *spec[k]["shape"]) or imgs.dtype != np.uint8:
                    raise LeRobotInteropError(f"episode {ep} {k!r}: decoded images have shape {imgs.shape} dtype "
                                              f"{imgs.dtype}, expected {(T, *spec[k]['shape'])} uint8")
                steps[k] = imgs
            reward = (np.asarray(cols[REWARD_KEY], np.float32).reshape(T) if REWARD_KEY in features
                      else np.full(T, np.nan, np.float32))
            prog = {k: (np.asarray(cols[f"progress.{k}"], np.float32).reshape(T) if k not in missing_progress
                        else np.full(T, np.nan, np.float32)) for k in pkeys}
            task_idx = np.asarray(cols["task_index"]).reshape(T)
            strings = [task_of_index[int(i)] for i in dict.fromkeys(task_idx.tolist())]
            side = side_eps.get(ep)
            if side is not None and int(side.get("length", -1)) != T:
                log.warning("dataset %s episode %d: %s says length %s, the data has %d; ignoring its metadata",
                            root, ep, SIDECAR, side.get("length"), T)
                side = None
            side = side or {}
            s0 = strings[0]
            name = task_names.get(s0) or side.get("task") or side_tasks.get(s0) or s0
            created[s0] = name
            demo = demonstration if demonstration is not None else bool(side.get("is_demo", True))
            if side.get("success") is not None:
                ok = bool(side["success"])
            elif SUCCESS_KEY in features:
                ok = bool(np.any(np.asarray(cols[SUCCESS_KEY])))
            else:
                ok = demo if success_if_unknown is None else bool(success_if_unknown)
            pv = policy_version if policy_version is not None else side.get(
                "policy_version", DEMO_POLICY_VERSION if demo else 0)
            extra = dict(side.get("extra") or {})
            extra["lerobot"] = {"repo_id": repo_id, "root": str(root.resolve()), "episode_index": ep, "task": s0,
                                "fps": int(meta.fps), **({"tasks": strings} if len(strings) > 1 else {}),
                                **({"source_episode_id": side["episode_id"]} if "episode_id" in side else {})}
            if extra.get("retry_of") is not None:   # the retried episode's id in this store, or no link
                extra["lerobot"]["source_retry_of"] = extra["retry_of"]
                extra["retry_of"] = new_id.get(str(extra["retry_of"]))
            writer.begin_episode(unit_id=unit_id if unit_id is not None else side.get("unit_id", EXTERNAL_UNIT_ID),
                                 embodiment=embodiment or side.get("embodiment") or robot_type, task=name,
                                 policy_version=pv, seed=side.get("seed", -1), is_demo=demo,
                                 start_time=side.get("start_time"), extra=extra, control_hz=float(meta.fps))
            for t in range(T):
                writer.add_step({k: steps[k][t] for k in obs_keys}, steps["action"][t], float(reward[t]),
                                {k: float(prog[k][t]) for k in pkeys})
            ep_id = writer.commit(success=ok, termination=side.get("termination"))
            if "episode_id" in side:
                new_id[str(side["episode_id"])] = ep_id
            if side.get("failure_onset") is not None:
                onsets[ep_id] = int(side["failure_onset"])
            imported.append(ep_id)
            frames += T
            bar.set_postfix(frames=frames, refresh=False)
    finally:
        writer.close()
    if onsets:
        store.refresh()
        for ep_id, step in onsets.items():
            store.set_failure_onset(ep_id, step)
    return {"store": store.url, "dataset": str(root), "repo_id": repo_id, "writer_id": writer_id,
            "episodes": len(imported), "frames": frames, "episode_ids": imported, "skipped": skipped,
            "tasks": created, "created_store": existing is None, "progress_filled_nan": missing_progress,
            "seconds": round(time.time() - t0, 2)}


# ----------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 a clear error printed on stderr)."""
    ap = argparse.ArgumentParser(prog="python -m experience_dict.lerobot",
                                 description="LeRobotDataset v3.0 export / import for the fleet's experience store.")
    sub = ap.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="store episodes -> a new LeRobotDataset v3.0")
    ex.add_argument("store", help="experience store URL (local directory or fsspec URL)")
    ex.add_argument("dir", help="dataset root to create (must not exist or be empty)")
    ex.add_argument("--repo-id", default=None, help="dataset repo id (default: local/<DIR name>); nothing is pushed")
    ex.add_argument("--episodes", nargs="+", default=None, metavar="ID", help="store episode ids (default: all)")
    ex.add_argument("--task", nargs="+", default=None, help="only these store task names")
    ex.add_argument("--unit-id", nargs="+", type=int, default=None, help="only these robot units")
    ok = ex.add_mutually_exclusive_group()
    ok.add_argument("--success-only", action="store_true", help="only successful episodes")
    ok.add_argument("--failures-only", action="store_true", help="only failed episodes")
    demo = ex.add_mutually_exclusive_group()
    demo.add_argument("--demos-only", action="store_true", help="only demonstrations")
    demo.add_argument("--no-demos", action="store_true", help="no demonstrations")
    ex.add_argument("--video", action=argparse.BooleanOptionalAction, default=True,
                    help="images as AV1 video (default) or, with --no-video, lossless PNG images")
    ex.add_argument("--vcodec", default="libsvtav1", help="LeRobot video codec (default libsvtav1)")
    ex.add_argument("--task-string", action="append", default=None, metavar="NAME=STRING",
                    help="LeRobot task string (e.g. an instruction) for store task NAME; repeatable")
    im = sub.add_parser("import", help="a LeRobotDataset v3.0 -> store episodes (store created if missing)")
    im.add_argument("dir", help="dataset root (LeRobotDataset v3.0)")
    im.add_argument("store", help="experience store URL (created from the dataset's features if missing)")
    im.add_argument("--repo-id", default=None, help="dataset repo id (default: local/<DIR name>)")
    im.add_argument("--episodes", nargs="+", type=int, default=None, metavar="INDEX",
                    help="dataset episode indices (default: all)")
    im.add_argument("--writer-id", default=None, help="store shard to write (default: lerobot-<repo id>)")
    im.add_argument("--unit-id", type=int, default=None, help=f"robot unit id (default: {EXTERNAL_UNIT_ID})")
    im.add_argument("--embodiment", default=None, help="robot type (default: the dataset's robot_type)")
    im.add_argument("--demonstration", action=argparse.BooleanOptionalAction, default=None,
                    help="mark episodes as demonstrations (default: yes)")
    im.add_argument("--policy-version", type=int, default=None,
                    help="policy version (default: -1 for demonstrations, else 0)")
    im.add_argument("--task-name", action="append", default=None, metavar="STRING=NAME",
                    help="store task name for LeRobot task STRING; repeatable")
    im.add_argument("--success-if-unknown", action=argparse.BooleanOptionalAction, default=None,
                    help="success of episodes without next.success (default: the demonstration flag)")
    for p in (ex, im):
        p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read the local root only; never reach the hub
    os.environ.setdefault("SVT_LOG", "2")  # SVT-AV1 encoder: warnings and errors only (its info goes to stderr)
    try:
        if args.command == "export":
            out = export_dataset(
                args.store, args.dir, repo_id=args.repo_id, episode_ids=args.episodes, task=args.task,
                unit_id=args.unit_id, success=True if args.success_only else False if args.failures_only else None,
                is_demo=True if args.demos_only else False if args.no_demos else None, video=args.video,
                task_strings=_parse_pairs(args.task_string, "--task-string"), vcodec=args.vcodec,
                progress=not args.quiet)
        else:
            out = import_dataset(
                args.dir, args.store, repo_id=args.repo_id, episodes=args.episodes, writer_id=args.writer_id,
                unit_id=args.unit_id, embodiment=args.embodiment, demonstration=args.demonstration,
                policy_version=args.policy_version, task_names=_parse_pairs(args.task_name, "--task-name"),
                success_if_unknown=args.success_if_unknown, progress=not args.quiet)
    except (LeRobotInteropError, StoreError, ImportError, FileNotFoundError, FileExistsError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"error: {msg}", file=sys.stderr)
        return 1
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
