"""The LeRobot env config of fleetmind's robot units: ``--env.type=fleetmind`` (LeRobot 0.6.1 ``EnvConfig``).

    lerobot-eval --policy.path=exports/reach_lerobot --env.type=fleetmind --env.task=reach-v3 \\
        --env.units='[100,101,102,103]' --eval.n_episodes=20 --eval.batch_size=4

Vector env ``i`` of a batch is robot unit ``units[i % len(units)]`` (by default the fleet's four held-out units,
100-103, which no training episode came from), built by ``sim.make_env`` exactly as fleetmind's fleet and
evaluation build it (task, unit, the ``robot`` preset, the ``obs`` options, ``max_episode_steps``,
``steps_after_success``); ``lerobot_env_fleetmind.env.LeRobotUnitEnv`` renames its observations to LeRobot's
(``agent_pos``, ``environment_state``, ``pixels/<camera>``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import gymnasium as gym
from lerobot.configs.types import FeatureType, PolicyFeature
from lerobot.envs.configs import EnvConfig, _make_vec_env_cls
from lerobot.utils.constants import ACTION, OBS_ENV_STATE, OBS_IMAGES, OBS_STATE

ENV_TYPE = "fleetmind"


@EnvConfig.register_subclass(ENV_TYPE)
@dataclass
class FleetmindEnv(EnvConfig):
    """fleetmind robot units as LeRobot envs (see module doc).

    Attributes:
        task: a task of any fleetmind suite (``sim.list_tasks()``: Meta-World v3 names such as ``reach-v3``, or the
            SO-100 twin's ``so100-*``).
        fps: control rate, Hz; set from the task's env (Meta-World 80, SO-100 30) when left at 0.
        units: robot unit ids; vector env ``i`` is ``units[i % len(units)]``. Default: the held-out units 100-103.
        robot: the ``robot`` config preset (``configs/robot/<name>.yaml``: ``default``, ``nominal``, ``shifted``).
        episode_length: ``max_episode_steps``, control steps.
        steps_after_success: the episode ends this many steps after the first success.
        cameras: cameras rendered into the observation (``observation.images.<camera>``); empty: state only.
        image_size: rendered image size, pixels (square).
    Raises:
        ValueError: an unknown task (``sim`` lists the valid ones), no units, a bad length.
    """

    task: str | None = "reach-v3"
    fps: int = 0
    units: list[int] = field(default_factory=lambda: [100, 101, 102, 103])
    robot: str = "default"
    episode_length: int = 150
    steps_after_success: int = 10
    cameras: list[str] = field(default_factory=list)
    image_size: int = 96

    def __post_init__(self) -> None:
        if not self.units:
            raise ValueError("env.units: give at least one robot unit id")
        if self.episode_length < 1 or self.steps_after_success < 0:
            raise ValueError(f"env.episode_length must be >= 1 and env.steps_after_success >= 0, given "
                             f"{self.episode_length} / {self.steps_after_success}")
        from lerobot_env_fleetmind.env import make_unit_env

        probe = make_unit_env(**self.gym_kwargs, unit_id=int(self.units[0]))  # shapes and rate from the real env
        try:
            space = probe.observation_space
            if not self.fps:
                self.fps = round(float(probe.control_hz))
        finally:
            probe.close()
        self.features = {ACTION: PolicyFeature(type=FeatureType.ACTION, shape=tuple(probe.action_space.shape)),
                         "agent_pos": PolicyFeature(type=FeatureType.STATE, shape=tuple(space["agent_pos"].shape)),
                         "environment_state": PolicyFeature(type=FeatureType.ENV,
                                                            shape=tuple(space["environment_state"].shape))}
        self.features_map = {ACTION: ACTION, "agent_pos": OBS_STATE, "environment_state": OBS_ENV_STATE}
        for cam in self.cameras:
            self.features[f"pixels/{cam}"] = PolicyFeature(type=FeatureType.VISUAL,
                                                           shape=tuple(space["pixels"][cam].shape))
            self.features_map[f"pixels/{cam}"] = f"{OBS_IMAGES}.{cam}"

    @property
    def gym_kwargs(self) -> dict:
        """Everything but the unit id that ``make_unit_env`` takes."""
        return {"task": self.task, "robot": self.robot, "episode_length": self.episode_length,
                "steps_after_success": self.steps_after_success, "cameras": list(self.cameras),
                "image_size": self.image_size}

    def create_envs(self, n_envs: int, use_async_envs: bool = False) -> dict[str, dict[int, gym.vector.VectorEnv]]:
        """``{"fleetmind": {0: VectorEnv of n_envs units}}`` (LeRobot's single-task layout)."""
        from gymnasium.vector import AutoresetMode

        from lerobot_env_fleetmind.env import make_unit_env

        fns = [functools.partial(make_unit_env, **self.gym_kwargs, unit_id=int(self.units[i % len(self.units)]))
               for i in range(n_envs)]
        env_cls = _make_vec_env_cls(use_async_envs, n_envs)
        extra = {"context": "forkserver"} if env_cls is gym.vector.AsyncVectorEnv else {}
        return {self.type: {0: env_cls(fns, autoreset_mode=AutoresetMode.SAME_STEP, **extra)}}
