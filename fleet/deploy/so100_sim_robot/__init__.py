"""A LeRobot ``Robot`` backed by the SO-100 MuJoCo twin: robot type ``fleetmind_so100_sim``.

Importing this package (needs ``lerobot``) registers the config with ``RobotConfig.register_subclass``, so
``lerobot.robots.make_robot_from_config`` builds the robot: for a type it does not name, LeRobot 0.6.1
falls back to ``lerobot.utils.import_utils.make_device_from_device_class``, which finds
``FleetmindSO100Sim`` (the config class name without ``Config``) in this package, the parent of the config's
module.

It lives in ``fleet/``, not ``sim/``, and imports ``sim`` lazily: importing it loads LeRobot, and ``sim``
(MuJoCo, EGL) stays unloaded until a robot is made.

    import fleet.deploy.so100_sim_robot  # registers "fleetmind_so100_sim"
    from lerobot.robots import make_robot_from_config
    robot = make_robot_from_config(FleetmindSO100SimConfig(task="so100-reach", render_cameras=["corner"]))
"""

from fleet.deploy.so100_sim_robot.config_fleetmind_so100_sim import ROBOT_TYPE, FleetmindSO100SimConfig
from fleet.deploy.so100_sim_robot.fleetmind_so100_sim import FleetmindSO100Sim

__all__ = ["ROBOT_TYPE", "FleetmindSO100Sim", "FleetmindSO100SimConfig"]
