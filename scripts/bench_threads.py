"""Training throughput under a competing CPU load: how many torch threads, and how they wait, side by side.

    python scripts/bench_threads.py                       # writes outputs/bench/bench_threads.json
    python scripts/bench_threads.py --load 6 --seconds 8 --repeats 2

Each measurement is a fresh process (OpenMP reads its settings when torch loads) training the default
state-only AED policy on random batches (``scripts/bench_policy.py``'s ``Setup``: batch 64, fused AdamW) for
``--seconds`` after a warm-up, and reports samples/s. Variants:

- ``1 thread``;
- ``all cores`` (torch's default: one thread per core, OpenMP's default spin-waiting at barriers);
- ``all cores, passive`` (the same with ``OMP_WAIT_POLICY=PASSIVE``: a waiting thread sleeps instead of
  spinning);
- ``budget``: what fleetmind does by default (``policies.threads``: ``OMP_WAIT_POLICY=PASSIVE`` and
  ``threads_for()`` of the CPUs this process may use).

each on an idle machine and beside ``--load`` busy-looping processes (a synthetic competing load: other jobs on
a shared machine), interleaved, ``--repeats`` times. The CPU share a variant can expect under load (every
runnable thread gets an equal slice): ``k x C / (L + k)`` cores for ``k`` threads on ``C`` cores beside ``L``
busy processes, against ``min(k, C)`` when idle; ``vs_share`` = (loaded / idle samples/s) / (that share's
ratio): 1.0 means the slowdown is exactly in proportion to the CPU share lost, far below 1 is a collapse.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

VARIANTS = {"1 thread": {"threads": "1", "env": {}},
            "all cores": {"threads": "all", "env": {"OMP_WAIT_POLICY": "ACTIVE"}},
            "all cores, passive": {"threads": "all", "env": {"OMP_WAIT_POLICY": "PASSIVE"}},
            "budget": {"threads": "budget", "env": {}}}


def child(threads: str, seconds: float) -> None:
    """Train for ``seconds`` and print ``{"samples_per_s", "threads", "omp_wait_policy"}`` as JSON."""
    from policies.threads import apply_thread_budget, available_cpus, passive_wait

    if threads == "budget":
        passive_wait()   # what fleetmind's entry points do before torch loads
    import torch

    from scripts.bench_policy import Setup, load_policy_cfg

    if threads == "budget":
        n = apply_thread_budget(None)
    else:
        n = 1 if threads == "1" else max(int(available_cpus()), 1)
        torch.set_num_threads(n)
    cfg = load_policy_cfg("aed_diffusion", 96)
    s = Setup(cfg, torch.device("cpu"), {"batch_size": 64, "compile": False, "amp_bf16": False})
    for _ in range(3):
        s.train_step()
    k, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        s.train_step()
        k += 1
    dt = time.perf_counter() - t0
    print(json.dumps({"samples_per_s": k * 64 / dt, "steps": k, "threads": torch.get_num_threads(),
                      "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}), flush=True)


def measure(variant: str, seconds: float) -> dict:
    v = VARIANTS[variant]
    env = {**os.environ, **v["env"]}
    if variant != "budget":
        env.setdefault("OMP_WAIT_POLICY", "ACTIVE")
    r = subprocess.run([sys.executable, __file__, "--child", v["threads"], "--seconds", str(seconds)], env=env,
                       cwd=REPO, capture_output=True, text=True, timeout=600, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--load", type=int, default=6, help="busy-looping processes of the competing load")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="outputs/bench/bench_threads.json")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.seconds)
    from policies.threads import available_cpus

    cpus = available_cpus()
    rows: dict[str, dict[str, list]] = {v: {"idle": [], "loaded": []} for v in VARIANTS}
    threads: dict[str, dict[str, int]] = {v: {} for v in VARIANTS}
    for rep in range(a.repeats):
        for cond in ("idle", "loaded"):
            hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.load if cond == "loaded" else 0)]
            try:
                time.sleep(1.0 if hogs else 0.0)
                for v in VARIANTS:
                    m = measure(v, a.seconds)
                    rows[v][cond].append(m["samples_per_s"])
                    threads[v][cond] = m["threads"]
                    print(f"[{rep}] {cond:6s} {v:20s} {m['threads']} threads: {m['samples_per_s']:.0f} samples/s",
                          flush=True)
            finally:
                for h in hogs:
                    h.kill()
                    h.wait()
    import numpy as np

    out = {"cpus": cpus, "load_processes": a.load, "seconds": a.seconds, "repeats": a.repeats,
           "policy": "AEDDiffusionPolicy state (configs/policy/aed_diffusion.yaml), batch 64", "variants": {}}
    best_idle = max(float(np.median(r["idle"])) for r in rows.values())
    for v, r in rows.items():
        idle, loaded = float(np.median(r["idle"])), float(np.median(r["loaded"]))
        k_idle, k_loaded = threads[v]["idle"], threads[v]["loaded"]
        share_idle = min(k_idle, cpus)
        share_loaded = k_loaded * cpus / (a.load + k_loaded)
        out["variants"][v] = {"threads": threads[v], "idle_samples_per_s": idle, "loaded_samples_per_s": loaded,
                              "slowdown": idle / loaded, "vs_share": (loaded / idle) / (share_loaded / share_idle),
                              "loaded_vs_best_idle": loaded / best_idle, "runs": r}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
