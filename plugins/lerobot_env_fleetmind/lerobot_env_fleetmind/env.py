"""One fleetmind robot unit as the gym env LeRobot's rollout expects (``lerobot.envs.utils.preprocess_observation``).

Observations: ``agent_pos`` = fleetmind's ``observation.state``, ``environment_state`` = its
``observation.environment_state`` (float32), and with cameras ``pixels`` = ``{camera: (H, W, 3) uint8}``.
``info["is_success"]`` is the episode's success so far (fleetmind's ``episode_success``: a success at any step,
the way fleetmind's evaluation counts a trial). ``task`` / ``task_description`` name the task and the unit.
``render()`` gives the first camera's image (``corner`` when none is observed) for LeRobot's videos.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

_ROBOT_CFG: dict[str, Any] = {}


def robot_config(name: str) -> dict:
    """The composed ``robot`` group of ``configs/robot/<name>.yaml`` (what the fleet job composes), as a dict.

    Raises:
        ValueError: no such preset (lists the ones there are).
    """
    if name not in _ROBOT_CFG:
        from pathlib import Path

        from hydra import compose, initialize_config_dir
        from omegaconf import OmegaConf

        import configs
        import configs.typed  # registers the typed groups before Hydra composes

        root = Path(configs.__file__).resolve().parent
        presets = sorted(p.stem for p in (root / "robot").glob("*.yaml")) + ["default"]
        if name not in presets:
            raise ValueError(f"env.robot: unknown preset {name!r}; expected one of {sorted(set(presets))}")
        with initialize_config_dir(config_dir=str(root), version_base=None):
            cfg = compose("config", overrides=[f"robot={name}"])
        _ROBOT_CFG[name] = OmegaConf.to_container(cfg.robot, resolve=True)
    return _ROBOT_CFG[name]


class LeRobotUnitEnv(gym.Env):
    """A fleetmind unit env (``sim.make_env``) with LeRobot's observation names (see module doc).

    Args:
        env: the fleetmind env (``MetaWorldEnv`` or ``SO100Env``).
        cameras: the cameras it observes (its ``obs.cameras`` when images are on), in order.
    """

    metadata = {"render_modes": ["rgb_array"]}  # noqa: RUF012 - gymnasium convention

    def __init__(self, env, cameras: list[str]):
        self.env, self.cameras = env, list(cameras)
        self.render_mode = "rgb_array"
        self.control_hz = float(env.spec_dict()["control_hz"])
        self.metadata = {**self.metadata, "render_fps": round(self.control_hz)}  # PyAV wants an integer rate
        obs_space = env.observation_space
        d = {"agent_pos": obs_space["observation.state"], "environment_state": obs_space["observation.environment_state"]}
        if self.cameras:
            d["pixels"] = spaces.Dict({c: obs_space[f"observation.images.{c}"] for c in self.cameras})
        self.observation_space = spaces.Dict(d)
        self.action_space = env.action_space
        self.task = env.task
        self.unit_id = int(env.unit.unit_id)
        self.task_description = f"{env.task} on robot unit {self.unit_id}"
        self._max_episode_steps = int(env.max_episode_steps)

    def _obs(self, obs: dict) -> dict:
        out = {"agent_pos": obs["observation.state"], "environment_state": obs["observation.environment_state"]}
        if self.cameras:
            out["pixels"] = {c: obs[f"observation.images.{c}"] for c in self.cameras}
        return out

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        obs, info = self.env.reset(seed=seed)
        return self._obs(obs), {**info, "is_success": bool(info.get("episode_success", False))}

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(np.asarray(action, dtype=np.float32))
        return self._obs(obs), reward, terminated, truncated, {**info, "is_success": bool(info["episode_success"])}

    def render(self) -> np.ndarray | None:
        return self.env.render()

    def close(self) -> None:
        self.env.close()


def make_unit_env(task: str, unit_id: int, robot: str = "default", episode_length: int = 150,
                  steps_after_success: int = 10, cameras: list[str] | None = None,
                  image_size: int = 96) -> LeRobotUnitEnv:
    """fleetmind's env of ``task`` on unit ``unit_id`` (``sim.make_env``), wrapped for LeRobot.

    Raises:
        ValueError: an unknown task or robot preset, a unit id outside the robot config's units (``sim``).
    """
    import sim

    cams = list(cameras or [])
    obs_cfg = {"images": bool(cams), "cameras": cams or ["corner"], "image_size": int(image_size)}
    task_cfg = {"max_episode_steps": int(episode_length), "steps_after_success": int(steps_after_success)}
    env = sim.make_env(task, int(unit_id), robot_config(robot), obs_cfg, task_cfg, render_mode="rgb_array")
    return LeRobotUnitEnv(env, cams)
