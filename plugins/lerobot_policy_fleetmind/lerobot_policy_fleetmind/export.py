"""Write a LeRobot policy folder (``--policy.path=``) from a fleetmind export.

    python -m lerobot_policy_fleetmind.export exports/reach exports/reach_lerobot [--device cpu] [--no-critic]
    python -m lerobot_policy_fleetmind.export exports/twin exports/twin_lerobot --robot so100   # lerobot-rollout

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


def robot_features(meta: dict, robot: str) -> tuple[dict[str, PolicyFeature], dict[str, PolicyFeature], list[str]]:
    """LeRobot's ``(input_features, output_features, action names)`` of a policy that drives ``robot``'s LeRobot
    robot directly (``robot="so100"``): ``observation.state`` STATE ``(6,)`` (the joint readings), the export's
    cameras as VISUAL, and ``action`` ``(6,)`` joint targets named ``<joint>.pos``.

    Raises:
        ValueError: an unknown robot, an export that reads the object state (no real arm gives it), or an export
            whose actions are not end-effector deltas (the bridge's check).
    """
    from fleet.deploy.lerobot_bridge import EE_ACTION_NAMES, ENV_STATE_KEY, MOTOR_KEYS

    if robot != "so100":
        raise ValueError(f"--robot: expected so100 (SO-100 / SO-101 and the twin), given {robot!r}")
    inputs, _ = policy_features(meta)
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


def export_for_lerobot(export_dir: str | Path, out_dir: str | Path, device: str = "cpu", use_critic: bool = True,
                       backend: str = "torch", overwrite: bool = False, robot: str | None = None) -> Path:
    """Write the LeRobot policy folder ``out_dir`` for the fleetmind export ``export_dir``; returns ``out_dir``.

    ``robot``: None (the policy's own features: ``lerobot-eval`` on fleetmind's or LeRobot's envs) or ``"so100"``
    (the policy drives an SO-100 / SO-101 LeRobot robot, the twin included, through fleetmind's deploy bridge:
    ``lerobot-rollout``; :func:`robot_features`).

    Raises:
        FileNotFoundError / ValueError: ``export_dir`` is not a valid export (``policies.runtime.verify_export``:
            a missing file or a sha256 mismatch, named); FileExistsError: ``out_dir`` exists and not ``overwrite``.
    """
    from experience_dict.atomic import atomic_dir
    from policies.runtime import verify_export

    export_dir, out_dir = Path(export_dir), Path(out_dir)
    meta = verify_export(export_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{str(out_dir)!r} exists (pass overwrite=True / --overwrite)")
    names = None
    if robot is None:
        inputs, outputs = policy_features(meta)
    else:
        inputs, outputs, names = robot_features(meta, robot)
    cfg = FleetmindConfig(device=device, input_features=inputs, output_features=outputs, push_to_hub=False,
                          use_critic=use_critic, backend=backend, robot_bridge=robot, action_feature_names=names)
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
    ap.add_argument("--overwrite", action="store_true")
    a = ap.parse_args(argv)
    try:
        out = export_for_lerobot(a.export_dir, a.out_dir, a.device, a.use_critic, a.backend, a.overwrite, a.robot)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        raise SystemExit(f"error: {e}") from e
    how = "lerobot-rollout --strategy.type=base" if a.robot else "lerobot-eval"
    print(f"wrote {out} ({how} --policy.path={out} ...)")


if __name__ == "__main__":
    main()
