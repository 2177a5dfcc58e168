"""Benchmark the sim: env steps/s state-only and with one camera, beside raw ``mj_step`` of the same model.

    python scripts/bench_sim.py                      # the default suite (mw_mid); JSON to <output_dir>/bench_sim.json
    python scripts/bench_sim.py task=mw10 +sim.bench.image_size=84

Per task, all in one process on one unit (the first training unit): random actions (seeded) through the env
state-only and with one ``sim.bench.camera`` image of ``sim.bench.image_size``; then ``mj_step`` alone on a copy
of the same (unit-varied) model and data. An env step is ``frame_skip`` = 5 physics steps, so the baseline is
``raw_control_steps_per_s = raw_mj_steps_per_s / 5`` and the figure of merit is
``ratio = env_steps_per_s / raw_control_steps_per_s`` (1.0 = no overhead above physics). Resets are timed
apart (``reset_s``) and excluded from steps/s. ``metaworld_steps_per_s`` times Meta-World's own ``step`` (no
fleetmind wrapper) on the same env, so ``ratio_state_to_metaworld`` is the wrapper's own cost.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import time
from pathlib import Path

import hydra
import numpy as np
from omegaconf import DictConfig
from tqdm import tqdm

import configs.typed  # noqa: F401 - registers the typed config groups before Hydra composes
import sim
from scripts.sim_check import sim_settings
from sim.units import as_dict


def time_env(env, steps: int, seed: int = 0) -> dict:
    """Env steps/s over ``steps`` random actions (reset time excluded and reported apart)."""
    rng = np.random.default_rng(seed)
    actions = rng.uniform(-1, 1, (steps, 4)).astype(np.float32)
    t_reset, n_reset = time.perf_counter(), 1
    env.reset(seed=seed)
    t_reset = time.perf_counter() - t_reset
    t_step = 0.0
    for i in range(steps):
        t0 = time.perf_counter()
        _, _, terminated, truncated, _ = env.step(actions[i])
        t_step += time.perf_counter() - t0
        if terminated or truncated:
            t0 = time.perf_counter()
            env.reset(seed=seed + n_reset)
            t_reset += time.perf_counter() - t0
            n_reset += 1
    return {"steps_per_s": steps / t_step, "reset_s": t_reset / n_reset}


def time_metaworld(env, steps: int, seed: int = 0) -> float:
    """Meta-World's own ``step`` per second (no fleetmind wrapper) with the same random actions."""
    actions = np.random.default_rng(seed).uniform(-1, 1, (steps, 4))
    env.reset(seed=seed)
    mw, t, n = env._mw, 0.0, 0
    for i in range(steps):
        if mw.curr_path_length >= mw.max_path_length:
            mw.reset()
        t0 = time.perf_counter()
        mw.step(actions[i])
        t += time.perf_counter() - t0
        n += 1
    return n / t


def time_raw(env, steps: int) -> float:
    """Raw ``mujoco.mj_step`` calls per second on a copy of the env's model and data."""
    import mujoco

    model, data = env.mj_model, copy.deepcopy(env.mj_data)
    t0 = time.perf_counter()
    for _ in range(steps):
        mujoco.mj_step(model, data)
    return steps / (time.perf_counter() - t0)


@hydra.main(version_base=None, config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> None:
    b = sim_settings(cfg)["bench"]
    tasks = sim.list_tasks(cfg.task)
    train, _ = sim.unit_lists(cfg.robot)
    unit = train[0] if train else 0
    task_cfg = {**as_dict(cfg.task), "max_episode_steps": 500}
    state_cfg = {**as_dict(cfg.obs), "images": False}
    image_cfg = {**as_dict(cfg.obs), "images": True, "cameras": [b["camera"]], "image_size": int(b["image_size"])}
    results = {}
    for task in tqdm(tasks, desc="bench tasks"):
        env = sim.make_env(task, unit, cfg.robot, state_cfg, task_cfg)
        state = time_env(env, int(b["state_steps"]))
        raw = time_raw(env, int(b["raw_steps"]))
        metaworld = time_metaworld(env, int(b["state_steps"]))
        env.close()
        env = sim.make_env(task, unit, cfg.robot, image_cfg, task_cfg)
        image = time_env(env, int(b["image_steps"]))
        frame_skip = int(env._mw.frame_skip)
        env.close()
        raw_control = raw / frame_skip
        results[task] = {
            "env_state_steps_per_s": round(state["steps_per_s"], 1),
            "env_image_steps_per_s": round(image["steps_per_s"], 1),
            "metaworld_steps_per_s": round(metaworld, 1),
            "raw_mj_steps_per_s": round(raw, 1),
            "frame_skip": frame_skip,
            "raw_control_steps_per_s": round(raw_control, 1),
            "ratio_state": round(state["steps_per_s"] / raw_control, 3),
            "ratio_image": round(image["steps_per_s"] / raw_control, 3),
            "ratio_state_to_metaworld": round(state["steps_per_s"] / metaworld, 3),
            "reset_s": round(state["reset_s"], 4),
        }
    keys = [k for k in next(iter(results.values())) if k != "frame_skip"]
    report = {
        "bench": "sim", "suite": cfg.task.name, "unit": unit, "camera": b["camera"],
        "image_size": int(b["image_size"]), "gl_backend": os.environ.get("MUJOCO_GL"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "tasks": results,
        "mean": {k: round(float(np.mean([r[k] for r in results.values()])), 3) for k in keys},
    }
    out = Path(b["out"]) if b["out"] else Path(cfg.output_dir) / "bench_sim.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
