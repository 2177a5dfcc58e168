"""Run an exported policy on a LeRobot robot, under safety limits, and commit its episodes to the store.

    # the SO-100 twin behind LeRobot's Robot API (robot type fleetmind_so100_sim), labelled by the twin
    python scripts/deploy.py deploy.run.export_dir=exports/so100 deploy.run.label=sim deploy.run.episodes=5 \\
        deploy.robot.task=so100-reach deploy.run.store_url=outputs/so100_store
    # a real SO-101 arm (LeRobot's so101_follower), the operator labels each episode at the keyboard
    python scripts/deploy.py deploy.run.export_dir=exports/so100 deploy.robot.type=so101_follower \\
        deploy.robot.port=/dev/ttyACM0 deploy.robot.id=arm0 deploy.run.store_url=outputs/so100_store

Runs at the export's ``control_hz``; maps LeRobot features to the policy's and the policy's end-effector actions to
joint targets through the twin's IK (``fleet/deploy/lerobot_bridge.py``); checks every action (``fleet/deploy/safety.py``);
writes ``deploy_report.json`` (steps, actions sent, safety events, latency per step, success) into the Hydra run
dir. Needs LeRobot 0.6.1 (the ``[lerobot]`` extra; ``make install`` installs it). See ``fleet/deploy/deployer.py``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from fleet.progress import calm_progress
from fleet.refusals import one_line_refusals
from policies.threads import passive_wait

passive_wait()   # before torch loads: OpenMP's idle threads sleep instead of spinning (policies/threads.py)
calm_progress()  # off a terminal, a progress bar redraws every 30 s, not 15 times a second (fleet/progress.py)

try:
    import lerobot.robots  # noqa: F401
except ImportError as e:  # pragma: no cover - an install without the [lerobot] extra
    raise SystemExit(f"scripts/deploy.py needs LeRobot 0.6.1 ({e}); install it with `make install` or "
                     "`pip install 'fleetmind[lerobot]'` (Python 3.12)") from e

import hydra
from omegaconf import DictConfig

import configs.typed  # noqa: F401 - registers the typed config groups before Hydra composes
from fleet.deploy.config import DeployConfig
from fleet.deploy.deployer import (
    Deployer,
    build_robot_config,
    export_path,
    make_robot,
    safety_limits,
)
from fleet.deploy.lerobot_bridge import JointMap

log = logging.getLogger("deploy")
SIM_TYPE = "fleetmind_so100_sim"


def _plain(value: Any) -> Any:
    """A config value as plain Python (an OmegaConf list or mapping to a list or dict)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def sim_robot_defaults(fields: dict, input_shapes: dict, meta: dict, fleet_robot: dict | None = None,
                       depth_cameras: Any = None) -> dict:
    """Fill the simulated robot's null fields from the export: the cameras it reads at their size, and the
    task it was trained on when that is a single SO-100 task; and ``fleet_robot`` (what its robot units are
    drawn from: ``deploy.robot.unit_id``, ``deploy.run.trials``) from the composed ``robot`` group, so the twin
    built as unit ``u`` is the unit ``u`` that ``scripts/eval.py`` evaluates with the same ``robot=`` settings."""
    fields = dict(fields)
    if fields.get("fleet_robot") is None and fleet_robot is not None:
        fields["fleet_robot"] = dict(fleet_robot)
    cams = [k.split(".", 2)[2] for k in input_shapes if k.startswith("observation.images.")]
    if fields.get("render_cameras") is None:
        fields["render_cameras"] = cams
    if fields.get("image_size") is None and cams:
        fields["image_size"] = int(input_shapes[f"observation.images.{cams[0]}"][0])
    if "observation.point_cloud" in input_shapes:   # a point-cloud policy: the twin's depth cameras give its cloud
        if not depth_cameras:
            raise ValueError("the export reads observation.point_cloud: name its depth cameras "
                             "(deploy.bridge.depth_cameras=[corner,topview]: the training's obs.point_cameras) and "
                             "their size (deploy.robot.depth_size: obs.point_image_size)")
        if fields.get("depth_cameras") is None:
            fields["depth_cameras"] = [str(c) for c in depth_cameras]
        if fields.get("depth_color") is None:
            fields["depth_color"] = "observation.point_colors" in input_shapes
    if fields.get("task") is None:
        tasks = [t for t in (meta.get("training", {}) or {}).get("tasks") or [] if str(t).startswith("so100-")]
        if len(tasks) == 1:
            fields["task"] = tasks[0]
    return fields


@hydra.main(version_base=None, config_path="../configs", config_name="config")
@one_line_refusals("deploy")   # a refusal (store, registry, policy): one line, exit 2, the trace in the run's log
def main(cfg: DictConfig) -> None:
    from configs.schema import check_or_exit

    check_or_exit(cfg)   # every value against its rule, before any work
    try:
        d = DeployConfig.from_dict(cfg.deploy)
        run, b = d.run, d.bridge
        export = export_path(run.export_dir)
        from policies.runtime import PolicyRuntime

        rt = PolicyRuntime.load(export, device=run.device, num_inference_steps=run.num_inference_steps,
                                num_threads=run.num_threads, compile=run.compile, backend=run.backend)
        report_path = Path(run.report or Path(cfg.output_dir) / "deploy_report.json")
        robot_fields = dict(d.robot)
        if robot_fields.get("type") == SIM_TYPE:
            from omegaconf import OmegaConf

            robot_fields = sim_robot_defaults(robot_fields, rt.input_shapes, rt.meta,
                                              OmegaConf.to_container(cfg.robot, resolve=True),
                                              _plain(b.depth_cameras))
        robot = make_robot(build_robot_config(robot_fields))
        joint_map = JointMap(list(b.joint_signs), list(b.joint_offsets_deg), float(b.gripper_closed_pos),
                             float(b.gripper_open_pos))
        deployer = Deployer(rt, robot, run, safety_limits(d.safety, joint_map), joint_map,
                            cameras=dict(b.cameras or {}), export_dir=str(export), hang_s=d.safety.hang_s,
                            robot_type=robot_fields["type"], embodiment=b.embodiment,
                            depth_cameras=_plain(b.depth_cameras))
    except (FileNotFoundError, ValueError, TypeError) as e:
        raise SystemExit(f"deploy: {e}") from e
    log.info("deploying %s (policy version %s) on %s at %.1f Hz, label=%s", export, deployer.policy_version,
             deployer.robot_type, deployer.control_hz, run.label)
    try:
        results = deployer.run_all()
    finally:
        if robot.is_connected:
            robot.disconnect()
    report = deployer.report(results)
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report_path.write_text(json.dumps(report, indent=1))
    summary = {"report": str(report_path), "robot_type": report["robot_type"], "task": report["task"],
               "episodes": [{k: e[k] for k in ("seed", "unit_id", "steps", "actions_sent", "holds", "stop_reason",
                                                 "success", "episode_id", "safety_counts", "policy_latency_s")}
                            for e in report["episodes"]],
               "successes": report["successes"], "committed": report["committed"]}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
