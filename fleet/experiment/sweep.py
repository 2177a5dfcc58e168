"""The fleet-size sweep (``job.fleet_sizes`` on the first seed, or ``scripts/fleet_size.py`` on a finished seed): the
main loop once per fleet size, each unit running the same episodes per round, every size's ``fert`` (K = 1) and
filtered BC on its own store evaluated on the held-out units (``fleet_size.md/json``, ``fleet_size_paired.md/json``,
``success_vs_fleet_size.png``)."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

from experience_dict.store import ExperienceStore, copy_episodes
from fleet.experiment.arms import get_arms
from fleet.experiment.evaluation import evaluate_arms
from fleet.experiment.job_config import JobConfig
from fleet.experiment.offline import stage_offline_arms
from fleet.experiment.rounds import stage_fleet_rounds
from fleet.experiment.state import JobState, Stages, seed_config
from fleet.experiment.tables import (
    paired_differences,
    plot_success_per_round,
    success_table,
    table_markdown,
    write_paired,
    write_table,
)
from fleet.registry import CheckpointRegistry

SWEEP_ARMS = ("fert", "filtered_bc_retries")


def check_fleet_sizes(sizes: list[int], train_units: list[int]) -> None:
    """Raise ValueError unless every fleet size is in ``[1, len(train_units)]``."""
    bad = [n for n in sizes if not 1 <= n <= len(train_units)]
    if bad:
        raise ValueError(f"job.fleet_sizes: sizes {bad} outside [1, {len(train_units)}] (robot.train_units has "
                         f"{len(train_units)} units: {train_units}); add training units or drop those sizes")


def sweep_report(seed_run: dict, sd: Path, out: Path, sizes: list[int], train_units: list[int],
                 heldout: list[int]) -> dict:
    """The fleet-size sweep on a seed (``fleet_size_sweep``) and its outputs in ``out``: ``fleet_size.md/json``,
    ``fleet_size_paired.md/json``, ``success_vs_fleet_size.png``. Returns the sweep."""
    sweep = fleet_size_sweep(seed_run["config"], sd, sizes, seed_run["checkpoints"]["base"], train_units, heldout)
    write_table(sweep["table"], out, "fleet_size")
    write_paired(sweep["paired"], out, "fleet_size_paired")
    plot_success_per_round(sweep["history"], out / "success_vs_fleet_size.png", x="fleet_size",
                           title="held-out success against fleet size (episodes per unit fixed)")
    print("\nheld-out success against fleet size:\n" + table_markdown(sweep["table"]), flush=True)
    return sweep


def size_config(c: dict, sub: Path, n: int, per_unit: int) -> dict:
    """The seed's config ``c`` for a fleet of ``n`` units in ``sub``: its own store, registry and cache; ``n`` units
    running ``per_unit`` episodes each per round; no per-round learning curve (the sizes are compared at the end)."""
    cn = seed_config(c, sub, int(c["seed"]))
    return {**cn, "fleet": {**cn["fleet"], "units": int(n)},
            "job": {**cn["job"], "fleet_episodes_per_unit": int(per_unit), "curve_trials_per_task": 0,
                    "overlap_offline_arms": False}}


def fleet_size_sweep(c: dict, sd: Path, sizes: list[int], base_ckpt: str, train_units: list[int],
                     heldout: list[int], progress: bool = True) -> dict:
    """The main loop once per fleet size, from the seed's demonstrations and base, evaluated on the held-out units.

    As in "Learning from Fleet Experience" (success against fleet size at a fixed collection time per robot),
    collection per robot is fixed, exactly: every round each of the ``n`` units (the first ``n`` of
    ``train_units``) runs ``job.sweep_episodes_per_unit`` episodes of the fixed plan with the newest version
    (``fleet.experiment.rounds.fleet_round``: the same retries or recovery attempts, the same labels, the same
    detector as the seed when it has one), then the ``fert`` learner runs its round and the gate publishes; after
    ``fert.rounds`` rounds, filtered BC + retries is fine-tuned on that size's store with the same budget. So a fleet
    of ``n`` units feeds every round ``n`` times the experience of one unit. Each size runs in
    ``<sd>/sweep/n<n>/`` (its store starts with a copy of the seed's demonstrations; ``job_state.json`` of its own,
    so it resumes from its last finished stage). Every size's ``fert`` (the newest version's weights alone, K = 1)
    and ``filtered_bc_retries`` and the base play the seed's held-out plan.

    Returns:
        ``{"table": success_table of "base", "fert_n<n>", "filtered_bc_retries_n<n>", "history": {"fert (K = 1)":
        [{"fleet_size", "successes", "trials"}], "filtered BC + retries": [...]}, "paired": each size against the
        next smaller one and fert against filtered BC per size, "sizes": {n: {"fleet_episodes", "rounds"}}}``.

    Raises:
        ValueError: a size outside ``[1, len(train_units)]``.
    """
    check_fleet_sizes(sizes, train_units)
    per_unit = JobConfig.from_dict(c["job"]).sweep_episodes_per_unit
    seed = int(c["seed"])
    demos = ExperienceStore.open(c["store"]["url"])
    arms = get_arms(list(SWEEP_ARMS))
    chosen: dict[str, str] = {"base": str(base_ckpt)}
    sizes_rec: dict[str, dict] = {}
    for n in sorted(sizes):
        sub = sd / "sweep" / f"n{n}"
        cn = size_config(c, sub, n, per_unit)
        units = list(train_units[:n])
        if not (sub / "store").exists():   # the seed's demonstrations only: every size starts from them
            copy_episodes(demos, str(sub / "store"), demos.episodes(is_demo=True))
        if (sd / "detector").is_dir() and not (sub / "detector").exists():   # the labelling effort is paid once
            shutil.copytree(sd / "detector", sub / "detector")
        reg = CheckpointRegistry(cn["fleet"]["registry_url"])
        if reg.latest_version() is None:
            from fleet.lineage import lineage

            reg.publish(base_ckpt, metadata={"run_id": "base", "round": -1, "kind": "base",
                                             **lineage(cn["store"]["url"], None, cn.get("obs"))})
        state = JobState(sub / "job_state.json")
        stages = Stages([5] * int(cn["fert"]["rounds"]) + [2])
        print(f"\nfleet-size sweep: {n} unit(s) x {per_unit} episodes per round, {cn['fert']['rounds']} rounds "
              f"({sub})", flush=True)
        ckpt = {"base": str(base_ckpt)}
        stage_fleet_rounds(cn, sub, seed, state, stages, [a for a in arms if a.in_loop], ckpt, units, heldout, reg,
                           progress)
        stage_offline_arms(cn, sub, seed, state, stages, [a for a in arms if not a.in_loop], ckpt,
                           ExperienceStore.open(cn["store"]["url"]), heldout)
        for a in SWEEP_ARMS:
            chosen[f"{a}_n{n}"] = str(ckpt[a])
        fleet_eps = ExperienceStore.open(cn["store"]["url"]).episodes(is_demo=False)
        sizes_rec[str(n)] = {"fleet_episodes": len(fleet_eps), "units": units,
                             "rounds": [state.get(f"round_{r}") for r in range(int(cn["fert"]["rounds"]))]}
    results = evaluate_arms(c, chosen, sd / "sweep", int(c["eval"]["trials_per_task"]), units=heldout,
                            progress=progress)
    table = success_table(results)
    table["meta"] = {"fleet_sizes": sorted(sizes), "episodes_per_unit_per_round": per_unit,
                     "rounds": int(c["fert"]["rounds"]), "held_out_units": heldout,
                     "trials_per_task": int(c["eval"]["trials_per_task"]), "checkpoints": chosen,
                     "fleet_episodes": {n: r["fleet_episodes"] for n, r in sizes_rec.items()}}
    names = {"fert": "fert (K = 1)", "filtered_bc_retries": "filtered BC + retries"}
    history = {names[a]: [{"fleet_size": n, **{k: table["arms"][f"{a}_n{n}"]["average"][k]
                                               for k in ("successes", "trials")}} for n in sorted(sizes)]
               for a in SWEEP_ARMS}
    order = sorted(sizes)
    pairs = [(f"{a}_n{n}", f"{a}_n{m}") for a in SWEEP_ARMS for m, n in itertools.pairwise(order)]
    pairs += [(f"fert_n{n}", f"filtered_bc_retries_n{n}") for n in order] + [(f"fert_n{n}", "base") for n in order]
    paired = paired_differences(results, pairs)
    (sd / "sweep" / "sizes.json").write_text(json.dumps(sizes_rec, indent=1, default=str))
    return {"table": table, "history": history, "paired": paired, "sizes": sizes_rec}
