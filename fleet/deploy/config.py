"""Deployment's typed config: Hydra's config group ``deploy``, and the one place its defaults live.

:class:`DeployConfig` (nested :class:`ExportConfig`, :class:`BenchConfig`, :class:`RunConfig`,
:class:`BridgeConfig`, :class:`SafetyConfig` and the free-form ``robot`` mapping) is registered in Hydra's
ConfigStore as ``deploy/default`` (:mod:`configs.typed`): an unknown key or a wrong type is refused while
composing, a value out of range by ``configs.schema.check``. ``scripts/export.py``, ``scripts/bench_runtime.py``,
``scripts/deploy.py`` and the Python API (``fleet.deploy.deployer.safety_limits``, ``Deployer``) read their part
through these classes, so a key a caller leaves out takes the value below. No LeRobot import here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from configs.rules import (
    FINITE_POS,
    POS,
    POS_NUMBER,
    TypedConfig,
    boolean,
    int_list,
    integer,
    one_of,
    optional,
)
from configs.sim_groups import TaskConfig

LABELS = ("sim", "operator", "classifier", "none")
WORKSPACE_M = ((-0.05, 0.39, 0.005), (0.29, 0.81, 0.28))   # tcp box, twin frame, metres: its target box + 3 cm
ROBOT = {"type": "fleetmind_so100_sim", "id": None, "calibration_dir": None, "port": None, "cameras": None,
         "max_relative_target": None, "task": None, "render_cameras": None, "image_size": None, "object_state": None,
         "unit_id": None, "fleet_robot": None, "depth_cameras": None, "depth_size": None, "depth_color": None}


@dataclass
class ExportConfig(TypedConfig):
    """``scripts/export.py``: a checkpoint (or a registry version) exported to a self-contained folder."""

    checkpoint: str | None = None
    """A ``pretrained_model`` directory, or a training run directory (its newest checkpoint); null: the registry."""
    registry_url: str | None = "${fleet.registry_url}"
    """The registry exported from when ``checkpoint`` is null."""
    version: Any = "latest"
    """Registry version (an int) or ``"latest"``, used when ``checkpoint`` is null."""
    out_dir: str = "exports/policy"
    """The export folder."""
    overwrite: bool = False
    """Replace an existing export folder."""
    success_table: str | None = None
    """JSON file for the model card: ``{task: {column: value}}`` (e.g. from ``scripts/eval.py``)."""
    control_hz: float | None = None
    """Hz the policy was trained at; null: the training run's store ``control_hz``, if found."""
    onnx_steps: list[int] | None = None
    """DDIM step counts also exported as ONNX graphs (``policies/onnx.py``; the runtime's fast CPU path): null =
    the policy's own ``num_inference_steps`` (none for a policy without denoising), [] = none."""
    onnx_batch_size: int = 1
    """The ONNX graphs' batch size (1: one robot; other batch sizes run in PyTorch)."""
    onnx_optimize: bool = True
    """onnxscript's graph optimizer (about half the nodes; ~1 min for the default policy on 2 cores)."""
    lerobot_dir: str | None = None
    """Also write a LeRobot policy folder here (``lerobot-eval`` / ``lerobot-rollout --policy.path=<it>``; needs the
    lerobot extra and fleetmind's plugins): one command from a checkpoint or registry version to LeRobot."""
    lerobot_robot: str | None = None
    """With ``lerobot_dir``: ``so100``: the LeRobot policy drives an SO-100 / SO-101 robot (joint readings in, joint
    targets out: ``lerobot-rollout``); null: the policy's own features (``lerobot-eval``)."""
    lerobot_depth_cameras: list[str] | None = None
    """With ``lerobot_robot`` and a point-cloud policy: the robot's depth cameras (the training's ``obs.point_cameras``,
    in order), given as LeRobot's ``<camera>_depth`` images; their calibration is the SO-100 twin's. null: the ones
    the policy was trained on (a published version's lineage, or the training run's config)."""
    lerobot_depth_size: int | None = None
    """The depth images' side, pixels (the training's ``obs.point_image_size``); null: the training's, else 64."""


ExportConfig._group, ExportConfig._rules = "deploy.export", {
    "version": lambda v: None if v == "latest" or integer(1)(v) is None else "'latest' or an integer >= 1",
    "overwrite": boolean, "control_hz": optional(POS_NUMBER), "onnx_steps": optional(int_list(1, empty=True)),
    "onnx_batch_size": POS, "onnx_optimize": boolean, "lerobot_robot": optional(one_of("so100")),
    "lerobot_depth_size": optional(POS)}


@dataclass
class BenchConfig(TypedConfig):
    """``scripts/bench_runtime.py``: the lean runtime's chunk latency per device, threads and denoising steps."""

    export_dir: str | None = None
    """An export folder; null: export a fresh default-size ``policy/aed_diffusion`` to a temp folder."""
    threads: list[int] = field(default_factory=lambda: [1, 2])
    """CPU torch threads to time."""
    devices: list[str] = field(default_factory=lambda: ["cpu", "cuda"])
    """Devices to time (cuda is skipped when no GPU is visible)."""
    num_inference_steps: list[int] = field(default_factory=lambda: [10])
    """DDIM steps per chunk to time."""
    compile: list[bool] = field(default_factory=lambda: [False, True])
    """The runtime eager and compiled (``torch.compile`` of the denoising step; compile time reported)."""
    onnx: bool = True
    """Also time the ONNX graph in ONNX Runtime (CPU), exported at each ``num_inference_steps``."""
    chunks: int = 20
    """Timed chunks per setting (after 10 warm-up chunks)."""
    out: str = "outputs/bench/runtime.json"
    """The JSON written."""


BenchConfig._group, BenchConfig._rules = "deploy.bench", {
    "threads": int_list(1, empty=True), "num_inference_steps": int_list(1, empty=True), "onnx": boolean, "chunks": POS}


@dataclass
class RunConfig(TypedConfig):
    """``scripts/deploy.py``: how an export runs episodes on a LeRobot robot (``fleet.deploy.deployer.Deployer``).

    Raises:
        configs.rules.ConfigError: (a ``ValueError``) an unknown label, non-positive steps or episodes, or any
            value out of its range, ``deploy.run.<key>: expected ..., given ...``.
    """

    export_dir: str | None = None
    """A folder written by ``scripts/export.py`` (required by ``scripts/deploy.py``)."""
    device: str = "cpu"
    """Torch device of the policy."""
    num_inference_steps: int | None = None
    """DDIM steps per chunk (null: the exported value)."""
    num_threads: int | None = 1
    """Torch CPU threads (1 beside the simulated robot's renderer; measure more with ``bench_runtime.py``)."""
    compile: bool = False
    """``torch.compile`` the per-step work (``PolicyRuntime(compile=True)``): faster chunks, a slow first one."""
    backend: str = "auto"
    """auto: the export's ONNX graph in ONNX Runtime when it has one for the step count (CPU), else torch |
    torch | onnx."""
    episodes: int = 1
    """Episodes to run."""
    max_steps: int = 300
    """Control steps per episode (30 Hz: 10 s)."""
    steps_after_success: int = TaskConfig.steps_after_success
    """With a per-step success signal (the simulated robot): end this many steps after it (the simulated fleet's
    default, ``task.steps_after_success``)."""
    stop_on_success: bool = True
    """End the episode after ``steps_after_success`` steps past the first success."""
    seed: int = 0
    """Episode i uses seed + i (the simulated robot's scene placement), unless ``trials`` gives the seeds."""
    trials: Any = None
    """The episodes' trials, one per episode (then ``episodes`` is their number): a list of ``{seed, unit_id,
    task}`` mappings (``unit_id`` and ``task`` optional; other keys ignored) or the path of a JSON file holding
    one, e.g. ``scripts/eval.py``'s ``episodes/<arm>.json``: the simulated robot then plays fleetmind's held-out
    evaluation trials, each on its robot unit (``FleetmindSO100Sim.reset_scene(seed, unit_id)``) with its reset
    seed. A ``unit_id`` needs the simulated robot; a ``task`` must be the robot's. Null: ``seed`` + i."""
    seed_noise: bool = True
    """Draw each episode's initial denoising noise from a generator seeded with the episode's seed, as fleetmind's
    evaluation seeds each trial's (the same export, unit and seed then sample the same noise in both); false:
    torch's global generator."""
    label: str = "operator"
    """The success label: sim (the twin's success) | operator (a y/n prompt) | classifier | none."""
    success_classifier: str | None = None
    """``label=classifier``: ``"sim"`` or ``"package.module:function"`` called as ``fn(robot, observation)``."""
    realtime: bool = True
    """Pace steps at ``control_hz`` (false: as fast as possible, simulated robot only)."""
    control_hz: float | None = None
    """Null: the export's ``control_hz`` (the rate the policy was trained at), Hz."""
    wait_for_reset: bool = True
    """Real robots: wait for Enter before each episode while the operator resets the scene."""
    task: str | None = None
    """Task name stored with the episodes (null: the simulated robot's task)."""
    store_url: str | None = None
    """Commit every labelled episode to this experience store (null: none)."""
    unit_id: int = 1000
    """Unit id of this robot in the store (keep real arms apart from simulated units)."""
    writer_id: str | None = None
    """Store shard (null: ``deploy-<robot type>-unit-<unit_id>``)."""
    report: str | None = None
    """JSON report path (null: ``<hydra run dir>/deploy_report.json``)."""


RunConfig._group, RunConfig._rules = "deploy.run", {
    "num_inference_steps": optional(POS), "num_threads": optional(POS), "compile": boolean,
    "backend": one_of("auto", "torch", "onnx"), "episodes": POS, "max_steps": POS,
    "steps_after_success": integer(0), "stop_on_success": boolean, "seed": integer(0), "label": one_of(*LABELS),
    "trials": lambda v: None if v is None or isinstance(v, str | list | tuple) else
    "null, a list of {seed, unit_id, task} or the path of a JSON file holding one", "seed_noise": boolean,
    "realtime": boolean, "control_hz": optional(POS_NUMBER), "wait_for_reset": boolean, "unit_id": integer(0)}


@dataclass
class BridgeConfig(TypedConfig):
    """LeRobot joints <-> the SO-100 model (``fleet/deploy/lerobot_bridge.py``): LeRobot degrees = sign x MJCF
    degrees + offset."""

    embodiment: str = "so100"
    """Whose bridge (``fleet.deploy.lerobot_bridge.register_bridge``): so100 (SO-100 / SO-101)."""
    cameras: Any = None
    """``{policy camera: robot camera}``, e.g. ``{corner: front}``; unmapped names are used as is."""
    joint_signs: list[float] = field(default_factory=lambda: [1.0] * 5)
    """Per arm joint (shoulder_pan, shoulder_lift, elbow_flex, wrist_flex, wrist_roll): +1 or -1."""
    joint_offsets_deg: list[float] = field(default_factory=lambda: [0.0] * 5)
    """Per arm joint, degrees (measure once on a real arm; see ``fleet/deploy/lerobot_bridge.py``)."""
    gripper_closed_pos: float = 0.0
    """``gripper.pos`` of a closed gripper."""
    gripper_open_pos: float = 100.0
    """``gripper.pos`` of an open gripper (the twin's ``JAW_OPEN``)."""
    depth_cameras: Any = None
    """A point-cloud policy's depth cameras (the training's ``obs.point_cameras``, in order): a list of names (the
    simulated robot's own calibration, read at every episode start: a unit's cameras differ; the twin robot is then
    given them as ``depth_cameras``) or ``{camera: {fx, fy, cx, cy, base_from_camera, depth_scale}}`` (a real
    RGB-D sensor's intrinsics and hand-eye calibration; the robot gives ``<camera>_depth`` images)."""


BridgeConfig._group, BridgeConfig._rules = "deploy.bridge", {
    "cameras": lambda v: None if v is None or isinstance(v, Mapping) else "null or a mapping {policy camera: robot camera}",
    "joint_signs": lambda v: None if isinstance(v, list | tuple) and len(v) == 5 and all(x in (1, -1) for x in v)
    else "five signs, each 1 or -1",
    "joint_offsets_deg": lambda v: None if isinstance(v, list | tuple) and len(v) == 5 else "five offsets in degrees",
    "depth_cameras": lambda v: None if v is None or isinstance(v, Mapping) or (
        isinstance(v, list | tuple) and v and all(isinstance(c, str) for c in v))
    else "null, a list of camera names or a mapping {camera: calibration}"}


@dataclass
class SafetyConfig(TypedConfig):
    """The limits checked on every action before it is sent (``fleet/deploy/safety.py``); each trigger is logged
    and counted in the report. Switching a protection off takes an explicit null for it (logged as a warning);
    ``inf`` is refused (it would switch a limit off without that warning)."""

    joint_limits_deg: Any = None
    """``{joint: [low, high]}`` overrides, degrees; the rest: the SO-100 MJCF joint ranges."""
    max_step_deg: float | None = 15.0
    """Largest |target - measured| per arm joint per control step, degrees (null: no limit)."""
    max_step_gripper: float | None = 50.0
    """The same for ``gripper.pos`` (0..100 units; null: no limit)."""
    workspace_m: Any = field(default_factory=lambda: [list(c) for c in WORKSPACE_M])
    """The tcp box ``[[x, y, z] low, [x, y, z] high]``, twin frame, metres: the twin's target box + 3 cm,
    z >= 5 mm (null: no box)."""
    deadline_s: float | None = 0.25
    """The policy's time per action before the arm is held, seconds (null: no watchdog)."""
    max_misses: int = 1
    """Consecutive missed deadlines that stop the episode."""
    hang_s: float = 30.0
    """A policy call still running this long after its start ends the run, seconds."""


SafetyConfig._group, SafetyConfig._rules = "deploy.safety", {
    "joint_limits_deg": lambda v: None if v is None or isinstance(v, Mapping) else "null or {joint: [low, high]}",
    "max_step_deg": optional(FINITE_POS), "max_step_gripper": optional(FINITE_POS),
    "deadline_s": optional(FINITE_POS), "max_misses": integer(0), "hang_s": FINITE_POS}


@dataclass
class DeployConfig(TypedConfig):
    """Deployment: export a checkpoint (``scripts/export.py``), time the lean runtime (``scripts/bench_runtime.py``)
    and run an export on a LeRobot robot under safety limits (``scripts/deploy.py``)."""

    export: ExportConfig = field(default_factory=ExportConfig)
    """``scripts/export.py``."""
    bench: BenchConfig = field(default_factory=BenchConfig)
    """``scripts/bench_runtime.py``."""
    run: RunConfig = field(default_factory=RunConfig)
    """``scripts/deploy.py``: how episodes run."""
    robot: dict[str, Any] = field(default_factory=lambda: dict(ROBOT))
    """The LeRobot robot config, decoded with draccus as LeRobot's CLI does: ``type`` plus that type's fields;
    null fields are left to the robot config's defaults; add others with ``+deploy.robot.<field>=...``, e.g.
    ``deploy.robot.type=so101_follower deploy.robot.port=/dev/ttyACM0 deploy.robot.id=arm0``. The default
    ``fleetmind_so100_sim`` is the SO-100 twin behind LeRobot's Robot API (``fleet/deploy/so100_sim_robot``):
    ``deploy.robot.unit_id=101`` builds it as that robot unit of the fleet, drawn from ``fleet_robot`` (null: the
    composed ``robot`` group, ``scripts/deploy.py``)."""
    bridge: BridgeConfig = field(default_factory=BridgeConfig)
    """LeRobot joints <-> the SO-100 model."""
    safety: SafetyConfig = field(default_factory=SafetyConfig)
    """The safety limits."""


DeployConfig._group, DeployConfig._rules = "deploy", {
    "robot": lambda v: None if isinstance(v, Mapping) else "a mapping: the robot type and its fields"}
DeployConfig._nested = {"export": ExportConfig, "bench": BenchConfig, "run": RunConfig, "bridge": BridgeConfig,
                        "safety": SafetyConfig}
