"""Scripted experts for the SO-100 tabletop tasks: privileged proportional controllers with phase switches
(the style of Meta-World's scripted policies) that read the true tcp, cube and goal positions from the env."""

from __future__ import annotations

import numpy as np

from sim.so100.env import CUBE_HALF, SO100Env


class SO100Expert:
    """Scripted expert for ``env.task`` (``so100-reach`` / ``so100-push-cube`` / ``so100-pick-place``).

    ``act(obs) -> (4,) float32`` in [-1, 1]; ``obs`` is ignored (the expert reads ``env.tcp``, ``env.cube``,
    ``env.goal``). Action = clip(gain x (waypoint - tcp) / action_scale): metres turned into action units.

    Args:
        env: the ``SO100Env``; noise_std: Gaussian action noise (then clipped); seed: noise seed.
    Raises:
        TypeError: not an ``SO100Env``. ValueError: negative ``noise_std``.
    """

    def __init__(self, env: SO100Env, noise_std: float = 0.0, seed: int = 0, gain: float = 0.6) -> None:
        env = getattr(env, "unwrapped", env)
        if not isinstance(env, SO100Env):
            raise TypeError(f"SO100Expert: expected an SO100Env, given {type(env).__name__}")
        if not noise_std >= 0:
            raise ValueError(f"SO100Expert: noise_std must be >= 0, given {noise_std}")
        self.env, self.noise_std, self.seed, self.gain = env, float(noise_std), int(seed), float(gain)
        self.rng = np.random.default_rng(self.seed)

    def reset(self, seed: int | None = None) -> None:
        """Restart the noise stream."""
        self.rng = np.random.default_rng(self.seed if seed is None else int(seed))

    def _move(self, waypoint: np.ndarray, grip: float, max_step: float = 1.0) -> np.ndarray:
        delta = (np.asarray(waypoint) - self.env.tcp) / self.env.action_scale
        return np.array([*np.clip(self.gain * delta, -max_step, max_step), grip])

    def act(self, obs: dict | None = None) -> np.ndarray:
        env = self.env
        tcp, cube, goal = env.tcp, env.cube, env.goal
        if env.task == "so100-reach":
            a = self._move(goal, -1.0)
        elif env.task == "so100-push-cube":
            a = self._push(tcp, cube, goal)
        else:
            a = self._pick_place(tcp, cube, goal)
        if self.noise_std > 0:
            a = a + self.rng.normal(0.0, self.noise_std, size=4)
        return np.clip(a, -1.0, 1.0).astype(np.float32)

    __call__ = act

    def _push(self, tcp, cube, goal) -> np.ndarray:
        """Push with the closed jaws' tips: waypoints are for the fingertips, moved into tcp coordinates.

        Behind the cube (on the goal->cube line, within 2 cm of it, low): aim at the cube's back face moved up
        to 2 cm towards the goal, which pushes the cube and re-centres the tips on the line as it goes; else go
        around above to 2 cm behind the cube and descend."""
        tips = self.env.fingertips
        shift = tcp - tips
        to_goal = goal[:2] - cube[:2]
        dist = np.linalg.norm(to_goal)
        u = to_goal / max(dist, 1e-6)
        rel = tips[:2] - cube[:2]
        lateral, along = abs(rel[0] * u[1] - rel[1] * u[0]), rel @ u
        low, behind = 0.013, cube[:2] - u * (CUBE_HALF + 0.02)
        if along < -0.5 * CUBE_HALF and lateral < 0.02 and tips[2] < 0.025:  # behind the cube: push it
            return self._move(np.r_[cube[:2] - u * CUBE_HALF + u * min(0.02, dist), low] + shift, 1.0,
                              max_step=0.4)
        if np.linalg.norm(tips[:2] - behind) > 0.01:                    # go behind the cube, from above
            return self._move(np.r_[behind, 0.045] + shift, 1.0)
        return self._move(np.r_[behind, low] + shift, 1.0)              # descend behind it

    def _pick_place(self, tcp, cube, goal) -> np.ndarray:
        xy_err = np.linalg.norm(tcp[:2] - cube[:2])
        if self.env.grasped():                               # holding: carry to the goal
            return self._move(goal, 1.0)
        if xy_err > 0.005:                                   # above the cube, gripper open
            return self._move([*cube[:2], cube[2] + (0.05 if xy_err > 0.02 else 0.02)], -1.0)
        if tcp[2] > cube[2] + 0.008:                         # descend open
            return self._move([*cube[:2], cube[2]], -1.0)
        return self._move([*cube[:2], cube[2]], 1.0)         # close


def make_so100_expert(env: SO100Env, noise_std: float = 0.0, seed: int = 0, **_: object) -> SO100Expert:
    """The scripted expert of ``env``'s SO-100 task (extra keyword arguments of ``sim.make_expert`` are ignored)."""
    return SO100Expert(env, noise_std=noise_std, seed=seed)
