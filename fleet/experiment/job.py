"""The main job behind ``scripts/run.py``: every stage of one experiment seed (:func:`run_seed`), and the whole job
over the seeds with its reports (:func:`run_job`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from omegaconf import DictConfig

from fleet.experiment.arms import get_arms
from fleet.experiment.bases import demo_config, needs_no_aed, stage_demos_and_bases
from fleet.experiment.evaluation import evaluate_arms
from fleet.experiment.job_config import JobConfig
from fleet.experiment.offline import stage_offline_arms, start_offline_arms
from fleet.experiment.reports import (
    PAIRED_CAPTION,
    RESULTS_CAPTION,
    log_wandb,
    record_videos,
    unit_table,
    write_reports,
)
from fleet.experiment.rounds import stage_fleet_rounds
from fleet.experiment.state import JobState, Stages, plain_config, seed_config
from fleet.experiment.sweep import check_fleet_sizes, sweep_report
from fleet.experiment.tables import paired_markdown, table_markdown
from fleet.lineage import lineage
from fleet.stages import stall_markdown, write_stall_report
from fleet.registry import CheckpointRegistry


def run_seed(c: dict, sd: Path, seed: int, arms: list, stages: Stages, progress: bool = True) -> dict:
    """Every stage of one experiment seed in ``sd`` (demonstrations, the two bases, the fleet rounds with the
    in-loop learners, the offline arms, the held-out evaluation), each skipped when ``job_state.json`` says it is
    done; returns ``{"results": {arm: episodes}, "checkpoints", "rounds", "config", "state"}``."""
    from sim import unit_lists

    sd.mkdir(parents=True, exist_ok=True)
    c = seed_config(c, sd, seed)
    (sd / "config.json").write_text(json.dumps(c, indent=1))
    state = JobState(sd / "job_state.json")
    train_units, heldout = unit_lists(c["robot"])
    fleet_units = train_units[: int(c["fleet"]["units"])]
    reader, ckpt = stage_demos_and_bases(c, sd, seed, state, stages, progress,
                                         need_no_aed=needs_no_aed(arms))
    reg = CheckpointRegistry(c["fleet"]["registry_url"])
    if reg.latest_version() is None:
        reg.publish(ckpt["base"], metadata={"run_id": "base", "round": -1, "kind": "base",
                                            **lineage(c["store"]["url"], None, c.get("obs"))})
    background: dict = {}

    def after_last_fleet() -> None:
        # the store is final once the last round's fleet and retries are in: the offline arms train in a process
        # of their own beside that round's learner (1 thread each), instead of after it
        if JobConfig.from_dict(c["job"]).overlap_offline_arms:
            background.update(start_offline_arms(c, sd, state, arms, ckpt, heldout, seed))

    stage_fleet_rounds(c, sd, seed, state, stages, [a for a in arms if a.in_loop], ckpt, fleet_units, heldout,
                       reg, progress, after_last_fleet=after_last_fleet)
    stage_offline_arms(c, sd, seed, state, stages, arms, ckpt, reader, heldout, background=background)
    stages.start(f"seed {seed}: held-out evaluation of {len(arms)} arms, {c['eval']['trials_per_task']} trials per task")
    chosen = {a.name: ckpt[a.name] for a in arms}
    results = evaluate_arms(c, chosen, sd, int(c["eval"]["trials_per_task"]), units=heldout, progress=progress)
    stalls = write_stall_report(results, sd / "eval_store", sd)   # multi-stage tasks: where failures stall
    if stalls:
        print(f"seed {seed}: where the held-out failures stall (seed_{seed}/stages.md)\n" + stall_markdown(stalls),
              flush=True)
    label_audit = stage_label_audit(c, sd, state, ckpt, heldout, progress)
    rounds_rec = [state.get(f"round_{r}") for r in range(int(c["fert"]["rounds"]))]
    curve = state.get("curve") if state.done("curve") else []
    return {"results": results, "checkpoints": chosen, "rounds": rounds_rec, "config": c, "state": state,
            "learning_curve": curve, "label_audit": label_audit}


def stage_label_audit(c: dict, sd: Path, state: JobState, ckpt: dict, heldout: list[int],
                      progress: bool = True) -> dict | None:
    """With ``labels.source: detector``: the success detector audited on held-out units. The base and the final
    ``fert`` weights (K = 1) play ``labels.audit_trials_per_task`` trials per task of a plan of their own (seed
    stream ``eval.seed + 500``) with the detector labelling and ending episodes as on the fleet; its labels are
    compared with the simulator's (``fleet.labels.label_audit``: precision, recall). Recorded as ``label_audit`` in
    ``job_state.json``; None without the detector or the audit."""
    from fleet.labels import Acting, label_audit
    from fleet.labels_config import LabelsConfig

    lc = LabelsConfig.from_dict(c.get("labels"))
    if lc.source != "detector" or lc.audit_trials_per_task <= 0:
        return None
    if state.done("label_audit"):
        return state.get("label_audit")
    acting = Acting("detector", lc.to_dict(), detector_dir=str(sd / "detector"))
    ca = {**c, "eval": {**c["eval"], "seed": int(c["eval"]["seed"]) + 500}}
    arms = {k: ckpt[k] for k in ("base", "fert") if k in ckpt}
    res = evaluate_arms(ca, arms, sd / "label_audit", lc.audit_trials_per_task, units=heldout, progress=progress,
                        acting=acting)
    eps = [e for v in res.values() for e in v]
    rec = {"arms": {k: label_audit(v)["overall"] for k, v in res.items()}, **label_audit(eps)}
    o = rec["overall"]
    print(f"seed {c['seed']}: success detector on held-out units ({o['n']} episodes of {list(arms)}): precision "
          f"{o['precision']}, recall {o['recall']}, accuracy {o['accuracy']} "
          f"(tp {o['tp']}, fp {o['fp']}, fn {o['fn']}, tn {o['tn']})", flush=True)
    state.mark("label_audit", rec)
    return rec


def run_job(cfg: DictConfig) -> None:
    """The main job on a composed, checked config (``scripts/run.py``): in ``cfg.output_dir`` (created), the
    resolved ``config.json``, the units' table, :func:`run_seed` for every seed of ``job.seeds`` (default: ``seed``),
    then ``results.md/json``, ``paired.md/json`` and ``arms.png`` over the seeds (:func:`write_reports`), the
    fleet-size sweep on the first seed with ``job.fleet_sizes``, videos with ``job.videos``, the wandb log; prints
    the stage lines and the two tables.

    Raises:
        ValueError: ``job.arms`` refused by ``fleet.experiment.arms.get_arms`` or a fleet size outside the training units,
            before any work.
        SystemExit: 130 on Ctrl-C, after printing how to resume (finished stages are kept in the run dir).
    """
    from sim import unit_lists

    t_start = time.perf_counter()
    out = Path(cfg.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    c = plain_config(cfg, out)
    job = JobConfig.from_dict(c["job"])
    arms = get_arms(job.arms)             # unknown arms refused before any work
    seeds = list(job.seeds)
    train_units, heldout = unit_lists(c["robot"])
    fleet_units = train_units[: int(c["fleet"]["units"])]
    sizes = list(job.fleet_sizes or [])
    check_fleet_sizes(sizes, train_units)
    (out / "config.json").write_text(json.dumps(c, indent=1))
    _, demo_units = demo_config(c)
    print(f"fleetmind main job -> {out}\n  tasks {c['task']['tasks']}; seeds {seeds}; demonstrations on units "
          f"{demo_units}; fleet on units {fleet_units}; held-out units {heldout}\n  arms {[a.name for a in arms]}",
          flush=True)
    units_md = unit_table(c, sorted(set(demo_units) | set(fleet_units)) + heldout)
    print(units_md, flush=True)
    n_off = sum(1 for a in arms if not a.in_loop and a.data != "none")
    # expected relative costs: demos 2, each base 6, each fleet round 5, each offline arm 2, evaluation 6
    seed_w = [2, 6] + [6] * needs_no_aed(arms) + [5] * int(c["fert"]["rounds"]) + [2] * n_off + [6]
    stages = Stages(seed_w * len(seeds) + ([10] if sizes else []))
    try:
        per_seed = {}
        for s in seeds:
            per_seed[s] = run_seed(c, out / f"seed_{s}", s, arms, stages)
        table, paired, fmt = write_reports(c, out, per_seed, arms, seeds, heldout, fleet_units, demo_units, units_md,
                                           time.perf_counter() - t_start)
        if sizes:
            stages.start(f"fleet-size sweep {sizes} (seed {seeds[0]})")
            sweep_report(per_seed[seeds[0]], out / f"seed_{seeds[0]}", out, sizes, train_units, heldout)
        if job.videos > 0:
            record_videos(per_seed[seeds[0]], c, out, heldout)
        log_wandb(c, out, table)
        print("\n" + RESULTS_CAPTION.format(**fmt) + table_markdown(table), flush=True)
        print("\n" + PAIRED_CAPTION.format(**fmt) + paired_markdown(paired), flush=True)
        print(f"outputs in {out}: results.md/json, paired.md/json, arms.png, seed_<s>/ (stores, checkpoints, "
              f"learner audits, episodes) ({time.perf_counter() - t_start:.0f} s)", flush=True)
    except KeyboardInterrupt:
        print(f"\ninterrupted: finished stages are kept; resume with: python scripts/run.py hydra.run.dir={out} "
              "(and the same overrides)", flush=True)
        raise SystemExit(130) from None
