"""Look at the sim: one frame from each of N robot units side by side (PNG), and the scripted experts' success
table per task and unit.

    python scripts/sim_check.py                               # the default suite (mw_mid), all configured units
    python scripts/sim_check.py task=mw10 +sim.check.episodes=3 obs.cameras=[corner2]

Writes ``<output_dir>/sim_check_units.png`` and ``<output_dir>/sim_check.json`` (success per task and unit) and
prints the table. Settings: ``sim.check`` (:class:`configs.scripts.SimCheckConfig`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import hydra
import numpy as np
from omegaconf import DictConfig
from tqdm import tqdm

import configs.typed  # noqa: F401 - registers the typed config groups before Hydra composes
import sim
from configs.scripts import SimConfig
from sim.units import as_dict


def sim_settings(cfg: DictConfig) -> dict:
    """``cfg.sim`` as a plain dict with every key (:class:`configs.scripts.SimConfig`'s defaults for a key it lacks)."""
    return SimConfig.from_dict(cfg.get("sim")).to_dict()


def render_units_png(cfg: DictConfig, task: str, units: list[int], heldout: set[int], size: int, path: Path) -> None:
    """Render the first reset frame (seed 0) of ``task`` on each unit and save them side by side with labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    camera = (list(cfg.obs.cameras) or ["corner"])[0]
    obs_cfg = {**as_dict(cfg.obs), "images": True, "cameras": [camera], "image_size": size}
    fig, axes = plt.subplots(1, len(units), figsize=(2.2 * len(units), 2.5), squeeze=False)
    for ax, u in zip(axes[0], units):
        env = sim.make_env(task, u, cfg.robot, obs_cfg, cfg.task)
        obs, _ = env.reset(seed=0)
        ax.imshow(obs[f"observation.images.{camera}"])
        ax.set_title(f"unit {u} ({'held-out' if u in heldout else 'train'})", fontsize=9)
        ax.axis("off")
        env.close()
    fig.suptitle(f"{task}, camera {camera}, seed 0", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def expert_table(cfg: DictConfig, tasks: list[str], units: list[int], episodes: int, noise_std: float,
                 compensate: bool = False) -> dict:
    """Success rate of the scripted expert per task and unit over seeds ``0..episodes-1`` (``fleet.rollout``:
    the fleet's own episode loop and fault rules)."""
    from fleet.rollout import rollout

    rates: dict[str, dict[int, float]] = {}
    bar = tqdm(total=len(tasks) * len(units) * episodes, desc="expert episodes", unit="ep")
    for task in tasks:
        rates[task] = {}
        for u in units:
            env = sim.make_env(task, u, cfg.robot, {**as_dict(cfg.obs), "images": False}, cfg.task)
            expert = sim.make_expert(env, noise_std=noise_std, seed=u, latency_compensation=compensate)
            wins = 0
            for seed in range(episodes):
                obs, _ = env.reset(seed=seed)
                wins += rollout(env, lambda o, t: expert.act(o), obs).success   # until the env ends the episode
                bar.update(1)
            rates[task][u] = wins / episodes
            env.close()
    bar.close()
    return rates


def format_table(rates: dict, units: list[int], heldout: set[int]) -> str:
    """Markdown table: one row per task, one column per unit (``*`` marks held-out units), plus the mean."""
    head = ["task"] + [f"u{u}{'*' if u in heldout else ''}" for u in units] + ["mean"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for task, row in rates.items():
        vals = [row[u] for u in units]
        lines.append("| " + " | ".join([task] + [f"{v:.2f}" for v in vals] + [f"{np.mean(vals):.2f}"]) + " |")
    return "\n".join(lines)


@hydra.main(version_base=None, config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> None:
    from configs.schema import check_or_exit

    check_or_exit(cfg)   # every value against its rule, before any work
    s = sim_settings(cfg)["check"]
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tasks = sim.list_tasks(cfg.task)
    train, heldout = sim.unit_lists(cfg.robot)
    units = sim.units.parse_units(s["units"], "sim.check.units") if s["units"] is not None else train + heldout
    print(f"GL backend: {os.environ.get('MUJOCO_GL')}; suite {cfg.task.name}: {tasks}; units {units}")

    png = out / "sim_check_units.png"
    render_units_png(cfg, s["render_task"] or tasks[0], (train + heldout)[: int(s["render_units"])],
                     set(heldout), int(s["render_size"]), png)
    print(f"wrote {png}")

    rates = expert_table(cfg, tasks, units, int(s["episodes"]), float(s["noise_std"]),
                         bool(s["latency_compensation"]))
    table = format_table(rates, units, set(heldout))
    overall = float(np.mean([v for row in rates.values() for v in row.values()]))
    latency = {u: sim.RobotUnit.draw(u, cfg.robot).action_latency for u in units}
    print(f"\nscripted expert success rate ({s['episodes']} episodes per cell, * = held-out unit; "
          f"action latency per unit: {latency}):\n{table}")
    print(f"overall: {overall:.3f}")
    result = {"suite": cfg.task.name, "tasks": tasks, "units": units, "heldout_units": heldout,
              "episodes": int(s["episodes"]), "noise_std": float(s["noise_std"]), "overall": overall,
              "latency_compensation": bool(s["latency_compensation"]),
              "success_rate": {t: {str(u): r for u, r in row.items()} for t, row in rates.items()},
              "robot": as_dict(cfg.robot)}
    (out / "sim_check.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'sim_check.json'}")


if __name__ == "__main__":
    main()
