"""The main job: the whole fleet-learning experiment on real Meta-World tasks, from a fresh machine.

    make run                                            # embedded default: mw_mid, state-only, CPU, one seed
    python scripts/run.py 'job.seeds=[0,1,2]'           # the protocol: every stage and arm per seed, intervals
                                                        # bootstrapped over seeds, then trials
    python scripts/run.py hydra.run.dir=outputs/myrun   # a fixed run dir: re-running resumes finished stages
    python scripts/run.py 'job.arms=[base,filtered_bc,filtered_bc_retries,fert,fert_no_retries,fert_no_gate]'
    python scripts/run.py robot=shifted                 # demos on near-nominal units, fleet + held-out wider
    python scripts/run.py 'job.fleet_sizes=[1,2,4]'     # + FERT per fleet size -> success_vs_fleet_size.png

The protocol is fixed before any result (``fleet.protocol``): every trial's (task, unit, reset seed) comes
from a plan that does not depend on scheduling. Per experiment seed ``s`` (``<run dir>/seed_<s>/``), stages
(each resumable, recorded in ``seed_<s>/job_state.json``):

1. demos: exactly ``job.demos_per_task`` successful scripted-expert demonstrations per task, from a fixed plan
   on ``robot.demo_units`` (the training units by default; the only expert data).
2. base policies: the AED diffusion policy and the same policy without AED, trained on the demonstrations.
3. fleet rounds (``fert.rounds``): the training units run a fixed plan of ``job.fleet_episodes_per_unit``
   episodes each with the newest published version (v1 = base; ``job.fleet_backend: vector`` steps every unit's
   env in batches, ``fleet.protocol.VectorFleet``); failed episodes are re-attempted with exploration
   (``fert.retry``: same task, unit and reset seed, growing action noise, tagged ``retry_of``, capped, never on
   held-out units); then the in-loop arms' learners run their FERT round on the store (by default, from the
   version the fleet runs: the success critic refitted on the whole store, its chosen chunks distilled into the
   weights, ``learner.round_init: published``) and ``fert`` publishes the next version through the gate; the new
   version plays the held-out plan alone and with its critic (the learning curve, ``job.curve_trials_per_task``).
4. offline arms (filtered BC, filtered BC + retries, FERT ablations): fine-tuned from their base on the final
   store with the same budget (``fleet.arms``).
5. held-out evaluation: every arm on the held-out units, the same ``eval.trials_per_task`` trials per task.

Then, over all seeds: ``results.md/json`` (success with Wilson intervals, pooled over seeds; ``learning_curve`` per
seed), ``paired.md/json`` (paired differences, bootstrapped over seeds then trials), ``arms.png`` (with the curve); with ``job.fleet_sizes``, the
fleet-size sweep on seed ``job.seeds[0]``. Ctrl-C stops cleanly; re-running with the same run dir resumes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from experience_dict.atomic import atomic_write_text
from fleet.gate import make_validator
from fleet.progress import calm_progress
from fleet.refusals import one_line_refusals
from policies.threads import passive_wait

passive_wait()   # before torch loads: OpenMP's idle threads sleep instead of spinning (policies/threads.py)
calm_progress()  # off a terminal, a progress bar redraws every 30 s, not 15 times a second (fleet/progress.py)
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

log = logging.getLogger("run")

RESULTS_CAPTION = ("Held-out success rate in % (successes/trials) with Wilson 95% intervals, pooled over the "
                   "experiment seeds {seeds}; every arm ran the same held-out trials (task, unit, reset seed) on "
                   "units {heldout}.\n\n")
PAIRED_CAPTION = ("Trial-by-trial differences arm − baseline in percentage points on the same held-out trials, "
                  "pooled over seeds {seeds}. [lo, hi]: 95% interval from a bootstrap that resamples the seeds, "
                  "then the trials within each seed and task (it counts training noise as well as trial noise "
                  "when there are several seeds). (w/l, p): trials only the arm solved / only the baseline "
                  "solved, and the exact McNemar p-value of that split.\n\n")


class JobState:
    """Which stages of a run are finished, with their outputs (``job_state.json``, written atomically)."""

    def __init__(self, path: Path):
        self.path = path
        self.data = json.loads(path.read_text()) if path.is_file() else {}

    def done(self, stage: str) -> bool:
        return stage in self.data

    def get(self, stage: str):
        return self.data[stage]

    def mark(self, stage: str, value) -> None:
        self.data[stage] = value
        atomic_write_text(self.path, json.dumps(self.data, indent=1, default=str))


class Stages:
    """Stage headers with an overall progress line: ``[stage k/n] name (elapsed, estimate left)``.

    ``weights``: the expected relative cost of each stage, in order (the estimate scales the elapsed time by
    the weight still to come); a stage already finished in an earlier run is skipped quickly, so the estimate
    is only meaningful from the first stage that really runs."""

    def __init__(self, weights: list[float]):
        self.w, self.k, self.t0 = [float(x) for x in weights], 0, time.perf_counter()

    def start(self, name: str) -> None:
        self.k += 1
        el = time.perf_counter() - self.t0
        done = sum(self.w[: self.k - 1])
        eta = f", ~{el / done * sum(self.w[self.k - 1:]) / 60:.0f} min left" if done > 0 and el > 5 else ""
        print(f"\n=== [stage {self.k}/{len(self.w)}] {name} ({el / 60:.1f} min elapsed{eta}) ===", flush=True)


def plain_config(cfg: DictConfig, out: Path) -> dict:
    """Resolved plain dict of the composed config, with the run's store, registry and caches in ``out``."""
    c = OmegaConf.to_container(cfg, resolve=True)
    return seed_config(c, out, int(c.get("seed", 0)))


def seed_config(c: dict, sd: Path, seed: int) -> dict:
    """``c`` for experiment seed ``seed``: store, registry and cache in ``sd``; ``seed`` set."""
    return {**c, "seed": int(seed), "train": {**c["train"], "seed": int(seed)},
            "store": {**c["store"], "url": str(sd / "store")},
            "fleet": {**c["fleet"], "registry_url": str(sd / "registry"), "cache_dir": str(sd / "cache")}}


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
    tcfg["steps"] = int(c["job"]["base_steps"])
    tcfg["desc"] = f"train {'base' if aed else 'base_no_aed'} (seed {c['seed']})"
    tcfg["wandb"] = {**tcfg.get("wandb", {}), "name": f"{out_dir.name}-seed{c['seed']}"}
    val = None
    if val_reader is not None:   # built once the policy exists (its window spec)
        val = lambda policy: WindowDataset(val_reader, val_reader.episodes(is_demo=True, success=True),
                                           windows=policy.window_spec())
    res = train_policy(tcfg, out_dir, policy_cfg=policy_cfg, reader=reader, episodes=demos, device=c["device"],
                       val_dataset=val)
    curve = res.get("val_curve") or []
    if str(c["job"].get("base_select") or "val_loss") == "success":
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
    from fleet.evaluation import evaluate_arms
    from sim import unit_lists

    saved = sorted((int(d.parent.name), d) for d in (out_dir / "checkpoints").glob("*/pretrained_model")
                   if d.parent.name.isdigit())
    points = [{"step": p["step"], "checkpoint": str(p["checkpoint"])} for p in val_curve] or [
        {"step": step, "checkpoint": str(d)} for step, d in saved]
    if not points:
        points = [{"step": res["step"], "checkpoint": str(res["checkpoint"])}]
    units = unit_lists(c["robot"])[0][: int(c["fleet"]["units"])]
    n = int(c["job"].get("base_select_trials_per_task") or 10)
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


def round_trials(reader, plan: list[dict], version: int) -> list:
    """The committed fleet episodes of a round's plan (no retries, acting version ``version``)."""
    from experience_dict.retrieval import retry_of

    want = {(int(t["unit_id"]), int(t["seed"])) for t in plan}
    return [m for m in reader.episodes(is_demo=False) if (int(m.unit_id), int(m.seed)) in want
            and not retry_of(m) and int(m.policy_version) == int(version)]


def fleet_round(c: dict, r: int, units: list[int], heldout: list[int], progress: bool = True) -> dict:
    """One fleet round: the fixed plan of fleet episodes with the newest version, then failure retries.

    Resumable: trials already committed with that version are not run again. Returns the round's record
    (success, failures, retries and how many failures they recovered)."""
    from experience_dict.store import ExperienceStore
    from fleet.coordinator import Fleet
    from fleet.protocol import VectorFleet, fleet_plan, run_retries, success_by_task
    from fleet.registry import CheckpointRegistry

    reg = CheckpointRegistry(c["fleet"]["registry_url"])
    version = reg.latest_version()
    plan = fleet_plan(list(c["task"]["tasks"]), units, int(c["job"]["fleet_episodes_per_unit"]), int(c["seed"]), r)
    rcfg = dict(c["fert"].get("retry") or {})
    backend = str(c["job"].get("fleet_backend") or "ray")
    with_critic = bool(c["job"].get("fleet_critic", True))
    t0 = time.perf_counter()
    if backend == "vector":    # every unit's envs stepped in batches, one policy call per step (fleet.protocol)
        ckpt = reg.fetch(version, Path(c["fleet"]["cache_dir"]) / "fleet" / f"v{version:06d}")
        fleet = VectorFleet(c, str(ckpt), c["store"]["url"], int(c["eval"].get("batch_size", 32)),
                            int(c["eval"].get("processes", 2)), with_critic=with_critic)
    elif backend == "ray" and not with_critic:
        raise ValueError("job.fleet_critic=false (the fleet acts with the weights alone) needs job.fleet_backend=vector")
    elif backend == "ray":
        fleet = Fleet(c, policy="latest", units=units, store_url=c["store"]["url"])
    else:
        raise ValueError(f"job.fleet_backend: expected 'vector' or 'ray', given {backend!r}")
    with fleet:
        reader = ExperienceStore.open(c["store"]["url"])
        done = {(int(m.unit_id), int(m.seed)) for m in round_trials(reader, plan, version)}
        todo = [t for t in plan if (t["unit_id"], t["seed"]) not in done]
        if todo:
            fleet.run(plan=todo, progress=progress)
        t_fleet = time.perf_counter() - t0
        reader.refresh()
        eps = round_trials(reader, plan, version)
        fails = [{"episode_id": m.episode_id, "task": m.task, "unit_id": int(m.unit_id), "seed": int(m.seed)}
                 for m in eps if not m.success]
        retries = {"failures": len(fails), "recovered": 0, "recovered_share": None, "retries": 0, "per_attempt": []}
        if rcfg.get("enabled", True) and fails:
            retries = run_retries(fleet, fails, rcfg, heldout, len(plan), progress)
            retries["steps"] = sum(int(e.get("length", 0)) for e in retries.pop("episodes", []))
    wall = time.perf_counter() - t0
    succ = sum(bool(m.success) for m in eps)
    per_task = success_by_task(eps)
    steps = sum(int(m.length) for m in eps)
    print(f"round {r}: fleet v{version}{'' if with_critic else ' (K = 1)'} {succ}/{len(eps)} successes on units {units} ({steps / max(t_fleet, 1e-9):.0f} "
          f"env steps/s, {backend}); {retries['failures']} failures, {retries['retries']} retries recovered "
          f"{retries['recovered']} ({_pct(retries['recovered_share'])}) {retries['per_attempt']}", flush=True)
    return {"version": version, "successes": succ, "episodes": len(eps), "per_task": per_task, "retries": retries,
            "failed_trials": [{k: f[k] for k in ("task", "unit_id", "seed")} for f in fails],
            "wall_s": wall, "times": {"fleet_s": t_fleet, "retries_s": wall - t_fleet}, "backend": backend,
            "with_critic": with_critic,
            "env_steps": steps, "env_steps_per_s": steps / max(t_fleet, 1e-9)}


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def run_seed(c: dict, sd: Path, seed: int, arms: list, stages: Stages, progress: bool = True,
             sweep: bool = False) -> dict:
    """Every stage of one experiment seed in ``sd`` (demonstrations, the two bases, the fleet rounds with the
    in-loop learners, the offline arms, the held-out evaluation), each skipped when ``job_state.json`` says it is
    done; returns ``{"results": {arm: episodes}, "checkpoints", "rounds", "config", "state"}``."""
    from fleet.evaluation import evaluate_arms
    from fleet.registry import CheckpointRegistry
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
        reg.publish(ckpt["base"], metadata={"run_id": "base", "round": -1, "kind": "base"})
    if sweep and c["job"].get("fleet_sizes"):
        stage_sweep_snapshot(c, sd, state, reader)
    background: dict = {}

    def after_last_fleet() -> None:
        # the store is final once the last round's fleet and retries are in: the offline arms train in a process
        # of their own beside that round's learner (1 thread each), instead of after it
        if c["job"].get("overlap_offline_arms", True):
            background.update(start_offline_arms(c, sd, state, arms, ckpt, heldout, seed))

    stage_fleet_rounds(c, sd, seed, state, stages, [a for a in arms if a.in_loop], ckpt, fleet_units, heldout,
                       reg, progress, after_last_fleet=after_last_fleet)
    stage_offline_arms(c, sd, seed, state, stages, arms, ckpt, reader, heldout, background=background)
    stages.start(f"seed {seed}: held-out evaluation of {len(arms)} arms, {c['eval']['trials_per_task']} trials per task")
    chosen = {a.name: ckpt[a.name] for a in arms}
    results = evaluate_arms(c, chosen, sd, int(c["eval"]["trials_per_task"]), units=heldout, progress=progress)
    rounds_rec = [state.get(f"round_{r}") for r in range(int(c["fert"]["rounds"]))]
    curve = state.get("curve") if state.done("curve") else []
    return {"results": results, "checkpoints": chosen, "rounds": rounds_rec, "config": c, "state": state,
            "learning_curve": curve}


def needs_no_aed(arms: list) -> bool:
    """Whether some arm starts from ``base_no_aed`` (only then is that base trained)."""
    return any(a.init == "base_no_aed" for a in arms)


def stage_demos_and_bases(c: dict, sd: Path, seed: int, state: JobState, stages: Stages, progress: bool,
                          need_no_aed: bool = True):
    """Collect the demonstrations (and the validation demonstrations) and train the bases: with AED, and
    without it when ``need_no_aed`` (some arm starts from ``base_no_aed``); returns ``(store reader,
    {"base": checkpoint dir[, "base_no_aed": checkpoint dir]})``."""
    job = c["job"]
    reader, val_reader = stage_demos(c, sd, seed, state, stages, progress)
    demos = reader.episodes(is_demo=True, success=True)
    bases = [("base", True)] + ([("base_no_aed", False)] if need_no_aed else [])
    for name, aed in bases:
        stages.start(f"seed {seed}: train {name} on {len(demos)} demonstrations (at most {job['base_steps']} steps, "
                     + ("the checkpoint with the most training-unit successes)" if job.get("base_select") == "success"
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
    from experience_dict.store import ExperienceStore
    from fleet.protocol import collect_demos

    job = c["job"]
    stages.start(f"seed {seed}: demonstrations")
    n_val = int(job.get("val_demos_per_task") or 0)
    val_url = str(sd / "val_store")
    if not state.done("demos"):
        dc, dunits = demo_config(c)
        res = collect_demos(dc, dunits, int(job["demos_per_task"]), float(job["demo_noise_std"]), seed,
                            c["store"]["url"], progress=progress)
        if n_val:   # held-out demonstrations for the base's validation loss, in a store of their own
            res["validation"] = collect_demos(dc, dunits, n_val, float(job["demo_noise_std"]), 500 + seed, val_url,
                                              progress=progress)
        state.mark("demos", {**res, "units": dunits})
    print(f"demos: {state.get('demos')}", flush=True)
    reader = ExperienceStore.open(c["store"]["url"])
    val_reader = ExperienceStore.open(val_url) if n_val and Path(val_url).is_dir() else None
    return reader, val_reader


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


def _fleet_round_and_learners(c: dict, sd: Path, seed: int, state: JobState, stages: Stages, in_loop: list,
                              ckpt: dict, fleet_units: list[int], heldout: list[int], reg, progress: bool,
                              after_last_fleet, r: int, rounds: int, bg) -> None:
    """Round ``r`` of :func:`stage_fleet_rounds` (skipped when ``job_state.json`` has it): the fleet and its
    retries, each in-loop learner's round, the round's record, and the learning curve's new points (evaluated in
    the background while the next round works, except after the last round)."""
    from fleet.arms import make_learner

    stages.start(f"seed {seed}: fleet round {r + 1}/{rounds} (units {fleet_units}) + learners "
                 f"{[a.name for a in in_loop]}")
    if state.done(f"round_{r}"):
        return
    t_round = time.perf_counter()
    rec = fleet_round(c, r, fleet_units, heldout, progress)
    if r == rounds - 1 and after_last_fleet is not None:
        after_last_fleet()
    rec["learners"] = {}
    for arm in in_loop:
        publishing = arm.name == "fert"
        lrn = make_learner(c, arm, sd / f"learner_{arm.name}", ckpt[arm.init],
                           c["fleet"]["registry_url"] if publishing else None, seed, offline=True,
                           validator=make_validator(c, fleet_units, sd, progress) if publishing else None)
        if lrn.state["round"] > r:
            continue
        out = lrn.run_round()
        print(f"  {arm.name} round {r}: {out['contexts']} failure contexts, {out['retrieved']} retrieved "
              f"segments ({out.get('own_retry_entries', 0)} from the failures' own retries), "
              f"{out['dataset']} training windows, loss {out['loss']}, "
              + (f"published v{out['version']} ({out.get('published_candidate')})" if out["version"]
                 else "not published"), flush=True)
        if out.get("critic"):
            cr = out["critic"]
            print(f"  {arm.name} round {r}: success critic on {cr['episodes']} episodes ({cr['steps']} steps, "
                  f"{100 * cr['positive_share']:.0f}% on the way to a success), validation BCE "
                  f"{cr['val_loss'] if cr['val_loss'] is None else round(cr['val_loss'], 3)} (predicting the mean: "
                  f"{cr.get('val_loss_constant') if cr.get('val_loss_constant') is None else round(cr['val_loss_constant'], 3)}), "
                  f"{cr['fit_s']:.0f} s", flush=True)
        if out.get("mix"):
            dist = out["mix"].get("distill")
            print(f"  {arm.name} round {r}: training windows {out['mix']['slots']}"
                  + (f"; critic targets at {dist['states']} states: best of {dist['candidates']} chunks scores "
                     f"{dist['q_chosen']:.3f} vs the policy's own sample {dist['q_own']:.3f} (own kept at "
                     f"{100 * dist['picked_own']:.0f}% of states)" if dist else "")
                  + f"; times {({k: round(v) for k, v in (out.get('times') or {}).items()})}", flush=True)
        rec["learners"][arm.name] = {k: out.get(k) for k in ("contexts", "retrieved", "dataset", "loss", "version",
                                                             "validation", "own_retry_entries", "critic",
                                                             "published_candidate", "mix", "times")}
        if publishing and c["learner"].get("failure_replay", True):
            rec["learners"][arm.name]["failure_replay"] = replay_round_failures(
                c, lrn.final_checkpoint(), rec, sd / "failure_replay" / f"round_{r}", heldout)
    rec["round_s"] = time.perf_counter() - t_round   # the fleet, its retries and every learner, up to publishing
    split = {**rec["times"], **((rec["learners"].get("fert") or {}).get("times") or {})}
    print(f"  round {r} wall time {rec['round_s']:.0f} s: " + ", ".join(f"{k[:-2]} {v:.0f} s" for k, v in split.items()),
          flush=True)
    state.mark(f"round_{r}", rec)
    record_curve(c, sd, seed, state, in_loop, heldout, reg, progress, bg, background=r < rounds - 1)


def record_curve(c: dict, sd: Path, seed: int, state: JobState, in_loop: list, heldout: list[int], reg,
                 progress: bool, bg, background: bool) -> None:
    """Record (``state["curve"]``) and print the learning curve's new points (``fleet.curve``): first those of the
    background call ``bg`` (a ``fleet.curve.BackgroundCurve``) started after the previous round, then, with
    ``background`` and ``job.background_curve``, start a background call for the versions published since;
    otherwise evaluate them here. Nothing without ``job.curve_trials_per_task`` or a ``fert`` arm in the loop.

    Raises:
        RuntimeError: the background evaluation failed (re-running the job evaluates its versions again)."""
    from fleet.curve import learning_curve, print_curve

    if int(c["job"].get("curve_trials_per_task") or 0) <= 0 or not any(a.name == "fert" for a in in_loop):
        return
    curve = state.get("curve") if state.done("curve") else []

    def add(points: list[dict]) -> None:
        seen = {int(p["version"]) for p in curve}
        points = [p for p in points if int(p["version"]) not in seen]
        if points:
            curve.extend(points)
            state.mark("curve", curve)
            print_curve(curve, seed)

    add(bg.collect())
    if background and c["job"].get("background_curve", True):
        if set(reg.versions()) - {int(p["version"]) for p in curve}:
            bg.start(c, sd, c["fleet"]["registry_url"], heldout, curve)
    else:
        add(learning_curve(c, sd, reg, heldout, progress, have=curve))


def stage_fleet_rounds(c: dict, sd: Path, seed: int, state: JobState, stages: Stages, in_loop: list, ckpt: dict,
                       fleet_units: list[int], heldout: list[int], reg, progress: bool,
                       after_last_fleet=None) -> None:
    """``fert.rounds`` rounds of fleet collection (``fleet_round``), each followed by one round of every in-loop
    learner (FERT publishes through the validation gate); sets ``ckpt[arm]`` for the in-loop arms (``fert``: the
    newest published version, the base when every round was rejected). ``after_last_fleet()`` is called once the
    last round's fleet episodes and retries are committed, before that round's learners (not on a resumed job
    whose last round is done)."""
    from fleet.arms import make_learner
    from fleet.curve import BackgroundCurve

    rounds = int(c["fert"]["rounds"])
    with BackgroundCurve() as bg:
        for r in range(rounds):
            _fleet_round_and_learners(c, sd, seed, state, stages, in_loop, ckpt, fleet_units, heldout, reg, progress,
                                      after_last_fleet, r, rounds, bg)
        record_curve(c, sd, seed, state, in_loop, heldout, reg, progress, bg, background=False)
    published_mode = str(c["learner"].get("round_init")) == "published"
    for arm in in_loop:
        ckpt[arm.name] = make_learner(c, arm, sd / f"learner_{arm.name}", ckpt[arm.init], None, seed).final_checkpoint()
        if published_mode and arm.name != "fert":
            # an in-loop ablation is credited like fert: its weights alone (K = 1); its last round's checkpoint
            # carries that learner's success critic, with which it would run K chunks per decision (experiment
            # 32's table compared those, with their critics, against fert alone)
            from fleet.registry import checkpoint_with_critic

            ckpt[arm.name] = checkpoint_with_critic(ckpt[arm.name], sd / "cache" / "arms" / f"{arm.name}_alone", None)
    if any(a.name == "fert" for a in in_loop):
        v = reg.latest_version()
        meta = reg.manifest(v).get("metadata") or {}
        # the fert arm is what the fleet runs: the newest published version (the base when every round was
        # rejected by the validation gate); fert_finetuned: the last round's fine-tuned weights (with their critic)
        ckpt["fert_finetuned"] = ckpt["fert"]
        if meta.get("run_id") != "fert":
            ckpt["fert"] = ckpt["base"]
        else:
            ckpt["fert"] = str(reg.fetch(v, sd / "cache" / "arms" / f"v{v:06d}"))
        # fert_critic: that version as published (with its success critic); with learner.round_init: published the
        # fert arm is its weights alone (K = 1), what a robot running the ONNX export executes
        ckpt["fert_version"] = ckpt["fert"]
        if str(c["learner"].get("round_init")) == "published":
            from fleet.registry import checkpoint_with_critic

            ckpt["fert"] = checkpoint_with_critic(ckpt["fert"], sd / "cache" / "arms" / f"v{v:06d}_alone", None)


def replay_round_failures(c: dict, checkpoint: str, rec: dict, out: Path, heldout: list[int]) -> dict:
    """``fleet.protocol.failure_replay`` of a round's failed fleet trials with the round's new weights; printed."""
    from fleet.protocol import failure_replay

    fr = failure_replay(c, checkpoint, rec["failed_trials"], str(out / "store"), heldout,
                        batch_size=int(c["eval"].get("batch_size", 32)))
    tasks = ", ".join(f"{t} {k}/{n}" for t, (k, n) in sorted(fr["per_task"].items()))
    print(f"  failure replay: the new weights solve {fr['solved']} of the {fr['failures']} fleet trials that "
          f"v{rec['version']} failed ({tasks or 'none'}; each replayed from its reset seed, no exploration)", flush=True)
    return fr


def _offline_arms_to_train(state: JobState, arms: list) -> list:
    """The offline arms (trained outside the fleet loop, with data) whose stage is not done yet."""
    return [a for a in arms if not a.in_loop and a.data != "none" and not state.done(a.name)]


def start_offline_arms(c: dict, sd: Path, state: JobState, arms: list, ckpt: dict, heldout: list[int],
                       seed: int) -> dict:
    """Start training the offline arms not done yet (``stage_offline_arms``' work, the same calls) in one
    background process (spawned; ``train.num_threads`` threads, 1 by default, so the weights are those a
    sequential run gives). Returns ``{"future", "executor", "arms", "t0"}`` or ``{}`` when there is nothing to
    train or an arm starts from a checkpoint the rounds have not made yet."""
    import concurrent.futures
    import multiprocessing

    todo = _offline_arms_to_train(state, arms)
    if not todo or any(a.init not in ckpt for a in todo):
        return {}
    ex = concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    from fleet.arms import train_offline_arms_process

    jobs = [(a, ckpt[a.init], str(sd / a.name)) for a in todo]
    print(f"  training {[a.name for a in todo]} in a background process beside the last round's learner", flush=True)
    return {"future": ex.submit(train_offline_arms_process, c, jobs, heldout, seed), "executor": ex,
            "arms": [a.name for a in todo], "t0": time.perf_counter()}


def stage_offline_arms(c: dict, sd: Path, seed: int, state: JobState, stages: Stages, arms: list, ckpt: dict,
                       reader, heldout: list[int], background: dict | None = None) -> None:
    """Fine-tune every arm trained outside the fleet loop (filtered BC, demos_bc, ...) on the final store; sets
    ``ckpt[arm]``. Arms without data (the bases) and in-loop arms are skipped; the critic arms
    (``fert_no_critic``, ``base_critic``) are copies of a checkpoint with or without FERT's success critic.
    ``background``: :func:`start_offline_arms`' handle; its arms are collected from that process (its error,
    if any, is raised here) instead of trained again.

    Raises:
        RuntimeError: the background training failed (the cause chained; re-running resumes it here)."""
    from fleet.arms import train_offline_arm

    if background:   # the arms' own stage lines follow (the stage count stays the job's)
        print(f"  waiting for {background['arms']} (training in the background since the last fleet round)", flush=True)
        try:
            done = background["future"].result()
        except Exception as e:
            raise RuntimeError(f"training the offline arms {background['arms']} in the background failed: "
                               f"{type(e).__name__}: {e}; re-running the job trains them again") from e
        finally:
            background["executor"].shutdown()
        waited = time.perf_counter() - background["t0"]
        for name, (path, wall) in done.items():
            state.mark(name, {"checkpoint": path, "wall_s": wall, "background": True,
                              "wall_s_to_join": waited})
    for arm in arms:
        if arm.in_loop or arm.data == "none":
            continue
        stages.start(f"seed {seed}: fine-tune {arm.name} ({arm.description})")
        if not state.done(arm.name):
            t0 = time.perf_counter()
            state.mark(arm.name, {"checkpoint": train_offline_arm(c, arm, reader, ckpt[arm.init], sd / arm.name,
                                                                  heldout, seed),
                                  "wall_s": time.perf_counter() - t0})
        ckpt[arm.name] = state.get(arm.name)["checkpoint"]
    from fleet.arms import critic_arm_checkpoint

    for arm in arms:   # FERT's weights without its critic, the base with it: copies, no training
        if arm.critic is not None:
            ckpt[arm.name] = critic_arm_checkpoint(arm, ckpt, sd / arm.name)


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


@hydra.main(version_base=None, config_path="../configs", config_name="config")
@one_line_refusals("job")   # a refusal (store, registry, policy): one line, exit 2, the trace in the run's log
def main(cfg: DictConfig) -> None:
    from configs.schema import check_or_exit

    check_or_exit(cfg)   # every value against its rule, before any work
    from fleet.arms import get_arms
    from fleet.report import paired_markdown, table_markdown
    from sim import unit_lists

    t_start = time.perf_counter()
    out = Path(cfg.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    c = plain_config(cfg, out)
    job = c["job"]
    arms = get_arms(job["arms"])             # unknown arms refused before any work
    seeds = [int(s) for s in (job.get("seeds") or [c["seed"]])]
    train_units, heldout = unit_lists(c["robot"])
    fleet_units = train_units[: int(c["fleet"]["units"])]
    sizes = [int(n) for n in (job.get("fleet_sizes") or [])]
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
            per_seed[s] = run_seed(c, out / f"seed_{s}", s, arms, stages, sweep=s == seeds[0])
        table, paired, fmt = write_reports(c, out, per_seed, arms, seeds, heldout, fleet_units, demo_units, units_md,
                                           time.perf_counter() - t_start)
        if sizes:
            stages.start(f"fleet-size sweep {sizes} (seed {seeds[0]})")
            sweep_report(per_seed[seeds[0]], out / f"seed_{seeds[0]}", out, sizes, train_units, heldout)
        if int(job.get("videos", 0)) > 0:
            _videos(per_seed[seeds[0]], c, out, heldout)
        _log_wandb(c, out, table)
        print("\n" + RESULTS_CAPTION.format(**fmt) + table_markdown(table), flush=True)
        print("\n" + PAIRED_CAPTION.format(**fmt) + paired_markdown(paired), flush=True)
        print(f"outputs in {out}: results.md/json, paired.md/json, arms.png, seed_<s>/ (stores, checkpoints, "
              f"learner audits, episodes) ({time.perf_counter() - t_start:.0f} s)", flush=True)
    except KeyboardInterrupt:
        print(f"\ninterrupted: finished stages are kept; resume with: python scripts/run.py hydra.run.dir={out} "
              "(and the same overrides)", flush=True)
        raise SystemExit(130) from None


def write_reports(c: dict, out: Path, per_seed: dict, arms: list, seeds: list[int], heldout: list[int],
                  fleet_units: list[int], demo_units: list[int], units_md: str, wall_s: float):
    """The job's pooled success table and paired differences (``results.md/json``, ``paired.md/json`` with their
    captions and the unit table) and the arms plot (``arms.png``); returns ``(table, paired, caption fields)``."""
    from fleet.arms import PAIRS
    from fleet.report import paired_over_seeds, plot_arms, success_table, write_paired, write_table

    job = c["job"]
    results_by_seed = {s: r["results"] for s, r in per_seed.items()}
    pooled = {a.name: [e | {"exp_seed": s} for s in seeds for e in results_by_seed[s][a.name]] for a in arms}
    table = success_table(pooled)
    table["meta"] = {"seeds": seeds, "held_out_units": heldout, "fleet_units": fleet_units,
                     "demo_units": demo_units, "trials_per_task": int(c["eval"]["trials_per_task"]),
                     "checkpoints": {s: r["checkpoints"] for s, r in per_seed.items()},
                     "fert_rounds": int(c["fert"]["rounds"]),
                     "updates_per_round": int(c["learner"]["updates_per_version"]),
                     "demos_per_task": int(job["demos_per_task"]),
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
        md.write_text(cap.format(**fmt) + md.read_text() + tail)
    fleet_hist = {f"fleet, seed {s}": [{"round": i, "successes": rr["successes"], "trials": rr["episodes"]}
                                       for i, rr in enumerate(r["rounds"])] for s, r in per_seed.items()}
    for s, r in per_seed.items():   # the learning curve: held-out success of each published version
        pts = r.get("learning_curve") or []
        fleet_hist[f"held-out K=1, seed {s}"] = [{"round": p["round"] + 1, "successes": p["successes"],
                                                  "trials": p["trials"]} for p in pts]
        fleet_hist[f"held-out + critic, seed {s}"] = [{"round": p["round"] + 1, "successes": p["successes_critic"],
                                                       "trials": p["trials"]} for p in pts
                                                      if p.get("successes_critic") is not None]
    plot_arms(table, out / "arms.png", title=f"held-out success, seeds {seeds}", rounds=fleet_hist)
    return table, paired, fmt


def sweep_report(seed_run: dict, sd: Path, out: Path, sizes: list[int], train_units: list[int],
                 heldout: list[int]) -> None:
    """The fleet-size sweep on the first seed (``fleet_size_sweep``) and its outputs: ``fleet_size.md/json``,
    ``fleet_size_paired.md/json``, ``success_vs_fleet_size.png``."""
    from fleet.report import plot_success_per_round, table_markdown, write_paired, write_table

    sweep = fleet_size_sweep(seed_run["config"], sd, seed_run["state"], sizes, seed_run["checkpoints"]["base"],
                             train_units, heldout)
    write_table(sweep["table"], out, "fleet_size")
    write_paired(sweep["paired"], out, "fleet_size_paired")
    plot_success_per_round(sweep["history"], out / "success_vs_fleet_size.png", x="fleet_size",
                           title="held-out success of FERT against fleet size")
    print("\nheld-out success against fleet size:\n" + table_markdown(sweep["table"]), flush=True)


def _videos(seed_run: dict, c: dict, out: Path, heldout: list[int]) -> None:
    """Rollout videos of ``fert`` and ``base`` on held-out units (first seed), once."""
    from fleet.evaluation import record_rollouts

    state = seed_run["state"]
    if state.done("videos"):
        return
    vids = []
    for arm in ("fert", "base"):
        if arm in seed_run["checkpoints"]:
            vids += [str(p) for p in record_rollouts(seed_run["config"], seed_run["checkpoints"][arm],
                                                     out / "videos" / arm, heldout, list(c["task"]["tasks"]),
                                                     max_videos=int(c["job"]["videos"]),
                                                     max_episodes=int(c["job"].get("video_episodes", 8)))]
    state.mark("videos", vids)


def check_fleet_sizes(sizes: list[int], train_units: list[int]) -> None:
    """Raise ValueError unless every fleet size is in ``[1, len(train_units)]``."""
    bad = [n for n in sizes if not 1 <= n <= len(train_units)]
    if bad:
        raise ValueError(f"job.fleet_sizes: sizes {bad} outside [1, {len(train_units)}] (robot.train_units has "
                         f"{len(train_units)} units: {train_units}); add training units or drop those sizes")


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
    from fleet.evaluation import evaluate_arms
    from fleet.report import paired_differences, success_table

    per_unit = int(c["job"].get("sweep_episodes_per_unit", 20))
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
    from experience_dict.retrieval import retry_of
    from experience_dict.store import ExperienceStore
    from fleet.coordinator import Fleet
    from fleet.learner import FertLearner
    from fleet.protocol import run_retries
    from fleet.registry import CheckpointRegistry

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


def staleness_summary(episodes: list[dict]) -> dict:
    """``{"episodes", "max", "mean", "counts": {versions behind: episodes}}`` over the fleet episodes that
    report a staleness (units following the newest version; ``fleet.worker.RobotWorker.run_episode``)."""
    vals = [int(e["staleness"]) for e in episodes if e.get("staleness") is not None]
    counts: dict[str, int] = {}
    for v in sorted(vals):
        counts[str(v)] = counts.get(str(v), 0) + 1
    return {"episodes": len(vals), "max": max(vals) if vals else None,
            "mean": sum(vals) / len(vals) if vals else None, "counts": counts}


def _per_version(episodes: list[dict]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for e in episodes:
        s = out.setdefault(str(int(e["policy_version"])), [0, 0])
        s[0] += int(bool(e["success"]))
        s[1] += 1
    return out


def _log_wandb(c: dict, out: Path, table: dict) -> None:
    """Log the result table and plot to wandb (offline unless WANDB_MODE says otherwise)."""
    if not c["train"].get("wandb", {}).get("enabled", True):
        return
    try:
        import wandb
    except ImportError:
        return
    run = wandb.init(project=c["train"]["wandb"].get("project", "fleetmind"), name="main-job", dir=str(out),
                     mode=os.environ.get("WANDB_MODE", "offline"), config=c)
    rows = [[arm, t, cell["rate"], cell["ci95"][0], cell["ci95"][1], cell["trials"]]
            for arm, row in table["arms"].items() for t, cell in {**row["tasks"], "average": row["average"]}.items()]
    run.log({"results": wandb.Table(columns=["arm", "task", "success", "ci_low", "ci_high", "trials"], data=rows),
             "arms": wandb.Image(str(out / "arms.png"))})
    run.finish()


if __name__ == "__main__":
    main()
