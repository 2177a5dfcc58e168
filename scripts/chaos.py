"""Chaos run: the fleet keeps working while its processes are SIGKILLed at random.

    python scripts/chaos.py                                  # 100 kills (configs/scripts.py ChaosConfig)
    python scripts/chaos.py chaos.kills=10 chaos.units=2     # a short one

On this machine only (local Ray, a local Zarr store and registry in the run directory): scripted demonstrations,
a tiny base policy published as version 1, then a fleet of ``chaos.units`` simulated units acting through the
batched policy server and following the newest version, while the FERT learner (its own process) trains rounds
on the fleet's experience and publishes new versions. Every ``chaos.interval_s`` one process is SIGKILLed: a
unit's Ray worker, the learner or the policy server (odds ``chaos.targets``). Ray restarts workers and the
server; this script restarts the learner, which resumes from its last checkpoint. Then it stops the fleet and
reports, as JSON (``<run dir>/chaos.json``):

- kills landed per kind, and how many the fleet survived (the run ended with every unit alive);
- episodes committed; **lost** (an episode a worker reported committed, or a reader once saw, that is not in the
  final store); **duplicated** ``(unit, seed)`` pairs (a trial run twice);
- whether ``ExperienceStore.verify`` passes and whether every published registry version verifies.

Exit status 0 when nothing was lost or duplicated and verify passed, else 1. Bounded: at most ``chaos.kills``
kills and ``chaos.max_wall_s`` seconds of killing.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
from configs.scripts import ChaosConfig
from fleet.progress import calm_progress
from policies.threads import passive_wait

passive_wait()   # before torch loads: OpenMP's idle threads sleep instead of spinning (policies/threads.py)
calm_progress()  # off a terminal, a progress bar redraws every 30 s, not 15 times a second (fleet/progress.py)
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
LEARNER_ENV = "FLEETMIND_CHAOS_LEARNER"


def learner_process(spec_path: str) -> None:
    """The learner's own process: FERT rounds until the stop file appears (resumes after a SIGKILL)."""
    from fleet.fert.learner import FertLearner

    spec = json.loads(Path(spec_path).read_text())
    stop = Path(spec["stop_file"])
    lrn = FertLearner(spec["cfg"], spec["store"], spec["registry"], spec["work_dir"], spec["base"], run_id="chaos")
    lrn.run(10 ** 6, should_stop=stop.exists)


def main_cfg(cfg) -> dict:
    from omegaconf import OmegaConf

    from fleet.coordinator import _plain

    c = _plain(cfg)
    for k in ("fert", "learner", "train"):   # the learner's groups
        c[k] = OmegaConf.to_container(cfg[k], resolve=True)
    ch = ChaosConfig.from_dict(cfg.chaos)
    out = Path(str(cfg.output_dir)).resolve()
    c["task"] = {**c["task"], "tasks": ch.tasks, "max_episode_steps": ch.max_episode_steps}
    c["store"] = {**c["store"], "url": str(out / "store")}
    c["fleet"] = {**c["fleet"], "registry_url": str(out / "registry"), "cache_dir": str(out / "cache"),
                  "policy_server": True, "max_restarts": -1, "max_recreates": 1000, "episode_timeout_s": 90,
                  "server_retry_s": 180, "max_trial_faults": 1000}
    return {"c": c, "chaos": ch, "out": out, "full": OmegaConf.to_container(cfg, resolve=False)}


def prepare(c: dict, ch: ChaosConfig, out: Path, full_cfg) -> str:
    """Demonstrations and a tiny base policy published as version 1; returns the base checkpoint dir."""
    from experience_dict.store import ExperienceStore
    from fleet.experiment.protocol import collect_demos
    from fleet.registry import CheckpointRegistry
    from policies.aed_diffusion.training import last_checkpoint, train_policy

    reg = CheckpointRegistry(c["fleet"]["registry_url"])
    if reg.latest_version() is not None and last_checkpoint(out / "base") is not None:   # a re-run in the same dir
        return str(last_checkpoint(out / "base") / "pretrained_model")
    units = list(range(ch.units))
    collect_demos(c, units, ch.demos_per_task, 0.0, 0, c["store"]["url"], progress=False)
    reader = ExperienceStore.open(c["store"]["url"])
    pcfg = {**dict(full_cfg["policy"]), **ch.policy}
    from omegaconf import OmegaConf

    pcfg = OmegaConf.to_container(OmegaConf.create(pcfg), resolve=True)
    res = train_policy({"steps": ch.base_steps, "batch_size": 32, "save_every": ch.base_steps,
                        "progress": False, "wandb": {"enabled": False}, "seed": 0},
                       out / "base", policy_cfg=pcfg, reader=reader,
                       episodes=reader.episodes(is_demo=True), device="cpu")
    reg.publish(res["checkpoint"], metadata={"run_id": "base", "round": -1})
    return str(res["checkpoint"])


class Learner:
    """The learner subprocess: started, killed, restarted (it resumes from its state and checkpoints)."""

    def __init__(self, c: dict, ch: dict, out: Path, base: str):
        self.spec = out / "learner_spec.json"
        self.stop_file = out / "learner.stop"
        self.stop_file.unlink(missing_ok=True)
        lcfg = {**c, "learner": {**c["learner"], "updates_per_version": ch.learner_updates,
                                 "min_new_episodes": 10, "max_wait_s": 120, "poll_s": 1.0, "batch_size": 16,
                                 "device": "cpu", "torch_threads": 1, "warmup_steps": 2},
                "train": {**c.get("train", {}), "wandb": {"enabled": False}, "log_every": 5, "progress": False}}
        # the success critic (fert.critic) fitted as briefly as the policy: rounds stay short, versions frequent
        critic = dict(c["fert"].get("critic") or {})
        if critic.get("enabled"):
            lcfg["fert"] = {**c["fert"], "critic": {**critic, "updates": ch.learner_updates},
                            # and its chosen chunks distilled at few states (learner.round_init: published)
                            "distill": {**dict(c["fert"].get("distill") or {}), "states_per_task": 64}}
        self.spec.write_text(json.dumps({"cfg": lcfg, "store": c["store"]["url"], "registry": c["fleet"]["registry_url"],
                                         "work_dir": str(out / "learner"), "base": base,
                                         "stop_file": str(self.stop_file)}))
        self.log = open(out / "learner.log", "a")  # noqa: SIM115 - closed in stop()
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def ensure(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve())], cwd=REPO,
                                         env={**os.environ, LEARNER_ENV: str(self.spec), "PYTHONPATH": str(REPO)},
                                         stdout=self.log, stderr=subprocess.STDOUT)
            self.starts += 1

    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def stop(self, timeout: float = 120) -> int | None:
        self.stop_file.touch()
        rc = None
        if self.proc is not None:
            try:
                rc = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                rc = self.proc.wait()
        self.log.close()
        return rc


def run(cfg) -> dict:
    import ray

    from experience_dict.store import ExperienceStore
    from fleet.coordinator import Fleet

    m = main_cfg(cfg)
    c, ch, out = m["c"], m["chaos"], m["out"]
    out.mkdir(parents=True, exist_ok=True)
    base = prepare(c, ch, out, m["full"])
    learner = Learner(c, ch, out, base)
    learner.ensure()
    reported: set[str] = set()
    seen: set[str] = set()
    kills: Counter = Counter()
    skipped: Counter = Counter()
    units = list(range(ch.units))
    done = threading.Event()
    rng = random.Random(int(cfg.seed))
    kinds = list(ch.targets)
    odds = [float(ch.targets[k]) for k in kinds]
    t0 = time.monotonic()
    with Fleet(c, policy="latest", units=units, use_server=True) as fleet:
        box: dict = {}

        def go():
            try:
                box["result"] = fleet.run(wall_time_s=ch.max_wall_s + ch.settle_s + 600,
                                          progress=False, should_stop=done.is_set,
                                          on_episode=lambda s: reported.add(s["episode_id"]))
            except BaseException as e:  # noqa: BLE001 - reported
                box["error"] = e

        th = threading.Thread(target=go, daemon=True)
        th.start()
        last_snapshot = 0
        while sum(kills.values()) < ch.kills and time.monotonic() - t0 < ch.max_wall_s and th.is_alive():
            time.sleep(ch.interval_s)
            learner.ensure()
            kind = rng.choices(kinds, odds)[0]
            pid = _target_pid(kind, fleet, learner, rng, units)
            if pid is None:
                skipped[kind] += 1
                continue
            try:
                os.kill(int(pid), signal.SIGKILL)
                kills[kind] += 1
            except ProcessLookupError:
                skipped[kind] += 1
            n = sum(kills.values())
            if n - last_snapshot >= 10:   # what a reader sees now must still be there at the end
                last_snapshot = n
                seen |= {e.episode_id for e in ExperienceStore.open(c["store"]["url"]).episodes(quarantined=None)}
                print(f"[chaos] {n} kills {dict(kills)}; {len(reported)} episodes reported committed", flush=True)
        kill_s = time.monotonic() - t0
        learner.ensure()
        n_before = len(reported)
        settle_end = time.monotonic() + ch.settle_s
        while time.monotonic() < settle_end and th.is_alive():   # every process back and committing again
            time.sleep(1.0)
        done.set()
        th.join(600)
        alive = [u for u in units if _alive(ray, fleet.actors[u])]
        server_alive = fleet.server is not None and _alive(ray, fleet.server)
    learner_rc = learner.stop()
    report = audit(c, out, box, reported, seen, units, alive, fleet.server is None or server_alive)
    report.update({"kills": dict(kills), "kills_total": sum(kills.values()), "skipped_restarting": dict(skipped),
                   "kill_phase_s": round(kill_s, 1), "learner_starts": learner.starts, "learner_exit": learner_rc,
                   "server_alive_at_end": server_alive, "episodes_after_last_kill": len(reported) - n_before})
    (out / "chaos.json").write_text(json.dumps(report, indent=1))
    return report


def _target_pid(kind: str, fleet, learner, rng: random.Random, units: list[int]) -> int | None:
    """The pid of one process of ``kind`` (``worker``: a random unit's, ``server``, ``learner``); None when it is
    restarting (then it is not killed)."""
    import ray

    try:
        if kind == "worker":
            return ray.get(fleet.actors[rng.choice(units)].pid.remote(), timeout=3)
        if kind == "server" and fleet.server is not None:
            return ray.get(fleet.server.pid.remote(), timeout=3)
        if kind == "learner":
            return learner.pid()
    except Exception:  # noqa: BLE001 - the target is restarting: not a kill
        return None
    return None


def audit(c: dict, out: Path, box: dict, reported: set[str], seen: set[str], units: list[int], alive: list[int],
          server_ok: bool) -> dict:
    """What survived: every episode reported committed or seen by a reader is in the store (``lost``), no (unit,
    seed) twice among fleet episodes, ``verify`` ok, every published policy version fetches with its sha256."""
    from experience_dict.store import ExperienceStore
    from fleet.registry import CheckpointRegistry

    result = box.get("result")
    final = ExperienceStore.open(c["store"]["url"])
    eps = final.episodes(quarantined=None)
    ids = {e.episode_id for e in eps}
    lost = sorted((reported | seen) - ids)
    fleet_eps = [e for e in eps if not e.is_demo]
    dup = {f"{u}:{s}": n for (u, s), n in Counter((e.unit_id, e.seed) for e in fleet_eps).items() if n > 1}
    check = final.verify()
    reg = CheckpointRegistry(c["fleet"]["registry_url"])
    versions, bad_versions = reg.versions(), []
    for v in versions:
        try:
            reg.fetch(v, out / "verify_cache" / f"v{v}")
        except Exception as e:  # noqa: BLE001 - reported
            bad_versions.append(f"v{v}: {e}")
    return {
        "units_alive_at_end": alive,
        "survived": len(alive) == len(units) and server_ok and "error" not in box,
        "episodes_committed": len(fleet_eps), "reported_committed": len(reported), "lost": lost, "lost_count": len(lost),
        "duplicated_unit_seed": dup, "duplicated_count": sum(n - 1 for n in dup.values()),
        "verify_ok": bool(check["ok"]), "verify_problems": check["problems"][:5],
        "policy_versions": len(versions), "bad_versions": bad_versions,
        "fleet": None if result is None else {"restarts": result.restarts, "failures": result.failures[-5:],
                                              "terminations": result.terminations,
                                              "dropped_units": result.dropped_units},
        "error": repr(box["error"]) if "error" in box else None,
    }


def _alive(ray, actor) -> bool:
    try:
        ray.get(actor.pid.remote(), timeout=60)
        return True
    except Exception:  # noqa: BLE001 - dead
        return False


def main() -> None:
    import hydra

    import configs.typed  # noqa: F401 - registers the typed config groups before Hydra composes

    @hydra.main(version_base=None, config_path="../configs", config_name="config")
    def _main(cfg) -> None:
        from configs.schema import check_or_exit

        check_or_exit(cfg)   # every value against its rule, before any work
        report = run(cfg)
        print(json.dumps({k: v for k, v in report.items() if k not in ("verify_problems",)}, indent=1))
        ok = report["lost_count"] == 0 and report["duplicated_count"] == 0 and report["verify_ok"] \
            and report["survived"] and not report["bad_versions"]
        print(f"chaos: {report['kills_total']} kills {report['kills']}; survived={report['survived']}; "
              f"{report['episodes_committed']} episodes committed, {report['lost_count']} lost, "
              f"{report['duplicated_count']} duplicated (unit, seed); verify ok={report['verify_ok']}; "
              f"{report['policy_versions']} policy versions")
        if not ok:
            raise SystemExit(1)

    _main()


if __name__ == "__main__":
    if os.environ.get(LEARNER_ENV):
        learner_process(os.environ[LEARNER_ENV])
    else:
        main()
