"""The fleet-size sweep (``job.fleet_sizes``, on the first seed): FERT once per fleet size from the
demonstrations-only store, each unit running the same episodes per round, every size evaluated on the held-out
units (``fleet_size.md/json``, ``fleet_size_paired.md/json``, ``success_vs_fleet_size.png``)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from experience_dict.store import ExperienceStore
from fleet.coordinator import Fleet
from fleet.experiment.evaluation import evaluate_arms
from fleet.experiment.job_config import JobConfig
from fleet.experiment.protocol import run_retries
from fleet.experiment.state import JobState
from fleet.experiment.tables import (
    paired_differences,
    plot_success_per_round,
    success_table,
    table_markdown,
    write_paired,
    write_table,
)
from fleet.fert.learner import FertLearner
from fleet.registry import CheckpointRegistry


def check_fleet_sizes(sizes: list[int], train_units: list[int]) -> None:
    """Raise ValueError unless every fleet size is in ``[1, len(train_units)]``."""
    bad = [n for n in sizes if not 1 <= n <= len(train_units)]
    if bad:
        raise ValueError(f"job.fleet_sizes: sizes {bad} outside [1, {len(train_units)}] (robot.train_units has "
                         f"{len(train_units)} units: {train_units}); add training units or drop those sizes")


def stage_sweep_snapshot(c: dict, sd: Path, state: JobState, reader) -> None:
    """For the fleet-size sweep: a copy of the store holding the demonstrations only, taken once before any fleet
    episode (every fleet size starts from it).

    Raises:
        SystemExit: the run directory already holds fleet episodes.
    """
    if state.done("demo_snapshot"):
        return
    if state.done("round_0") or reader.episodes(is_demo=False):
        raise SystemExit(f"job.fleet_sizes: {sd} already holds fleet episodes; run the sweep in a fresh run dir "
                         "(hydra.run.dir=...) so every fleet size starts from the demonstrations only")
    snap = sd / "sweep" / "demo_store"
    shutil.rmtree(snap, ignore_errors=True)
    shutil.copytree(c["store"]["url"], snap)
    state.mark("demo_snapshot", str(snap))


def sweep_report(seed_run: dict, sd: Path, out: Path, sizes: list[int], train_units: list[int],
                 heldout: list[int]) -> None:
    """The fleet-size sweep on the first seed (``fleet_size_sweep``) and its outputs: ``fleet_size.md/json``,
    ``fleet_size_paired.md/json``, ``success_vs_fleet_size.png``."""
    sweep = fleet_size_sweep(seed_run["config"], sd, seed_run["state"], sizes, seed_run["checkpoints"]["base"],
                             train_units, heldout)
    write_table(sweep["table"], out, "fleet_size")
    write_paired(sweep["paired"], out, "fleet_size_paired")
    plot_success_per_round(sweep["history"], out / "success_vs_fleet_size.png", x="fleet_size",
                           title="held-out success of FERT against fleet size")
    print("\nheld-out success against fleet size:\n" + table_markdown(sweep["table"]), flush=True)


def fleet_size_sweep(c: dict, out: Path, state: JobState, sizes: list[int], base_ckpt: str,
                     train_units: list[int], heldout: list[int]) -> dict:
    """FERT once per fleet size, each from the demonstrations-only store, evaluated on the held-out units.

    As in "Learning from Fleet Experience" (success against fleet size at a fixed collection time per robot),
    collection per robot is fixed, here exactly: every round, each of the ``n`` units runs
    ``job.sweep_episodes_per_unit`` episodes with the current policy version, then the learner runs its FERT
    round on the store and publishes the next version. So a fleet of ``n`` units feeds every round ``n`` times
    the experience of one unit. (The main run's concurrent fleet cannot fix that: on a fixed number of CPU
    cores, units share the cores, and the fleet's total episodes per round would not grow with ``n``.)
    Everything else (rounds, updates per round, base policy, evaluation plan) is the main run's. Each size
    runs in ``<out>/sweep/n<n>/`` (own store copied from ``sweep/demo_store``, registry, learner) and is a
    resumable stage ``sweep_n<n>`` of ``job_state.json``; a size interrupted mid-round resumes its learner from
    its checkpoint and tops its units up to the round's episode count.

    Returns:
        ``{"table": success_table of arms "fert_n<n>", "history": {"FERT (held-out)": [{"fleet_size",
        "successes", "trials"}]}, "paired": paired_differences of every size against the smallest}``.
    """
    per_unit = JobConfig.from_dict(c["job"]).sweep_episodes_per_unit
    rounds = int(c["fert"]["rounds"])
    arms = {}
    for n in sizes:
        sub = out / "sweep" / f"n{n}"
        stage = f"sweep_n{n}"
        units = train_units[:n]
        cs = {**c, "store": {**c["store"], "url": str(sub / "store")},
              "fleet": {**c["fleet"], "registry_url": str(sub / "registry"), "cache_dir": str(sub / "cache")},
              # the fleet idles while the learner trains (learner.torch_threads as configured: 2 threads trained ~2x
              # slower than 1 on the 2-core machine, docs/RESULTS.md experiment 26)
              "learner": {**c["learner"], "min_new_episodes": 0, "max_wait_s": 0}}
        if not state.done(stage):
            state.mark(stage, _sweep_size(cs, sub, n, units, state.get("demo_snapshot"), base_ckpt, per_unit, rounds,
                                          heldout))
        arms[f"fert_n{n}"] = state.get(stage)["checkpoint"]
    results = evaluate_arms(c, arms, out / "sweep", int(c["eval"]["trials_per_task"]), units=heldout)
    table = success_table(results)
    table["meta"] = {"fleet_sizes": sizes, "episodes_per_unit_per_round": per_unit, "rounds": rounds,
                     "held_out_units": heldout, "trials_per_task": int(c["eval"]["trials_per_task"]),
                     "checkpoints": arms,
                     "fleet_episodes": {f"fert_n{n}": state.get(f"sweep_n{n}")["fleet_episodes"] for n in sizes}}
    history = {"FERT (held-out)": [{"fleet_size": n, "successes": table["arms"][f"fert_n{n}"]["average"]["successes"],
                                    "trials": table["arms"][f"fert_n{n}"]["average"]["trials"]} for n in sizes]}
    smallest = f"fert_n{min(sizes)}"
    paired = paired_differences(results, [(a, smallest) for a in arms if a != smallest])
    return {"table": table, "history": history, "paired": paired}


def _sweep_size(cs: dict, sub: Path, n: int, units: list[int], demo_snapshot: str, base_ckpt: str, per_unit: int,
                rounds: int, heldout: list[int]) -> dict:
    """One fleet size of ``fleet_size_sweep`` in ``sub``: ``rounds`` rounds of ``per_unit`` episodes on each of
    ``units`` (topped up after an interruption), failure retries, one FERT round each. Returns the stage record
    ``{"checkpoint", "fleet_episodes", "wall_s", "per_version", "learner"}``."""
    from fleet.fert.contexts import retry_of

    if not (sub / "store").exists():
        shutil.copytree(demo_snapshot, sub / "store")
    reg = CheckpointRegistry(cs["fleet"]["registry_url"])
    if reg.latest_version() is None:
        reg.publish(base_ckpt, metadata={"run_id": "base", "round": -1, "kind": "base"})
    print(f"fleet-size sweep: FERT with {n} unit(s), {per_unit} episodes per unit per round", flush=True)
    t0 = time.perf_counter()
    learner = FertLearner(cs, cs["store"]["url"], cs["fleet"]["registry_url"], str(sub / "learner_fert"),
                          base_ckpt, run_id=f"fert_n{n}")
    with Fleet(cs, policy="latest", units=units, store_url=cs["store"]["url"]) as fleet:
        while learner.state["round"] < rounds:
            version = reg.latest_version()
            reader = ExperienceStore.open(cs["store"]["url"])
            done = min(sum(1 for m in reader.episodes(unit_id=u, is_demo=False)
                           if int(m.policy_version) == version and not retry_of(m)) for u in units)
            if per_unit - done > 0:
                res = fleet.run(episodes_per_unit=per_unit - done)
                fails = [e for e in res.episodes if not e["success"]]
                rcfg = dict(cs["fert"].get("retry") or {})
                if fails and rcfg.get("enabled", True):
                    run_retries(fleet, fails, rcfg, heldout, len(res.episodes))
            learner.run_round()
    reader = ExperienceStore.open(cs["store"]["url"])
    eps = [{"policy_version": m.policy_version, "success": m.success} for m in reader.episodes(is_demo=False)]
    return {"checkpoint": learner.final_checkpoint(), "fleet_episodes": len(eps), "wall_s": time.perf_counter() - t0,
            "per_version": _per_version(eps), "learner": learner.status()}


def _per_version(episodes: list[dict]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for e in episodes:
        s = out.setdefault(str(int(e["policy_version"])), [0, 0])
        s[0] += int(bool(e["success"]))
        s[1] += 1
    return out
