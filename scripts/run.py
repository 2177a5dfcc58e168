"""The main job: the whole fleet-learning loop on real Meta-World tasks, from a fresh machine.

    make run                                            # embedded default: mw_quick, state-only, CPU, ~20 min
    python scripts/run.py hydra.run.dir=outputs/myrun   # a fixed run dir: re-running resumes finished stages
    python scripts/run.py job.fleet_units=4 fert.rounds=4 eval.trials_per_task=100
    python scripts/run.py experiment=mw10_vision        # full-size image run meant for a GPU
    python scripts/run.py job.fleet_sizes=[1,2,4]       # + FERT per fleet size -> success_vs_fleet_size.png

Stages (each resumable; finished ones are recorded in ``<run dir>/job_state.json``):

1. demos: the scripted experts collect ``job.demos_per_task`` demonstrations per task on the training units
   (the only expert data; on the Ray fleet, in parallel).
2. base policies: the AED diffusion policy (tokenizer fitted on the demos) and the same policy without AED,
   trained on the demonstrations only.
3. fleet + FERT: the base policy is published as version 1 and deployed to ``job.fleet_units`` training
   units; the asynchronous learner (a Ray actor, on the GPU when there is one) runs ``fert.rounds`` rounds of
   failure-guided retrieval fine-tuning and publishes a version per round; units pick up new versions between
   episodes. Collection never waits for training.
4. comparison arms: filtered BC (the base policy fine-tuned on every successful fleet episode, no retrieval,
   as many updates as FERT) and FERT without AED (the no-AED base fine-tuned by the same FERT rounds on the
   same fleet store, offline).
5. held-out evaluation: every arm on the held-out units (never used for training), ``eval.trials_per_task``
   episodes per task; success with Wilson 95% intervals -> ``results.md`` / ``results.json``; plots, rollout
   videos, retrieval audits; wandb (offline) logs.
6. fleet-size sweep (only with ``job.fleet_sizes=[1,2,4]``): FERT rerun from the demonstrations-only store with
   each fleet size at a fixed collection per unit (exactly ``job.sweep_episodes_per_unit`` episodes per unit per
   round, then the round's update), each evaluated on the held-out units -> ``fleet_size.md`` / ``.json``,
   ``fleet_size_paired.md`` / ``.json`` and ``success_vs_fleet_size.png``. Start it in a fresh run dir.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

log = logging.getLogger("run")

# (arm, baseline) pairs compared trial by trial on the same held-out trials -> paired.md / paired.json
PAIRS = [("fert", "base"), ("fert", "filtered_bc"), ("fert", "fert_no_aed"), ("filtered_bc", "base"),
         ("fert_no_aed", "base_no_aed"), ("base", "base_no_aed")]


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
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


def plain_config(cfg: DictConfig, out: Path) -> dict:
    """Resolved plain dict of the composed config, with the run's store, registry and caches in ``out``."""
    c = OmegaConf.to_container(cfg, resolve=True)
    c["store"]["url"] = str(out / "store")
    c["fleet"]["registry_url"] = str(out / "registry")
    c["fleet"]["cache_dir"] = str(out / "cache")
    return c


def train_base(c: dict, reader, demos, out_dir: Path, aed: bool) -> str:
    """Train a base policy on the demonstrations; returns its ``pretrained_model`` directory."""
    from policies.aed_diffusion.training import train_policy
    from scripts.train import policy_config_from_hydra

    pcfg = dict(c["policy"])
    pcfg["aed"] = {**pcfg["aed"], "enabled": aed}
    policy_cfg = policy_config_from_hydra(pcfg, reader)
    tcfg = {k: v for k, v in c["train"].items() if k not in ("out_dir", "init_from", "episodes")}
    tcfg["steps"] = int(c["job"]["base_steps"])
    tcfg["wandb"] = {**tcfg.get("wandb", {}), "name": out_dir.name}
    res = train_policy(tcfg, out_dir, policy_cfg=policy_cfg, reader=reader, episodes=demos, device=c["device"])
    return str(res["checkpoint"])


def run_fleet_with_learner(c: dict, out: Path, base_ckpt: str, units: list[int]) -> dict:
    """Deploy the published base version to ``units`` and run the FERT learner beside them until its
    rounds are done (plus a tail of episodes with the final version). Returns the learner status and the
    fleet's episode summaries."""
    import ray
    from ray.exceptions import RayActorError

    from fleet.coordinator import Fleet, ensure_ray
    from fleet.learner import FertLearner

    ensure_ray(c["fleet"])
    gpus = ray.cluster_resources().get("GPU", 0)
    total_cpus = ray.cluster_resources().get("CPU", 1.0)
    learner_cpus = 1.0 if total_cpus > 1 else 0.5
    c = {**c, "fleet": {**c["fleet"], "worker_cpus": max(0.1, (total_cpus - learner_cpus) / len(units))}}
    rounds = int(c["fert"]["rounds"])
    Learner = ray.remote(FertLearner).options(num_cpus=learner_cpus, num_gpus=1 if gpus else 0, max_restarts=2,
                                              max_task_retries=0)
    learner = Learner.remote(c, c["store"]["url"], c["fleet"]["registry_url"], str(out / "learner_fert"),
                             base_ckpt, run_id="fert")
    state = {"ref": learner.run.remote(rounds), "resubmits": 0, "status": None}
    per_version: dict[int, list[int]] = {}
    tail = int(c["job"].get("tail_episodes", 6))

    def learner_finished() -> bool:
        if state["status"] is None:
            ready, _ = ray.wait([state["ref"]], timeout=0)
            if not ready:
                return False
            try:
                state["status"] = ray.get(state["ref"])
            except RayActorError:  # the learner died: Ray restarts it, it resumes from its checkpoint
                if state["resubmits"] >= 3:
                    raise
                state["resubmits"] += 1
                log.warning("learner died; resubmitting its run (restart %d)", state["resubmits"])
                state["ref"] = learner.run.remote(rounds)
                return False
        final = max(per_version) if per_version else None
        return final is not None and final >= len(state["status"]["published"]) + 1 and \
            len(per_version[final]) >= tail

    def on_episode(ep: dict) -> None:
        per_version.setdefault(int(ep["policy_version"]), []).append(int(bool(ep["success"])))

    t0 = time.perf_counter()
    with Fleet(c, policy="latest", units=units, store_url=c["store"]["url"]) as fleet:
        res = fleet.run(wall_time_s=float(c["job"].get("max_fleet_s", 7200)), should_stop=learner_finished,
                        on_episode=on_episode)
    if state["status"] is None:  # the fleet's time budget ran out first: wait for the learner
        state["status"] = ray.get(state["ref"])
    return {"learner": state["status"], "episodes": res.episodes, "wall_s": time.perf_counter() - t0,
            "restarts": dict(res.restarts) if hasattr(res, "restarts") else {}}


def train_filtered_bc(c: dict, reader, base_ckpt: str, out_dir: Path, updates: int, heldout: list[int]) -> str:
    """Filtered BC: the base policy fine-tuned on every successful training-unit episode (+ the demos)."""
    from policies.aed_diffusion import AEDDiffusionPolicy
    from policies.aed_diffusion.training import train_policy

    reader.refresh()
    eps = [m for m in reader.episodes(success=True) if int(m.unit_id) not in heldout]
    tcfg = {k: v for k, v in c["train"].items() if k not in ("out_dir", "init_from", "episodes")}
    tcfg.update(steps=int(updates), lr=float(c["learner"]["lr"]), warmup_steps=0,
                batch_size=int(c["learner"]["batch_size"]), save_every=int(updates))
    tcfg["wandb"] = {**tcfg.get("wandb", {}), "name": "filtered_bc"}
    res = train_policy(tcfg, out_dir, policy=AEDDiffusionPolicy.from_pretrained(base_ckpt), reader=reader,
                       episodes=eps, device=c["device"])
    return str(res["checkpoint"])


@hydra.main(version_base=None, config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> None:
    from experience_dict.store import ExperienceStore
    from fleet.coordinator import collect
    from fleet.evaluation import evaluate_arms, record_rollouts
    from fleet.learner import FertLearner
    from fleet.registry import CheckpointRegistry
    from fleet.report import (
        paired_differences,
        paired_markdown,
        plot_success_per_round,
        success_table,
        table_markdown,
        write_paired,
        write_table,
    )
    from sim import unit_lists

    t_start = time.perf_counter()
    out = Path(cfg.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    c = plain_config(cfg, out)
    (out / "config.json").write_text(json.dumps(c, indent=1))
    state = JobState(out / "job_state.json")
    train_units, heldout = unit_lists(c["robot"])
    job = c["job"]
    print(f"fleetmind main job -> {out}\n  tasks {c['task']['tasks']}, training units {train_units}, "
          f"held-out units {heldout}", flush=True)
    sizes = [int(n) for n in (job.get("fleet_sizes") or [])]
    check_fleet_sizes(sizes, train_units)

    # 1. demonstrations (the only expert data)
    if not state.done("demos"):
        t0 = time.perf_counter()
        res = collect(c, policy={"kind": "expert", "noise_std": float(job["demo_noise_std"])}, is_demo=True,
                      episodes_per_task=int(job["demos_per_task"]), units=train_units, store_url=c["store"]["url"])
        print(res.table("task"), flush=True)
        state.mark("demos", {"episodes": len(res.episodes), "wall_s": time.perf_counter() - t0})
    reader = ExperienceStore.open(c["store"]["url"])
    demos = reader.episodes(is_demo=True, success=True)
    if not demos:
        raise SystemExit("no successful demonstrations were collected; check scripts/sim_check.py")

    # 2. base policies on the demonstrations
    for name, aed in (("base", True), ("base_no_aed", False)):
        if not state.done(name):
            t0 = time.perf_counter()
            ckpt = train_base(c, reader, demos, out / name, aed)
            state.mark(name, {"checkpoint": ckpt, "wall_s": time.perf_counter() - t0})
    base_ckpt, base_noaed_ckpt = state.get("base")["checkpoint"], state.get("base_no_aed")["checkpoint"]

    if sizes and not state.done("demo_snapshot"):   # the demonstrations-only store every fleet size starts from
        if state.done("fert") or reader.episodes(is_demo=False):
            raise SystemExit(f"job.fleet_sizes: {out} already holds fleet episodes; run the sweep in a fresh "
                             "run dir (hydra.run.dir=...) so every fleet size starts from the demonstrations only")
        snap = out / "sweep" / "demo_store"
        shutil.rmtree(snap, ignore_errors=True)
        shutil.copytree(c["store"]["url"], snap)
        state.mark("demo_snapshot", str(snap))

    # 3. fleet + asynchronous FERT learner
    reg = CheckpointRegistry(c["fleet"]["registry_url"])
    if reg.latest_version() is None:
        reg.publish(base_ckpt, metadata={"run_id": "base", "round": -1, "kind": "base"})
    if not state.done("fert"):
        units = train_units[: int(job["fleet_units"])]
        r = run_fleet_with_learner(c, out, base_ckpt, units)
        stale = staleness_summary(r["episodes"])
        print(f"fleet staleness (versions behind the newest at commit): {stale}", flush=True)
        state.mark("fert", {"learner": r["learner"], "fleet_episodes": len(r["episodes"]), "wall_s": r["wall_s"],
                            "per_version": _per_version(r["episodes"]), "staleness": stale})
        (out / "fleet_episodes.json").write_text(json.dumps(r["episodes"], default=str))
    fert_state = state.get("fert")
    fert_ckpt = FertLearner(c, c["store"]["url"], None, str(out / "learner_fert"), base_ckpt).final_checkpoint()
    updates = int(c["fert"]["rounds"]) * int(c["learner"]["updates_per_version"])

    # 4. comparison arms
    if not state.done("filtered_bc"):
        t0 = time.perf_counter()
        state.mark("filtered_bc", {"checkpoint": train_filtered_bc(c, reader, base_ckpt, out / "filtered_bc",
                                                                   updates, heldout),
                                   "wall_s": time.perf_counter() - t0})
    if not state.done("fert_no_aed"):
        t0 = time.perf_counter()
        offline = {**c, "learner": {**c["learner"], "min_new_episodes": 0, "max_wait_s": 0}}
        lrn = FertLearner(offline, c["store"]["url"], None, str(out / "learner_fert_no_aed"), base_noaed_ckpt,
                          run_id="fert_no_aed", publish=False)
        lrn.run(int(c["fert"]["rounds"]))
        state.mark("fert_no_aed", {"checkpoint": lrn.final_checkpoint(), "wall_s": time.perf_counter() - t0})

    # 5. held-out evaluation
    all_arms = {"base": base_ckpt, "filtered_bc": state.get("filtered_bc")["checkpoint"], "fert": fert_ckpt,
                "fert_no_aed": state.get("fert_no_aed")["checkpoint"], "base_no_aed": base_noaed_ckpt}
    unknown = [a for a in job["arms"] if a not in all_arms]
    if unknown:
        raise ValueError(f"job.arms: unknown arms {unknown}; known: {sorted(all_arms)}")
    arms = {a: all_arms[a] for a in job["arms"]}
    t0 = time.perf_counter()
    results = evaluate_arms(c, arms, out, int(job["trials_per_task"]), units=heldout)
    table = success_table(results)
    table["meta"] = {"held_out_units": heldout, "training_units": train_units[: int(job["fleet_units"])],
                     "trials_per_task": int(job["trials_per_task"]), "checkpoints": arms,
                     "fert_rounds": int(c["fert"]["rounds"]), "updates_per_round": int(c["learner"]["updates_per_version"]),
                     "demos_per_task": int(job["demos_per_task"]), "eval_wall_s": time.perf_counter() - t0,
                     "fleet_staleness": fert_state.get("staleness"),
                     "total_wall_s": time.perf_counter() - t_start}
    write_table(table, out, "results")
    paired = paired_differences(results, [(a, b) for a, b in PAIRS if a in arms and b in arms])
    write_paired(paired, out, "paired")

    # plots: training-fleet success per policy version (v1 = base = round -1, v2 = round 0, ...) beside the
    # held-out arms (placed at the last round)
    history = {"fert (training units, per version)": [
        {"round": int(v) - 2, "successes": s, "trials": n} for v, (s, n) in sorted(
            ((int(k), tuple(v)) for k, v in fert_state["per_version"].items()))]}
    for arm, row in table["arms"].items():
        history[f"{arm} (held-out)"] = [{"round": int(c["fert"]["rounds"]) - 1, "successes": row["average"]["successes"],
                                         "trials": row["average"]["trials"]}]
    plot_success_per_round(history, out / "success_per_round.png",
                           title="success per FERT round (round -1 = base policy)")
    # 6. fleet-size sweep: at a fixed collection per unit and round, FERT with n units, on held-out units
    if sizes:
        sweep = fleet_size_sweep(c, out, state, sizes, base_ckpt, train_units, heldout)
        write_table(sweep["table"], out, "fleet_size")
        write_paired(sweep["paired"], out, "fleet_size_paired")
        plot_success_per_round(sweep["history"], out / "success_vs_fleet_size.png", x="fleet_size",
                               title="held-out success of FERT against fleet size")
        print("\nheld-out success against fleet size:\n" + table_markdown(sweep["table"]), flush=True)
    if not state.done("videos") and int(job["videos"]) > 0:
        vids = []
        for arm in ("fert", "base"):
            if arm in arms:
                vids += [str(p) for p in record_rollouts(c, arms[arm], out / "videos" / arm, heldout,
                                                         list(c["task"]["tasks"]), max_videos=int(job["videos"]),
                                                         max_episodes=int(job.get("video_episodes", 8)))]
        state.mark("videos", vids)
    _log_wandb(c, out, table)
    print("\nheld-out success (Wilson 95% interval):\n" + table_markdown(table), flush=True)
    print("\ntrial-by-trial differences on the same held-out trials (paired bootstrap 95% interval; "
          "wins/losses; McNemar p):\n" + paired_markdown(paired), flush=True)
    print(f"outputs in {out}: results.md/json, paired.md/json, success_per_round.png, videos/, "
          f"learner_fert/audits/ ({time.perf_counter() - t_start:.0f} s)", flush=True)


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
    from experience_dict.store import ExperienceStore
    from fleet.coordinator import Fleet
    from fleet.evaluation import evaluate_arms
    from fleet.learner import FertLearner
    from fleet.registry import CheckpointRegistry
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
              # the fleet idles while the learner trains: give training every core
              "learner": {**c["learner"], "min_new_episodes": 0, "max_wait_s": 0,
                          "torch_threads": max(int(c["learner"].get("torch_threads") or 1), os.cpu_count() or 1)}}
        if not state.done(stage):
            if not (sub / "store").exists():
                shutil.copytree(state.get("demo_snapshot"), sub / "store")
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
                                   if int(m.policy_version) == version) for u in units)
                    if per_unit - done > 0:
                        fleet.run(episodes_per_unit=per_unit - done)
                    learner.run_round()
            reader = ExperienceStore.open(cs["store"]["url"])
            eps = [{"policy_version": m.policy_version, "success": m.success}
                   for m in reader.episodes(is_demo=False)]
            state.mark(stage, {"checkpoint": learner.final_checkpoint(), "fleet_episodes": len(eps),
                               "wall_s": time.perf_counter() - t0, "per_version": _per_version(eps),
                               "learner": learner.status()})
        arms[f"fert_n{n}"] = state.get(stage)["checkpoint"]
    results = evaluate_arms(c, arms, out / "sweep", int(c["job"]["trials_per_task"]), units=heldout)
    table = success_table(results)
    table["meta"] = {"fleet_sizes": sizes, "episodes_per_unit_per_round": per_unit, "rounds": rounds,
                     "held_out_units": heldout, "trials_per_task": int(c["job"]["trials_per_task"]),
                     "checkpoints": arms,
                     "fleet_episodes": {f"fert_n{n}": state.get(f"sweep_n{n}")["fleet_episodes"] for n in sizes}}
    history = {"FERT (held-out)": [{"fleet_size": n, "successes": table["arms"][f"fert_n{n}"]["average"]["successes"],
                                    "trials": table["arms"][f"fert_n{n}"]["average"]["trials"]} for n in sizes]}
    smallest = f"fert_n{min(sizes)}"
    paired = paired_differences(results, [(a, smallest) for a in arms if a != smallest])
    return {"table": table, "history": history, "paired": paired}


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
             "success_per_round": wandb.Image(str(out / "success_per_round.png"))})
    run.finish()


if __name__ == "__main__":
    main()
