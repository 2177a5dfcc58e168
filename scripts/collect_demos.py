"""Collect scripted-expert demonstrations of a task suite into the experience store.

    python scripts/collect_demos.py task=mw_quick                       # 10 demos per task, state only
    python scripts/collect_demos.py task=mw10 obs=vision store.demos.per_task=25 store.url=outputs/demos

For every task of ``cfg.task.tasks``, ``store.demos.per_task`` episodes of Meta-World's scripted expert
(``sim.make_expert``) run on the demonstration units (``store.demos.units``, else ``robot.demo_units``, else
``robot.train_units``; round-robin) and are committed with
``is_demo=True`` and ``policy_version=-1`` (the scripted expert's version, as in ``configs/policy/expert.yaml``).
Each unit writes its own shard (writer id ``<store.demos.writer_id>-unit-<id>``). Episode seeds are
``store.demos.seed + 1000 * task_index + demo_index + 100000 * attempt``; with ``successful_only`` a failed
attempt is discarded and retried with the next attempt's seed. Running it again adds more demonstrations.

With ``store.demos.on_fleet=true`` the demonstrations are collected in parallel on the Ray fleet instead
(``fleet.coordinator.collect``: one worker per training unit, each writing its own shard ``unit-<id>``;
failed attempts are kept as non-successful episodes rather than retried).

Prints and writes ``<output_dir>/collect_demos.json``: per-task counts and success, the store's ``verify``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

import configs.typed  # noqa: F401 - registers the typed config groups before Hydra composes
from fleet.progress import calm_progress
from fleet.refusals import one_line_refusals
from policies.threads import passive_wait

passive_wait()   # before torch loads: OpenMP's idle threads sleep instead of spinning (policies/threads.py)
calm_progress()  # off a terminal, a progress bar redraws every 30 s, not 15 times a second (fleet/progress.py)

from experience_dict.store import ExperienceStore
from experience_dict.store.config import StoreConfig, store_layout

DEMO_POLICY_VERSION = -1  # the scripted expert


def run_episode(env, expert, writer, task: str, unit, seed: int) -> tuple[bool, int]:
    """Roll out the expert once, buffering every step in ``writer``; returns (success, steps)."""
    writer.begin_episode(unit_id=unit.unit_id, embodiment=unit.embodiment, task=task,
                         control_hz=getattr(env, "control_hz", None) or None,
                         policy_version=DEMO_POLICY_VERSION, seed=seed, is_demo=True,
                         extra={"unit": unit.to_dict(), "expert_noise_std": expert.noise_std})
    obs, info = env.reset(seed=seed)
    expert.reset(seed=seed)
    success, steps = False, 0
    while True:
        action = expert.act(obs)
        next_obs, reward, terminated, truncated, info = env.step(action)
        writer.add_step(obs, action, float(reward), info["progress"])
        obs, steps = next_obs, steps + 1
        success = success or bool(info.get("episode_success", info["success"]))
        if terminated or truncated:
            return success, steps


@hydra.main(version_base=None, config_path="../configs", config_name="config")
@one_line_refusals("demos")   # a refusal (store, registry, policy): one line, exit 2, the trace in the run's log
def main(cfg: DictConfig) -> None:
    from configs.schema import check_or_exit

    check_or_exit(cfg)   # every value against its rule, before any work
    from sim import make_env, make_expert

    scfg = StoreConfig.from_dict(cfg.store)
    dcfg = scfg.demos
    tasks = list(cfg.task.tasks)
    if dcfg.on_fleet:
        return collect_on_fleet(cfg)
    units = demo_units(cfg)
    if not units or not tasks:
        raise SystemExit(f"collect_demos: need tasks and units, given tasks={tasks} units={units}")
    robot_cfg, obs_cfg, task_cfg = (OmegaConf.to_container(c, resolve=True) for c in (cfg.robot, cfg.obs, cfg.task))
    envs: dict = {}

    def env_of(task: str, unit_id: int):
        if (task, unit_id) not in envs:
            env = make_env(task=task, unit_id=unit_id, robot_cfg=robot_cfg, obs_cfg=obs_cfg, task_cfg=task_cfg)
            envs[task, unit_id] = (env, make_expert(env, noise_std=float(dcfg.noise_std), seed=int(dcfg.seed)))
        return envs[task, unit_id]

    spec = env_of(tasks[0], units[0])[0].spec_dict()
    store = ExperienceStore.create_or_open(str(cfg.store.url), spec=spec, control_hz=spec.get("control_hz"),
                                           **store_layout(scfg))
    writers = {u: store.writer(f"{dcfg.writer_id}-unit-{u}") for u in units}
    summary = {t: {"committed": 0, "successes": 0, "discarded": 0, "steps": 0} for t in tasks}
    t0 = time.time()
    bar = tqdm(total=len(tasks) * int(dcfg.per_task), desc="demos", unit="ep")
    for ti, task in enumerate(tasks):
        for i in range(int(dcfg.per_task)):
            unit_id = units[i % len(units)]
            env, expert = env_of(task, unit_id)
            writer = writers[unit_id]
            for attempt in range(int(dcfg.max_attempts)):
                seed = int(dcfg.seed) + 1000 * ti + i + 100000 * attempt
                success, steps = run_episode(env, expert, writer, task, env.unit, seed)
                last = attempt == int(dcfg.max_attempts) - 1
                if success or not dcfg.successful_only:
                    writer.commit(success=success)
                    s = summary[task]
                    s["committed"] += 1
                    s["successes"] += int(success)
                    s["steps"] += steps
                    break
                writer.abort()
                summary[task]["discarded"] += 1
                if last:
                    tqdm.write(f"{task} demo {i} (unit {unit_id}): no success in {dcfg.max_attempts} attempts; skipped")
            bar.update(1)
            bar.set_postfix(task=task, refresh=False)
    bar.close()
    for w in writers.values():
        w.close()
    for env, _ in envs.values():
        env.close()
    finish(cfg, {"tasks": summary, "wall_s": round(time.time() - t0, 1)})


def finish(cfg: DictConfig, result: dict) -> None:
    """Verify the store, print and write ``<output_dir>/collect_demos.json``; exit non-zero on corruption."""
    reader = ExperienceStore.open(str(cfg.store.url))
    check = reader.verify()
    result = {"store": str(cfg.store.url), **result, "demos_in_store": len(reader.episodes(is_demo=True)),
              "verify": {k: check[k] for k in ("ok", "episodes", "chunks_checked", "corrupt_episodes")}}
    out = Path(cfg.output_dir) / "collect_demos.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    if not check["ok"]:
        raise SystemExit(f"store verify failed: {check['problems'][:3]}")


def demo_units(cfg: DictConfig) -> list[int]:
    """The units the demonstrations run on: ``store.demos.units``, else ``robot.demo_units``, else the training
    units (``sim.demo_unit_list``)."""
    from sim import demo_unit_list
    from sim.units import parse_units

    units = StoreConfig.from_dict(cfg.store).demos.units
    if units is not None:
        return parse_units(units, "store.demos.units")
    return demo_unit_list(OmegaConf.to_container(cfg.robot, resolve=True))


def collect_on_fleet(cfg: DictConfig) -> None:
    """Collect the demonstrations on the Ray fleet (one worker per unit, in parallel)."""
    from fleet.coordinator import collect

    dcfg = StoreConfig.from_dict(cfg.store).demos
    t0 = time.time()
    res = collect(cfg, policy={"kind": "expert", "noise_std": float(dcfg.noise_std)}, is_demo=True,
                  episodes_per_task=int(dcfg.per_task),
                  units=demo_units(cfg), store_url=str(cfg.store.url))
    print(res.table("task"))
    finish(cfg, {"episodes": len(res.episodes), "wall_s": round(time.time() - t0, 1)})


if __name__ == "__main__":
    main()
