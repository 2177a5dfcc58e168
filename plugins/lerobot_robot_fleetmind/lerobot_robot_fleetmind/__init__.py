"""The SO-100 MuJoCo twin inside LeRobot 0.6: ``--robot.type=fleetmind_so100_sim`` (see plugins/README.md).

Importing this package imports ``fleet.deploy.so100_sim_robot``, whose config class is registered with
``RobotConfig.register_subclass("fleetmind_so100_sim")``; LeRobot's ``make_robot_from_config`` then finds the robot
class ``FleetmindSO100Sim`` in that package (``make_device_from_device_class``). So ``lerobot-record``,
``lerobot-replay``, ``lerobot-rollout`` and ``lerobot-teleoperate`` take the twin like a real SO-100 follower.
"""

from fleet.deploy.so100_sim_robot import ROBOT_TYPE, FleetmindSO100Sim, FleetmindSO100SimConfig

__all__ = ["ROBOT_TYPE", "FleetmindSO100Sim", "FleetmindSO100SimConfig"]
