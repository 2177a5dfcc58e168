"""Run the simulated fleet: N robot units acting with one policy for a budget, every episode into the store.

    python scripts/rollout.py task=mw_quick fleet.units=4 policy=expert
    python scripts/rollout.py policy=random fleet.episodes_per_unit=null fleet.wall_time_s=60
    python scripts/rollout.py policy=aed_diffusion fleet.policy_version=latest          # newest registry version
    python scripts/rollout.py policy=aed_diffusion fleet.checkpoint=outputs/ckpt fleet.policy_server=true
    python scripts/rollout.py fleet.ray_address=auto fleet.units=96 robot.train_units=0:96   # on a Ray cluster

Prints per-task and per-unit success tables and writes them, with every episode summary, to
``<output_dir>/fleet_result.json``. Ctrl-C stops the fleet; committed episodes stay in the store.

Exit status: 0 when every unit ran its budget; 1 (with a summary saying why) when the run committed nothing,
gave up a unit (its trials kept committing nothing: an error in the env or the policy, a NaN at the first
step) or the store's ``verify`` fails; 2 on a refusal, said in one line with the full trace in the run's log
file (``fleet.refusals``): the acting policy cannot be built (e.g. a checkpoint of the wrong shape), another live
fleet holds a unit's shard (``WriterBusyError``), a missing or tampered checkpoint; 3 when the Ray head of a
joined cluster is lost mid-run (``fleet.head_lost_after_s``): one line, the partial ``fleet_result.json``
(``"complete": false``) and the command that resumes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

import configs.typed  # noqa: F401 - registers the typed config groups before Hydra composes
from fleet.progress import calm_progress
from policies.threads import passive_wait

passive_wait()   # before torch loads: OpenMP's idle threads sleep instead of spinning (policies/threads.py)
calm_progress()  # off a terminal, a progress bar redraws every 30 s, not 15 times a second (fleet/progress.py)

from fleet.coordinator import Fleet


def result_json(result, server: dict | None, verify_ok: bool | None, **extra) -> dict:
    """``fleet_result.json``'s content: the run's episodes, restarts, failures, success tables and store check."""
    return {"episodes": result.episodes, "restarts": result.restarts, "failures": result.failures,
            "interrupted": result.interrupted, "wall_s": result.wall_s,
            "success_by_task": {k: list(v) for k, v in result.success_by("task").items()},
            "success_by_unit": {str(k): list(v) for k, v in result.success_by("unit_id").items()},
            "policy_server": server, "store_verify_ok": verify_ok,
            "terminations": result.terminations, "faulted": result.faulted,
            "dropped_units": result.dropped_units, "dropped_tasks": result.dropped_tasks, **extra}


def head_lost_handler(out: Path, store_url: str):
    """``Fleet(on_head_lost=...)``: write the partial ``fleet_result.json`` (``"head_lost"`` says when and where;
    the store is not verified) and say in one line what happened, what is kept and how to resume."""
    import shlex

    def on_lost(result, address: str, down_s: float) -> None:
        from fleet.result import FleetResult

        result = result or FleetResult()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result_json(result, None, None, complete=False,
                                              head_lost={"address": address, "unreachable_s": round(down_s, 1)}),
                                  indent=1))
        print(f"\nfleet: the Ray head at {address} was lost mid-run (unreachable for {down_s:.0f} s): "
              f"{len(result.episodes)} episodes committed to {store_url} are kept; partial results: {out}; "
              f"once the head is back, resume (each unit continues its seeds from its shard) with: "
              f"python scripts/rollout.py {shlex.join(sys.argv[1:])}", file=sys.stderr, flush=True)

    return on_lost


@hydra.main(version_base=None, config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> None:
    from configs.schema import check_or_exit

    check_or_exit(cfg)   # every value against its rule, before any work
    from fleet.refusals import one_line_refusals

    out = Path(cfg.output_dir) / "fleet_result.json"
    # a refusal (another fleet holds a shard, a checkpoint that cannot be built, a tampered registry): its
    # one-line cause on stderr, exit 2, the full trace in the run's log file
    with one_line_refusals("fleet"), Fleet(cfg, on_head_lost=head_lost_handler(out, str(cfg.store.url))) as fleet:
        result = fleet.run()
        server = fleet.server_stats()
    print(f"\n{len(result.episodes)} episodes, {result.steps} steps in {result.wall_s:.1f} s "
          f"({result.steps / max(result.wall_s, 1e-9):.0f} steps/s); restarts {result.restarts}"
          + (" (interrupted)" if result.interrupted else ""))
    print("\n" + result.table("task") + "\n\n" + result.table("unit_id"))
    if server:
        print(f"\npolicy server: {server}")
    from experience_dict.store import ExperienceStore, StoreError

    out.parent.mkdir(parents=True, exist_ok=True)   # what the fleet did, written before the store is checked
    out.write_text(json.dumps(result_json(result, server, None, complete=True), indent=1))
    try:
        check = ExperienceStore.open(str(cfg.store.url)).verify()
        print(f"\nstore {cfg.store.url}: {check['episodes']} episodes, verify ok={check['ok']}")
    except StoreError as e:   # e.g. the object-store endpoint went down after the last commit: said in one line
        check = {"ok": False, "episodes": None, "error": str(e)}
        print(f"\nstore {cfg.store.url}: cannot be checked: {e}", file=sys.stderr)
    out.write_text(json.dumps(result_json(result, server, check["ok"], complete=True,
                                          **({"store_error": check["error"]} if "error" in check else {})), indent=1))
    print(f"results: {out}")
    print(f"summary: {result.summary()}")
    bad = [why for why, hit in [("no episode was committed", not result.episodes and not result.interrupted),
                                (f"units {result.dropped_units} were given up", bool(result.dropped_units)),
                                ("tasks were given up on some units: "
                                 + ", ".join(f"{d['task']} on unit {d['unit']}" for d in result.dropped_tasks),
                                 bool(result.dropped_tasks)),
                                ("the store's verify failed" if "error" not in check else
                                 "the store could not be checked", not check["ok"])] if hit]
    if bad:
        print(f"fleet: FAILED: {'; '.join(bad)}; {'; '.join(result.failures[-3:])}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
