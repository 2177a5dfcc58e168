"""Benchmark the experience store on object storage (a real S3 API server: moto's server mode on 127.0.0.1,
started and stopped here) and write JSON.

    python scripts/bench_store_s3.py                       # 24 episodes x 150 steps, state-only
    python scripts/bench_store_s3.py --episodes 48 --out outputs/bench_store_s3.json

Write: every episode (``--steps`` steps of a 4-d state, 17-d env state, 4-d action, reward, 6 progress
signals) is written once through ``EpisodeWriter`` (add_step x T + commit: chunks, statistics sketch, commit
record, each a PUT) and once as raw objects of the same arrays (``numpy.save`` bytes, one PUT per key per
episode, ``s3fs.pipe_file``) and as one raw object (``numpy.savez`` of them all, one PUT) to the same server,
alternating episode by episode in this process; the ratios are store throughput / raw-put throughput
(uncompressed bytes, wall time); the one-object PUT is the stricter baseline.

Sampling: ``WindowDataset`` (state [-1, 0], action 0..15, action history -8..-1) over the S3 store, random
batches of 64 windows through ``fetch`` (one vectorised read per batch): the first pass reads every chunk
from the server (cold), later passes hit the dataset's decoded-chunk cache in memory (warm, the "local
cache"); windows per second of each.
"""

from __future__ import annotations

import argparse
import io
import json
import time
from pathlib import Path

import numpy as np

from experience_dict.sampler import WindowDataset
from experience_dict.store import DEFAULT_PROGRESS_KEYS, ExperienceStore, configure_storage
from experience_dict.store.local_s3 import start_local_s3

SPEC = {"observation.state": {"shape": [4], "dtype": "float32"},
        "observation.environment_state": {"shape": [17], "dtype": "float32"},
        "action": {"shape": [4], "dtype": "float32"}, "control_hz": 80.0}


def episode(rng: np.random.Generator, steps: int) -> tuple[list[dict], np.ndarray]:
    obs = [{"observation.state": rng.normal(size=4).astype(np.float32),
            "observation.environment_state": rng.normal(size=17).astype(np.float32)} for _ in range(steps)]
    return obs, rng.uniform(-1, 1, (steps, 4)).astype(np.float32)


def bench_write(url: str, fs, episodes: int, steps: int) -> dict:
    store = ExperienceStore.create_or_open(url, SPEC, progress_keys=list(DEFAULT_PROGRESS_KEYS))
    w = store.writer("unit-0000")
    rng = np.random.default_rng(0)
    t_store = t_raw = t_one = 0.0
    nbytes = 0
    for e in range(episodes):
        obs, acts = episode(rng, steps)
        prog = {k: 0.0 for k in DEFAULT_PROGRESS_KEYS}
        t0 = time.perf_counter()
        w.begin_episode(unit_id=0, embodiment="sawyer", task="reach-v3", policy_version=1, seed=e, is_demo=False)
        for t in range(steps):
            w.add_step(obs[t], acts[t], reward=0.0, progress=prog)
        w.commit(success=bool(e % 2))
        t_store += time.perf_counter() - t0
        arrays = {k: np.stack([o[k] for o in obs]) for k in obs[0]}
        arrays.update(action=acts, reward=np.zeros(steps, np.float32),
                      **{f"progress.{k}": np.zeros(steps, np.float32) for k in DEFAULT_PROGRESS_KEYS})
        t0 = time.perf_counter()
        for k, v in arrays.items():
            buf = io.BytesIO()
            np.save(buf, v)
            fs.pipe_file(f"bench/raw/{e:05d}/{k}.npy", buf.getvalue())
        t_raw += time.perf_counter() - t0
        t0 = time.perf_counter()
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        fs.pipe_file(f"bench/raw1/{e:05d}.npz", buf.getvalue())
        t_one += time.perf_counter() - t0
        nbytes += sum(v.nbytes for v in arrays.values())
    return {"episodes": episodes, "steps": steps, "bytes": nbytes,
            "store_MB_per_s": nbytes / t_store / 1e6, "raw_put_per_key_MB_per_s": nbytes / t_raw / 1e6,
            "raw_put_one_object_MB_per_s": nbytes / t_one / 1e6,
            "ratio_store_over_raw_put_per_key": t_raw / t_store,
            "ratio_store_over_raw_put_one_object": t_one / t_store, "commit_ms_mean": 1e3 * t_store / episodes}


def bench_sampling(url: str, passes: int = 3, batch: int = 64) -> dict:
    reader = ExperienceStore.open(url)
    spec = {"observation.state": ("observation.state", [-1, 0]),
            "observation.environment_state": ("observation.environment_state", [-1, 0]),
            "action": ("action", list(range(16))), "history.action": ("action", list(range(-8, 0)))}
    ds = WindowDataset(reader, reader.episodes(), windows=spec)
    rng = np.random.default_rng(0)
    out = []
    for p in range(passes):
        order = rng.permutation(len(ds))
        t0 = time.perf_counter()
        for i in range(0, len(order) - batch + 1, batch):
            ds.fetch(order[i:i + batch].tolist())
        dt = time.perf_counter() - t0
        out.append({"pass": p, "windows": int(len(order) // batch * batch), "windows_per_s": len(order) // batch * batch / dt})
    return {"windows": len(ds), "passes": out, "cold_windows_per_s": out[0]["windows_per_s"],
            "warm_windows_per_s": float(np.median([o["windows_per_s"] for o in out[1:]]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=24)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--out", default="outputs/bench_store_s3.json")
    a = ap.parse_args()
    import s3fs

    proc, opts = start_local_s3("bench")
    try:
        url = "s3://bench/store"
        configure_storage({"url": url, "storage_options": opts})
        fs = s3fs.S3FileSystem(**opts)
        res = {"server": "moto (S3 API) on 127.0.0.1", "write": bench_write(url, fs, a.episodes, a.steps),
               "sampling": bench_sampling(url), "verify_ok": ExperienceStore.open(url).verify()["ok"]}
    finally:
        proc.kill()
    try:
        res["load_average"] = list(__import__("os").getloadavg())
    except OSError:
        pass
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
