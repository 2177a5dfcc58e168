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


def evaluate_arms(cfg: dict, arms: dict[str, str], out_dir: str | Path, trials_per_task: int,
                  units: list[int] | None = None, progress: bool = True) -> dict[str, list[dict]]:
    """Evaluate each arm's checkpoint on held-out units, one arm after the other on one set of workers.

    Args:
        cfg: plain config dict (``robot``, ``obs``, ``task``, ``store``, ``fleet``, ``seed``).
        arms: ``{arm name: pretrained_model directory}``.
        out_dir: the evaluation episodes are committed to ``<out_dir>/eval_store`` (never the training
            store); each arm's episode summaries go to ``<out_dir>/episodes/<arm>.json`` (an arm whose file
            exists is not run again, so an interrupted evaluation resumes).
        trials_per_task: episodes per task per arm, spread over ``units``.
        units: default ``cfg["robot"]["heldout_units"]``.

    Returns:
        ``{arm: [{"task", "unit_id", "success", "length", "policy_version", "episode_id", ...}, ...]}``.
        Every arm meets the same units; the reset seeds continue across arms (episode ``i`` of a unit uses
        seed ``episode_seed(seed, unit, i)``), so arms see different but identically distributed initial
        states.
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
    units = list(units if units is not None else c["robot"]["heldout_units"])
    first = next(iter(todo.values()))
    with Fleet(c, policy=str(first), units=units, store_url=str(out / "eval_store"), is_demo=False) as fleet:
        for arm, ckpt in todo.items():
            log.info("evaluating arm %s (%s) on units %s", arm, ckpt, units)
            res = fleet.run(episodes_per_task=int(trials_per_task), progress=progress, policy=str(ckpt))
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
