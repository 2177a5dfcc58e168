"""Recording benchmark: fleetmind's experience store against LeRobot's own recording (LeRobotDataset v3.0 with
video) on the same Meta-World episodes, side by side in one process (JSON + a short table).

    python scripts/bench_recording.py              # 20 push-v3 episodes x 150 steps, 96x96 corner camera
                                                   # -> outputs/bench/bench_recording.json
    python scripts/bench_recording.py --episodes 2 --steps 20 --image-size 64 --windows 32 --out /tmp/r.json

Episodes: ``--episodes`` real Meta-World expert episodes (``sim.make_env`` + ``sim.make_expert``, the
``--task`` env reset with seeds 0..N-1, ``--steps`` steps each; ``scripts.bench_store.sim_episodes``), each step
an ``--image-size`` RGB render of the ``corner`` camera (uint8), ``observation.state`` (4 float32),
``observation.environment_state`` (17 float32), the expert's action (4 float32), the env's reward and its 6
progress signals. They are generated once, held in memory, and both writers record the identical arrays.

Write (wall seconds, ``time.perf_counter``; CPU seconds of the whole process, all threads, beside them):

- **store**: ``ExperienceStore.create_or_open`` (the store's default codec settings, ``StoreConfig``: each frame
  minus the one before then Blosc/zstd level 1 on images, 1 MiB chunks; ``--image-codec`` / ``--image-clevel`` /
  ``--chunk-bytes`` to try others) and its
  ``EpisodeWriter``: ``begin_episode`` + ``add_step`` x T + ``commit`` per episode
  (``scripts.bench_store.write_store_episode``), ``close`` at the end.
- **LeRobot**: ``LeRobotDataset.create`` (v3.0; the camera as dtype ``video``, ``--vcodec``, LeRobot's default
  CRF 30 / GOP 2 via ``RGBEncoderConfig``; ``image_writer_threads=--image-writer-threads``, by default
  ``lerobot-record``'s 4 per camera), ``add_frame`` x T + ``save_episode`` per episode (PNG frames, then the
  episode's video encoded and its parquet rows and statistics written), ``finalize`` at the end. Features come
  from the store through ``experience_dict.lerobot.store_to_lerobot_features`` (the export's own mapping).

Episode by episode the two sides alternate which goes first (so load from other jobs on the machine hits both
alike). Reported: total seconds (setup + every episode + close/finalize), the per-episode median (ms) and the
paired per-episode ratio (median over episodes of LeRobot's time over the store's, with a bootstrap interval).

Disk: bytes of each result directory after close/finalize, as ``du`` counts them (allocated blocks, bytes) and
as ``du --apparent-size`` does (file sizes, bytes), with a breakdown per top-level folder.

Read: random training windows (anchor steps drawn uniformly with replacement, the same seed for both): the
observation (state and image) at steps t-``history``+1..t and the action chunk t..t+``horizon``-1, through a
torch ``DataLoader`` (batch ``--batch-size``, ``--workers`` worker processes, per-window items +
``default_collate``, one warm-up batch untimed), one torch thread. Store: ``experience_dict.sampler.WindowDataset``
with its decoded-chunk cache (default 1 GB) and with the cache off (``scripts.bench_store.bench_sampling``);
LeRobot: ``LeRobotDataset(repo_id, root=..., delta_timestamps=..., video_backend="pyav", return_uint8=True)``
(uint8 frames, as LeRobot's training factory asks for). Windows per second.

Checks (in the JSON): both results read back the same actions, states and rewards for every episode (bit for
bit), whether the store's images are the recorded ones bit for bit (the lossless codecs; ``--image-codec h264``:
the mean absolute error, grey levels), and the mean absolute error of LeRobot's decoded
video frames against the recorded ones (grey levels, episode 0).

Figures are ratios store / LeRobot measured in this process: write seconds (target <= 1), bytes on disk
(target <= 1), windows per second (higher is better). Everything is offline (``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from experience_dict.store import ExperienceStore
from experience_dict.store.config import StoreConfig
from scripts.bench_store import bench_sampling, paired_ratio_stats, sim_episodes, timed, write_store_episode

REPO_ID = "local/bench_recording"
CAMERA = "observation.images.corner"


def dir_bytes(root: str | Path) -> dict:
    """Disk use of the tree under ``root``, files and folders (symlinks not followed).

    Returns:
        ``{"du_bytes": allocated bytes (st_blocks x 512, what ``du -sB1`` prints), "apparent_bytes": sizes in
        bytes (``du -sb``), "files": number of files, "by_top": {top-level entry: allocated bytes}}``.
    """
    root = Path(root)
    total = apparent = files = 0
    by_top: dict[str, int] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            alloc = st.st_blocks * 512
            total += alloc
            apparent += st.st_size
            files += name in filenames
            top = p.relative_to(root).parts[0]
            by_top[top] = by_top.get(top, 0) + alloc
    st = root.lstat()
    return {"du_bytes": total + st.st_blocks * 512, "apparent_bytes": apparent + st.st_size, "files": files,
            "by_top": by_top}


def lerobot_frame(obs: dict, action: np.ndarray, reward: float, progress: dict, success: bool, task: str) -> dict:
    """One ``add_frame`` dict in the layout of ``experience_dict.lerobot.export_dataset``: the observation keys
    as they are (scalars as ``(1,)``), ``action``, ``next.reward`` / ``progress.<k>`` as ``(1,)`` float32,
    ``next.success`` as ``(1,)`` bool, and the ``task`` string."""
    from experience_dict.lerobot import REWARD_KEY, SUCCESS_KEY

    frame = {k: v if np.ndim(v) > 0 else np.asarray([v]) for k, v in obs.items()}
    frame["action"] = action
    frame[REWARD_KEY] = np.asarray([reward], np.float32)
    for k, v in progress.items():
        frame[f"progress.{k}"] = np.asarray([v], np.float32)
    frame[SUCCESS_KEY] = np.asarray([success])
    frame["task"] = task
    return frame


def bench_write(spec: dict, eps: list[dict], root: Path, args: argparse.Namespace) -> dict:
    """Record every episode with both writers, alternating episode by episode; see the module docstring.

    Returns ``{"store": {...}, "lerobot": {...}, "paired": ...}``, each side with ``total_s`` (wall seconds,
    setup + episodes + close), ``setup_s``, ``close_s``, ``episode_ms_median``, ``episodes_s`` (sum of episode
    wall seconds), ``cpu_s`` (process CPU seconds over the side's timed blocks), ``steps_per_s``, and the
    result's ``url`` / ``root``; ``paired``: :func:`scripts.bench_store.paired_ratio_stats` of LeRobot's episode
    times over the store's (above 1: the store is faster).
    """
    from experience_dict.lerobot import _codec_kwargs, _lerobot_dataset_cls, store_to_lerobot_features

    LeRobotDataset = _lerobot_dataset_cls()
    scfg = StoreConfig()
    clevel = scfg.image_clevel if args.image_clevel is None else args.image_clevel
    chunk_bytes = scfg.chunk_bytes if args.chunk_bytes is None else args.chunk_bytes
    codec = scfg.image_codec if args.image_codec is None else args.image_codec
    crf = scfg.image_crf if args.image_crf is None else args.image_crf
    url, lr_root = str(root / "store"), root / "lerobot"
    wall = {"store": [], "lerobot": []}
    cpu = {"store": [], "lerobot": []}
    setup, close = {"store": [], "lerobot": []}, {"store": [], "lerobot": []}
    pkeys = list(eps[0]["progress"][0])
    with timed(setup["store"], cpu["store"]):
        store = ExperienceStore.create_or_open(url, spec, control_hz=spec["control_hz"], progress_keys=pkeys,
                                              chunk_bytes=chunk_bytes, max_chunk_rows=scfg.max_chunk_rows,
                                              image_clevel=clevel, image_codec=codec, image_crf=crf)
        writer = store.writer("bench-0")
    features = store_to_lerobot_features(store, video=True)  # the export's mapping (untimed: a lookup)
    fps = float(spec["control_hz"])
    if fps != round(fps):
        raise ValueError(f"LeRobotDataset stores an integer fps; control_hz is {fps}")
    with timed(setup["lerobot"], cpu["lerobot"]):
        ds = LeRobotDataset.create(repo_id=REPO_ID, fps=round(fps), features=features, root=lr_root,
                                   robot_type="sawyer", use_videos=True,
                                   image_writer_threads=args.image_writer_threads, **_codec_kwargs(args.vcodec))

    def store_side(e: int, ep: dict) -> None:
        with timed(wall["store"], cpu["store"]):
            write_store_episode(writer, ep["obs"], ep["actions"], ep["rewards"], ep["progress"], seed=e,
                                task=args.task, success=ep["success"])

    def lerobot_side(e: int, ep: dict) -> None:
        T = len(ep["obs"])
        with timed(wall["lerobot"], cpu["lerobot"]):
            for t in range(T):
                ds.add_frame(lerobot_frame(ep["obs"][t], ep["actions"][t], float(ep["rewards"][t]),
                                           ep["progress"][t], ep["success"] and t == T - 1, args.task))
            ds.save_episode()

    for e, ep in enumerate(tqdm(eps, desc="record (store | LeRobot)", unit="ep")):
        sides = (store_side, lerobot_side) if e % 2 == 0 else (lerobot_side, store_side)
        for side in sides:
            side(e, ep)
    with timed(close["store"], cpu["store"]):
        writer.close()
    with timed(close["lerobot"], cpu["lerobot"]):
        ds.finalize()
    steps = sum(len(ep["obs"]) for ep in eps)
    out = {}
    for side in ("store", "lerobot"):
        t = wall[side]
        total = setup[side][0] + sum(t) + close[side][0]
        out[side] = {"total_s": total, "setup_s": setup[side][0], "episodes_s": sum(t), "close_s": close[side][0],
                     "episode_ms_median": 1e3 * float(np.median(t)), "cpu_s": sum(cpu[side]),
                     "steps_per_s": steps / total, "episode_s": t}
    out["store"].update(url=url, image_clevel=clevel, chunk_bytes=chunk_bytes, image_codec=codec, image_crf=crf)
    out["lerobot"].update(root=str(lr_root), vcodec=args.vcodec, image_writer_threads=args.image_writer_threads)
    out["paired_lerobot_over_store"] = paired_ratio_stats(wall["lerobot"], wall["store"])
    return out


def read_windows_lerobot(root: Path, args: argparse.Namespace, fps: float) -> dict:
    """Windows per second of ``LeRobotDataset`` indexing (``delta_timestamps`` windows, PyAV video decoding,
    uint8 frames) through a ``DataLoader`` like the store's; ``open_s``: seconds to open the dataset."""
    import torch

    from experience_dict.lerobot import _lerobot_dataset_cls

    obs_dt = [o / fps for o in range(-args.history + 1, 1)]
    delta = {"observation.state": obs_dt, CAMERA: obs_dt, "action": [k / fps for k in range(args.horizon)]}
    t0 = time.perf_counter()
    ds = _lerobot_dataset_cls()(REPO_ID, root=root, delta_timestamps=delta, video_backend="pyav",
                                return_uint8=True)
    open_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    sampler = torch.utils.data.RandomSampler(ds, replacement=True, num_samples=args.windows + args.batch_size,
                                             generator=gen)
    loader = torch.utils.data.DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers)
    it = iter(loader)
    next(it)  # warm-up: worker start-up, first file opens
    n, t0 = 0, time.perf_counter()
    for batch in tqdm(it, desc="read LeRobot", unit="batch", total=-(-args.windows // args.batch_size)):
        n += len(batch["action"])
    dt = time.perf_counter() - t0
    return {"windows": n, "windows_per_s": n / dt, "open_s": open_s, "frames": len(ds),
            "loader": "default_collate", "workers": args.workers}


def bench_read(url: str, lr_root: Path, args: argparse.Namespace, fps: float) -> dict:
    """Windows per second of both results, ``--read-repeats`` rounds alternating the side that goes first;
    the median of each side's rounds is reported (with every round's figure)."""
    import torch

    torch.set_num_threads(1)
    obs_offsets = list(range(-args.history + 1, 1))
    windows = {"observation.state": ("observation.state", obs_offsets), CAMERA: (CAMERA, obs_offsets),
               "action": ("action", list(range(args.horizon)))}
    cfg = {"windows": args.windows, "batch_size": args.batch_size}
    runs: dict[str, list[dict]] = {"store": [], "store_cache_off": [], "lerobot": []}

    def store(cache: int) -> dict:
        t0 = time.perf_counter()
        r = bench_sampling(url, cfg, args.workers, cache, batched=False, windows=windows)
        return {**r, "wall_s": time.perf_counter() - t0}

    sides = {"store": lambda: store(1 << 30), "store_cache_off": lambda: store(0),
             "lerobot": lambda: read_windows_lerobot(lr_root, args, fps)}
    for rep in range(args.read_repeats):
        order = list(sides) if rep % 2 == 0 else list(reversed(sides))
        for name in order:
            runs[name].append(sides[name]())
            print(f"read {name}: {runs[name][-1]['windows_per_s']:.0f} windows/s", flush=True)
    out = {}
    for name, rs in runs.items():
        per_s = [r["windows_per_s"] for r in rs]
        out[name] = {**rs[0], "windows_per_s": float(np.median(per_s)), "windows_per_s_runs": per_s}
    out["windows"] = {"observation": obs_offsets, "action": list(range(args.horizon))}
    return out


def check_same(url: str, lr_root: Path, eps: list[dict]) -> dict:
    """Both results read back: actions, states and rewards of every episode equal to the recorded ones in both
    (bit for bit), whether the store's images are equal bit for bit and their mean absolute error (grey levels: 0
    for the lossless codecs), LeRobot's decoded video of episode 0 against the
    recorded frames (mean absolute error, grey levels)."""
    from experience_dict.lerobot import REWARD_KEY, _lerobot_dataset_cls, decode_episode_frames

    store = ExperienceStore.open(url)
    ds = _lerobot_dataset_cls()(REPO_ID, root=lr_root, video_backend="pyav")
    hf = ds.hf_dataset.with_format("numpy")
    metas = store.episodes()
    same = {"actions": True, "states": True, "rewards": True, "store_images": True}
    store_err = []
    for i, (meta, ep) in enumerate(zip(metas, eps, strict=True)):
        row = ds.meta.episodes[i]
        cols = hf[int(row["dataset_from_index"]):int(row["dataset_to_index"])]
        mine = store.load_episode(meta.episode_id)
        want_state = np.stack([o["observation.state"] for o in ep["obs"]])
        same["actions"] &= bool(np.array_equal(mine["action"], ep["actions"])
                                and np.array_equal(np.asarray(cols["action"], np.float32), ep["actions"]))
        same["states"] &= bool(np.array_equal(mine["observation.state"], want_state)
                               and np.array_equal(np.asarray(cols["observation.state"], np.float32), want_state))
        same["rewards"] &= bool(np.array_equal(mine["reward"], ep["rewards"])
                                and np.array_equal(np.asarray(cols[REWARD_KEY], np.float32).reshape(-1), ep["rewards"]))
        recorded = np.stack([o[CAMERA] for o in ep["obs"]])
        same["store_images"] &= bool(np.array_equal(mine[CAMERA], recorded))
        store_err.append(float(np.abs(mine[CAMERA].astype(np.float64) - recorded).mean()))
    row = ds.meta.episodes[0]
    cols = hf[int(row["dataset_from_index"]):int(row["dataset_to_index"])]
    frames = decode_episode_frames(lr_root / ds.meta.get_video_file_path(0, CAMERA),
                                   float(row[f"videos/{CAMERA}/from_timestamp"]) + np.asarray(cols["timestamp"]),
                                   ds.tolerance_s)
    want = np.stack([o[CAMERA] for o in eps[0]["obs"]]).astype(np.float64)
    return {**{f"{k}_equal": v for k, v in same.items()}, "episodes": len(metas),
            "lerobot_video_mae_grey_levels_ep0": float(np.abs(frames.astype(np.float64) - want).mean()),
            "store_image_mae_grey_levels_ep0": store_err[0] if store_err else None,
            "store_image_mae_grey_levels_mean": float(np.mean(store_err)) if store_err else None}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=20, help="episodes recorded by each writer")
    ap.add_argument("--steps", type=int, default=150, help="steps per episode")
    ap.add_argument("--image-size", type=int, default=96, help="camera image height = width (pixels)")
    ap.add_argument("--task", default="push-v3", help="Meta-World task of the expert episodes")
    ap.add_argument("--vcodec", default="libsvtav1", help="LeRobot's video codec (LeRobot's default: libsvtav1)")
    ap.add_argument("--image-writer-threads", type=int, default=4,
                    help="LeRobot's PNG writer threads (lerobot-record's default: 4 per camera)")
    ap.add_argument("--image-clevel", type=int, default=None,
                    help="the store's Blosc/zstd level for images, 0..9 (default: StoreConfig's, 1)")
    ap.add_argument("--image-codec", choices=("delta-zstd", "zstd", "h264"), default=None,
                    help="the store's image codec (default: StoreConfig's, delta-zstd; h264 is lossy)")
    ap.add_argument("--image-crf", type=int, default=None,
                    help="the store's libx264 CRF with --image-codec h264, 0..51 (default: StoreConfig's, 18)")
    ap.add_argument("--chunk-bytes", type=int, default=None,
                    help="the store's target chunk size along time, bytes (default: StoreConfig's, 1 MiB)")
    ap.add_argument("--windows", type=int, default=1024, help="timed random windows per read run")
    ap.add_argument("--batch-size", type=int, default=32, help="DataLoader batch size (windows)")
    ap.add_argument("--workers", type=int, default=0, help="DataLoader worker processes (0: in this process)")
    ap.add_argument("--history", type=int, default=2, help="observation steps per window (t-history+1..t)")
    ap.add_argument("--horizon", type=int, default=16, help="action chunk length (t..t+horizon-1)")
    ap.add_argument("--read-repeats", type=int, default=1, help="read rounds (sides alternate; medians)")
    ap.add_argument("--dir", default="outputs/bench/bench_recording_data",
                    help="working folder for both results (emptied first)")
    ap.add_argument("--keep", action="store_true", help="keep both results in --dir (default: removed)")
    ap.add_argument("--out", default="outputs/bench/bench_recording.json", help="the JSON result file")
    a = ap.parse_args(argv)
    if a.episodes < 1 or a.steps < 2 or a.history < 1 or a.horizon < 1 or a.windows < 1 or a.batch_size < 1:
        ap.error("--episodes, --history, --horizon, --windows and --batch-size must be >= 1, --steps >= 2")
    if a.image_clevel is not None and not 0 <= a.image_clevel <= 9:
        ap.error(f"--image-clevel must be 0..9 (Blosc's levels), given {a.image_clevel}")
    if a.image_crf is not None and not 0 <= a.image_crf <= 51:
        ap.error(f"--image-crf must be 0..51 (libx264's CRF), given {a.image_crf}")
    if a.chunk_bytes is not None and a.chunk_bytes < 1:
        ap.error("--chunk-bytes must be >= 1")
    return a


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; writes ``--out`` (JSON), prints a table and returns the result dict."""
    a = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read and write local roots only; never reach the hub
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("SVT_LOG", "2")  # SVT-AV1: warnings and errors only
    root = Path(a.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    spec, eps = sim_episodes(a.episodes, a.steps, a.image_size, task=a.task)
    gen_s = time.perf_counter() - t0
    write = bench_write(spec, eps, root, a)
    url, lr_root = write["store"]["url"], Path(write["lerobot"]["root"])
    disk = {"store": dir_bytes(url), "lerobot": dir_bytes(lr_root)}
    read = bench_read(url, lr_root, a, float(spec["control_hz"]))
    check = check_same(url, lr_root, eps)
    raw = sum(sum(np.asarray(v).nbytes for v in o.values()) for ep in eps for o in ep["obs"])
    raw += sum(ep["actions"].nbytes + ep["rewards"].nbytes + 4 * len(ep["progress"]) * len(ep["progress"][0])
               for ep in eps)
    ratios = {
        "write_s": write["store"]["total_s"] / write["lerobot"]["total_s"],
        "write_episode_median": write["store"]["episode_ms_median"] / write["lerobot"]["episode_ms_median"],
        "du_bytes": disk["store"]["du_bytes"] / disk["lerobot"]["du_bytes"],
        "apparent_bytes": disk["store"]["apparent_bytes"] / disk["lerobot"]["apparent_bytes"],
        "windows_per_s": read["store"]["windows_per_s"] / read["lerobot"]["windows_per_s"],
        "windows_per_s_cache_off": read["store_cache_off"]["windows_per_s"] / read["lerobot"]["windows_per_s"],
    }
    for side in ("store", "lerobot"):
        write[side].pop("episode_s")
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpu_count": os.cpu_count(),
        "loadavg_1min_before_after": [load_before[0], os.getloadavg()[0]],
        "episodes": {"count": a.episodes, "steps": a.steps, "image_size": a.image_size, "task": a.task,
                     "camera": CAMERA, "generate_s": gen_s, "raw_bytes": raw,
                     "successes": sum(ep["success"] for ep in eps)},
        "write": write, "disk": disk, "read": read, "check": check,
        "ratios_store_over_lerobot": ratios,
        "targets": {"write_s_ratio_max": 1.0, "du_bytes_ratio_max": 1.0,
                    "write_met": ratios["write_s"] <= 1.0, "disk_met": ratios["du_bytes"] <= 1.0},
        "args": vars(a),
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print_table(result)
    print(f"wrote {out}")
    if not a.keep:
        shutil.rmtree(root, ignore_errors=True)
    return result


def print_table(r: dict) -> None:
    """The headline figures, one row each: store, LeRobot, store / LeRobot."""
    w, d, rd, q = r["write"], r["disk"], r["read"], r["ratios_store_over_lerobot"]
    e = r["episodes"]
    print(f"\n{e['count']} episodes x {e['steps']} steps, {e['image_size']}x{e['image_size']} {e['task']} "
          f"(load {r['loadavg_1min_before_after'][0]:.1f} -> {r['loadavg_1min_before_after'][1]:.1f})")
    rows = [("write, total s", w["store"]["total_s"], w["lerobot"]["total_s"], q["write_s"]),
            ("write, episode median ms", w["store"]["episode_ms_median"], w["lerobot"]["episode_ms_median"],
             q["write_episode_median"]),
            ("disk, du MB", d["store"]["du_bytes"] / 1e6, d["lerobot"]["du_bytes"] / 1e6, q["du_bytes"]),
            ("disk, apparent MB", d["store"]["apparent_bytes"] / 1e6, d["lerobot"]["apparent_bytes"] / 1e6,
             q["apparent_bytes"]),
            ("read, windows/s (cache on)", rd["store"]["windows_per_s"], rd["lerobot"]["windows_per_s"],
             q["windows_per_s"]),
            ("read, windows/s (cache off)", rd["store_cache_off"]["windows_per_s"], rd["lerobot"]["windows_per_s"],
             q["windows_per_s_cache_off"])]
    print(f"{'figure':<30}{'store':>12}{'LeRobot':>12}{'store/LeRobot':>15}")
    for name, s, lr, ratio in rows:
        print(f"{name:<30}{s:>12.2f}{lr:>12.2f}{ratio:>15.3f}")
    p = w["paired_lerobot_over_store"]
    print(f"paired per-episode write, LeRobot / store: {p['median']:.2f} [{p['ci95'][0]:.2f}, {p['ci95'][1]:.2f}]; "
          f"same actions: {r['check']['actions_equal']}; LeRobot video MAE "
          f"{r['check']['lerobot_video_mae_grey_levels_ep0']:.2f} grey levels; store "
          f"{r['write']['store']['image_codec']} MAE {r['check']['store_image_mae_grey_levels_ep0']:.2f}")


if __name__ == "__main__":
    main()
