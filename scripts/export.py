"""Export a policy checkpoint (directory or registry version) to a self-contained deployment folder.

    python scripts/export.py deploy.export.checkpoint=outputs/train_quick deploy.export.out_dir=exports/push
    python scripts/export.py deploy.export.version=3 deploy.export.success_table=outputs/eval/table.json
    python scripts/export.py deploy.export.registry_url=outputs/run/seed_0/registry deploy.export.out_dir=exports/v \
        deploy.export.lerobot_dir=lerobot/fleetmind_v deploy.export.lerobot_robot=so100   # + a LeRobot policy folder

Writes weights (safetensors), config, normalization stats, tokenizer, ``export.json`` and a model card
(``README.md``); load the folder with ``policies.runtime.PolicyRuntime.load``. See ``policies.export``.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

import hydra
from omegaconf import DictConfig

import configs.typed  # noqa: F401 - registers the typed config groups before Hydra composes
from fleet.deploy.config import ExportConfig
from fleet.progress import calm_progress
from fleet.refusals import one_line_refusals
from policies.threads import passive_wait

passive_wait()   # before torch loads: OpenMP's idle threads sleep instead of spinning (policies/threads.py)
calm_progress()  # off a terminal, a progress bar redraws every 30 s, not 15 times a second (fleet/progress.py)

from policies.aed_diffusion.training import last_checkpoint
from policies.export import export_checkpoint, training_provenance

log = logging.getLogger("export")


def resolve_checkpoint(path: str | Path) -> Path:
    """A ``pretrained_model`` dir as given, or a training run dir's newest checkpoint. Raises FileNotFoundError."""
    p = Path(path)
    if (p / "config.json").is_file():
        return p
    last = last_checkpoint(p)
    if last is not None and (last / "pretrained_model" / "config.json").is_file():
        return last / "pretrained_model"
    raise FileNotFoundError(f"export.checkpoint {str(p)!r}: neither a checkpoint dir (config.json) nor a training "
                            "run dir (checkpoints/last.json)")


def store_control_hz(ckpt: Path) -> float | None:
    """The control rate of the store the checkpoint was trained on (``train_summary.json``, else the store named
    by the run's Hydra config), or None."""
    prov = training_provenance(ckpt)
    if prov.get("control_hz") is not None:
        return float(prov["control_hz"])
    store = prov.get("store")
    if not store:
        return None
    try:
        from experience_dict.store import ExperienceStore

        return float(ExperienceStore.open(str(store)).control_hz)
    except Exception as e:  # noqa: BLE001 - provenance only: the store may have moved
        log.warning("could not read control_hz from store %r: %s", store, e)
        return None


def onnx_steps(given, ckpt: Path) -> list[int]:
    """``deploy.export.onnx_steps`` resolved: a given list as is; null -> the checkpoint's own
    ``num_inference_steps`` when its policy type has a chunk graph (``policies.onnx``), else none."""
    if given is not None:
        return [int(n) for n in given]
    from policies.factory import policy_class, policy_type

    cfg = json.loads((ckpt / "config.json").read_text())
    has_graph = hasattr(policy_class(policy_type(ckpt)), "chunk_graph")
    return [int(cfg["num_inference_steps"])] if has_graph and "num_inference_steps" in cfg else []


def lerobot_depth_sensors(ecfg, meta: dict) -> tuple[list[str] | None, int]:
    """The robot's depth cameras and their image side (pixels) for a point-cloud export's LeRobot folder: as given
    (``deploy.export.lerobot_depth_cameras`` / ``lerobot_depth_size``), else what the policy was trained on
    (``export.json`` ``training.point_cloud``: a published version's lineage, or the training run's config).

    Raises:
        SystemExit: the given cameras are not the ones the policy was trained on (a cloud from other cameras is
            another observation)."""
    pc = (meta.get("training") or {}).get("point_cloud") or {}
    given = list(ecfg.lerobot_depth_cameras or [])
    if given and pc.get("cameras") and given != list(pc["cameras"]):
        raise SystemExit(f"export: deploy.export.lerobot_depth_cameras={given}, but the policy was trained on the "
                         f"point cloud of {pc['cameras']} (in that order); leave it unset to use them")
    cams = given or list(pc.get("cameras") or []) or None
    size = ecfg.lerobot_depth_size if ecfg.lerobot_depth_size is not None else pc.get("image_size")
    if isinstance(size, list):   # [height, width]: LeRobot's depth features here are square
        if len(set(size)) != 1:
            raise SystemExit(f"export: the policy's depth images are {size[0]} x {size[1]} pixels; the LeRobot folder "
                             "takes square ones (deploy.export.lerobot_depth_size)")
        size = size[0]
    return cams, int(size if size is not None else 64)


@hydra.main(version_base=None, config_path="../configs", config_name="config")
@one_line_refusals("export")   # a refusal (store, registry, policy): one line, exit 2, the trace in the run's log
def main(cfg: DictConfig) -> None:
    from configs.schema import check_or_exit

    check_or_exit(cfg)   # every value against its rule, before any work
    if "deploy" not in cfg:
        raise SystemExit("compose the deploy group: python scripts/export.py deploy.export....")
    ecfg = ExportConfig.from_dict(cfg.deploy.export)
    table = json.loads(Path(ecfg.success_table).read_text()) if ecfg.success_table else None
    with tempfile.TemporaryDirectory() as tmp:
        training = None
        if ecfg.checkpoint:
            ckpt, source = resolve_checkpoint(ecfg.checkpoint), None
        else:
            from fleet.registry import CheckpointRegistry

            reg = CheckpointRegistry(str(ecfg.registry_url))
            version = None if str(ecfg.version) == "latest" else int(ecfg.version)
            ckpt = reg.fetch(version, Path(tmp) / "ckpt")
            manifest = json.loads((ckpt / "MANIFEST.json").read_text())
            md = manifest.get("metadata") or {}
            source = {"kind": "registry", "path": str(ecfg.registry_url), "registry_url": str(ecfg.registry_url),
                      "version": manifest["version"], "metadata": md}
            # what the fleet published with the version (fleet.lineage): its rate, tasks, store and parent
            training = {k: md.get(k) for k in ("control_hz", "tasks", "store", "store_episodes", "store_demos",
                                               "parent_version", "point_cloud")}
        hz = ecfg.control_hz if ecfg.control_hz is not None else (training or {}).get("control_hz")
        hz = hz if hz is not None else store_control_hz(ckpt)
        if hz is None:
            log.warning("export: no control rate recorded for %s (not in its registry metadata, training summary or "
                        "store); set deploy.export.control_hz=<Hz>: the deployer refuses an export without one",
                        ecfg.checkpoint or f"{ecfg.registry_url} version {ecfg.version}")
        out = export_checkpoint(ckpt, ecfg.out_dir, control_hz=hz, success_table=table, source=source,
                                training=training, overwrite=bool(ecfg.overwrite), onnx_steps=onnx_steps(ecfg.onnx_steps, ckpt),
                                onnx_batch_size=int(ecfg.onnx_batch_size), onnx_optimize=bool(ecfg.onnx_optimize))
    meta = json.loads((out / "export.json").read_text())
    summary = {"export_dir": str(out), "files": sorted(meta["files"]), "parameters": meta["parameters"],
               "control_hz": meta["control_hz"], "git": meta["git"]}
    if meta["source"].get("version") is not None:   # 'latest' resolved: the registry version exported
        summary["version"] = meta["source"]["version"]
    if ecfg.lerobot_dir:   # the LeRobot policy folder of the same export, in the same command
        try:
            from lerobot_policy_fleetmind.export import export_for_lerobot
        except ImportError as e:
            raise SystemExit(f"export: deploy.export.lerobot_dir needs fleetmind's LeRobot plugins ({e}); install "
                             "them with `make install` (the lerobot extra and plugins/)") from None
        cams, size = lerobot_depth_sensors(ecfg, meta)
        try:
            summary["lerobot_dir"] = str(export_for_lerobot(
                out, ecfg.lerobot_dir, overwrite=bool(ecfg.overwrite), robot=ecfg.lerobot_robot,
                depth_cameras=cams, depth_size=size))
        except ValueError as e:
            raise SystemExit(f"export: the fleetmind export is in {out}; its LeRobot folder was not written: {e} "
                             "(deploy.export.lerobot_depth_cameras=[...] for a point-cloud policy)") from None
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
