"""Fuzz the experience store's read path with injected faults; writes counts as JSON.

    python scripts/fuzz_store.py                       # 1,000 cases -> fuzz_store.json
    python scripts/fuzz_store.py --cases 200 --out /tmp/f.json --seed 3

A small real store (two writers, 16x16 images and the packed low-dim array in 4 KiB chunks, 12 episodes) is
written once. Each case copies it, damages one file (a chunk file, a commit record or an array's ``zarr.json``)
by deleting, truncating, flipping one bit or replacing it with another file of the same kind, then runs every
read path (``experience_dict.store.faults``: open, load_episode, corrupt_episodes, readable(skip), the sampler
on what readable kept, verify) against what the undamaged store returned. Cases cycle over the 12 (target,
fault) kinds with random files, offsets and bits (``--seed``).

The JSON: per kind the cases tried and the outcomes of every read (``exact`` / ``named`` / ``silent_wrong`` /
``unnamed``), totals, and the first failing cases with what went wrong. The target: 0 ``silent_wrong``,
0 ``unnamed``.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experience_dict.store.faults import FAULTS, TARGETS, WINDOWS, build_store, run_case, snapshot


def fuzz(cases: int, seed: int, work: Path, progress: bool = True, keep_failures: int = 20) -> dict:
    """Run ``cases`` fault cases; returns the report (see the module docstring)."""
    base = work / "base"
    build_store(base)
    truth = snapshot(str(base), WINDOWS)
    kinds = [(t, f) for t in TARGETS for f in FAULTS]
    per_kind = {f"{t}/{f}": {"cases": 0, "skipped": 0, "failed": 0, "undetectable": 0, "reads": {}} for t, f in kinds}
    failures, t0 = [], time.perf_counter()
    for i in tqdm(range(cases), desc="fuzz", disable=not progress):
        t, f = kinds[i % len(kinds)]
        res = run_case(base, work / "case", truth, WINDOWS, t, f, seed * 1_000_003 + i)
        k = per_kind[f"{t}/{f}"]
        k["cases"] += 1
        k["skipped"] += int(bool(res.get("skipped")))
        k["failed"] += int(not res["ok"])
        k["undetectable"] += int(bool(res.get("undetectable")))
        for outs in res["reads"].values():
            for o, n in outs.items():
                k["reads"].setdefault(o, 0)
                k["reads"][o] += n
        if not res["ok"] and len(failures) < keep_failures:
            failures.append({"case": i, "fault": res["fault"], "failures": res["failures"][:5]})
    totals: dict[str, int] = {}
    for k in per_kind.values():
        for o, n in k["reads"].items():
            totals[o] = totals.get(o, 0) + n
    return {"cases": cases, "seed": seed, "wall_s": time.perf_counter() - t0,
            "failed_cases": sum(k["failed"] for k in per_kind.values()),
            "undetectable_cases": sum(k["undetectable"] for k in per_kind.values()),
            "silent_wrong_reads": totals.get("silent_wrong", 0), "unnamed_errors": totals.get("unnamed", 0),
            "read_outcomes": totals, "per_kind": per_kind, "first_failures": failures}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="fuzz_store.json")
    args = ap.parse_args(argv)
    logging.getLogger("fleetmind.store").setLevel(logging.ERROR)   # readable(skip)'s warning, once per case
    work = Path(tempfile.mkdtemp(prefix="fuzz_store_"))
    try:
        rep = fuzz(args.cases, args.seed, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    Path(args.out).write_text(json.dumps(rep, indent=1))
    print(json.dumps({k: rep[k] for k in ("cases", "failed_cases", "undetectable_cases", "silent_wrong_reads", "unnamed_errors",
                                          "read_outcomes", "wall_s")}))
    for f in rep["first_failures"][:5]:
        print("FAILED", json.dumps(f)[:600])
    return 0 if rep["failed_cases"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
