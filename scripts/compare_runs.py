"""Pair the held-out trials of arms from different job runs that ran the same evaluation plan.

Two runs of ``scripts/run.py`` whose held-out plans share ``(task, unit, reset seed)`` trials (the same
``eval.seed``, units and trials per task; a mixed fleet's plan keeps each embodiment's trials those of its own
suite's plan, ``fleet.experiment.evaluation.evaluation_plan``) can be compared trial for trial, e.g. one policy
for a mixed fleet against one policy per embodiment (docs/RESULTS.md, experiment 48)::

    python scripts/compare_runs.py --run mixed=/work/exp48/run --run single=<mw_mid run> --run single=<so100 run> \\
        --arms base,fert,fert_critic --baseline single --pair mixed:fert-mixed:base --out /work/exp48/compare

``--run LABEL=DIR``: a job output folder (``DIR/seed_<seed>/episodes/<arm>.json``); runs given the same label are
merged (their trials must not overlap). For every arm of ``--arms``, ``LABEL:arm − BASELINE:arm`` for each other
label; ``--pair A-B`` adds any other pair of ``LABEL:arm`` names. Writes ``paired.md`` / ``paired.json`` and
``success.md`` / ``success.json`` (``fleet.experiment.tables``) into ``--out`` and prints the paired table.

Raises (exit status 2 with the message): a folder without the episodes of an arm asked for, two merged runs with the
same trial, or a pair naming an unknown arm.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet.experiment.tables import (
    paired_differences,
    paired_markdown,
    success_table,
    table_markdown,
    write_paired,
    write_table,
)


def load_arms(runs: list[tuple[str, Path]], arms: list[str], seed: int) -> dict[str, list[dict]]:
    """``{"label:arm": [episode result]}`` from each run's ``seed_<seed>/episodes/<arm>.json``.

    Raises:
        FileNotFoundError: a run lacks an arm's episodes. ValueError: merged runs share a trial."""
    out: dict[str, list[dict]] = {}
    for label, run in runs:
        for arm in arms:
            f = run / f"seed_{seed}" / "episodes" / f"{arm}.json"
            if not f.is_file():
                raise FileNotFoundError(f"{str(run)!r} has no held-out episodes of arm {arm!r} ({f})")
            eps = json.loads(f.read_text())
            have = {(e["task"], e["unit_id"], e["seed"]) for e in out.get(f"{label}:{arm}", [])}
            dup = [e for e in eps if (e["task"], e["unit_id"], e["seed"]) in have]
            if dup:
                raise ValueError(f"runs labelled {label!r} share trials (e.g. {dup[0]['task']} unit {dup[0]['unit_id']} "
                                 f"seed {dup[0]['seed']}): give them different labels")
            out.setdefault(f"{label}:{arm}", []).extend(eps)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="append", required=True, help="LABEL=DIR, a job output folder (repeatable)")
    ap.add_argument("--arms", default="base,fert", help="comma-separated arms compared across labels")
    ap.add_argument("--baseline", default=None, help="the label every other label is compared with (default: the last)")
    ap.add_argument("--pair", action="append", default=[], help="extra pair LABEL:ARM-LABEL:ARM (repeatable)")
    ap.add_argument("--seed", type=int, default=0, help="the experiment seed's folder (seed_<seed>)")
    ap.add_argument("--out", required=True, help="output folder")
    args = ap.parse_args(argv)
    try:
        runs = []
        for r in args.run:
            label, sep, d = r.partition("=")
            if not sep or not label or not d:
                raise ValueError(f"--run expects LABEL=DIR, given {r!r}")
            runs.append((label, Path(d)))
        labels = list(dict.fromkeys(label for label, _ in runs))
        base = args.baseline or labels[-1]
        if base not in labels:
            raise ValueError(f"--baseline {base!r} is not one of the labels {labels}")
        arms = [a for a in args.arms.split(",") if a]
        results = load_arms(runs, arms, args.seed)
        pairs = [(f"{lab}:{a}", f"{base}:{a}") for a in arms for lab in labels if lab != base]
        for p in args.pair:
            a, sep, b = p.partition("-")
            if not sep or a not in results or b not in results:
                raise ValueError(f"--pair {p!r}: expected LABEL:ARM-LABEL:ARM of {sorted(results)}")
            pairs.append((a, b))
    except (ValueError, FileNotFoundError) as e:
        print(f"compare_runs: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = success_table(results)
    paired = paired_differences(results, pairs)
    write_table(table, out, "success")
    write_paired(paired, out, "paired")
    print(table_markdown(table))
    print()
    print(paired_markdown(paired))
    return 0


if __name__ == "__main__":
    sys.exit(main())
