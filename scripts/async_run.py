"""Asynchronous learning run: a synchronous job's seed again, with the learner beside a working fleet.

    python scripts/async_run.py async_run.from_dir=outputs/<date>/<time>/seed_0

The synchronous job (``scripts/run.py``) alternates: the fleet plays a round, then waits while the learner trains
and the gate publishes. Here the two run at once, as on a real fleet:

- the fleet (``fleet.experiment.protocol.VectorFleet``) plays round after round of the same plan (``fleet.experiment.protocol.fleet_plan``,
  rounds 0, 1, 2, ...) and each round's failure retries (``fleet.experiment.protocol.run_retries``), in waves of
  ``async_run.wave`` trials; before every wave it picks up the newest published version, so it never waits for
  training;
- the learner (``fleet.fert.learner.FertLearner``, the synchronous job's ``fert`` arm with its validation gate, in its
  own process) starts a round whenever ``async_run.min_new_episodes`` new fleet episodes are in, and stops after
  ``async_run.learner_rounds`` rounds (the synchronous job's ``fert.rounds``).

Both start from the synchronous seed's demonstrations (copied into a new store) and its base (published as v1),
with its config, so the two runs differ only in the schedule. Reported (``<run dir>/async.json``, ``async.md``,
``async_curve.png``):

- the learning curve: every published version on the same held-out plan as the synchronous job (K = 1 and with its
  critic, ``job.curve_trials_per_task`` trials per task), against the fleet episodes committed and the wall time
  at which it was published, beside the synchronous job's curve;
- staleness: per fleet episode, how many versions were published while its wave ran (0: it acted with the newest);
- the final comparison on the same held-out trials: the last version alone (``fert``) and with its critic
  (``fert_critic``) against the base and against the synchronous job's ``fert`` / ``fert_critic``.

Resumable: the learner resumes from its state; fleet trials already committed are not run again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from configs.scripts import AsyncRunConfig
from fleet.experiment.eval_config import EvalConfig
from fleet.experiment.job_config import JobConfig
from fleet.progress import calm_progress
from policies.threads import passive_wait

passive_wait()   # before torch loads: OpenMP's idle threads sleep instead of spinning (policies/threads.py)
calm_progress()  # off a terminal, a progress bar redraws every 30 s, not 15 times a second (fleet/progress.py)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
LEARNER_ENV = "FLEETMIND_ASYNC_LEARNER"


def learner_process(spec_path: str) -> None:
    """The learner's own process: the synchronous job's fert learner, rounds until done or the stop file."""
    from fleet.experiment.arms import get_arms, make_learner
    from fleet.fert.gate import make_validator

    spec = json.loads(Path(spec_path).read_text())
    c, sd, stop = spec["cfg"], Path(spec["sd"]), Path(spec["stop_file"])
    lrn = make_learner(c, get_arms(["fert"])[0], sd / "learner_fert", spec["base"], c["fleet"]["registry_url"],
                       int(c["seed"]), validator=make_validator(c, spec["units"], sd, progress=False))
    lrn.run(int(spec["rounds"]), should_stop=stop.exists)


class FollowingFleet:
    """The fleet of the asynchronous run: ``run(plan=...)`` plays ``plan`` in waves of ``wave`` trials, each wave
    with the registry's newest version (fetched into ``cache``), so the interface ``run_retries`` uses is kept
    and a version published mid-round is picked up at the next wave. Trials already committed as fleet episodes
    of the store (same unit and reset seed, not a retry) are skipped, so a restarted run does not repeat them.

    ``waves``: one record per wave (``t_s`` since ``t0``, ``version`` acted with, ``latest`` at its end, trials,
    successes, whether it held retries); an episode's staleness is its wave's ``latest - version``: versions
    published while it ran."""

    def __init__(self, c: dict, reg, cache: Path, wave: int, t0: float, should_stop=None):
        from fleet.experiment.protocol import VectorFleet

        self.c, self.reg, self.cache, self.wave, self.t0 = c, reg, Path(cache), int(wave), t0
        self.should_stop = should_stop or (lambda: False)
        ec = EvalConfig.from_dict(c["eval"])
        self.vf = VectorFleet(c, "", c["store"]["url"], ec.batch_size, ec.processes,
                              with_critic=JobConfig.from_dict(c["job"]).fleet_critic)
        self.waves: list[dict] = []
        self.episodes = 0

    def run(self, plan: list[dict], progress: bool = False, desc: str = "fleet"):
        from experience_dict.store import ExperienceStore
        from fleet.fert.contexts import retry_of

        reader = ExperienceStore.open(self.c["store"]["url"])
        done = {(int(m.unit_id), int(m.seed)) for m in reader.episodes(is_demo=False) if not retry_of(m)}
        todo = [t for t in plan if t.get("explore") or (int(t["unit_id"]), int(t["seed"])) not in done]
        eps = []
        for i in range(0, len(todo), self.wave):
            if self.should_stop():
                break
            v = int(self.reg.latest_version())
            self.vf.checkpoint = str(self.reg.fetch(v, self.cache / f"v{v:06d}"))
            part = self.vf.run(todo[i:i + self.wave], progress=False).episodes
            latest = int(self.reg.latest_version())
            eps += part
            self.episodes += len(part)
            self.waves.append({"t_s": round(time.perf_counter() - self.t0, 1), "version": v, "latest": latest,
                               "trials": len(part), "successes": sum(bool(e["success"]) for e in part),
                               "retries": any(t.get("explore") for t in todo[i:i + self.wave])})
        return SimpleNamespace(episodes=eps, failures=[])

    def close(self) -> None:
        self.vf.close()


def fleet_loop(c: dict, fleet: FollowingFleet, units: list[int], heldout: list[int], stop: threading.Event,
               rounds_out: list) -> None:
    """Round after round of the fleet's plan and its failure retries until ``stop`` is set."""
    from fleet.experiment.protocol import fleet_plan, run_retries

    rcfg = dict(c["fert"].get("retry") or {})
    per_unit = JobConfig.from_dict(c["job"]).fleet_episodes_per_unit
    r = 0
    while not stop.is_set():
        plan = fleet_plan(list(c["task"]["tasks"]), units, per_unit, int(c["seed"]), r)
        eps = fleet.run(plan).episodes
        fails = [{"episode_id": e["episode_id"], "task": e["task"], "unit_id": int(e["unit_id"]), "seed": int(e["seed"])}
                 for e in eps if not e["success"]]
        retries = {"failures": len(fails), "recovered": 0, "retries": 0}
        if rcfg.get("enabled", True) and fails and not stop.is_set():
            retries = run_retries(fleet, fails, rcfg, heldout, len(plan), progress=False)
            retries.pop("episodes", None)
        rounds_out.append({"round": r, "episodes": len(eps), "successes": sum(bool(e["success"]) for e in eps),
                           "versions": sorted({int(e["policy_version"]) for e in eps}),
                           "failures": retries["failures"], "retries": retries["retries"],
                           "recovered": retries["recovered"], "t_s": round(time.perf_counter() - fleet.t0, 1)})
        print(f"[async] fleet round {r}: {rounds_out[-1]['successes']}/{len(eps)} successes with versions "
              f"{rounds_out[-1]['versions']}; {retries['retries']} retries recovered {retries['recovered']} "
              f"({rounds_out[-1]['t_s']:.0f} s)", flush=True)
        r += 1


def prepare(c: dict, src: Path, out: Path) -> str:
    """The synchronous seed's demonstrations copied into ``out``'s store and its base published as v1 there;
    returns the base checkpoint directory."""
    from experience_dict.store import ExperienceStore
    from experience_dict.store.reader import copy_episodes
    from fleet.registry import CheckpointRegistry

    state = json.loads((src / "job_state.json").read_text())
    base = str(state["base"]["checkpoint"])
    reg = CheckpointRegistry(c["fleet"]["registry_url"])
    if reg.latest_version() is None:
        dst = Path(c["store"]["url"])
        if not dst.exists():
            src_store = ExperienceStore.open(str(src / "store"))
            copy_episodes(src_store, str(dst), src_store.episodes(is_demo=True), writer_id="demos")
        from fleet.lineage import lineage

        reg.publish(base, metadata={"run_id": "base", "round": -1, "kind": "base",
                                    **lineage(str(dst), None, c.get("obs"))})
    return base


def run(cfg) -> dict:

    from experience_dict.store import ExperienceStore
    from fleet.experiment.curve import learning_curve, print_curve
    from fleet.experiment.rounds import staleness_summary
    from fleet.experiment.state import seed_config
    from fleet.registry import CheckpointRegistry
    from sim import unit_lists

    a = AsyncRunConfig.from_dict(cfg.async_run)
    if not a.from_dir:
        raise SystemExit("async_run.from_dir: give the synchronous job's seed dir, e.g. "
                         "async_run.from_dir=outputs/<date>/<time>/seed_0")
    src = Path(a.from_dir).resolve()
    if not (src / "job_state.json").is_file() or not (src / "config.json").is_file():
        raise SystemExit(f"async_run.from_dir={src}: not a finished synchronous seed dir (no job_state.json / "
                         "config.json; run scripts/run.py first)")
    out = Path(str(cfg.output_dir)).resolve()
    out.mkdir(parents=True, exist_ok=True)
    src_c = json.loads((src / "config.json").read_text())
    seed = int(src_c["seed"])
    c = seed_config(src_c, out, seed)
    train_units, heldout = unit_lists(c["robot"])
    units = train_units[: int(c["fleet"]["units"])]
    rounds = int(a.learner_rounds or c["fert"]["rounds"])
    min_new = a.min_new_episodes or len(units) * JobConfig.from_dict(c["job"]).fleet_episodes_per_unit
    c["learner"] = {**c["learner"], "min_new_episodes": min_new, "max_wait_s": float(a.max_wall_s), "poll_s": 2.0}
    (out / "config.json").write_text(json.dumps(c, indent=1))
    base = prepare(c, src, out)
    reg = CheckpointRegistry(c["fleet"]["registry_url"])
    print(f"async run -> {out}\n  from {src} (seed {seed}); fleet units {units}, waves of {a.wave} trials; "
          f"learner: {rounds} rounds, each after {min_new} new fleet episodes", flush=True)

    spec = out / "learner_spec.json"
    stop_file = out / "learner.stop"
    stop_file.unlink(missing_ok=True)
    spec.write_text(json.dumps({"cfg": c, "sd": str(out), "base": base, "units": units, "rounds": rounds,
                                "stop_file": str(stop_file)}))
    t0 = time.perf_counter()
    log = open(out / "learner.log", "a")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve())], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT,
                            env={**os.environ, LEARNER_ENV: str(spec), "PYTHONPATH": str(REPO)})
    stop = threading.Event()
    fleet = FollowingFleet(c, reg, out / "cache" / "fleet", a.wave, t0, should_stop=stop.is_set)
    fleet_rounds: list[dict] = []
    box: dict = {}

    def go():
        try:
            fleet_loop(c, fleet, units, heldout, stop, fleet_rounds)
        except BaseException as e:  # noqa: BLE001 - reported below
            box["error"] = e
            stop.set()

    th = threading.Thread(target=go, daemon=True)
    th.start()
    published = {1: {"version": 1, "t_s": 0.0, "fleet_episodes": 0}}
    reader = ExperienceStore.open(c["store"]["url"])
    try:
        while proc.poll() is None and time.perf_counter() - t0 < a.max_wall_s and not stop.is_set():
            time.sleep(3.0)
            for v in reg.versions():
                if v not in published:
                    reader.refresh()
                    n = len([m for m in reader.episodes(is_demo=False) if int(m.unit_id) not in heldout])
                    published[v] = {"version": v, "t_s": round(time.perf_counter() - t0, 1), "fleet_episodes": n}
                    print(f"[async] v{v} published at {published[v]['t_s']:.0f} s, {n} fleet episodes in the store",
                          flush=True)
    finally:
        stop.set()
        stop_file.touch()
        th.join()
        fleet.close()
        try:
            proc.wait(timeout=900)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    wall = time.perf_counter() - t0
    if "error" in box:
        raise RuntimeError(f"the asynchronous fleet failed: {box['error']!r}") from box["error"]
    if proc.returncode:
        raise RuntimeError(f"the asynchronous learner exited with {proc.returncode}: see {out / 'learner.log'}")
    src_state = json.loads((src / "job_state.json").read_text())
    have = [p for p in src_state.get("curve") or [] if int(p["version"]) == 1]   # v1 is the same base
    curve = have + learning_curve(c, out, reg, heldout, True, have=have)
    for p in curve:
        p.update({k: published.get(int(p["version"]), {}).get(k) for k in ("t_s", "fleet_episodes")})
    print_curve(curve, seed)
    report = compare(c, src, out, curve, src_state)
    staleness = staleness_summary([{"staleness": w["latest"] - w["version"]} for w in fleet.waves
                                   for _ in range(w["trials"])])
    report.update({"from_dir": str(src), "seed": seed, "wall_s": round(wall, 1), "learner_rounds": rounds,
                   "min_new_episodes": min_new, "learning_curve": curve, "fleet_rounds": fleet_rounds,
                   "waves": fleet.waves, "fleet_episodes": fleet.episodes,
                   "staleness": staleness,
                   "learner": json.loads((out / "learner_fert" / "learner_state.json").read_text())})
    (out / "async.json").write_text(json.dumps(report, indent=1, default=str))
    plot_curves(curve, sync_curve_points(src_state), out / "async_curve.png")
    return report


def compare(c: dict, src: Path, out: Path, curve: list[dict], src_state: dict) -> dict:
    """The final comparison on the synchronous job's held-out trials: the last version alone and with its critic
    against the base and the synchronous job's arms (``async.md``)."""
    from fleet.experiment.tables import paired_differences, paired_markdown, success_table, table_markdown

    def load(d: Path, name: str):
        f = d / "episodes" / f"{name}.json"
        return json.loads(f.read_text()) if f.is_file() else None

    last = int(curve[-1]["version"])
    res = {"base": load(src, "base"), "fert_sync": load(src, "fert"), "fert_critic_sync": load(src, "fert_critic"),
           "fert": load(out, f"curve_v{last}") if last > 1 else load(src, "base"),
           "fert_critic": load(out, f"curve_v{last}_critic")}
    res = {k: v for k, v in res.items() if v}
    keys = {k: {(e["task"], int(e["unit_id"]), int(e["seed"])) for e in v} for k, v in res.items()}
    if len({frozenset(s) for s in keys.values()}) > 1:
        raise ValueError("async run: the synchronous job's held-out trials differ from the curve's (eval.seed, "
                         "eval.trials_per_task and job.curve_trials_per_task must match)")
    pairs = [("fert", "base"), ("fert_critic", "base"), ("fert", "fert_sync"), ("fert_critic", "fert_critic_sync")]
    table = success_table(res)
    paired = paired_differences(res, pairs)
    md = (f"Asynchronous run (learner beside the fleet) vs the synchronous job {src}, on its held-out trials.\n\n"
          + table_markdown(table) + "\n\n" + paired_markdown(paired) + "\n")
    (out / "async.md").write_text(md)
    print("\n" + md, flush=True)
    return {"table": table, "paired": paired, "last_version": last}


def sync_curve_points(state: dict) -> list[dict]:
    """The synchronous job's curve with the fleet episodes (fleet + retries) and the wall time (fleet, retries
    and the learner's round) spent before each version was published."""
    pts, n, t = [], 0, 0.0
    by_version = {int(p["version"]): p for p in state.get("curve") or []}
    if 1 in by_version:
        pts.append({**by_version[1], "fleet_episodes": 0, "t_s": 0.0})
    r = 0
    while f"round_{r}" in state:
        rec = state[f"round_{r}"]
        n += int(rec.get("episodes", 0)) + int((rec.get("retries") or {}).get("retries", 0))
        lr = (rec.get("learners") or {}).get("fert") or {}
        t += float(rec.get("wall_s", 0.0)) + sum((lr.get("times") or {}).values())
        v = lr.get("version")
        if v and int(v) in by_version:
            pts.append({**by_version[int(v)], "fleet_episodes": n, "t_s": round(t, 1)})
        r += 1
    return pts


def plot_curves(curve: list[dict], sync: list[dict], path: Path) -> None:
    """Held-out success (K = 1 solid, with the critic dashed) against fleet episodes and wall time, async vs sync."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, x, label in ((axes[0], "fleet_episodes", "fleet episodes committed (training units)"),
                         (axes[1], "t_s", "wall time (s)")):
        for pts, name, color in ((curve, "asynchronous", "C0"), (sync, "synchronous", "C1")):
            p = [q for q in pts if q.get(x) is not None]
            ax.plot([q[x] for q in p], [100 * q["heldout"] for q in p], "o-", color=color, label=f"{name}, K = 1")
            pc = [q for q in p if q.get("heldout_critic") is not None]
            ax.plot([q[x] for q in pc], [100 * q["heldout_critic"] for q in pc], "s--", color=color,
                    label=f"{name}, with its critic")
        ax.set_xlabel(label)
        ax.set_ylabel("held-out success (%)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("learning curve: every published version on the same held-out trials")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    import hydra

    import configs.typed  # noqa: F401 - registers the typed config groups before Hydra composes
    from fleet.refusals import one_line_refusals

    @hydra.main(version_base=None, config_path="../configs", config_name="config")
    @one_line_refusals("async run")
    def _main(cfg) -> None:
        from configs.schema import check_or_exit

        check_or_exit(cfg)
        rep = run(cfg)
        st = rep["staleness"]
        print(f"async run: {rep['fleet_episodes']} fleet episodes, versions {[p['version'] for p in rep['learning_curve']]}, "
              f"staleness mean {st['mean'] or 0:.2f} (max {st['max']}); {rep['wall_s']:.0f} s; "
              f"outputs: {Path(str(cfg.output_dir)).resolve()}/async.json, async.md, async_curve.png", flush=True)

    _main()


if __name__ == "__main__":
    if os.environ.get(LEARNER_ENV):
        learner_process(os.environ[LEARNER_ENV])
    else:
        main()
