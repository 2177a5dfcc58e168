"""fleetmind's robot units inside LeRobot 0.6: ``--env.type=fleetmind`` (see plugins/README.md).

Importing this package registers :class:`FleetmindEnv` with ``EnvConfig.register_subclass("fleetmind")``.
"""

from lerobot_env_fleetmind.configs import ENV_TYPE, FleetmindEnv
from lerobot_env_fleetmind.env import LeRobotUnitEnv

__all__ = ["ENV_TYPE", "FleetmindEnv", "LeRobotUnitEnv"]
