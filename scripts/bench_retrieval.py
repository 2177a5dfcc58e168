"""Retrieval at scale: exact against IVF search of the success index, side by side in one process.

    python scripts/bench_retrieval.py                          # 10k, 100k, 1M windows -> outputs/bench/retrieval.json
    python scripts/bench_retrieval.py --sizes 10000 100000 --out /tmp/r.json

The windows are the FERT key (``fleet.fert.keys.RelativeEmbedder``, 16-d, metres) of real MuJoCo
episodes: scripted-expert reach-v3 and push-v3 episodes on several units, embedded at every step. To reach a
million windows without simulating thousands of episodes, those real windows are repeated with independent
Gaussian jitter of 2 mm per coordinate (the size of the units' observation noise), so the set keeps the real
key's geometry. Queries are other real windows (held out of the index, jittered the same way).

Per size: the exact index (faiss ``IndexFlatL2``) and the IVF index that ``SuccessIndex`` switches to above
``fert.approx_above`` (``IndexIVFFlat``, ``nlist = sqrt(n)``, ``nprobe`` 32), each answering single queries
(k = 8) one at a time: median and p90 latency in ms, recall@8 of IVF against exact, build seconds and the
index's memory (bytes of the stored vectors and lists). One torch/faiss thread, as in the learner.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def real_windows(n_episodes: int = 24, seed: int = 0) -> np.ndarray:
    """(W, 16) float32 relative-key windows of real expert episodes (reach-v3 and push-v3, units 0..3)."""
    from fleet.fert.keys import RelativeEmbedder
    from sim import make_env, make_expert

    emb = RelativeEmbedder(frames=8)
    out = []
    for i in range(n_episodes):
        task = ("reach-v3", "push-v3")[i % 2]
        env = make_env(task, unit_id=i % 4)
        expert = make_expert(env, noise_std=0.1, seed=seed + i)
        obs, _ = env.reset(seed=seed + i)
        expert.reset(seed=seed + i)
        rows = {k: [] for k in emb.keys}
        for _ in range(150):
            for k in emb.keys:
                rows[k].append(obs[k])
            obs, _, term, trunc, _ = env.step(expert.act(obs))
            if term or trunc:
                break
        data = {k: np.stack(v) for k, v in rows.items()}
        out.append(emb.embed_episode(data, np.arange(len(data[emb.keys[0]]))))
        env.close()
    return np.concatenate(out).astype(np.float32)


def bench(size: int, base: np.ndarray, queries: np.ndarray, rng, nprobe: int = 32, k: int = 8) -> dict:
    import faiss

    x = base[rng.integers(0, len(base), size)] + rng.normal(0, 0.002, (size, base.shape[1])).astype(np.float32)
    x = np.ascontiguousarray(x, dtype=np.float32)
    t0 = time.perf_counter()
    exact = faiss.IndexFlatL2(x.shape[1])
    exact.add(x)
    t_exact = time.perf_counter() - t0
    t0 = time.perf_counter()
    nlist = max(1, int(np.sqrt(size)))
    ivf = faiss.IndexIVFFlat(faiss.IndexFlatL2(x.shape[1]), x.shape[1], nlist, faiss.METRIC_L2)
    sample = x if size <= 64 * nlist else x[rng.choice(size, 64 * nlist, replace=False)]
    ivf.train(sample)
    ivf.add(x)
    ivf.nprobe = min(nprobe, nlist)
    t_ivf = time.perf_counter() - t0

    def time_one(index) -> tuple[list[float], np.ndarray]:
        lat, labels = [], []
        for q in queries:
            t = time.perf_counter()
            _, lab = index.search(q[None], k)
            lat.append((time.perf_counter() - t) * 1e3)
            labels.append(lab[0])
        return lat, np.array(labels)

    time_one(exact)   # warm-up
    l_exact, want = time_one(exact)
    time_one(ivf)
    l_ivf, got = time_one(ivf)
    recall = float(np.mean([len(set(w) & set(g)) / k for w, g in zip(want, got)]))
    vec_bytes = size * x.shape[1] * 4
    return {"windows": size, "dim": int(x.shape[1]), "k": k,
            "exact": {"median_ms": float(np.median(l_exact)), "p90_ms": float(np.percentile(l_exact, 90)),
                      "build_s": t_exact, "bytes": vec_bytes},
            "ivf": {"nlist": nlist, "nprobe": int(ivf.nprobe), "median_ms": float(np.median(l_ivf)),
                    "p90_ms": float(np.percentile(l_ivf, 90)), "build_s": t_ivf,
                    "bytes": vec_bytes + size * 8 + nlist * x.shape[1] * 4, "recall_at_k": recall},
            "speedup_median": float(np.median(l_exact) / max(np.median(l_ivf), 1e-9))}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--episodes", type=int, default=24)
    ap.add_argument("--out", default="outputs/bench/retrieval.json")
    a = ap.parse_args(argv)
    import faiss

    faiss.omp_set_num_threads(1)
    rng = np.random.default_rng(0)
    windows = real_windows(a.episodes)
    perm = rng.permutation(len(windows))
    n_q = min(a.queries, len(windows) // 5)
    queries = windows[perm[:n_q]] + rng.normal(0, 0.002, (n_q, windows.shape[1])).astype(np.float32)
    base = windows[perm[n_q:]]
    rows = []
    for size in a.sizes:
        r = bench(size, base, np.ascontiguousarray(queries, dtype=np.float32), rng)
        rows.append(r)
        print(f"{size:>9,} windows: exact {r['exact']['median_ms']:.3f} ms, IVF {r['ivf']['median_ms']:.3f} ms "
              f"(x{r['speedup_median']:.1f}), recall@8 {r['ivf']['recall_at_k']:.3f}, IVF build {r['ivf']['build_s']:.1f} s",
              flush=True)
    out = {"source_windows": len(windows), "episodes": a.episodes, "jitter_m": 0.002, "threads": 1, "rows": rows}
    p = Path(a.out)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(out, indent=1))
    print(f"wrote {p}")
    return out


if __name__ == "__main__":
    main()
