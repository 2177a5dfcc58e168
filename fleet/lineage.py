"""What a published policy version carries about where it came from (``CheckpointRegistry.publish`` metadata).

A version the fleet publishes must be deployable and traceable on its own: the control rate it acts at, the tasks
it was trained on, the experience store it learned from and how much of it there was (a snapshot: its episode
count at publication), and the version it was fine-tuned from. ``scripts/export.py`` reads these back, so an
export of a registry version knows its rate without a training run directory.
"""

from __future__ import annotations

from typing import Any

from configs.sim_groups import point_cloud_sensors


def lineage(store_url: str, parent_version: int | None, obs: dict | None = None) -> dict[str, Any]:
    """``{"control_hz", "tasks", "store", "store_episodes", "store_demos", "parent_version"}`` for a version
    trained on the store at ``store_url`` (as it is now) from ``parent_version`` (None: from demonstrations), and
    ``"point_cloud"`` (:func:`point_cloud_sensors`) when the observation group ``obs`` has a point cloud: the depth
    cameras an export's robot must give (``scripts/export.py`` names them in the LeRobot folder without being told).

    ``control_hz`` is the store's control rate (Hz; None when the store does not record one); ``tasks`` the sorted
    task names of its episodes; ``store_episodes`` / ``store_demos`` its episode and demonstration counts now.

    Raises:
        experience_dict.store.StoreError: the store cannot be opened (a missing or corrupt store).
    """
    from experience_dict.store import ExperienceStore

    reader = ExperienceStore.open(str(store_url))
    metas = list(reader.episodes())
    hz = reader.control_hz
    return {"control_hz": None if hz is None else float(hz), "tasks": sorted({str(m.task) for m in metas}),
            "store": str(store_url), "store_episodes": len(metas), "store_demos": sum(bool(m.is_demo) for m in metas),
            "parent_version": None if parent_version is None else int(parent_version),
            **({"point_cloud": pc} if (pc := point_cloud_sensors(obs)) else {})}
