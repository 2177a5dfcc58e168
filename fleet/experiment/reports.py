"""The job's outputs over all seeds: the pooled success table and the paired differences with their captions and
the unit table (``results.md/json``, ``paired.md/json``), the arms plot (``arms.png``), rollout videos
(``videos/``) and the wandb log."""

from __future__ import annotations

import os
from pathlib import Path

from fleet.experiment.arms import PAIRS
from fleet.experiment.bases import demo_config
from fleet.experiment.evaluation import record_rollouts
from fleet.experiment.job_config import JobConfig
from fleet.experiment.tables import paired_over_seeds, plot_arms, success_table, write_paired, write_table
from policies.train_config import TrainConfig

RESULTS_CAPTION = ("Held-out success rate in % (successes/trials) with Wilson 95% intervals, pooled over the "
                   "experiment seeds {seeds}; every arm ran the same held-out trials (task, unit, reset seed) on "
                   "units {heldout}.\n\n")
PAIRED_CAPTION = ("Trial-by-trial differences arm − baseline in percentage points on the same held-out trials, "
                  "pooled over seeds {seeds}. [lo, hi]: 95% interval from a bootstrap that resamples the seeds, "
                  "then the trials within each seed and task (it counts training noise as well as trial noise "
                  "when there are several seeds). (w/l, p): trials only the arm solved / only the baseline "
                  "solved, and the exact McNemar p-value of that split.\n\n")


def unit_table(c: dict, units: list[int]) -> str:
    """Markdown table of the units' variation (gain, latency, friction, mass, observation noise)."""
    from sim import unit_lists
    from sim.units import RobotUnit

    rows = ["| unit | action gain (x, y, z) | latency (steps) | friction x | mass x | obs noise (mm) |",
            "|---|---|---|---|---|---|"]
    dc, demo_units = demo_config(c)
    only_demo = set(demo_units) - set(unit_lists(c["robot"])[0])
    for u in units:   # a demonstration-only unit has the demonstrations' (scaled) variation
        d = RobotUnit.draw(int(u), (dc if u in only_demo else c)["robot"])
        rows.append(f"| {u} | {', '.join(f'{g:.2f}' for g in d.action_gain)} | {d.action_latency} | "
                    f"{d.friction_scale:.2f} | {d.mass_scale:.2f} | {1000 * d.obs_noise_std:.2f} |")
    return "\n".join(rows)


def write_reports(c: dict, out: Path, per_seed: dict, arms: list, seeds: list[int], heldout: list[int],
                  fleet_units: list[int], demo_units: list[int], units_md: str, wall_s: float):
    """The job's pooled success table and paired differences (``results.md/json``, ``paired.md/json`` with their
    captions and the unit table) and the arms plot (``arms.png``); returns ``(table, paired, caption fields)``."""
    job = JobConfig.from_dict(c["job"])
    results_by_seed = {s: r["results"] for s, r in per_seed.items()}
    pooled = {a.name: [e | {"exp_seed": s} for s in seeds for e in results_by_seed[s][a.name]] for a in arms}
    table = success_table(pooled)
    table["meta"] = {"seeds": seeds, "held_out_units": heldout, "fleet_units": fleet_units,
                     "demo_units": demo_units, "trials_per_task": int(c["eval"]["trials_per_task"]),
                     "checkpoints": {s: r["checkpoints"] for s, r in per_seed.items()},
                     "fert_rounds": int(c["fert"]["rounds"]),
                     "updates_per_round": int(c["learner"]["updates_per_version"]),
                     "demos_per_task": job.demos_per_task,
                     "rounds": {s: r["rounds"] for s, r in per_seed.items()},
                     "total_wall_s": wall_s}
    table["learning_curve"] = {s: [{k: p[k] for k in ("round", "version", "heldout", "heldout_critic", "successes",
                                                      "successes_critic", "trials", "per_task", "per_task_critic")}
                                   for p in r.get("learning_curve") or []] for s, r in per_seed.items()}
    names = [a.name for a in arms]
    paired = paired_over_seeds(results_by_seed, [(a, b) for a, b in PAIRS if a in names and b in names])
    fmt = {"seeds": seeds, "heldout": heldout}
    write_table(table, out, "results")
    write_paired(paired, out, "paired")
    for name, cap in (("results", RESULTS_CAPTION), ("paired", PAIRED_CAPTION)):
        md = out / f"{name}.md"
        tail = (f"\n\nUnits (demonstrations on {demo_units}, fleet on {fleet_units}, held out {heldout}):\n\n"
                + units_md + "\n") if name == "results" else ""
        if name == "results":   # the learning curve beside the table (it was printed to stdout only)
            from fleet.experiment.curve import curve_lines

            curves = [(s, r.get("learning_curve")) for s, r in per_seed.items() if r.get("learning_curve")]
            tail += "".join("\n```\n" + "\n".join(curve_lines(pts, s)) + "\n```\n" for s, pts in curves)
        md.write_text(cap.format(**fmt) + md.read_text() + tail)
    # one x axis for the fleet and the learning curve, the policy version (as stdout's curve and results.json name
    # it): fleet round i acts with version i + 1 (v1 = the base)
    fleet_hist = {f"fleet, seed {s}": [{"round": i + 1, "successes": rr["successes"], "trials": rr["episodes"]}
                                       for i, rr in enumerate(r["rounds"])] for s, r in per_seed.items()}
    for s, r in per_seed.items():   # the learning curve: held-out success of each published version
        pts = r.get("learning_curve") or []
        fleet_hist[f"held-out K=1, seed {s}"] = [{"round": p["version"], "successes": p["successes"],
                                                  "trials": p["trials"]} for p in pts]
        fleet_hist[f"held-out + critic, seed {s}"] = [{"round": p["version"], "successes": p["successes_critic"],
                                                       "trials": p["trials"]} for p in pts
                                                      if p.get("successes_critic") is not None]
    plot_arms(table, out / "arms.png", title=f"held-out success, seeds {seeds}", rounds=fleet_hist)
    return table, paired, fmt


def record_videos(seed_run: dict, c: dict, out: Path, heldout: list[int]) -> None:
    """Rollout videos of ``fert`` and ``base`` on held-out units (first seed), once."""
    state = seed_run["state"]
    if state.done("videos"):
        return
    job, vids = JobConfig.from_dict(c["job"]), []
    for arm in ("fert", "base"):
        if arm in seed_run["checkpoints"]:
            vids += [str(p) for p in record_rollouts(seed_run["config"], seed_run["checkpoints"][arm],
                                                     out / "videos" / arm, heldout, list(c["task"]["tasks"]),
                                                     max_videos=job.videos, max_episodes=job.video_episodes)]
    state.mark("videos", vids)


def log_wandb(c: dict, out: Path, table: dict) -> None:
    """Log the result table and plot to wandb (offline unless WANDB_MODE says otherwise)."""
    wb = TrainConfig.from_dict(c["train"]).wandb
    if not wb.enabled:
        return
    try:
        import wandb
    except ImportError:
        return
    run = wandb.init(project=wb.project, name="main-job", dir=str(out), mode=os.environ.get("WANDB_MODE", wb.mode),
                     config=c)
    rows = [[arm, t, cell["rate"], cell["ci95"][0], cell["ci95"][1], cell["trials"]]
            for arm, row in table["arms"].items() for t, cell in {**row["tasks"], "average": row["average"]}.items()]
    run.log({"results": wandb.Table(columns=["arm", "task", "success", "ci_low", "ci_high", "trials"], data=rows),
             "arms": wandb.Image(str(out / "arms.png"))})
    run.finish()
