"""fleetmind's policies inside LeRobot 0.6: ``--policy.type=fleetmind`` (see plugins/README.md).

Importing this package registers :class:`FleetmindConfig` with ``PreTrainedConfig.register_subclass("fleetmind")``;
LeRobot's ``get_policy_class`` then finds :class:`FleetmindPolicy` in the sibling ``modeling_fleetmind`` and
``make_pre_post_processors`` the processors in ``processor_fleetmind`` (LeRobot's naming convention).
"""

from lerobot_policy_fleetmind.configuration_fleetmind import EXPORT_SUBDIR, POLICY_TYPE, FleetmindConfig
from lerobot_policy_fleetmind.modeling_fleetmind import FleetmindPolicy
from lerobot_policy_fleetmind.processor_fleetmind import make_fleetmind_pre_post_processors

__all__ = ["EXPORT_SUBDIR", "POLICY_TYPE", "FleetmindConfig", "FleetmindPolicy", "make_fleetmind_pre_post_processors"]
