"""Scripted experts: Meta-World's hand-written policies (``metaworld.policies.ENV_POLICY_MAP``), one per task.

They are privileged: they read the env's true, noise-free 39-d Meta-World observation (``env.raw_observation``),
not the noisy dict observation a learned policy sees. They are closed-loop proportional controllers with phase
switches, so they solve varied units; action latency (2 steps = 25 ms) makes some tasks fail more often
(``scripts/sim_check.py`` prints the table). ``latency_compensation=True`` feeds them a Smith-predicted hand
position instead; measured at latency 2 (6 seeds) it lifts handle-pull-side 0->1.0, box-close 0.17->1.0,
bin-picking 0.17->0.67, but breaks tasks whose phase switch waits for the hand to arrive (basketball 0.67->0,
pick-out-of-hole, peg-insert-side, handle-pull 1.0->0), so it is off by default.
"""

from __future__ import annotations

import warnings

import numpy as np

from sim.metaworld_env import MetaWorldEnv


class ScriptedExpert:
    """Meta-World's scripted policy for ``env.task``, with optional Gaussian action noise.

    Args:
        env: the ``MetaWorldEnv`` whose privileged state the expert reads.
        noise_std: std of Gaussian noise added to every action dimension (actions are then clipped to [-1, 1]).
        seed: seed of the noise generator (its own stream, independent of the env's).
        latency_compensation: act on the hand position predicted after the unit's pending actions.

    Raises:
        ValueError: negative ``noise_std``.
        TypeError: ``env`` is not a ``sim`` MetaWorldEnv.
    """

    def __init__(self, env: MetaWorldEnv, noise_std: float = 0.0, seed: int = 0,
                 latency_compensation: bool = False) -> None:
        from metaworld.policies import ENV_POLICY_MAP

        env = getattr(env, "unwrapped", env)
        if not isinstance(env, MetaWorldEnv):
            raise TypeError(f"make_expert: expected a sim MetaWorldEnv, given {type(env).__name__}")
        if not noise_std >= 0:
            raise ValueError(f"make_expert: noise_std must be >= 0, given {noise_std}")
        self.env, self.noise_std, self.seed = env, float(noise_std), int(seed)
        self.latency_compensation = bool(latency_compensation)
        self.policy = ENV_POLICY_MAP[env.task]()
        self.rng = np.random.default_rng(self.seed)

    def reset(self, seed: int | None = None) -> None:
        """Restart the noise stream (from ``seed``, else from the constructor's seed)."""
        self.rng = np.random.default_rng(self.seed if seed is None else int(seed))

    def act(self, obs: dict | None = None) -> np.ndarray:
        """Action (4,) float32 in [-1, 1] for the env's current state; ``obs`` is accepted and ignored."""
        with warnings.catch_warnings():  # Meta-World's `move` warns on large P-responses; the env clips them
            warnings.filterwarnings("ignore", message=r"Constant\(s\) may be too high")
            raw = self._predicted_observation() if self.latency_compensation else self.env.raw_observation
            a = np.asarray(self.policy.get_action(raw), dtype=np.float64)
        if self.noise_std > 0:
            a = a + self.rng.normal(0.0, self.noise_std, size=a.shape)
        return np.clip(a, -1.0, 1.0).astype(np.float32)

    __call__ = act

    def _predicted_observation(self) -> np.ndarray:
        """The raw observation with the hand moved by the actions still queued by the unit's latency.

        A Smith predictor (O. J. M. Smith, 1957): the scripted P-controllers act on where the hand will be when
        their action executes, which keeps them from overshooting on units with action latency.
        """
        raw = self.env.raw_observation
        pending = self.env.pending_actions
        if len(pending):
            raw[0:3] += (np.clip(pending[:, :3], -1.0, 1.0) * self.env.action_scale).sum(axis=0)
        return raw


def make_expert(env: MetaWorldEnv, noise_std: float = 0.0, seed: int = 0,
                latency_compensation: bool = False) -> ScriptedExpert:
    """The scripted expert of ``env``'s task; see ``ScriptedExpert``."""
    return ScriptedExpert(env, noise_std=noise_std, seed=seed, latency_compensation=latency_compensation)
