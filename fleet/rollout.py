"""One rollout: an env stepped by a policy until the episode ends, under the fleet's fault rules.

Every fleet episode runs through :func:`rollout` (``fleet.worker.RobotWorker`` runs demonstrations, fleet
episodes, failure retries and Ray-backed held-out trials with it) and so does ``scripts/sim_check.py``'s expert
table; the vectorised evaluation (``fleet.experiment.evaluation.run_plan_vectorised``) steps many envs in one batch with the
same per-step rule, :func:`step_trial`. Real robots run through ``fleet.deploy.deployer`` (its own loop: the
watchdog, the safety filter and the bridge sit between the policy and the arm).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


def _finite_obs(obs: dict) -> bool:
    """Every float array of ``obs`` is finite (images are uint8)."""
    return all(np.isfinite(v).all() for v in obs.values()
               if isinstance(v, np.ndarray) and np.issubdtype(v.dtype, np.floating))


def step_trial(env, obs: dict, action: np.ndarray) -> tuple[tuple | None, str | None, tuple | None]:
    """One control step under the fleet's fault rules (:func:`rollout` and the vectorised evaluation use it).

    Args:
        env: the trial's env; obs: the observation the action was chosen on; action: (A,) float32 policy action.
    Returns:
        ``(row, fault, out)``: ``row`` = ``(obs, taken action (A,) float32, reward, progress)`` to store (the
        env's clipped command ``info["action"]``), or None; ``fault`` = the termination when this step ends the
        episode as a fault (``non_finite_action``: nothing stepped; ``non_finite_reward``: not stored;
        ``sim_unstable`` from the env, ``non_finite_observation`` for the next observation: stored), else None;
        ``out`` = ``env.step``'s ``(next_obs, reward, terminated, truncated, info)`` or None. A faulty step adds
        nothing to the episode's success or return.
    """
    if not np.all(np.isfinite(action)):
        return None, "non_finite_action", None
    out = env.step(action)
    nxt, reward, _, _, info = out
    if not np.isfinite(reward):
        return None, "non_finite_reward", out
    row = (obs, np.asarray(info.get("action", np.clip(action, -1.0, 1.0)), dtype=np.float32), float(reward),
           info["progress"])
    if info.get("termination"):           # e.g. sim_unstable: the env ended the episode
        return row, str(info["termination"]), out
    if not _finite_obs(nxt):
        return row, "non_finite_observation", out
    return row, None, out


@dataclass
class RolloutResult:
    """What one rollout did: ``success`` (the env's ``info["success"]`` at any step), ``ret`` (summed reward),
    ``length`` (steps stored), ``termination`` (``terminated`` / ``truncated`` / ``max_steps`` or a fault of
    :func:`step_trial`, or ``non_finite_observation`` for the reset observation)."""

    success: bool
    ret: float
    length: int
    termination: str


def rollout(env, act: Callable[[dict, int], np.ndarray], obs: dict, max_steps: int | None = None, writer=None,
            before_step: Callable[[int], None] | None = None,
            on_step: Callable[[int], None] | None = None) -> RolloutResult:
    """Step ``env`` from its reset observation ``obs`` with ``act(obs, t) -> (A,) float32 action`` until it
    terminates, truncates, faults (:func:`step_trial`) or ``max_steps`` steps were taken (None: until the env
    ends it).

    Args:
        writer: an ``EpisodeWriter`` with an open episode: every stored step is ``writer.add_step(*row)``.
        before_step: called with ``t`` before each step (the fleet's fault-injection hook).
        on_step: called with the episode length after each stored step (progress reporting).
    Returns:
        :class:`RolloutResult`.
    """
    success, ret, length = False, 0.0, 0
    if not _finite_obs(obs):
        return RolloutResult(False, 0.0, 0, "non_finite_observation")
    t = 0
    while max_steps is None or t < max_steps:
        if before_step is not None:
            before_step(t)
        row, fault, out = step_trial(env, obs, act(obs, t))
        if row is not None:
            if writer is not None:
                writer.add_step(*row)
            length = t + 1
            if on_step is not None:
                on_step(length)
        if fault is not None:
            return RolloutResult(success, ret, length, fault)
        obs, reward, terminated, truncated, info = out
        success |= bool(info["success"])
        ret += float(reward)
        if terminated or truncated:
            return RolloutResult(success, ret, length, "terminated" if terminated else "truncated")
        t += 1
    return RolloutResult(success, ret, length, "max_steps")
