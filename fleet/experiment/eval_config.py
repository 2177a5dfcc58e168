"""Evaluation's typed config: Hydra's config group ``eval``, and the one place its defaults live.

:class:`EvalConfig` is registered in Hydra's ConfigStore as ``eval/default`` (:mod:`configs.typed`), so an
unknown key (``eval.trails_per_task=5``) or a wrong type is refused while the config is composed, naming the key,
and a value out of range by ``configs.schema.check`` before any work. Held-out evaluation
(``fleet.experiment.evaluation.evaluate_arms``), the vectorised fleet of the main job's rounds and ``scripts/eval.py`` read
it through :meth:`EvalConfig.from_dict`, so a key a caller leaves out takes the value below.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from configs.rules import POS, TypedConfig, integer, one_of, optional


@dataclass
class EvalConfig(TypedConfig):
    """Held-out evaluation: every arm plays the same fixed plan of (task, unit, reset seed) trials (common random
    numbers; ``fleet.experiment.evaluation.evaluation_plan``), so arms are compared trial by trial.

    Raises:
        configs.rules.ConfigError: (a ``ValueError``) listing every value out of its range,
            ``eval.<key>: expected ..., given ...``, or naming an unknown key.
    """

    trials_per_task: int = 50
    """Held-out trials per task and arm (spread over the units)."""
    seed: int = 1000
    """Seed stream of the held-out trial plan: every arm runs the same (task, unit, reset seed) trials."""
    checkpoint: str | None = None
    """``scripts/eval.py``: one ``pretrained_model`` directory (arm name: its parent run's folder name)."""
    checkpoints: Any = None
    """``scripts/eval.py``: ``{arm name: pretrained_model directory}``, e.g.
    ``'eval.checkpoints={fert: outputs/r/...}'`` (null: none; typed Any, as a typed mapping would refuse the
    command line's new keys)."""
    units: Any = None
    """``scripts/eval.py``: unit ids to evaluate on, a list or a ``"start:stop"`` range (``sim.units.parse_units``;
    null: ``robot.heldout_units``)."""
    tasks: list[str] | None = None
    """``scripts/eval.py``: task names (null: ``task.tasks``)."""
    videos: int = 2
    """Rollout videos (successes and failures) per arm; 0: none."""
    video_episodes: int = 8
    """Episodes rendered at most per arm while looking for those videos."""
    baseline: str | None = None
    """``scripts/eval.py``: the arm the others are compared with trial by trial (paired differences); null: none."""
    backend: str = "vector"
    """vector: ``batch_size`` envs stepped together with one batched policy call per step, in ``processes``
    spawned processes (``fleet.experiment.evaluation.run_plan_vectorised``) | ray: the fleet's workers."""
    batch_size: int = 32
    """Envs stepped together per process (vector backend; also the main job's vectorised fleet)."""
    processes: int = 2
    """Spawned evaluation processes (vector backend)."""
    max_envs: int | None = None
    """Envs each process keeps for reuse, at most (least recently used closed first); null: 4 x batch_size
    state-only, 2 x batch_size with images (~90 MB each on a CPU renderer). Unbounded, the task-by-task plan kept
    batch_size envs per (task, unit): ~9 GB per process with obs=vision at batch 32 (2026-12-02)."""


EvalConfig._group, EvalConfig._rules = "eval", {
    "checkpoints": lambda v: None if v is None or isinstance(v, Mapping) else "null or a mapping {arm: directory}",
    "trials_per_task": POS, "seed": integer(0), "videos": integer(0), "video_episodes": integer(0),
    "backend": one_of("vector", "ray"), "batch_size": POS, "processes": POS, "max_envs": optional(POS)}
