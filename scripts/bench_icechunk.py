"""Icechunk against fleetmind's own commit protocol, on the same S3 API server (moto on 127.0.0.1): the
measurement behind the object-storage decision recorded in docs/STORAGE.md.

    python scripts/bench_icechunk.py                          # writes outputs/bench/bench_icechunk.json
    python scripts/bench_icechunk.py --writers 16 --episodes 6 --kills 5

Icechunk (transactional Zarr storage: every commit a snapshot, optimistic concurrency on a branch) is an
optional dependency (``pip install icechunk``); fleetmind does not use it at run time.

Episodes are 150-step state-only episodes (4-d state, 17-d env state, 4-d action, reward, 6 progress
signals: 32 float32 columns, 19.2 kB). Each writer owns its arrays (one fleet unit's shard), in both stores:

- **one writer**, episode by episode alternating: fleetmind's ``EpisodeWriter`` (add_step x T + commit),
  Icechunk (append the rows to the writer's array, commit the session), and one raw PUT of the same bytes;
- **N writer processes at once** (``--writers``, default 16), each committing ``--episodes``: aggregate
  episodes/s of each store (Icechunk commits rebase on the moved branch, ``ConflictDetector``: writers touch
  disjoint arrays, so every rebase succeeds);
- **crash safety**: ``--kills`` Icechunk writers SIGKILLed at random moments while committing; afterwards
  every episode a writer reported committed is in the branch's newest snapshot, and the repository opens;
- **snapshot reads**: a reader pins a snapshot id (what a FERT round would pin) while writers commit, and
  re-reading it later returns the same rows.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

STEPS, COLS = 150, 32

WRITER = r"""
import sys, time, json, numpy as np
from scripts.bench_icechunk import ours_writer, ice_writer
kind, wid, n, start_at, opts = {kind!r}, {wid}, {n}, {start_at}, {opts!r}
commit = (ours_writer if kind == "ours" else ice_writer)(opts, wid)
while time.time() < start_at:
    time.sleep(0.005)
t0 = time.time()
for e in range(n):
    commit(e)
    print(json.dumps({{"wid": wid, "e": e, "t": time.time()}}), flush=True)
print(json.dumps({{"wid": wid, "done": True, "t0": t0, "t1": time.time()}}), flush=True)
"""


def rows(wid: int, e: int) -> np.ndarray:
    """(STEPS, COLS) float32 rows whose values encode (writer, episode, step)."""
    return (wid * 1e4 + e * 100 + np.arange(STEPS, dtype=np.float32))[:, None].repeat(COLS, 1).astype(np.float32)


def _ice_storage(opts: dict, prefix: str):
    import icechunk

    return icechunk.s3_storage(bucket="bench", prefix=prefix, endpoint_url=opts["endpoint_url"], allow_http=True,
                               access_key_id=opts["key"], secret_access_key=opts["secret"], region="us-east-1",
                               force_path_style=True)


def ice_writer(opts: dict, wid: int, prefix: str = "ice"):
    """A function committing episode ``e`` of writer ``wid`` to the Icechunk repository (one commit each)."""
    import icechunk
    import zarr

    repo = icechunk.Repository.open(_ice_storage(opts, prefix))
    s = repo.writable_session("main")
    g = zarr.open_group(s.store, mode="a")
    if f"w{wid:03d}" not in g:   # the writer's own array (its shard), created once
        g.create_array(f"w{wid:03d}", shape=(0, COLS), chunks=(1024, COLS), dtype="float32")
        s.commit(f"writer {wid}", rebase_with=icechunk.ConflictDetector())

    def commit(e: int) -> None:
        s = repo.writable_session("main")
        a = zarr.open_array(s.store, path=f"w{wid:03d}", mode="a")
        n = a.shape[0]
        a.resize((n + STEPS, COLS))
        a[n:] = rows(wid, e)
        s.commit(f"w{wid} e{e}", metadata={"wid": wid, "e": e}, rebase_with=icechunk.ConflictDetector())
    return commit


def ours_writer(opts: dict, wid: int, url: str = "s3://bench/ours"):
    """A function committing episode ``e`` of writer ``wid`` through fleetmind's ``EpisodeWriter``."""
    from experience_dict.store import ExperienceStore, configure_storage

    configure_storage({"url": url, "storage_options": opts})
    spec = {"observation.state": {"shape": [4], "dtype": "float32"},
            "observation.environment_state": {"shape": [17], "dtype": "float32"},
            "action": {"shape": [4], "dtype": "float32"}, "control_hz": 80.0}
    store = ExperienceStore.create_or_open(url, spec)
    w = store.writer(f"unit-{wid:04d}")
    keys = list(store.progress_keys)

    def commit(e: int) -> None:
        r = rows(wid, e)
        w.begin_episode(unit_id=wid, embodiment="sawyer", task="reach-v3", policy_version=1, seed=e, is_demo=False)
        for t in range(STEPS):
            w.add_step({"observation.state": r[t, :4], "observation.environment_state": r[t, 4:21]}, r[t, 21:25],
                       float(r[t, 25]), {k: float(r[t, 26 + i]) for i, k in enumerate(keys)})
        w.commit(success=True)
    return commit


def single_writer(opts: dict, episodes: int) -> dict:
    """Per-commit latency of each store beside one raw PUT of the same bytes, alternating episode by episode."""
    import s3fs

    fs = s3fs.S3FileSystem(**opts)
    ours, ice = ours_writer(opts, 900), ice_writer(opts, 900)
    t = {"ours": [], "icechunk": [], "raw_put": []}
    for e in range(episodes):
        for name, fn in (("ours", lambda e=e: ours(e)), ("icechunk", lambda e=e: ice(e)),
                         ("raw_put", lambda e=e: fs.pipe_file(f"bench/raw/{e:05d}.npy", rows(900, e).tobytes()))):
            t0 = time.perf_counter()
            fn()
            t[name].append(time.perf_counter() - t0)
    med = {k: float(np.median(v) * 1e3) for k, v in t.items()}
    return {"episodes": episodes, "commit_ms_median": med,
            "ratio_vs_raw_put": {k: med["raw_put"] / med[k] for k in ("ours", "icechunk")}}


def _spawn(kind: str, wid: int, n: int, start_at: float, opts: dict) -> subprocess.Popen:
    code = WRITER.format(repo=str(REPO), kind=kind, wid=wid, n=n, start_at=start_at, opts=opts)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def many_writers(opts: dict, kind: str, writers: int, episodes: int) -> dict:
    """Aggregate committed episodes/s of ``writers`` processes, started together after their setup."""
    start_at = time.time() + 8.0 + 0.4 * writers
    procs = [_spawn(kind, w, episodes, start_at, opts) for w in range(writers)]
    outs = [p.communicate(timeout=1800) for p in procs]
    done, errors = [], []
    for (so, se), p in zip(outs, procs):
        lines = [json.loads(x) for x in so.splitlines() if x.startswith("{")]
        fin = [x for x in lines if x.get("done")]
        if p.returncode or not fin:
            errors.append(se[-500:])
        done += fin
    if not done:
        return {"errors": errors}
    t0, t1 = min(d["t0"] for d in done), max(d["t1"] for d in done)
    late = max(d["t0"] for d in done) - start_at
    return {"writers": writers, "episodes_each": episodes, "episodes_per_s": len(done) * episodes / (t1 - t0),
            "wall_s": t1 - t0, "latest_start_s": late, "errors": errors}


def ice_crash(opts: dict, kills: int, episodes: int) -> dict:
    """SIGKILL Icechunk writers at random moments; every reported commit must be in the branch's tip."""
    import icechunk
    import zarr

    rng = random.Random(0)
    reported: dict[int, int] = {}
    for k in range(kills):
        wid = 500 + k
        p = _spawn("ice", wid, episodes, time.time(), opts)
        time.sleep(rng.uniform(3.0, 6.0))
        p.send_signal(signal.SIGKILL)
        so, _ = p.communicate(timeout=60)
        reported[wid] = sum(1 for x in so.splitlines() if x.startswith("{") and '"e"' in x)
    repo = icechunk.Repository.open(_ice_storage(opts, "ice"))
    g = zarr.open_group(repo.readonly_session("main").store, mode="r")
    lost = 0
    for wid, n in reported.items():
        name = f"w{wid:03d}"
        have = g[name].shape[0] // STEPS if name in g else 0
        lost += max(n - have, 0)
        if have:
            a = g[name][:]
            for e in range(have):   # every visible episode is whole and has its writer's values
                assert np.array_equal(a[e * STEPS:(e + 1) * STEPS], rows(wid, e)), (wid, e)
    return {"kills": kills, "reported_commits": sum(reported.values()), "lost": lost, "repository_opens": True}


def ice_snapshot(opts: dict) -> dict:
    """A reader pins a snapshot id while a writer commits; re-reading the pinned snapshot gives the same rows."""
    import icechunk
    import zarr

    repo = icechunk.Repository.open(_ice_storage(opts, "ice"))
    snap = repo.lookup_branch("main")
    first = zarr.open_array(repo.readonly_session(snapshot_id=snap).store, path="w900", mode="r")[:]
    writer = ice_writer(opts, 900)
    for e in range(100, 103):
        writer(e)
    again = zarr.open_array(repo.readonly_session(snapshot_id=snap).store, path="w900", mode="r")[:]
    tip = zarr.open_array(repo.readonly_session("main").store, path="w900", mode="r")
    return {"pinned_rows": int(first.shape[0]), "pinned_unchanged": bool(np.array_equal(first, again)),
            "tip_rows": int(tip.shape[0])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--writers", type=int, default=16)
    ap.add_argument("--episodes", type=int, default=6, help="episodes per writer process")
    ap.add_argument("--single", type=int, default=20, help="episodes of the one-writer comparison")
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--out", default="outputs/bench/bench_icechunk.json")
    a = ap.parse_args()
    import icechunk

    from experience_dict.store.local_s3 import start_local_s3

    proc, opts = start_local_s3("bench")
    try:
        icechunk.Repository.create(_ice_storage(opts, "ice"))
        res = {"server": "moto (S3 API) on 127.0.0.1", "icechunk": icechunk.__version__,
               "episode": {"steps": STEPS, "float32_columns": COLS, "bytes": STEPS * COLS * 4}}
        res["one_writer"] = single_writer(opts, a.single)
        print(json.dumps(res["one_writer"]), flush=True)
        res["many_writers"] = {k: many_writers(opts, k, a.writers, a.episodes) for k in ("ours", "ice")}
        print(json.dumps(res["many_writers"]), flush=True)
        res["icechunk_crash"] = ice_crash(opts, a.kills, 50)
        res["icechunk_snapshot"] = ice_snapshot(opts)
    finally:
        proc.kill()
    res["load_average"] = list(os.getloadavg())
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
