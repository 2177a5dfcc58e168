"""Benchmark the experience store: write throughput beside numpy.save, window sampling throughput (JSON).

    python scripts/bench_store.py                          # 96x96 Meta-World renders + state, 16 episodes
    python scripts/bench_store.py store.bench.image_source=synthetic store.bench.episodes=8

Write: every episode (``steps`` steps of a 96x96x3 uint8 image, 4-d state, 17-d env state, 4-d action,
reward and 6 progress signals) is written once through ``EpisodeWriter`` (add_step x T + commit: Blosc/zstd,
crc32c, statistics sketch, atomic commit record) and once with ``numpy.save`` (stack each key, one .npy per
key per episode, the same arrays) to the same disk, back to back episode by episode (the side going first
alternates), in this process. The run is repeated ``store.bench.repeats`` times (default 3,
``store.bench.repeats=N``) after an untimed warm-up. The figure for the target (store / numpy.save >= 0.5) is
``write.paired``: the median over all timed episodes of numpy.save's wall time over the store's for the same
episode, with a bootstrap interval, and ``ratio_vs_fast_numpy`` (numpy.save's fastest decile against the
store's median), since numpy.save's cost on a shared VM swings several-fold between runs (page cache). The
ratio of totals of the median run and the CPU-time ratio (all threads) are reported beside it. Throughput counts
uncompressed bytes (MB = 1e6 bytes).

Sampling: ``WindowDataset`` (state [-1, 0], image [-1, 0], action 0..15, action history -8..-1), random
windows through a torch ``DataLoader`` (batch ``batch_size``) with 1 and 2 worker processes, after one
warm-up batch: workers building whole batches (``BatchSampler``, ``batch_size=None``) or per-window items +
``default_collate``; with the decoded-chunk cache (the dataset fits) and with it off (every image chunk
read and decoded when needed). ``rows_check``: the cost of checking every episode's rows against its commit
record (checked / unchecked windows per second, alternating runs in this process; ``bench_rows_check``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import hydra
import numpy as np
from omegaconf import DictConfig
from tqdm import tqdm

import configs.typed  # noqa: F401 - registers the typed config groups before Hydra composes
from experience_dict.sampler import WindowDataset
from experience_dict.store import DEFAULT_PROGRESS_KEYS, ExperienceStore

SAMPLING_WINDOWS = {"observation.state": ("observation.state", [-1, 0]),
                    "observation.images.corner": ("observation.images.corner", [-1, 0]),
                    "action": ("action", list(range(16))), "history.action": ("action", list(range(-8, 0)))}
"""The sampling benchmark's windows (``WindowDataset``'s ``{name: (key, step offsets)}``)."""


def sim_episodes(episodes: int, steps: int, size: int, task: str = "push-v3",
                 seed: int = 0) -> tuple[dict, list[dict]]:
    """Real Meta-World expert episodes with ``size`` x ``size`` RGB renders of the ``corner`` camera.

    Episode ``e`` resets the env with seed ``seed + e`` and records exactly ``steps`` steps (if the env ends the
    episode earlier, it is reset and recording goes on, so every episode has ``steps`` steps); one scripted
    expert (``sim.make_expert``, seed ``seed``) acts throughout.

    Returns:
        ``(spec, episodes)``: the env's ``spec_dict()`` and, per episode, ``{"obs": [per-step observation dict],
        "actions": (steps, A) float32, "rewards": (steps,) float32, "progress": [per-step {key: float}],
        "success": bool (succeeded at some step)}``.

    Raises:
        whatever the simulator raises (no MuJoCo / EGL, unknown task).
    """
    from sim import make_env, make_expert

    env = make_env(task, unit_id=0, obs_cfg={"images": True, "cameras": ["corner"], "image_size": size},
                   task_cfg={"max_episode_steps": steps, "steps_after_success": steps})
    try:
        expert = make_expert(env, seed=seed)
        out = []
        for e in range(episodes):
            obs, _ = env.reset(seed=seed + e)
            ep = {"obs": [], "actions": [], "rewards": [], "progress": [], "success": False}
            for _ in range(steps):
                a = expert.act(obs)
                ep["obs"].append(obs)
                ep["actions"].append(a)
                obs, r, term, trunc, info = env.step(a)
                ep["rewards"].append(r)
                ep["progress"].append({k: float(v) for k, v in (info.get("progress") or {}).items()})
                ep["success"] = ep["success"] or bool(info.get("success", False))
                if term or trunc:
                    obs, _ = env.reset(seed=seed + e * steps + len(ep["obs"]))
            ep["actions"] = np.stack(ep["actions"]).astype(np.float32)
            ep["rewards"] = np.asarray(ep["rewards"], np.float32)
            out.append(ep)
        return env.spec_dict(), out
    finally:
        env.close()


def sim_frames(steps: int, size: int) -> tuple[dict, list[dict], np.ndarray] | None:
    """One real push-v3 expert episode with 96x96 renders: (spec, observations, actions); None if sim fails."""
    try:
        spec, (ep,) = sim_episodes(1, steps, size)
        return spec, ep["obs"], ep["actions"]
    except Exception as e:  # noqa: BLE001 - fall back to synthetic frames, recorded in the JSON
        print(f"sim frames unavailable ({type(e).__name__}: {e}); using synthetic frames")
        return None


def synthetic_frames(steps: int, size: int) -> tuple[dict, list[dict], np.ndarray]:
    """Smooth render-like frames (gradient background, a moving disc, mild noise) and random state."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size]
    obs = []
    for t in range(steps):
        img = np.stack([xx * 2, yy * 2, (xx + yy)], -1).astype(np.float32) % 256
        cx, cy = size / 2 + size / 3 * np.sin(t / 10), size / 2 + size / 3 * np.cos(t / 10)
        img[(xx - cx) ** 2 + (yy - cy) ** 2 < (size / 10) ** 2] = (200, 40, 40)
        img = np.clip(img + rng.normal(0, 2, img.shape), 0, 255).astype(np.uint8)
        obs.append({"observation.state": rng.normal(size=4).astype(np.float32),
                    "observation.environment_state": rng.normal(size=17).astype(np.float32),
                    "observation.images.corner": img})
    spec = {"observation.state": {"shape": [4], "dtype": "float32"},
            "observation.environment_state": {"shape": [17], "dtype": "float32"},
            "observation.images.corner": {"shape": [size, size, 3], "dtype": "uint8"},
            "action": {"shape": [4], "dtype": "float32"}, "control_hz": 80.0}
    return spec, obs, rng.uniform(-1, 1, (steps, 4)).astype(np.float32)


@contextlib.contextmanager
def timed(wall: list[float], cpu: list[float] | None = None) -> Iterator[None]:
    """Append the block's wall time (``time.perf_counter``, seconds) to ``wall`` and, if given, the whole
    process's CPU time over it (``time.process_time``, seconds, all threads) to ``cpu``."""
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        yield
    finally:
        wall.append(time.perf_counter() - t0)
        if cpu is not None:
            cpu.append(time.process_time() - c0)


def write_store_episode(w, obs: list[dict], actions: np.ndarray, rewards, progress: list[dict], seed: int,
                        task: str = "push-v3", success: bool = True) -> str:
    """One episode through the store's ``EpisodeWriter`` ``w``: ``begin_episode`` + ``add_step`` per step +
    ``commit`` (unit 0, embodiment ``sawyer``, policy version 0); ``rewards``: a float per step (or one float
    for every step). Returns the episode id."""
    w.begin_episode(unit_id=0, embodiment="sawyer", task=task, policy_version=0, seed=seed)
    per_step = np.ndim(rewards) > 0
    for t, o in enumerate(obs):
        w.add_step(o, actions[t], float(rewards[t]) if per_step else float(rewards), progress[t])
    return w.commit(success=success)


def bench_write(cfg: dict, root: Path, spec: dict, obs: list[dict], actions: np.ndarray, scfg: dict) -> tuple[dict, str]:
    r"""One write run: every episode through ``EpisodeWriter`` and, right after, through ``numpy.save``.

    Both sides start from the same per-step observation dicts, write to the same disk in the same process and
    are timed alternately episode by episode (so load from other jobs hits both alike): the store side is
    ``begin_episode`` + ``add_step`` x T + ``commit`` (validation, Blosc/zstd, crc32c, statistics sketch,
    atomic commit record); the numpy side stacks each key over the episode and ``numpy.save``\ s one ``.npy``
    per key into a new directory per episode (what a plain writer would do). Wall time (``perf_counter``) and
    CPU time of the whole process (``process_time``, all threads) are both reported.
    """
    url = str(root / "store")
    store = ExperienceStore.create_or_open(url, spec, **scfg)
    w = store.writer("bench-0")
    progress = [{k: float(i % 7) / 7 for k in DEFAULT_PROGRESS_KEYS} for i in range(len(obs))]
    t_zarr, t_np, c_zarr, c_np = [], [], [], []
    nbytes = 0

    def store_side(e: int) -> None:
        with timed(t_zarr, c_zarr):
            write_store_episode(w, obs, actions, 0.5, progress, seed=e)

    def numpy_side(e: int) -> int:  # numpy.save of the same arrays (stacked per key, one file each), same disk
        with timed(t_np, c_np):
            arrays = {k: np.stack([o[k] for o in obs]) for k in obs[0]}
            arrays["action"] = actions
            arrays["reward"] = np.full(len(obs), 0.5, np.float32)
            for k in DEFAULT_PROGRESS_KEYS:
                arrays[f"progress.{k}"] = np.array([p[k] for p in progress], np.float32)
            d = root / "npy" / f"ep{e:04d}"
            d.mkdir(parents=True, exist_ok=True)
            for k, v in arrays.items():
                np.save(d / f"{k}.npy", v)
        return sum(v.nbytes for v in arrays.values())

    for e in tqdm(range(cfg["episodes"]), desc="write episodes"):
        if e % 2 == 0:  # the side that goes first alternates: neither always follows the other's writeback
            store_side(e)
            nbytes += numpy_side(e)
        else:
            nbytes += numpy_side(e)
            store_side(e)
    w.close()
    steps = cfg["episodes"] * len(obs)
    info = ExperienceStore.open(url).info()
    return {
        "episodes": cfg["episodes"], "steps_per_episode": len(obs), "raw_MB": nbytes / 1e6,
        "store_MB_on_disk": info["bytes"] / 1e6, "compression_ratio": nbytes / max(info["bytes"], 1),
        "zarr_steps_per_s": steps / sum(t_zarr), "zarr_MB_per_s": nbytes / 1e6 / sum(t_zarr),
        "numpy_save_steps_per_s": steps / sum(t_np), "numpy_save_MB_per_s": nbytes / 1e6 / sum(t_np),
        "ratio_zarr_over_numpy": sum(t_np) / sum(t_zarr), "cpu_ratio_zarr_over_numpy": sum(c_np) / sum(c_zarr),
        "zarr_cpu_ms_per_episode": 1e3 * sum(c_zarr) / cfg["episodes"],
        "numpy_cpu_ms_per_episode": 1e3 * sum(c_np) / cfg["episodes"],
        "episode_wall_s": {"zarr": t_zarr, "numpy_save": t_np},
    }, url


def paired_ratio_stats(base: list[float], other: list[float], seed: int = 0, n_boot: int = 2000) -> dict:
    """Paired ratio of two equal-length lists of times (seconds) measured back to back, pair by pair.

    Returns ``{"median": median of base[i] / other[i], "ci95": 95 % bootstrap interval of that median over
    pairs, "p10_p90": the ratios' 10th and 90th percentiles, "n": pairs}``. With ``base`` the baseline's times,
    a ratio above 1 means ``other`` is faster.

    Raises:
        ValueError: the lists differ in length or are empty.
    """
    a, b = np.asarray(other, np.float64), np.asarray(base, np.float64)
    if a.shape != b.shape or a.size == 0:
        raise ValueError(f"paired ratio: expected two equal non-empty lists, given {b.size} and {a.size}")
    r = b / a
    boot = np.random.default_rng(seed).choice(r, (n_boot, r.size)) if r.size > 1 else r[None]
    lo, hi = np.quantile(np.median(boot, 1), [0.025, 0.975])
    return {"median": float(np.median(r)), "ci95": [float(lo), float(hi)],
            "p10_p90": [float(np.quantile(r, 0.1)), float(np.quantile(r, 0.9))], "n": int(r.size)}


def paired_write_ratio(t_zarr: list[float], t_np: list[float], seed: int = 0, n_boot: int = 2000) -> dict:
    """Per-episode paired statistics of write wall times (seconds) of the store and of ``numpy.save``.

    ``paired_ratio_median``: the median over episodes of ``t_np[i] / t_zarr[i]`` (each episode's two sides ran
    back to back, so machine-wide slowdowns hit both), with a 95 % bootstrap interval over episodes
    (:func:`paired_ratio_stats`). ``ratio_vs_fast_numpy``: ``numpy.save``'s 10th-percentile episode time over
    the store's median: the store against ``numpy.save`` at its fastest (a conservative figure for a shared VM
    whose page cache makes ``numpy.save``'s cost swing several-fold between runs).

    Raises:
        ValueError: the lists differ in length or are empty.
    """
    if len(t_zarr) != len(t_np) or not t_zarr:
        raise ValueError(f"paired_write_ratio: expected two equal non-empty lists, given {len(t_zarr)} and "
                         f"{len(t_np)}")
    p = paired_ratio_stats(t_np, t_zarr, seed=seed, n_boot=n_boot)
    a, b = np.asarray(t_zarr, np.float64), np.asarray(t_np, np.float64)
    return {"paired_ratio_median": p["median"], "paired_ratio_ci95": p["ci95"],
            "paired_ratio_p10_p90": p["p10_p90"],
            "ratio_vs_fast_numpy": float(np.quantile(b, 0.1) / np.median(a)),
            "episodes": p["n"], "zarr_ms_median": 1e3 * float(np.median(a)),
            "numpy_save_ms_median": 1e3 * float(np.median(b)), "numpy_save_ms_p10": 1e3 * float(np.quantile(b, 0.1))}


def bench_write_repeated(cfg: dict, root: Path, spec: dict, obs: list[dict], actions: np.ndarray,
                         scfg: dict) -> tuple[dict, str]:
    """``repeats`` write runs (fresh store and .npy directory each) after one untimed warm-up run of both sides.

    Reported: the run with the median ratio of totals, every run's ratios, and :func:`paired_write_ratio` over
    the episodes of all timed runs (``paired``: the figure for the target, since the machine is shared and one
    slow ``numpy.save`` or commit moves a ratio of totals). The warm-up removes a first-run bias in the store's
    favour: in a fresh process the first run's ``numpy.save`` took about 4x the CPU time of later runs
    (page-cache first touch)."""
    warm = root / "warmup"
    warm.mkdir(parents=True)
    bench_write({**cfg, "episodes": min(int(cfg["episodes"]), 8)}, warm, spec, obs, actions, scfg)
    shutil.rmtree(warm, ignore_errors=True)
    runs, url = [], None
    for r in range(int(cfg.get("repeats", 3))):
        run_root = root / f"write{r}"
        run_root.mkdir(parents=True)
        res, run_url = bench_write(cfg, run_root, spec, obs, actions, scfg)
        runs.append((res, run_url))
        shutil.rmtree(run_root / "npy", ignore_errors=True)
    order = sorted(range(len(runs)), key=lambda i: runs[i][0]["ratio_zarr_over_numpy"])
    median, url = runs[order[len(runs) // 2]]
    for i, (_, u) in enumerate(runs):  # keep one store (the median run's) for the sampling benchmark
        if u != url:
            shutil.rmtree(Path(u).parent, ignore_errors=True)
    paired = paired_write_ratio([t for r, _ in runs for t in r["episode_wall_s"]["zarr"]],
                                [t for r, _ in runs for t in r["episode_wall_s"]["numpy_save"]])
    return {**{k: v for k, v in median.items() if k != "episode_wall_s"}, "repeats": len(runs),
            "ratio_zarr_over_numpy_runs": [r["ratio_zarr_over_numpy"] for r, _ in runs],
            "cpu_ratio_zarr_over_numpy_runs": [r["cpu_ratio_zarr_over_numpy"] for r, _ in runs],
            "paired": paired}, url


def bench_sampling(url: str, cfg: dict, workers: int, cache_bytes: int, batched: bool,
                   check_rows: bool = True, windows: dict | None = None) -> dict:
    """Windows per second of ``WindowDataset`` through a DataLoader; ``check_rows=False`` turns off the rows
    check against the commit records (``ExperienceStore.check_rows``, the integrity check a reader cannot skip
    in production) so that its cost can be measured beside it. ``cfg``: ``windows`` (how many are timed, after
    one warm-up batch) and ``batch_size``; ``windows``: ``WindowDataset``'s windows (default
    :data:`SAMPLING_WINDOWS`); ``cache_bytes``: the decoded-chunk cache (bytes, 0 = off)."""
    import torch

    torch.set_num_threads(1)
    reader = ExperienceStore.open(url)
    if not check_rows:
        reader.check_rows = lambda *a, **k: None   # the instance only (the forked workers inherit it)
    ds = WindowDataset(reader, windows=windows or SAMPLING_WINDOWS, cache_bytes=cache_bytes)
    gen = torch.Generator().manual_seed(0)
    sampler = torch.utils.data.RandomSampler(ds, replacement=True, num_samples=cfg["windows"] + cfg["batch_size"],
                                             generator=gen)
    if batched:  # workers build whole batches (WindowDataset.fetch): no per-window collation
        bs = torch.utils.data.BatchSampler(sampler, cfg["batch_size"], drop_last=False)
        loader = torch.utils.data.DataLoader(ds, sampler=bs, batch_size=None, num_workers=workers)
    else:
        loader = torch.utils.data.DataLoader(ds, batch_size=cfg["batch_size"], sampler=sampler, num_workers=workers)
    it = iter(loader)
    next(it)  # warm-up: worker start-up
    n, t0 = 0, time.perf_counter()
    for batch in it:
        n += len(batch["step"])
    dt = time.perf_counter() - t0
    return {"workers": workers, "loader": "batched (BatchSampler, batch_size=None)" if batched else "default_collate",
            "cache_MB": cache_bytes / 1e6, "windows": n, "windows_per_s": n / dt, "rows_checked": check_rows}


def bench_rows_check(url: str, cfg: dict, repeats: int = 3) -> list[dict]:
    """The rows check's cost on sampling: 1 worker, batched, with the chunk cache and without it (every chunk
    decode then reads its not-yet-checked episodes whole); checked and unchecked runs alternate ``repeats``
    times in this process, and the medians' ratio is the figure (checked / unchecked, 1.0 = free)."""
    out = []
    for cache in (1 << 30, 0):
        runs: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(repeats):
            for chk in ((True, False) if rep % 2 == 0 else (False, True)):
                runs[chk].append(bench_sampling(url, cfg, 1, cache, True, check_rows=chk)["windows_per_s"])
        on, off = float(np.median(runs[True])), float(np.median(runs[False]))
        out.append({"cache_MB": cache / 1e6, "windows_per_s_checked": on, "windows_per_s_unchecked": off,
                    "checked_over_unchecked": on / off, "runs": {"checked": runs[True], "unchecked": runs[False]}})
        print(out[-1])
    return out


@hydra.main(version_base=None, config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> None:
    from experience_dict.store.config import StoreConfig, store_layout

    store_cfg = StoreConfig.from_dict(cfg.store)
    scfg = store_layout(store_cfg)
    bcfg = store_cfg.bench.to_dict()
    root = Path(bcfg["dir"] or Path(cfg.output_dir) / "bench_store")
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    src = sim_frames(bcfg["steps"], bcfg["image_size"]) if bcfg["image_source"] == "sim" else None
    source = "sim (Meta-World push-v3 expert, corner camera)" if src else "synthetic"
    spec, obs, actions = src or synthetic_frames(bcfg["steps"], bcfg["image_size"])
    load_before = os.getloadavg()
    write, url = bench_write_repeated(bcfg, root, spec, obs, actions, scfg)
    sampling = []
    for workers in (1, 2):
        for batched, cache in ((True, 1 << 30), (False, 1 << 30), (True, 0)):
            r = bench_sampling(url, bcfg, workers, cache, batched)
            sampling.append(r)
            print(r)
    rows_check = bench_rows_check(url, bcfg, int(bcfg.get("repeats", 3)))
    result = {"image_source": source, "image_size": bcfg["image_size"], "cpu_count": os.cpu_count(),
              "loadavg_1min_before_after": [load_before[0], os.getloadavg()[0]],
              "write": write, "sampling": sampling, "rows_check": rows_check,
              "targets": {"write_ratio_min": 0.5, "windows_per_s_min_2_workers": 2000}}
    out = Path(bcfg["out"] or Path(cfg.output_dir) / "bench_store.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    pw = write["paired"]
    print(f"store write / numpy.save (target >= 0.5): paired median {pw['paired_ratio_median']:.2f} "
          f"[{pw['paired_ratio_ci95'][0]:.2f}, {pw['paired_ratio_ci95'][1]:.2f}] over {pw['episodes']} episodes, "
          f"against numpy.save's fastest decile {pw['ratio_vs_fast_numpy']:.2f}; ratio of totals "
          f"{write['ratio_zarr_over_numpy']:.2f} (runs {[round(x, 2) for x in write['ratio_zarr_over_numpy_runs']]})")
    for r in rows_check:
        print(f"sampling with the rows check / without (cache {r['cache_MB']:.0f} MB, 1 worker): "
              f"{r['checked_over_unchecked']:.2f} ({r['windows_per_s_checked']:.0f} vs "
              f"{r['windows_per_s_unchecked']:.0f} windows/s)")
    print(f"wrote {out}")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
