"""The simulation's typed config groups ``robot``, ``obs`` and ``task``: the one place their defaults live.

Each dataclass is registered in Hydra's ConfigStore as ``<group>/default`` (:mod:`configs.typed`); the presets
stay YAML and extend it (``robot=nominal``, ``robot=shifted``, ``obs=vision``, the task suites ``task=mw10``,
...; each lists ``default`` first in its defaults list), so an unknown key or a wrong type in a preset or on the
command line is refused while composing, a value out of range by ``configs.schema.check``.

The envs and ``sim.units`` keep accepting ``None`` or a partial mapping for each (``None``: the nominal robot,
state only, the env family's own episode length), as their docstrings say.

They live here, not in the ``sim`` package, so that composing or checking a config never imports ``sim``: its
``__init__`` loads MuJoCo and Meta-World and probes the GL backend, which in the LeRobot environments must come
after LeRobot's own imports (``tests/with_lerobot/conftest.py``), and a refused config stays quick.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from configs.rules import POS, TypedConfig, integer, number, optional, xyz

FACTOR = number(0, 1)


@dataclass
class VariationConfig(TypedConfig):
    """Per-unit variation ranges (``sim.units.RobotUnit.draw``): each unit draws its own values from them, by
    ``(fleet_seed, unit_id)``."""

    camera_pos_mm: float = 10.0
    """Uniform +- jitter of each camera's position, millimetres."""
    camera_rot_deg: float = 2.0
    """Uniform +- jitter of each camera's orientation, degrees."""
    light: float = 0.2
    """+- relative change of the lights' diffuse intensity."""
    color: float = 0.15
    """+- RGB change of the table's and objects' colours."""
    mass_scale: float = 0.2
    """Object mass multiplied by U(1 - x, 1 + x)."""
    friction_scale: float = 0.2
    """Object friction multiplied by U(1 - x, 1 + x)."""
    action_gain: float = 0.1
    """Position action multiplied by U(1 - x, 1 + x) (per unit, per axis)."""
    action_latency_max: int = 2
    """Action latency in integer control steps, U{0 .. max}."""
    obs_noise_std: float = 0.001
    """Per-unit std ~ U(0, x) of Gaussian noise on the observed positions, metres."""


VariationConfig._group, VariationConfig._rules = "robot.variation", {
    "camera_pos_mm": number(0), "camera_rot_deg": number(0), "light": FACTOR, "color": number(0),
    "mass_scale": FACTOR, "friction_scale": FACTOR, "action_gain": FACTOR, "action_latency_max": integer(0),
    "obs_noise_std": number(0)}


@dataclass
class RobotConfig(TypedConfig):
    """The fleet's robot units: which ids exist (training, held-out, demonstration units) and how they vary."""

    embodiment: str = "sawyer"
    """The arm of the suite (Meta-World's Sawyer; the SO-100 twin sets its own)."""
    fleet_seed: int = 0
    """Seed of every unit's variation draw."""
    stratify_block: int | None = 4
    """Mass, friction, action gain and observation noise are stratified over blocks of this many consecutive
    unit ids (each block spans the ranges); null or 0: independent draws."""
    train_units: Any = "0:16"
    """Training unit ids: a list, or ``"start:stop"`` (a Python range, e.g. ``"0:96"``)."""
    heldout_units: Any = field(default_factory=lambda: [100, 101, 102, 103])
    """Held-out unit ids (evaluation only, never training data): a list or ``"start:stop"``."""
    variation: VariationConfig = field(default_factory=VariationConfig)
    """Per-unit variation ranges."""
    demo_units: Any = field(default_factory=lambda: [0, 1, 2, 3])
    """Units the scripted demonstrations run on (null: ``train_units``)."""
    demo_variation_scale: float = 1.0
    """Every variation range times this for the demonstration units (``robot=shifted``: 0.25)."""


RobotConfig._group, RobotConfig._rules = "robot", {
    "fleet_seed": integer(0), "stratify_block": optional(integer(0)), "demo_variation_scale": number(0)}
RobotConfig._nested = {"variation": VariationConfig}


def _image_size(v) -> str | None:
    if integer(1)(v) is None or (isinstance(v, list | tuple) and len(v) == 2 and all(integer(1)(x) is None for x in v)):
        return None
    return "an integer >= 1 or [height, width]"


@dataclass
class ObsConfig(TypedConfig):
    """What the envs observe: state always, camera images with ``images`` (``obs=vision``)."""

    images: bool = False
    """Render camera images into the observation (``observation.images.<camera>``)."""
    cameras: list[str] = field(default_factory=lambda: ["corner"])
    """Cameras rendered (also used by ``render()`` when images are off)."""
    image_size: Any = 96
    """Image size, pixels: an int or ``[height, width]``."""
    embodiment_feature: bool = False
    """Add ``observation.embodiment``, a one-hot of the unit's robot (``sim.units.EMBODIMENTS``), so one policy
    can drive a mixed fleet (``task=mixed``)."""
    shadows: bool = False
    """Shadows (they and reflections cost ~3x on CPU rasterisers, llvmpipe)."""
    reflections: bool = False
    """Reflections."""
    shadowsize: int = 256
    """Shadow map texels when shadows are on (MuJoCo's default 4096)."""
    point_cloud: bool = False
    """Add ``observation.point_cloud``: the depth cameras' workspace point cloud, (num_points, 3) float32 metres in
    the robot's base frame (``sim.pointcloud``, after DP3; ``obs=pointcloud``)."""
    point_cameras: list[str] = field(default_factory=lambda: ["corner", "corner3"])
    """Depth cameras whose points are merged."""
    point_image_size: Any = 64
    """Depth image size, pixels: an int or ``[height, width]``."""
    num_points: int = 512
    """Points after farthest-point sampling (DP3: 512 on Meta-World)."""
    crop_min: list[float] | None = None
    """Workspace box, lower corner (x, y, z) metres in the robot's base frame; null: the embodiment's own."""
    crop_max: list[float] | None = None
    """Workspace box, upper corner; null: the embodiment's own."""
    point_color: bool = False
    """With ``point_cloud``: also ``observation.point_colors``, each point's RGB from its depth camera's
    depth-aligned colour image, (num_points, 3) uint8 (an RGB-D sensor's colour stream; DP3's colour variant)."""


ObsConfig._group, ObsConfig._rules = "obs", {"image_size": _image_size, "shadowsize": POS,
                                             "point_image_size": _image_size, "num_points": POS,
                                             "crop_min": xyz, "crop_max": xyz}


@dataclass
class TaskConfig(TypedConfig):
    """A task suite (``task=mw_mid``, the default; ``task=mw10``, ``mw50``, ``mw_quick``, ``so100``)."""

    name: str = "mw_mid"
    """The suite's name."""
    tasks: list[str] = field(default_factory=lambda: ["reach-v3", "button-press-topdown-v3", "window-open-v3"])
    """Task names of any registered suite (``sim.list_tasks()``)."""
    max_episode_steps: int = 150
    """Control steps per episode at most (Meta-World: 80 Hz, so 150 steps are 1.875 s; the experts'
    demonstrations take 64-103 steps on these tasks)."""
    steps_after_success: int = 10
    """The episode ends this many steps after the first success."""
    stop_on_success: bool = True
    """The simulator's success ends the episode (``steps_after_success`` later). False: only the time limit does, or
    a deployment's success detector (``labels.source: detector``, which sets it false for the fleet's own envs)."""
    max_episode_steps_by_embodiment: dict[str, int] = field(default_factory=dict)
    """A mixed fleet's per-robot episode length, e.g. ``{sawyer: 150}`` beside ``max_episode_steps: 300`` for the
    SO-100 twin (``task=mixed``); an embodiment not named takes ``max_episode_steps``."""


TaskConfig._group, TaskConfig._rules = "task", {"max_episode_steps": POS, "steps_after_success": integer(0)}


def point_cloud_sensors(obs: dict | None) -> dict[str, Any] | None:
    """``{"cameras", "image_size", "color"}`` of a point-cloud observation group (``obs.point_cameras`` in order,
    ``obs.point_image_size`` in pixels, ``obs.point_color``): the depth cameras a robot must give a policy trained on
    it; None when ``obs`` has no point cloud."""
    if not obs or not obs.get("point_cloud"):
        return None
    size = obs.get("point_image_size", 64)
    return {"cameras": [str(c) for c in obs.get("point_cameras") or []],
            "image_size": int(size) if isinstance(size, (int, float)) else [int(x) for x in size],
            "color": bool(obs.get("point_color", False))}
