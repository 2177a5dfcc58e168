"""Write a LeRobot policy folder (``--policy.path=``) from a fleetmind export.

    python -m lerobot_policy_fleetmind.export exports/reach exports/reach_lerobot [--device cpu] [--no-critic]

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


def export_for_lerobot(export_dir: str | Path, out_dir: str | Path, device: str = "cpu", use_critic: bool = True,
                       backend: str = "torch", overwrite: bool = False) -> Path:
    """Write the LeRobot policy folder ``out_dir`` for the fleetmind export ``export_dir``; returns ``out_dir``.

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
    inputs, outputs = policy_features(meta)
    cfg = FleetmindConfig(device=device, input_features=inputs, output_features=outputs, push_to_hub=False,
                          use_critic=use_critic, backend=backend)
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
    ap.add_argument("--overwrite", action="store_true")
    a = ap.parse_args(argv)
    try:
        out = export_for_lerobot(a.export_dir, a.out_dir, a.device, a.use_critic, a.backend, a.overwrite)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        raise SystemExit(f"error: {e}") from e
    print(f"wrote {out} (lerobot-eval --policy.path={out} ...)")


if __name__ == "__main__":
    main()
