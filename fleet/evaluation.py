"""Held-out evaluation of policy arms and rollout videos.

``evaluate_arms`` runs every arm's checkpoint on the held-out units through the fleet
(``fleet.coordinator.evaluate``: Ray workers, episodes committed to a separate evaluation store, never to the
training store) and returns the episode results; ``record_rollouts`` renders a few held-out episodes of a
checkpoint into MP4 files labelled success / failure.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


def evaluation_plan(tasks: list[str], units: list[int], trials_per_task: int, seed: int = 1000) -> list[dict]:
    """The held-out trials every arm runs: the same ``(task, unit, reset seed)`` list for every policy.

    Giving each arm the same initial states (common random numbers) removes the initial-state variance from
    the differences between arms, so they can be compared trial by trial (:func:`fleet.report.paired_differences`).
    The ``g``-th trial overall (tasks in order, ``trials_per_task`` each) runs on ``units[g % len(units)]``, so units
    get equal shares; a unit's ``k``-th trial resets with ``fleet.worker.episode_seed(seed, unit, k)``.

    Args:
        tasks: task names; units: unit ids (>= 1); trials_per_task: >= 1; seed: the seed stream of the plan
            (``eval.seed``), apart from the training fleet's ``seed``.

    Returns:
        ``[{"task": str, "unit_id": int, "seed": int, "trial": int}, ...]``, ``len(tasks) * trials_per_task`` trials.

    Raises:
        ValueError: no tasks, no units or ``trials_per_task < 1``.
    """
    from fleet.worker import episode_seed

    if not tasks or not units or int(trials_per_task) < 1:
        raise ValueError(f"evaluation_plan: expected tasks, units and trials_per_task >= 1, given tasks={tasks}, "
                         f"units={units}, trials_per_task={trials_per_task}")
    count = {int(u): 0 for u in units}
    plan = []
    for i, task in enumerate(tasks):
        for j in range(int(trials_per_task)):
            u = int(units[(i * int(trials_per_task) + j) % len(units)])
            plan.append({"task": str(task), "unit_id": u, "seed": episode_seed(int(seed), u, count[u]), "trial": j})
            count[u] += 1
    return plan


def evaluate_arms(cfg: dict, arms: dict[str, str], out_dir: str | Path, trials_per_task: int,
                  units: list[int] | None = None, progress: bool = True,
                  tasks: list[str] | None = None) -> dict[str, list[dict]]:
    """Evaluate each arm's checkpoint on held-out units, one arm after the other on one set of workers.

    Args:
        cfg: plain config dict (``robot``, ``obs``, ``task``, ``store``, ``fleet``, ``seed``; ``eval.seed``).
        arms: ``{arm name: pretrained_model directory}``.
        out_dir: the evaluation episodes are committed to ``<out_dir>/eval_store`` (never the training
            store); each arm's episode summaries go to ``<out_dir>/episodes/<arm>.json`` (an arm whose file
            exists is not run again, so an interrupted evaluation resumes).
        trials_per_task: episodes per task per arm, spread over ``units``.
        units: default ``cfg["robot"]["heldout_units"]``.
        tasks: default ``cfg["task"]["tasks"]``.

    Returns:
        ``{arm: [{"task", "unit_id", "seed", "success", "length", "policy_version", "episode_id", ...}, ...]}``.
        Every arm runs the same :func:`evaluation_plan` (same units, tasks and reset seeds; the denoising noise
        follows the seed too), so arms are compared on identical initial states.
    """
    from fleet.coordinator import Fleet

    out = Path(out_dir)
    results: dict[str, list[dict]] = {}
    todo = {}
    for arm, ckpt in arms.items():
        cache = out / "episodes" / f"{arm}.json"
        if cache.is_file():
            results[arm] = json.loads(cache.read_text())
        else:
            todo[arm] = ckpt
    if not todo:
        return results
    c = {**cfg, "fleet": {**cfg["fleet"], "tasks_per_unit": None}}
    units = [int(u) for u in (units if units is not None else c["robot"]["heldout_units"])]
    tasks = list(tasks or c["task"]["tasks"])
    plan = evaluation_plan(tasks, units, int(trials_per_task), int((c.get("eval") or {}).get("seed", 1000)))
    first = next(iter(todo.values()))
    with Fleet(c, policy=str(first), units=units, tasks=tasks, store_url=str(out / "eval_store"),
               is_demo=False) as fleet:
        for arm, ckpt in todo.items():
            log.info("evaluating arm %s (%s) on units %s", arm, ckpt, units)
            res = fleet.run(plan=plan, progress=progress, policy=str(ckpt))
            if res.failures:
                log.warning("arm %s: %d failed calls: %s", arm, len(res.failures), "; ".join(res.failures[-3:]))
            eps = [{k: _jsonable(v) for k, v in e.items()} | {"arm": arm} for e in res.episodes]
            cache = out / "episodes" / f"{arm}.json"
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(eps))
            results[arm] = eps
    return {a: results[a] for a in arms}


def _jsonable(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    return v


def record_rollouts(cfg: dict, checkpoint: str | Path, out_dir: str | Path, units: list[int], tasks: list[str],
                    max_videos: int = 2, max_episodes: int = 12, camera: str = "corner", size: int = 128,
                    seed: int = 10_000) -> list[Path]:
    """Roll a checkpoint out on held-out units with a camera on and save MP4s of successes and failures.

    Runs in this process (no Ray): for each task in turn, episodes on ``units`` until ``max_videos``
    successes and ``max_videos`` failures are saved overall or ``max_episodes`` episodes are spent. The
    policy acts on the same observation keys as in training; the camera image is only recorded.

    Returns:
        paths of ``<out_dir>/<task>_unit<id>_<success|failure>_<n>.mp4`` (80 Hz control rendered at 20 fps,
        every 4th step).
    """
    import imageio.v2 as imageio

    from fleet.policies import TorchPolicy, load_checkpoint
    from sim import make_env

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, version = load_checkpoint(checkpoint, "cpu")
    policy = TorchPolicy(model, version)
    img_key = f"observation.images.{camera}"
    policy_keys = set(getattr(model.config, "input_shapes", {}) or {})
    uses_camera = img_key in policy_keys
    cams = list(dict.fromkeys([*(cfg["obs"].get("cameras") or []), camera])) if uses_camera else [camera]
    obs_cfg = {**dict(cfg["obs"]), "images": True, "cameras": cams,
               "image_size": int(cfg["obs"]["image_size"] if uses_camera else size)}
    saved: list[Path] = []
    counts = {True: 0, False: 0}
    for i in range(max_episodes):
        if counts[True] >= max_videos and counts[False] >= max_videos:
            break
        task, unit = tasks[i % len(tasks)], units[(i // len(tasks)) % len(units)]
        env = make_env(task=task, unit_id=unit, robot_cfg=cfg["robot"], obs_cfg=obs_cfg, task_cfg=cfg["task"])
        obs, info = env.reset(seed=seed + i)
        policy.reset()
        frames, success, done, t = [obs[img_key]], False, False, 0
        while not done:
            action = policy.select_action({k: v for k, v in obs.items() if k != img_key or uses_camera})
            obs, _, terminated, truncated, info = env.step(action)
            success = success or bool(info["success"])
            done = terminated or truncated
            t += 1
            if t % 4 == 0:
                frames.append(obs[img_key])
        env.close()
        if counts[success] >= max_videos:
            continue
        counts[success] += 1
        path = out / f"{task}_unit{unit}_{'success' if success else 'failure'}_{counts[success]}.mp4"
        imageio.mimsave(path, frames, fps=20, macro_block_size=1)
        saved.append(path)
    return saved
