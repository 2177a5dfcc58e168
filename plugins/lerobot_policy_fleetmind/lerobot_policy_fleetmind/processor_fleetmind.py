"""LeRobot processors of a fleetmind policy: rename, add the batch dimension, move to the device; back to the CPU.

No normaliser step: a fleetmind policy normalises its inputs and un-normalises its actions itself, with the
statistics saved in its checkpoint (``stats.json``, fitted by fleetmind's training on the store's episodes), so the
same export acts the same inside LeRobot and in fleetmind's runtime. LeRobot finds this module by its convention
(``configuration_fleetmind`` -> ``processor_fleetmind``, ``make_<type>_pre_post_processors``).
"""

from __future__ import annotations

from typing import Any

from lerobot.processor import (
    AddBatchDimensionProcessorStep,
    DeviceProcessorStep,
    PolicyAction,
    PolicyProcessorPipeline,
    RenameObservationsProcessorStep,
)
from lerobot.processor.factory import make_policy_processor_pipelines

from lerobot_policy_fleetmind.configuration_fleetmind import FleetmindConfig


def make_fleetmind_pre_post_processors(
    config: FleetmindConfig, dataset_stats: dict | None = None, **_: Any,
) -> tuple[PolicyProcessorPipeline[dict[str, Any], dict[str, Any]], PolicyProcessorPipeline[PolicyAction, PolicyAction]]:
    """``(preprocessor, postprocessor)``: LeRobot's default steps without (un)normalisation (see module doc).

    ``dataset_stats`` is accepted for LeRobot's factory and not used: the policy carries its own statistics.
    """
    return make_policy_processor_pipelines(
        input_steps=[RenameObservationsProcessorStep(rename_map={}), AddBatchDimensionProcessorStep(),
                     DeviceProcessorStep(device=config.device)],
        output_steps=[DeviceProcessorStep(device="cpu")])
