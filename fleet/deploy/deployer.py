"""Run an exported policy on a LeRobot robot: the loop behind ``scripts/deploy.py`` (real arm or the SO-100 twin).

Import order matters on CPU machines: this module imports LeRobot (and so torchvision / triton) before anything
imports ``sim`` (see ``fleet/deploy/so100_sim_robot/__init__.py``: Mesa's EGL then triton segfaults).

One control step (at the export's ``control_hz``, paced in real time unless ``realtime=False``)::

    obs = robot.get_observation()                          # LeRobot features: <joint>.pos, cameras, (sim.*)
    action = watchdog.call(runtime.select_action, bridge.policy_observation(obs))   # hold the arm on a miss
    targets = bridge.propose(action, obs)                  # EE delta -> joint targets (the twin's mink IK)
    sent, events = safety.filter(targets, joints(obs))     # NaN/limits/step/workspace; see fleet.deploy.safety
    robot.send_action(bridge.robot_action(sent))

An episode ends after ``max_steps``, ``steps_after_success`` steps after the first success (simulated robot),
at a latched safety stop (NaN/inf, missed deadlines), or when the operator presses Ctrl-C. Then it is labelled
(``label``: ``sim`` the twin's success, ``operator`` a y/n prompt, ``classifier`` a configured callable, ``none``)
and, with a store, committed with embodiment ``"so100"`` and the export's policy version.

Episode ``i`` resets the scene with seed ``run.seed + i``, or plays ``run.trials[i]`` (:func:`load_trials`: e.g.
fleetmind's held-out evaluation trials, each with its reset seed and, on the simulated robot, its robot unit). With
``run.seed_noise`` the policy's denoising noise comes from a generator seeded with the episode's seed, as in
fleetmind's evaluation (``fleet.experiment.evaluation``), so a deployed trial can be compared with the evaluated one.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import math
import pkgutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lerobot.robots  # noqa: F401 - before sim (EGL) is imported, see the module doc
import numpy as np

from fleet.deploy.config import RunConfig, SafetyConfig
from fleet.deploy.lerobot_bridge import MOTOR_KEYS, JointMap, make_bridge
from fleet.deploy.safety import EventLog, SafetyEvent, SafetyFilter, SafetyLimits, Watchdog

log = logging.getLogger("fleetmind.deploy")
EMBODIMENT = "so100"


# ---------------------------------------------------------------------------------------------- robot types
def register_robot_types() -> list[str]:
    """Register every robot and camera config LeRobot ships (each ``lerobot.robots.<x>`` /
    ``lerobot.cameras.<x>`` package that imports), third-party ``lerobot_robot_*`` plugins, and
    ``fleetmind_so100_sim``; returns the known robot types, sorted."""
    from lerobot import cameras as cams
    from lerobot import robots
    from lerobot.robots import RobotConfig

    for pkg in (robots, cams):
        for m in pkgutil.iter_modules(pkg.__path__):
            if m.ispkg:
                try:
                    importlib.import_module(f"{pkg.__name__}.{m.name}")
                except Exception as e:  # noqa: BLE001 - a robot whose SDK is missing stays unregistered
                    log.debug("lerobot %s.%s not importable: %s", pkg.__name__, m.name, e)
    try:
        from lerobot.utils.import_utils import register_third_party_plugins

        register_third_party_plugins()
    except ImportError:
        pass
    import fleet.deploy.so100_sim_robot  # noqa: F401 - registers fleetmind_so100_sim

    return sorted(RobotConfig.get_known_choices())


def build_robot_config(robot: Mapping[str, Any]):
    """``deploy.robot`` (``{"type": ..., other fields}``) -> a LeRobot ``RobotConfig`` (decoded by draccus, as
    LeRobot's own CLI does). Keys whose value is None are left to the config class's defaults.

    Raises:
        ValueError: no ``type``, a type LeRobot does not know (the known ones are listed), or fields the
            type rejects (draccus' message).
    """
    import draccus
    from lerobot.robots import RobotConfig

    fields = {k: v for k, v in dict(robot).items() if v is not None}
    known = register_robot_types()
    rtype = fields.get("type")
    if not rtype:
        raise ValueError(f"deploy.robot.type is not set; known robot types: {', '.join(known)}")
    if rtype not in known:
        raise ValueError(f"unknown robot type {rtype!r}; robot types LeRobot knows here: {', '.join(known)}")
    try:
        return draccus.decode(RobotConfig, fields)
    except Exception as e:  # draccus.utils.DecodingError and friends
        root = e
        while (root.__cause__ or root.__context__) is not None:   # the config's own check (its __post_init__)
            root = root.__cause__ or root.__context__
        why = f"{e}" + (f" ({root})" if root is not e else "")
        raise ValueError(f"deploy.robot: cannot build a {rtype!r} config from {fields}: {why}") from e


def make_robot(robot_cfg):
    """``lerobot.robots.make_robot_from_config`` (so third-party types resolve exactly as in LeRobot)."""
    from lerobot.robots import make_robot_from_config

    return make_robot_from_config(robot_cfg)


def load_classifier(spec: str | None) -> Callable[[Any, Mapping[str, Any]], bool]:
    """A success classifier: ``"sim"`` (the simulated robot's ``sim_info()["episode_success"]``) or
    ``"package.module:function"`` called as ``function(robot, observation) -> bool`` on the final observation.

    Raises:
        ValueError: no spec or a malformed one; ImportError / AttributeError: the callable cannot be found.
    """
    if not spec:
        raise ValueError("label=classifier needs deploy.run.success_classifier ('sim' or 'module:function')")
    if spec == "sim":
        return lambda robot, _obs: bool(robot.sim_info()["episode_success"])
    mod, sep, fn = str(spec).partition(":")
    if not sep or not mod or not fn:
        raise ValueError(f"success_classifier {spec!r}: expected 'sim' or 'package.module:function'")
    return getattr(importlib.import_module(mod), fn)


def load_trials(spec: Any) -> list[dict[str, Any]] | None:
    """``deploy.run.trials`` -> ``[{"seed": int, "unit_id": int | None, "task": str | None}, ...]`` (None: no
    trial list).

    Args:
        spec: None; a list of mappings with ``seed`` (int >= 0) and optionally ``unit_id`` (int >= 0) and ``task``
            (other keys, such as an evaluation episode's ``success``, are ignored); or the path of a JSON file
            holding such a list (``scripts/eval.py``'s ``episodes/<arm>.json``, or
            ``fleet.experiment.evaluation.evaluation_plan``'s trials) or a mapping with it under ``"trials"``.
    Raises:
        FileNotFoundError: a path that does not exist. ValueError: an empty list, or a trial without an integer
            seed >= 0 or with a bad unit id / task (its index named).
    """
    if spec is None:
        return None
    src = "deploy.run.trials"
    if isinstance(spec, str | Path):
        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(f"{src}: no trial file {str(path)!r} (a JSON list of {{seed, unit_id, task}})")
        spec = json.loads(path.read_text())
        if isinstance(spec, Mapping) and "trials" in spec:
            spec = spec["trials"]
        src = f"{src} ({path})"
    if not isinstance(spec, list | tuple) or not spec:
        raise ValueError(f"{src}: expected a non-empty list of {{seed, unit_id, task}}, given {spec!r:.80}")
    out = []
    for i, tr in enumerate(spec):
        if not isinstance(tr, Mapping):
            msg = f"{src}[{i}]: expected a mapping {{seed, unit_id, task}}, given {tr!r}"
            raise ValueError(msg)  # noqa: TRY004 - a config value, refused as the others are
        seed, unit, task = tr.get("seed"), tr.get("unit_id"), tr.get("task")
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
            raise ValueError(f"{src}[{i}]: expected an integer seed >= 0, given {seed!r}")
        if unit is not None and (isinstance(unit, bool) or not isinstance(unit, int | np.integer) or unit < 0):
            raise ValueError(f"{src}[{i}]: expected an integer unit_id >= 0 or none, given {unit!r}")
        if task is not None and not isinstance(task, str):
            raise ValueError(f"{src}[{i}]: expected a task name or none, given {task!r}")
        out.append({"seed": int(seed), "unit_id": None if unit is None else int(unit), "task": task})
    return out


# keys whose explicit null switches a protection off (logged as a warning)
_SWITCHABLE = ("max_step_deg", "max_step_gripper", "workspace_m", "deadline_s")


def safety_limits(cfg: Mapping[str, Any] | None, joint_map: JointMap) -> SafetyLimits:
    """``deploy.safety`` -> ``SafetyLimits`` in LeRobot units (``MOTOR_KEYS`` order).

    Every key not given takes its value from :class:`fleet.deploy.config.SafetyConfig` (the conservative limits
    every composed config has), so ``safety_limits({}, ...)`` is safe. ``joint_limits_deg``:
    ``{joint: [low, high]}`` overrides (others: the SO-100 MJCF ranges through ``joint_map``); ``max_step_deg``
    (arm joints, degrees) and ``max_step_gripper`` (0..100 units) per control step; ``workspace_m`` (metres);
    ``deadline_s`` (seconds); ``max_misses``. Switching a protection off takes an explicit ``null`` for it and is
    logged as a warning.

    Raises:
        ValueError: an unknown key or joint name; a step limit of 0 (it is not "no limit": give a positive limit,
            or null to switch the limit off); and everything ``SafetyLimits`` checks (negative or NaN limits).
    """
    cfg = dict(cfg.to_dict() if isinstance(cfg, SafetyConfig) else cfg or {})
    for key in ("max_step_deg", "max_step_gripper"):
        if cfg.get(key) is not None and float(cfg[key]) == 0.0:
            raise ValueError(f"deploy.safety.{key}=0: a step limit of 0 would hold the arm forever and is not "
                             "'no limit'; give a positive limit, or null to switch the limit off (logged)")
    c = SafetyConfig.from_dict(cfg).to_dict()   # unknown keys and values out of range refused, naming them
    off = [k for k in _SWITCHABLE if c[k] is None]
    if off:
        log.warning("deploy.safety: protections switched off by an explicit null: %s", off)
    names = [k.removesuffix(".pos") for k in MOTOR_KEYS]
    limits = joint_map.limits()
    for j, rng in dict(c.get("joint_limits_deg") or {}).items():
        if j not in names:
            raise ValueError(f"deploy.safety.joint_limits_deg: unknown joint {j!r}; joints: {names}")
        limits[names.index(j)] = [float(rng[0]), float(rng[1])]

    def step_limit(key: str) -> float:
        return math.inf if c[key] is None else float(c[key])

    step = [step_limit("max_step_deg")] * 5 + [step_limit("max_step_gripper")]
    ws = c["workspace_m"]
    return SafetyLimits(names, limits, step, workspace=None if ws is None else np.asarray(ws, dtype=np.float64),
                        deadline_s=c["deadline_s"], max_misses=int(c["max_misses"]))


def describe_limits(limits: SafetyLimits) -> str:
    """One line per protection of ``limits``, as logged before the first action of a deployment."""
    step = {n: (None if not np.isfinite(s) else float(s)) for n, s in zip(limits.names, limits.max_step)}
    lines = [f"joint limits: {dict(zip(limits.names, limits.joint_limits.round(1).tolist()))}",
             f"max step per control step: {step}" + ("  (None: OFF)" if None in step.values() else ""),
             "workspace (m): " + ("OFF" if limits.workspace is None else str(limits.workspace.tolist())),
             "policy deadline (s): " + ("OFF" if limits.deadline_s is None else
                                        f"{limits.deadline_s}, stop after {limits.max_misses} consecutive misses")]
    return "\n  ".join(["safety limits in force:"] + lines)


# ---------------------------------------------------------------------------------------------- results
@dataclasses.dataclass
class EpisodeResult:
    """One deployed episode. Arrays have one row per control step that sent an action (T, 6) in LeRobot units:
    ``current`` (measured before the step), ``proposed`` (bridge output, NaN for a NaN action / a missed
    deadline), ``sent`` (after the safety filter); ``held`` (T,) marks holds (sent = current by a stop or the
    watchdog); ``policy_s`` / ``step_s`` (T,) seconds of the policy call and of the whole step; ``unit_id``: the
    robot unit the simulated robot played (None: a real robot)."""

    index: int
    seed: int
    unit_id: int | None = None
    steps: int = 0
    stop_reason: str = "max_steps"
    success: bool | None = None
    label_source: str = "none"
    episode_id: str | None = None
    first_success_step: int | None = None
    overruns: int = 0
    events: list[SafetyEvent] = dataclasses.field(default_factory=list)
    current: list = dataclasses.field(default_factory=list)
    proposed: list = dataclasses.field(default_factory=list)
    sent: list = dataclasses.field(default_factory=list)
    held: list = dataclasses.field(default_factory=list)
    policy_s: list = dataclasses.field(default_factory=list)
    step_s: list = dataclasses.field(default_factory=list)
    start_time: float = 0.0
    store_steps: list = dataclasses.field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary for the deploy report (with per-step latency, not the joint arrays)."""
        counts: dict[str, int] = {}
        for e in self.events:
            counts[e.kind] = counts.get(e.kind, 0) + 1
        pct = (lambda a, q: float(np.percentile(a, q))) if self.policy_s else (lambda a, q: None)
        return {"index": self.index, "seed": self.seed, "unit_id": self.unit_id, "steps": self.steps,
                "actions_sent": len(self.sent), "holds": int(np.sum(self.held)) if self.held else 0, "stop_reason": self.stop_reason,
                "success": self.success, "label_source": self.label_source, "episode_id": self.episode_id,
                "first_success_step": self.first_success_step, "overruns": self.overruns,
                "safety_counts": counts, "safety_events": [e.to_dict() for e in self.events],
                "policy_latency_s": {"mean": float(np.mean(self.policy_s)) if self.policy_s else None,
                                     "p50": pct(self.policy_s, 50), "p95": pct(self.policy_s, 95),
                                     "max": float(np.max(self.policy_s)) if self.policy_s else None},
                "policy_s": [round(float(x), 6) for x in self.policy_s],
                "step_s": [round(float(x), 6) for x in self.step_s]}


# ---------------------------------------------------------------------------------------------- deployer
class Deployer:
    """Runs a ``PolicyRuntime``-like policy on a connected LeRobot robot under the safety filter and watchdog.

    Args:
        runtime: has ``select_action(obs) -> (4,)``, ``reset()``, ``input_shapes``, ``control_hz`` and ``meta``
            (``export.json``); normally ``policies.runtime.PolicyRuntime``.
        robot: a LeRobot ``Robot`` (connected by ``run``/``connect`` here if it is not yet).
        run: ``RunConfig``; safety: ``SafetyLimits`` (None: ``safety_limits({}, joint_map)``, the conservative
            defaults of ``fleet.deploy.config.SafetyConfig``);
        joint_map / cameras: the bridge's convention (``deploy.bridge``).
        export_dir: recorded in the report and the store.
        input_fn: the operator prompt (``input``; tests pass a scripted one).
        hang_s: ``Watchdog.hang_s``; robot_type: the type name for messages, the report and the store (default:
            the config's; LeRobot's so100_follower and so101_follower share one config class).
        embodiment: whose bridge maps the policy to the robot (``fleet.deploy.lerobot_bridge.make_bridge``).
    Raises:
        ValueError: an export the robot cannot serve (features, control rate), a label the robot cannot give, a
            bad trial list (``load_trials``), a trial on a robot unit for a robot that cannot be built as one, a
            trial of another task than the robot's.
        FileNotFoundError: ``run.trials`` names a file that does not exist.
    """

    def __init__(self, runtime, robot, run: RunConfig, safety: SafetyLimits | None = None,
                 joint_map: JointMap | None = None, cameras: Mapping[str, str] | None = None,
                 export_dir: str | None = None, input_fn: Callable[[str], str] = input, hang_s: float = 30.0,
                 robot_type: str | None = None, embodiment: str = "so100", depth_cameras: Any = None):
        self.runtime, self.robot, self.run = runtime, robot, run
        self.input_fn, self.export_dir = input_fn, export_dir
        self.joint_map = joint_map or JointMap()
        self.eventlog = EventLog()
        meta = dict(getattr(runtime, "meta", {}) or {})
        action_names = (meta.get("features", {}).get("action", {}) or {}).get("names") or ["dx", "dy", "dz", "gripper"]
        # depth cameras (a point-cloud policy): {camera: calibration} of a real sensor, or camera names whose
        # calibration the simulated robot gives (re-read at every episode start: a unit's cameras differ)
        self._robot_depth = isinstance(depth_cameras, list | tuple)
        if self._robot_depth:
            if not hasattr(robot, "depth_calibration"):
                raise ValueError(f"deploy.bridge.depth_cameras={list(depth_cameras)}: only the simulated robot gives "
                                 "its cameras' calibration; give a real sensor's as {camera: {fx, fy, cx, cy, "
                                 "base_from_camera, depth_scale}}")
            from sim.pointcloud import DepthCamera

            eye = [[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]]
            depth_cameras = {str(c): DepthCamera(1.0, 1.0, 0.0, 0.0, tuple(map(tuple, eye))) for c in depth_cameras}
        self.bridge = make_bridge(embodiment, runtime.input_shapes, action_names, joint_map=self.joint_map,
                                  cameras=cameras, events=self.eventlog, depth_cameras=depth_cameras or None)
        rtype = robot_type or getattr(getattr(robot, "config", None), "type", None) or getattr(robot, "name", "robot")
        self.robot_type = rtype
        self.bridge.check_robot(robot.observation_features, robot.action_features, rtype)
        if getattr(getattr(robot, "config", None), "use_degrees", True) is False:
            # so10x_follower: arm joints then read -100..100, which the bridge would take for degrees. LeRobot
            # 0.6.1 defaults so_follower to use_degrees=True (koch, omx and lekiwi followers to False).
            raise ValueError(f"robot type {rtype!r} is configured with use_degrees=false, but the bridge reads and "
                             "sends arm joints in degrees: set +deploy.robot.use_degrees=true")
        hz = run.control_hz if run.control_hz is not None else runtime.control_hz
        if hz is None:
            raise ValueError("the export has no control_hz (export.json) and deploy.run.control_hz is not set: the "
                             "policy must run at the rate it was trained at")
        robot_hz = getattr(robot, "control_hz", None)
        if robot_hz is not None and abs(float(robot_hz) - float(hz)) > 1e-6:
            raise ValueError(f"the policy runs at {hz} Hz but robot type {rtype!r} steps at {robot_hz} Hz")
        self.control_hz = float(hz)
        self.is_sim = hasattr(robot, "sim_info")
        if run.label == "sim" and not self.is_sim:
            raise ValueError(f"label=sim needs the simulated robot's success signal; robot type {rtype!r} has "
                             "none (use label=operator or label=classifier)")
        self.classifier = load_classifier(run.success_classifier) if run.label == "classifier" else None
        self.limits = safety if safety is not None else safety_limits({}, self.joint_map)
        self.safety = SafetyFilter(self.limits, fk=self.bridge.fk, events=self.eventlog)
        self.watchdog = Watchdog(self.limits.deadline_s, hang_s=max(hang_s, self.limits.deadline_s or 0.0))
        source = meta.get("source") or {}
        self.policy_version = int(source["version"]) if source.get("version") is not None else -1
        self.task = run.task or getattr(getattr(robot, "config", None), "task", None)
        if run.store_url and not self.task:
            raise ValueError("deploy.run.task must name the task of a real robot's episodes for the store "
                             "(e.g. deploy.run.task=so100-pick-place)")
        self.trials = load_trials(run.trials)
        for i, tr in enumerate(self.trials or []):
            if tr["unit_id"] is not None and not (self.is_sim and hasattr(type(robot), "action_scale_m")):
                raise ValueError(f"deploy.run.trials[{i}] names robot unit {tr['unit_id']}, but robot type {rtype!r} "
                                 "cannot be built as a fleet unit (only the simulated robot can)")
            if tr["task"] is not None and self.task is not None and tr["task"] != self.task:
                raise ValueError(f"deploy.run.trials[{i}] is a trial of task {tr['task']!r}, but the robot runs "
                                 f"{self.task!r} (deploy.robot.task / deploy.run.task)")
        self.writer = self._open_store() if run.store_url else None
        self._generator = None

    @property
    def episodes(self) -> int:
        """Episodes ``run_all`` runs: one per trial of ``run.trials``, else ``run.episodes``."""
        return len(self.trials) if self.trials else int(self.run.episodes)

    # ------------------------------------------------------------------ store
    def store_spec(self) -> dict[str, Any]:
        """The store spec of the policy's features (the twin's names and units, ``so100_feature_spec``)."""
        from sim.so100.env import so100_feature_spec

        shapes = self.runtime.input_shapes
        cams = [k.split(".", 2)[2] for k in shapes if k.startswith("observation.images.")]
        hw = tuple(shapes[f"observation.images.{cams[0]}"][:2]) if cams else (96, 96)
        spec = so100_feature_spec(cams or None, hw)
        for k in [k for k in spec if k.startswith("observation.") and k not in shapes]:
            del spec[k]
        for c in cams:
            spec[f"observation.images.{c}"]["shape"] = list(shapes[f"observation.images.{c}"])
        return spec

    def _open_store(self):
        from experience_dict.store import ExperienceStore

        spec = self.store_spec()
        store = ExperienceStore.create_or_open(str(self.run.store_url), spec=spec, control_hz=self.control_hz)
        wid = self.run.writer_id or f"deploy-{self.robot_type}-unit-{int(self.run.unit_id)}"
        self.progress_keys = list(store.progress_keys)
        return store.writer(wid)

    def _progress(self) -> tuple[float, dict[str, float]]:
        keys = self.progress_keys if self.writer is not None else []
        if self.is_sim:
            info = self.robot.sim_info()
            return float(info.get("reward", math.nan)), {k: float(info["progress"].get(k, math.nan)) for k in keys}
        return math.nan, dict.fromkeys(keys, math.nan)  # a real arm has no reward or progress signal

    # ------------------------------------------------------------------ episodes
    def _reset_scene(self, seed: int, unit_id: int | None = None) -> None:
        robot = self.robot
        if hasattr(robot, "reset_scene"):
            if unit_id is None:
                robot.reset_scene(seed)
            else:
                robot.reset_scene(seed, unit_id=unit_id)
            if hasattr(type(robot), "action_scale_m") and hasattr(self.bridge, "set_action_scale"):
                # the unit's action gain lives in the twin's EE controller, which the bridge runs here
                self.bridge.set_action_scale(robot.action_scale_m)
            if self._robot_depth:   # this unit's depth cameras, as its hand-eye calibration would give them
                self.bridge.set_depth_cameras(robot.depth_calibration())
        elif self.run.wait_for_reset:
            self.input_fn(f"Reset the scene for episode (seed {seed}) and press Enter to start ")

    def episode_trial(self, index: int) -> tuple[int, int | None]:
        """``(reset seed, robot unit or None)`` of episode ``index``: ``run.trials[index]``, else
        ``(run.seed + index, None)``. Raises IndexError past the trial list."""
        if self.trials:
            tr = self.trials[index]
            return tr["seed"], tr["unit_id"]
        return int(self.run.seed) + index, None

    def run_episode(self, index: int = 0) -> EpisodeResult:
        """Run, label and (with a store) commit one episode (its seed and unit: ``episode_trial(index)``); the arm
        is held at the end of a stopped one."""
        run, robot, bridge = self.run, self.robot, self.bridge
        seed, unit_id = self.episode_trial(index)
        res = EpisodeResult(index=index, seed=seed)
        n_events = len(self.eventlog.events)
        self.runtime.reset()
        self.safety.reset()
        self.watchdog.misses = 0
        self._reset_scene(seed, unit_id)
        res.unit_id = getattr(robot, "unit_id", None) if self.is_sim else None
        self._generator = None
        if run.seed_noise and getattr(self.runtime, "denoises", False):
            import torch

            self._generator = torch.Generator().manual_seed(seed)   # as the evaluation seeds a trial's noise
        obs = robot.get_observation()
        bridge.reset(obs)
        res.start_time = time.time()
        period = 1.0 / self.control_hz
        t_next = time.perf_counter()
        try:
            for step in range(int(run.max_steps)):
                t0 = time.perf_counter()
                if self._act(step, obs, res):
                    break
                obs = robot.get_observation()
                if self.is_sim and self.robot.sim_info()["success"] and res.first_success_step is None:
                    res.first_success_step = res.steps
                res.step_s.append(time.perf_counter() - t0)
                if (run.stop_on_success and res.first_success_step is not None
                        and res.steps - res.first_success_step >= run.steps_after_success):
                    res.stop_reason = "success"
                    break
                if run.realtime:
                    t_next += period
                    wait = t_next - time.perf_counter()
                    if wait > 0:
                        time.sleep(wait)
                    else:
                        res.overruns += 1
                        t_next = time.perf_counter()
        except KeyboardInterrupt:
            log.warning("operator stop (Ctrl-C) at step %d: holding the arm", res.steps)
            res.stop_reason = "operator"
            held = self.safety.stop(res.steps, "operator", bridge.joints(robot.get_observation()))
            robot.send_action(bridge.robot_action(held))
        res.events = self.eventlog.events[n_events:]
        self._label(res, obs)
        self._commit(res)
        log.info("episode %d (seed %d%s): %d steps, stop %s, success %s, safety %s", index, seed,
                 "" if res.unit_id is None else f", unit {res.unit_id}", res.steps, res.stop_reason, res.success,
                 dict(res.to_dict()["safety_counts"]))
        return res

    def _act(self, step: int, obs: Mapping[str, Any], res: EpisodeResult) -> bool:
        """One control step from the robot observation ``obs``: ask the policy (under the watchdog), filter its
        action through the safety layer, send it, record it; True when the episode must stop (``res.stop_reason``
        set: deadline misses, a bad action, a safety stop)."""
        robot, bridge = self.robot, self.bridge
        current = bridge.joints(obs)
        pobs = bridge.policy_observation(obs)
        held_by_watchdog = []

        def hold(current=current, held=held_by_watchdog):
            held.append(self.safety.hold(current))
            robot.send_action(bridge.robot_action(held[-1]))

        kw = {} if self._generator is None else {"generator": self._generator}
        call = self.watchdog.call(self.runtime.select_action, pobs, on_miss=hold, **kw)
        res.policy_s.append(call.elapsed_s)
        if call.missed:
            self.eventlog.add(SafetyEvent(step, "deadline", {
                "deadline_s": self.limits.deadline_s, "held_after_s": round(call.miss_handled_s, 4),
                "policy_s": round(call.elapsed_s, 4), "consecutive_misses": self.watchdog.misses}))
            bridge.sent(held_by_watchdog[-1])
            self._record(res, current, np.full(6, np.nan), held_by_watchdog[-1], True)
            if self.watchdog.misses >= self.limits.max_misses:
                self.safety.stop(step, "deadline", held_by_watchdog[-1])
                res.stop_reason = "deadline"
                return True
        else:
            action = np.asarray(call.value, dtype=np.float32).reshape(-1)
            try:
                proposed = bridge.propose(action, obs, step)
            except ValueError as e:   # an action of the wrong dimension: hold the arm, end the episode
                self.eventlog.add(SafetyEvent(step, "bad_action", {"error": str(e),
                                                                   "shape": list(action.shape)}))
                held = self.safety.stop(step, "bad_action", current)
                robot.send_action(bridge.robot_action(held))
                bridge.sent(held)
                self._record(res, current, np.full(6, np.nan), held, True)
                res.stop_reason = "bad_action"
                return True
            sent, _ev = self.safety.filter(proposed, current, step, action)
            robot.send_action(bridge.robot_action(sent))
            bridge.sent(sent)
            self._record(res, current, proposed, sent, self.safety.stopped is not None)
            if self.safety.stopped is not None:
                res.stop_reason = self.safety.stopped
                return True
            if self.writer is not None:
                reward, progress = self._progress()
                res.store_steps.append(({k: v.copy() for k, v in pobs.items()},  # camera buffers may be reused
                                        action.astype(np.float32), reward, progress))
        return False

    @staticmethod
    def _record(res: EpisodeResult, current, proposed, sent, held: bool) -> None:
        res.current.append(np.asarray(current, dtype=np.float64).copy())
        res.proposed.append(np.asarray(proposed, dtype=np.float64).copy())
        res.sent.append(np.asarray(sent, dtype=np.float64).copy())
        res.held.append(bool(held))
        res.steps += 1

    def _label(self, res: EpisodeResult, obs: Mapping[str, Any]) -> None:
        label = self.run.label
        if label == "sim":
            res.success, res.label_source = bool(self.robot.sim_info()["episode_success"]), "sim"
        elif label == "classifier":
            res.success, res.label_source = bool(self.classifier(self.robot, obs)), "classifier"
        elif label == "operator":
            while True:
                ans = self.input_fn(f"Episode {res.index} ({res.steps} steps, stop: {res.stop_reason}): success? "
                                    "[y/n, Enter = no label] ").strip().lower()
                if ans in ("y", "yes", "n", "no", ""):
                    break
            if ans:
                res.success, res.label_source = ans.startswith("y"), "operator"

    def _commit(self, res: EpisodeResult) -> None:
        w = self.writer
        if w is None:
            return
        if res.success is None or not res.store_steps:
            log.warning("episode %d not committed: %s", res.index,
                        "no success label" if res.success is None else "no policy step to store")
            return
        w.begin_episode(unit_id=int(self.run.unit_id), embodiment=EMBODIMENT, task=self.task,
                        policy_version=self.policy_version, seed=res.seed, is_demo=False, start_time=res.start_time,
                        extra={"deploy": {"robot_type": self.robot_type, "export": self.export_dir,
                                          "stop_reason": res.stop_reason, "label_source": res.label_source,
                                          "safety_counts": res.to_dict()["safety_counts"],
                                          "sim_unit_id": res.unit_id,
                                          "actions": "the policy's proposals, before the safety filter"}})
        try:
            for pobs, action, reward, progress in res.store_steps:
                w.add_step(pobs, action, reward, progress)
        except Exception:
            w.abort()
            raise
        res.episode_id = w.commit(success=bool(res.success))
        log.info("episode %d committed to %s as %s (success %s)", res.index, self.run.store_url, res.episode_id,
                 res.success)

    def warmup(self) -> float:
        """One untimed policy call on a real observation (nothing is sent), so the first step of the first episode
        does not pay for lazy initialisation; returns its seconds."""
        t0 = time.perf_counter()
        self.runtime.reset()
        if self._robot_depth:
            self.bridge.set_depth_cameras(self.robot.depth_calibration())
        self.runtime.select_action(self.bridge.policy_observation(self.robot.get_observation()))
        self.runtime.reset()
        return time.perf_counter() - t0

    def run_all(self) -> list[EpisodeResult]:
        """Connect the robot if needed, run ``episodes`` episodes (``run.episodes``, or one per ``run.trials``),
        then close the watchdog and the writer (the robot stays connected: the caller disconnects it)."""
        try:
            if not self.robot.is_connected:
                self.robot.connect()
            log.info(describe_limits(self.limits))
            self.warmup()
            return [self.run_episode(i) for i in range(self.episodes)]
        finally:
            self.close()

    def close(self) -> None:
        self.watchdog.close()
        if self.writer is not None:
            self.writer.close()

    def report(self, results: list[EpisodeResult]) -> dict[str, Any]:
        """The JSON report of a deployment (``scripts/deploy.py`` writes it into the Hydra run dir)."""
        meta = dict(getattr(self.runtime, "meta", {}) or {})
        return {"export_dir": self.export_dir, "policy_type": meta.get("policy_type"),
                "policy_version": self.policy_version, "robot_type": self.robot_type, "task": self.task,
                "control_hz": self.control_hz, "store_url": self.run.store_url,
                "run": dataclasses.asdict(self.run), "safety": self.limits.to_dict(),
                "joint_map": {"signs": self.joint_map.signs.tolist(),
                              "offsets_deg": self.joint_map.offsets_deg.tolist(),
                              "gripper_closed_pos": self.joint_map.gripper_closed_pos,
                              "gripper_open_pos": self.joint_map.gripper_open_pos},
                "cameras": self.bridge.cameras, "episodes": [r.to_dict() for r in results],
                "successes": sum(bool(r.success) for r in results),
                "committed": [r.episode_id for r in results if r.episode_id]}


def export_path(path: str | Path | None) -> Path:
    """Check an export folder exists and holds ``export.json``. Raises FileNotFoundError naming the fix."""
    if not path:
        raise FileNotFoundError("deploy.run.export_dir is not set: point it at a folder written by scripts/export.py")
    p = Path(path)
    if not (p / "export.json").is_file():
        raise FileNotFoundError(f"export folder {str(p)!r} {'lacks export.json' if p.is_dir() else 'does not exist'}"
                                " (write one with scripts/export.py)")
    return p
