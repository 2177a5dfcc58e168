"""The job's first stages: the scripted-expert demonstrations (and held-out ones for the validation loss), then
the base policies trained on them (with AED, and without it when an arm starts from ``base_no_aed``), each
checkpoint chosen by validation loss or by training-unit success (``job.base_select``)."""

from __future__ import annotations

import time
from pathlib import Path

from experience_dict.store import ExperienceStore
from fleet.experiment.evaluation import evaluate_arms
from fleet.experiment.job_config import JobConfig
from fleet.experiment.protocol import collect_demos
from fleet.experiment.state import JobState, Stages


def train_base(c: dict, reader, demos, out_dir: Path, aed: bool, val_reader=None) -> dict:
    """Train a base policy on the demonstrations, checkpointing every ``train.save_every`` steps.

    With ``val_reader`` (held-out demonstrations in a store of their own), every checkpoint's validation loss
    is measured and the checkpoint with the lowest one is the base (early stopping: ``job.base_steps`` is a
    ceiling, the validation curve picks the budget). Returns ``{"checkpoint", "val_curve", "best_step"}``."""
    from experience_dict.sampler import WindowDataset
    from policies.aed_diffusion.training import train_policy

    policy_cfg = dict(c["policy"])                     # policies.factory.make_policy builds it
    if "aed" in policy_cfg:
        policy_cfg["aed"] = {**policy_cfg["aed"], "enabled": aed}
    tcfg = {k: v for k, v in c["train"].items() if k not in ("out_dir", "init_from", "episodes")}
    tcfg["steps"] = JobConfig.from_dict(c["job"]).base_steps
    tcfg["desc"] = f"train {'base' if aed else 'base_no_aed'} (seed {c['seed']})"
    tcfg["wandb"] = {**tcfg.get("wandb", {}), "name": f"{out_dir.name}-seed{c['seed']}"}
    val = None
    if val_reader is not None:   # built once the policy exists (its window spec)
        val = lambda policy: WindowDataset(val_reader, val_reader.episodes(is_demo=True, success=True),
                                           windows=policy.window_spec())
    res = train_policy(tcfg, out_dir, policy_cfg=policy_cfg, reader=reader, episodes=demos, device=c["device"],
                       val_dataset=val)
    curve = res.get("val_curve") or []
    if JobConfig.from_dict(c["job"]).base_select == "success":
        return select_base_by_success(c, out_dir, curve, res)
    if curve:
        best = min(curve, key=lambda p: p["val_loss"])
        print(f"  {out_dir.name}: validation loss on held-out demonstrations by step: "
              + ", ".join(f"{p['step']}: {p['val_loss']:.4f}" for p in curve) + f" -> base = step {best['step']}",
              flush=True)
        return {"checkpoint": best["checkpoint"], "val_curve": curve, "best_step": best["step"]}
    return {"checkpoint": str(res["checkpoint"]), "val_curve": [], "best_step": res["step"]}


def select_base_by_success(c: dict, out_dir: Path, val_curve: list[dict], res: dict) -> dict:
    """``job.base_select: success``: every saved checkpoint of the base's training (``train.save_every``) plays the
    same fixed plan of training-unit trials (``job.base_select_trials_per_task`` per task on the fleet's units,
    seed stream ``6000 + seed``: neither the held-out plan nor the validation gate's), and the checkpoint with
    the most successes is the base (ties: the later one). A success curve that is still rising at the last
    checkpoint says ``job.base_steps`` stops short of the plateau. Returns ``{"checkpoint", "val_curve",
    "best_step", "success_curve": [{"step", "checkpoint", "success", "successes", "trials"}]}``."""
    from sim import unit_lists

    saved = sorted((int(d.parent.name), d) for d in (out_dir / "checkpoints").glob("*/pretrained_model")
                   if d.parent.name.isdigit())
    points = [{"step": p["step"], "checkpoint": str(p["checkpoint"])} for p in val_curve] or [
        {"step": step, "checkpoint": str(d)} for step, d in saved]
    if not points:
        points = [{"step": res["step"], "checkpoint": str(res["checkpoint"])}]
    units = unit_lists(c["robot"])[0][: int(c["fleet"]["units"])]
    n = JobConfig.from_dict(c["job"]).base_select_trials_per_task
    cs = {**c, "eval": {**c["eval"], "seed": 6000 + int(c["seed"])}}
    eps = evaluate_arms(cs, {f"step_{p['step']}": p["checkpoint"] for p in points}, out_dir / "select", n,
                        units=units, progress=False)
    for p in points:
        got = eps[f"step_{p['step']}"]
        p["successes"], p["trials"] = sum(bool(e["success"]) for e in got), len(got)
        p["success"] = p["successes"] / max(p["trials"], 1)
    best = max(points, key=lambda p: (p["successes"], p["step"]))
    print(f"  {out_dir.name}: training-unit success by step ({n} trials per task on units {units}): "
          + ", ".join(f"{p['step']}: {100 * p['success']:.1f}%" for p in points) + f" -> base = step {best['step']}",
          flush=True)
    return {"checkpoint": best["checkpoint"], "val_curve": val_curve, "best_step": best["step"],
            "success_curve": points}


def demo_config(c: dict) -> tuple[dict, list[int]]:
    """Config and units of the demonstration stage: ``robot.demo_units`` (default: the training units), with
    every variation range scaled by ``robot.demo_variation_scale`` (default 1; ``robot=shifted`` collects its
    demonstrations on near-nominal units). Demonstration units that are not training units are added to the
    stage config's ``train_units`` (after them, so the fleet's first ``fleet.units`` are unchanged), which makes
    them known to ``sim.make_env``.

    Raises:
        ValueError: a demonstration unit that is also a held-out unit.
    """
    from sim import demo_unit_list, unit_lists

    robot = dict(c["robot"])
    train, heldout = unit_lists(robot)
    units = demo_unit_list(robot)
    bad = sorted(set(units) & set(heldout))
    if bad:
        raise ValueError(f"robot.demo_units: units {bad} are held-out units")
    robot["train_units"] = train + [u for u in units if u not in train]
    scale = float(robot.get("demo_variation_scale", 1.0))
    if scale != 1.0:
        robot["variation"] = {k: (v * scale if k != "action_latency_max" else round(v * scale))
                              for k, v in dict(robot["variation"]).items()}
    return {**c, "robot": robot}, units


def needs_no_aed(arms: list) -> bool:
    """Whether some arm starts from ``base_no_aed`` (only then is that base trained)."""
    return any(a.init == "base_no_aed" for a in arms)


def stage_demos_and_bases(c: dict, sd: Path, seed: int, state: JobState, stages: Stages, progress: bool,
                          need_no_aed: bool = True):
    """Collect the demonstrations (and the validation demonstrations) and train the bases: with AED, and
    without it when ``need_no_aed`` (some arm starts from ``base_no_aed``); returns ``(store reader,
    {"base": checkpoint dir[, "base_no_aed": checkpoint dir]})``."""
    job = JobConfig.from_dict(c["job"])
    reader, val_reader = stage_demos(c, sd, seed, state, stages, progress)
    demos = reader.episodes(is_demo=True, success=True)
    bases = [("base", True)] + ([("base_no_aed", False)] if need_no_aed else [])
    for name, aed in bases:
        stages.start(f"seed {seed}: train {name} on {len(demos)} demonstrations (at most {job.base_steps} steps, "
                     + ("the checkpoint with the most training-unit successes)" if job.base_select == "success"
                        else "the checkpoint with the lowest validation loss)"))
        stage_base(c, state, name, reader, demos, sd / name, aed, val_reader)
    return reader, {name: state.get(name)["checkpoint"] for name, _ in bases}


def stage_base(c: dict, state: JobState, key: str, reader, demos, out_dir: Path, aed: bool, val_reader) -> dict:
    """:func:`train_base` once per run (``state`` stage ``key``, with its training wall time ``wall_s``); returns
    the stage's record ``{"checkpoint", "val_curve", "best_step", "wall_s"}``."""
    if not state.done(key):
        t0 = time.perf_counter()
        state.mark(key, {**train_base(c, reader, demos, out_dir, aed, val_reader), "wall_s": time.perf_counter() - t0})
    return state.get(key)


def stage_demos(c: dict, sd: Path, seed: int, state: JobState, stages: Stages, progress: bool):
    """Collect the demonstrations into the run's store and the validation demonstrations into ``<sd>/val_store``
    (``job.val_demos_per_task``; 0: none), once per seed (``state`` stage ``demos``); returns ``(store reader,
    validation store reader or None)``."""
    job = JobConfig.from_dict(c["job"])
    stages.start(f"seed {seed}: demonstrations")
    n_val = job.val_demos_per_task
    val_url = str(sd / "val_store")
    if not state.done("demos"):
        dc, dunits = demo_config(c)
        res = collect_demos(dc, dunits, job.demos_per_task, job.demo_noise_std, seed,
                            c["store"]["url"], progress=progress)
        if n_val:   # held-out demonstrations for the base's validation loss, in a store of their own
            res["validation"] = collect_demos(dc, dunits, n_val, job.demo_noise_std, 500 + seed, val_url,
                                              progress=progress)
        state.mark("demos", {**res, "units": dunits})
    print(f"demos: {state.get('demos')}", flush=True)
    reader = ExperienceStore.open(c["store"]["url"])
    val_reader = ExperienceStore.open(val_url) if n_val and Path(val_url).is_dir() else None
    return reader, val_reader
