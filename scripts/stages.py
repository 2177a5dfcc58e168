"""Where a run's failures stall and whether FERT's retrieval answers them at the same stage (multi-stage tasks).

    python scripts/stages.py outputs/run/seed_0                 # a main-job seed directory
    python scripts/stages.py outputs/run/seed_0 --arms base,fert

Reads the seed directory's held-out episodes (``episodes/<arm>.json``, ``eval_store``) and every in-loop learner's
retrieval audits (``learner_*/audits/retrieval_audit_round_*.json``, their ``"retrieved"`` record) with the run's
store, and writes into the seed directory:

* ``stages.md`` / ``stages.json``: per arm and task, the held-out failures by the stage they stalled at
  (``fleet.stages.stall_table``; the main job writes the same after its evaluation);
* ``retrieval_stages.md`` / ``retrieval_stages.json``: per learner, round and task, the stage each failure context
  had reached at its onset and the retrieval weight on windows whose anchor (where the supervised continuation
  starts) is at the same, a later or an earlier stage (``fleet.stages.retrieval_stage_match``).

Stages (``fleet.stages``): start, reached, grasped, carried, success, from the simulator's signals; for analysis
only. Exits with a message naming the problem for a missing directory or a run without staged tasks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet.stages import STAGE_NAMES, retrieval_stage_match, stall_markdown, write_stall_report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("seed_dir", help="a main-job seed directory (<run>/seed_<s>)")
    ap.add_argument("--arms", default=None, help="comma-separated arms of the held-out table (default: all)")
    a = ap.parse_args(argv)
    sd = Path(a.seed_dir)
    if not (sd / "store").is_dir():
        raise SystemExit(f"{sd}: not a seed directory of the main job (no store/)")
    from experience_dict.store import ExperienceStore

    arms = {}
    for f in sorted((sd / "episodes").glob("*.json")):
        if f.stem != "fingerprints" and (a.arms is None or f.stem in a.arms.split(",")):
            arms[f.stem] = json.loads(f.read_text())
    table = write_stall_report(arms, sd / "eval_store", sd) if arms else None
    if table:
        print("held-out failures by the stage they stalled at (stages.md):\n" + stall_markdown(table))
    reader = ExperienceStore.open(str(sd / "store"))
    match: dict = {}
    for audit in sorted(sd.glob("learner_*/audits/retrieval_audit_round_*.json")):
        rec = json.loads(audit.read_text()).get("retrieved")
        if rec is None:
            continue
        learner = audit.parent.parent.name[len("learner_"):]
        got = retrieval_stage_match(rec, reader)
        if got:
            match.setdefault(learner, {})[int(audit.stem.rsplit("_", 1)[1])] = got
    if match:
        (sd / "retrieval_stages.json").write_text(json.dumps(match, indent=1))
        names = STAGE_NAMES[:-1]
        lines = ["# Retrieval against the failure's stage (simulator's stage signals)", "",
                 ("Failure contexts by the stage reached at their onset; the retrieval weight by the stage of the "
                  "retrieved window's anchor (where its supervised continuation starts), relative to the context's."),
                 "",
                 "| learner | round | task | contexts at " + " / ".join(names) + " | anchors at " + " / ".join(names)
                 + " | same stage | later | earlier | own retry |", "|---|---|---|---|---|---|---|---|---|"]
        for learner, rounds in match.items():
            for r, per in sorted(rounds.items()):
                for task, m in sorted(per.items()):
                    lines.append(f"| {learner} | {r} | {task} | "
                                 + " / ".join(str(m["context_stage"][n]) for n in names) + " | "
                                 + " / ".join(f"{m['anchor_stage'][n]:.2f}" for n in names)
                                 + f" | {m['same_stage_weight']:.2f} | {m['later_stage_weight']:.2f} | "
                                 f"{m['earlier_stage_weight']:.2f} | {m['own_retry_weight']:.2f} |")
        (sd / "retrieval_stages.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    if not table and not match:
        raise SystemExit(f"{sd}: no episode of a staged task (fleet.stages.STAGED_TASKS) and no retrieval audit "
                         "with a 'retrieved' record")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
