"""Write a LeRobot policy folder (``--policy.path=``) from a fleetmind export.

    python -m lerobot_policy_fleetmind.export exports/reach exports/reach_lerobot [--device cpu] [--no-critic]
    python -m lerobot_policy_fleetmind.export exports/twin exports/twin_lerobot --robot so100   # lerobot-rollout
    python -m lerobot_policy_fleetmind.export exports/cloud exports/cloud_lerobot --robot so100 \
        --depth-cameras corner,topview [--depth-size 64] [--depth-calibration realsense.json]   # a point-cloud policy

The folder: LeRobot's ``config.json`` (type ``fleetmind``, the export's features as LeRobot ``PolicyFeature`` s),
``policy_preprocessor.json`` / ``policy_postprocessor.json`` (``processor_fleetmind``) and the fleetmind export,
copied whole into ``fleetmind/`` (its sha256 sums are checked before and when loaded). Written out of sight and
renamed into place (``experience_dict.atomic.atomic_dir``).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from lerobot.configs.types import FeatureType, PolicyFeature

from lerobot_policy_fleetmind.configuration_fleetmind import EXPORT_SUBDIR, FleetmindConfig
from lerobot_policy_fleetmind.processor_fleetmind import make_fleetmind_pre_post_processors


def policy_features(meta: dict) -> tuple[dict[str, PolicyFeature], dict[str, PolicyFeature]]:
    """LeRobot's ``(input_features, output_features)`` from an ``export.json``: ``observation.state`` -> STATE,
    ``observation.environment_state`` -> ENV, ``observation.images.<cam>`` ``[H, W, 3]`` -> VISUAL ``(3, H, W)``,
    ``action`` -> ACTION ``(dim,)``.

    Raises:
        ValueError: an input LeRobot has no feature type for (names it).
    """
    inputs = {}
    for key, shape in meta["features"]["inputs"].items():
        if key.startswith("observation.images."):
            h, w, c = shape
            inputs[key] = PolicyFeature(type=FeatureType.VISUAL, shape=(c, h, w))
        elif key == "observation.state":
            inputs[key] = PolicyFeature(type=FeatureType.STATE, shape=tuple(shape))
        elif key == "observation.environment_state":
            inputs[key] = PolicyFeature(type=FeatureType.ENV, shape=tuple(shape))
        else:
            raise ValueError(f"export input {key!r}: no LeRobot feature type for it")
    outputs = {"action": PolicyFeature(type=FeatureType.ACTION, shape=(int(meta["features"]["action"]["dim"]),))}
    return inputs, outputs


def robot_features(meta: dict, robot: str, depth_cameras: list[str] | None = None, depth_size: int = 64,
                   ) -> tuple[dict[str, PolicyFeature], dict[str, PolicyFeature], list[str]]:
    """LeRobot's ``(input_features, output_features, action names)`` of a policy that drives ``robot``'s LeRobot
    robot directly (``robot="so100"``): ``observation.state`` STATE ``(6,)`` (the joint readings), the export's
    cameras as VISUAL, and ``action`` ``(6,)`` joint targets named ``<joint>.pos``. A point-cloud policy's
    ``observation.point_cloud`` (and ``observation.point_colors``) become the robot's depth images
    ``observation.images.<camera>_depth`` VISUAL ``(1, depth_size, depth_size)`` (and the aligned colour images
    ``<camera>_depth_rgb`` ``(3, depth_size, depth_size)``) of ``depth_cameras``: the bridge makes the cloud.

    Raises:
        ValueError: an unknown robot, an export that reads the object state (no real arm gives it), an export
            whose actions are not end-effector deltas (the bridge's check), or a point-cloud export without
            ``depth_cameras``.
    """
    from fleet.deploy.lerobot_bridge import (
        CLOUD_KEY,
        COLORS_KEY,
        DEPTH_RGB_SUFFIX,
        DEPTH_SUFFIX,
        EE_ACTION_NAMES,
        ENV_STATE_KEY,
        IMAGE_PREFIX,
        MOTOR_KEYS,
    )

    if robot != "so100":
        raise ValueError(f"--robot: expected so100 (SO-100 / SO-101 and the twin), given {robot!r}")
    raw = dict(meta["features"]["inputs"])
    cloud = {k: raw.pop(k) for k in (CLOUD_KEY, COLORS_KEY) if k in raw}
    if cloud and not depth_cameras:
        raise ValueError(f"--robot {robot}: the export reads {sorted(cloud)}; name the robot's depth cameras it was "
                         "made from (--depth-cameras corner,topview: the cameras of obs.point_cameras)")
    inputs, _ = policy_features({**meta, "features": {**meta["features"], "inputs": raw}})
    d = int(depth_size)
    for c in (depth_cameras or []) if cloud else []:
        inputs[f"{IMAGE_PREFIX}{c}{DEPTH_SUFFIX}"] = PolicyFeature(type=FeatureType.VISUAL, shape=(1, d, d))
        if COLORS_KEY in cloud:
            inputs[f"{IMAGE_PREFIX}{c}{DEPTH_RGB_SUFFIX}"] = PolicyFeature(type=FeatureType.VISUAL, shape=(3, d, d))
    if ENV_STATE_KEY in inputs:
        raise ValueError(f"--robot {robot}: the export reads {ENV_STATE_KEY!r} (the object state), which no LeRobot "
                         "robot gives a policy; export a policy that sees proprioception and cameras")
    names = list(meta["features"]["action"].get("names") or [])
    if names != EE_ACTION_NAMES:
        raise ValueError(f"--robot {robot}: the export's actions are {names}; the bridge drives end-effector "
                         f"actions {EE_ACTION_NAMES}")
    inputs = {**inputs, "observation.state": PolicyFeature(type=FeatureType.STATE, shape=(len(MOTOR_KEYS),))}
    outputs = {"action": PolicyFeature(type=FeatureType.ACTION, shape=(len(MOTOR_KEYS),))}
    return inputs, outputs, list(MOTOR_KEYS)


def twin_depth_calibration(cameras: list[str], depth_size: int = 64, unit_id: int | None = None,
                           fleet_robot: dict | None = None) -> dict[str, dict]:
    """``{camera: sim.pointcloud.DepthCamera.to_dict()}``: the SO-100 twin robot's (``fleetmind_so100_sim``; the
    nominal twin, or robot unit ``unit_id`` of ``fleet_robot``, whose cameras are jittered per unit) depth cameras at
    ``depth_size`` pixels, read from the twin itself (what it gives ``lerobot-rollout``).

    Raises:
        ValueError: a camera the twin does not have, or a unit ``fleet_robot`` does not name."""
    import tempfile

    from fleet.deploy.so100_sim_robot import FleetmindSO100Sim, FleetmindSO100SimConfig

    with tempfile.TemporaryDirectory() as tmp:
        robot = FleetmindSO100Sim(FleetmindSO100SimConfig(calibration_dir=Path(tmp), render_cameras=[],
                                                          depth_cameras=list(cameras), depth_size=int(depth_size),
                                                          unit_id=unit_id, fleet_robot=fleet_robot))
        robot.connect()
        try:
            return robot.depth_calibration()
        finally:
            robot.disconnect()


def export_for_lerobot(export_dir: str | Path, out_dir: str | Path, device: str = "cpu", use_critic: bool = True,
                       backend: str = "torch", overwrite: bool = False, robot: str | None = None,
                       depth_cameras: list[str] | None = None, depth_size: int = 64,
                       depth_calibration: dict[str, dict] | None = None) -> Path:
    """Write the LeRobot policy folder ``out_dir`` for the fleetmind export ``export_dir``; returns ``out_dir``.

    ``robot``: None (the policy's own features: ``lerobot-eval`` on fleetmind's or LeRobot's envs) or ``"so100"``
    (the policy drives an SO-100 / SO-101 LeRobot robot, the twin included, through fleetmind's deploy bridge:
    ``lerobot-rollout``; :func:`robot_features`). For a point-cloud policy: ``depth_cameras`` (the robot's depth
    cameras, in the order of the training's ``obs.point_cameras``), ``depth_size`` (their image side, pixels) and
    ``depth_calibration`` (``{camera: DepthCamera dict}``; None: the twin's, :func:`twin_depth_calibration`), saved
    in the config (``FleetmindConfig.depth_cameras``).

    Raises:
        FileNotFoundError / ValueError: ``export_dir`` is not a valid export (``policies.runtime.verify_export``:
            a missing file or a sha256 mismatch, named), a calibration that lacks a depth camera or does not parse;
            FileExistsError: ``out_dir`` exists and not ``overwrite``.
    """
    from experience_dict.atomic import atomic_dir
    from policies.runtime import verify_export

    export_dir, out_dir = Path(export_dir), Path(out_dir)
    meta = verify_export(export_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{str(out_dir)!r} exists (pass overwrite=True / --overwrite)")
    names, calib = None, None
    if robot is None:
        inputs, outputs = policy_features(meta)
    else:
        inputs, outputs, names = robot_features(meta, robot, depth_cameras, depth_size)
        if depth_cameras and "observation.point_cloud" in meta["features"]["inputs"]:
            from sim.pointcloud import DepthCamera

            given = depth_calibration if depth_calibration is not None else twin_depth_calibration(depth_cameras,
                                                                                                   depth_size)
            lacks = [c for c in depth_cameras if c not in given]
            if lacks:
                raise ValueError(f"--depth-calibration: no calibration for depth cameras {lacks} (given {sorted(given)})")
            calib = {c: DepthCamera.from_dict(dict(given[c])).to_dict() for c in depth_cameras}
    cfg = FleetmindConfig(device=device, input_features=inputs, output_features=outputs, push_to_hub=False,
                          use_critic=use_critic, backend=backend, robot_bridge=robot, action_feature_names=names,
                          depth_cameras=calib)
    pre, post = make_fleetmind_pre_post_processors(cfg)
    with atomic_dir(out_dir) as tmp:
        cfg._save_pretrained(tmp)
        pre.save_pretrained(tmp)
        post.save_pretrained(tmp)
        shutil.copytree(export_dir, tmp / EXPORT_SUBDIR)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m lerobot_policy_fleetmind.export", description=__doc__.split("\n")[0])
    ap.add_argument("export_dir", help="a fleetmind export (scripts/export.py)")
    ap.add_argument("out_dir", help="the LeRobot policy folder to write (lerobot-eval --policy.path=...)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="torch", choices=["torch", "onnx", "auto"])
    ap.add_argument("--no-critic", dest="use_critic", action="store_false",
                    help="act with the policy alone even if the export has a success critic")
    ap.add_argument("--robot", choices=["so100"], default=None,
                    help="drive this LeRobot robot directly: joint readings in, joint targets out "
                         "(lerobot-rollout --robot.type=so100_follower | fleetmind_so100_sim)")
    ap.add_argument("--depth-cameras", default=None,
                    help="with --robot, a point-cloud policy: the robot's depth cameras, comma-separated, in the order "
                         "of the training's obs.point_cameras (the robot gives <camera>_depth images)")
    ap.add_argument("--depth-size", type=int, default=64, help="the depth images' side, pixels (obs.point_image_size)")
    ap.add_argument("--depth-calibration", default=None,
                    help="a JSON file {camera: {fx, fy, cx, cy, base_from_camera (4x4, metres), depth_scale}} of a "
                         "real robot's depth cameras (default: the SO-100 twin's)")
    ap.add_argument("--overwrite", action="store_true")
    a = ap.parse_args(argv)
    try:
        import json

        cams = [c for c in (a.depth_cameras or "").split(",") if c] or None
        calib = json.loads(Path(a.depth_calibration).read_text()) if a.depth_calibration else None
        out = export_for_lerobot(a.export_dir, a.out_dir, a.device, a.use_critic, a.backend, a.overwrite, a.robot,
                                 depth_cameras=cams, depth_size=a.depth_size, depth_calibration=calib)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        raise SystemExit(f"error: {e}") from e
    how = "lerobot-rollout --strategy.type=base" if a.robot else "lerobot-eval"
    print(f"wrote {out} ({how} --policy.path={out} ...)")


if __name__ == "__main__":
    main()
