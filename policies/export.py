"""Export a policy checkpoint to a self-contained deployment folder (loaded by ``policies.runtime``).

Writes the checkpoint's files (``config.json``, ``model.safetensors``, ``stats.json``, ``tokenizer.json``),
``export.json`` (format, features, action names, control rate, training provenance, source, git commit and
sha256 of every file) and a model card ``README.md``. The checkpoint is loaded once before anything is written,
so a broken checkpoint never becomes an export. ``scripts/export.py`` resolves registry versions and calls this.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from experience_dict.atomic import atomic_dir
from policies.runtime import EXPORT_FORMAT, EXPORT_META, MODEL_CARD, sha256_file

# the policy's files, and the success critic FERT ships beside them (policies/critic.py) and a noise actor
# (policies/noise_actor.py), copied when present
CHECKPOINT_FILES = ("config.json", "model.safetensors", "stats.json", "tokenizer.json", "critic.safetensors",
                    "critic.json", "noise_actor.safetensors", "noise_actor.json")
ACTION_NAMES = ["dx", "dy", "dz", "gripper"]  # docs/INTERFACES.md action spec (4-d end-effector actions)


def git_commit(repo: str | Path | None = None) -> dict[str, Any]:
    """``{"commit": sha or None, "dirty": bool or None}`` of the repository at ``repo`` (default: this file's)."""
    cwd = Path(repo) if repo else Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10,
                             check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                                    capture_output=True, text=True, timeout=10, check=True).stdout.strip())
        return {"commit": sha, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def training_provenance(checkpoint_dir: Path) -> dict[str, Any]:
    """What the checkpoint was trained on, read from the training run around a ``.../checkpoints/<step>/
    pretrained_model`` directory (all optional): ``step`` (``training_state/state.json``), ``run_dir``,
    ``train_summary`` (``train_summary.json``: episodes, parameters, last metrics), ``tasks`` and ``store``
    (Hydra's ``.hydra/config.yaml`` of the run, else ``train_summary.json``), ``control_hz`` (Hz, the training
    store's control rate as ``scripts/train.py`` records it in ``train_summary.json``), ``point_cloud`` (the depth
    cameras of a point-cloud observation, ``configs.sim_groups.point_cloud_sensors``, from the Hydra config)."""
    out: dict[str, Any] = {}
    ckpt = checkpoint_dir.parent
    state = ckpt / "training_state" / "state.json"
    if state.is_file():
        out["step"] = json.loads(state.read_text()).get("step")
    if ckpt.parent.name == "checkpoints":
        run = ckpt.parent.parent
        out["run_dir"] = str(run)
        summary = run / "train_summary.json"
        if summary.is_file():
            s = json.loads(summary.read_text())
            out["train_summary"] = {k: s.get(k) for k in ("step", "episodes", "parameters", "last_metrics")}
            for k in ("tasks", "store", "control_hz"):
                if s.get(k) is not None:
                    out[k] = s[k]
        hydra_cfg = run / ".hydra" / "config.yaml"
        if hydra_cfg.is_file():
            from omegaconf import OmegaConf  # only when the run was a Hydra app

            c = OmegaConf.to_container(OmegaConf.load(hydra_cfg), resolve=False)
            out.setdefault("tasks", list((c.get("task") or {}).get("tasks") or []))
            out.setdefault("store", (c.get("store") or {}).get("url"))
            from configs.sim_groups import point_cloud_sensors

            if (pc := point_cloud_sensors(c.get("obs"))) is not None:
                out.setdefault("point_cloud", pc)
    return out


def _success_markdown(table: Any) -> str:
    """Markdown of a success table: ``{row: {column: value}}``, ``{row: value}`` or a list of row dicts."""
    if isinstance(table, dict) and all(not isinstance(v, dict) for v in table.values()):
        table = {k: {"success_rate": v} for k, v in table.items()}
    if isinstance(table, list):
        table = {str(i): r for i, r in enumerate(table)}
    if not isinstance(table, dict) or not table:
        raise ValueError(f"success table: expected a non-empty dict or list of rows, given {type(table).__name__}")
    cols = list(dict.fromkeys(c for r in table.values() for c in r))
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else ("" if v is None else str(v))
    lines = ["| | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    lines += [f"| {k} | " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for k, r in table.items()]
    return "\n".join(lines)


def model_card(meta: dict[str, Any], success_table: Any = None) -> str:
    """The export's README.md (model card) from its ``export.json`` metadata and an optional success table."""
    cfg, tr, src, git = meta["policy_config"], meta.get("training", {}), meta.get("source", {}), meta["git"]
    feats = "\n".join(f"- `{k}`: shape {v}" for k, v in meta["features"]["inputs"].items())
    act = meta["features"]["action"]
    aed = cfg.get("aed") or {}
    lines = [
        f"# fleetmind policy: {meta['policy_type']}", "",
        (f"Exported {meta['created']} by `scripts/export.py` (format `{EXPORT_FORMAT}`). Load it with "
        "`policies.runtime.PolicyRuntime.load(<this folder>)`: torch, safetensors and numpy (a diffusion policy "
        "also diffusers' DDIM scheduler and HF tokenizers); no Ray, MuJoCo, Hydra or wandb."), "",
        "## Inputs and outputs", feats,
        (f"- `action`: shape [{act['dim']}] ({', '.join(act['names'])}); relative dims {act['relative_dims']}, "
        f"absolute dims {act['absolute_dims']}; a chunk of {cfg['horizon']} actions, {cfg['n_action_steps']} "
        "executed per prediction"),
        f"- control rate: {meta.get('control_hz') or 'unknown'} Hz; history: {cfg.get('n_obs_steps', 1)} observation "
        f"frame(s)" + (f", {aed['history_actions']} past actions (AED)" if aed.get("enabled") else ""),
        (f"- DDIM denoising steps: {cfg['num_inference_steps']} (of {cfg['num_train_timesteps']} training "
         "timesteps)" if "num_inference_steps" in cfg else "- one forward pass per chunk (no denoising)")
        + f"; parameters: {meta['parameters']:,}", "",
        "## Training",
        f"- source: {src.get('kind', '?')} `{src.get('path')}`"
        + (f", registry `{src['registry_url']}` version {src['version']}" if src.get("version") is not None else ""),
        f"- tasks: {', '.join(tr['tasks']) if tr.get('tasks') else 'not recorded'}",
        f"- store: `{tr.get('store') or 'not recorded'}`; step: {tr.get('step', 'not recorded')}",
    ]
    if tr.get("store_episodes") is not None:
        lines.append(f"- the store when this version was published: {tr['store_episodes']} episodes "
                     f"({tr.get('store_demos', '?')} demonstrations)")
    if "parent_version" in tr:
        lines.append("- fine-tuned from: " + (f"version {tr['parent_version']}" if tr["parent_version"] is not None
                                                else "demonstrations (a base)"))
    if tr.get("train_summary"):
        lines.append(f"- run summary: `{json.dumps(tr['train_summary'])}`")
    if src.get("metadata"):
        lines.append(f"- registry metadata: `{json.dumps(src['metadata'])}`")
    if "state_norm" in cfg:
        lines += [f"- normalization: `stats.json` (state {cfg['state_norm']}, action {cfg['action_norm']})"]
    lines += [""]
    lines += ["## Success", _success_markdown(success_table) if success_table is not None else
              "No success table was given at export time.", ""]
    lines += ["## Code", f"- git commit: `{git['commit']}`" + (" (uncommitted changes)" if git["dirty"] else ""), ""]
    return "\n".join(lines)


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path, *, control_hz: float | None = None,
                      success_table: Any = None, source: dict[str, Any] | None = None,
                      training: dict[str, Any] | None = None, overwrite: bool = False, onnx_steps: list[int] | None = None, onnx_batch_size: int = 1,
                      onnx_optimize: bool = True) -> Path:
    """Export ``checkpoint_dir`` (a ``save_pretrained`` folder) to ``out_dir``; returns ``out_dir``.

    Args:
        control_hz: the control rate the policy was trained at (Hz), recorded for deployment.
        success_table: JSON-able success table for the model card (``{task: {column: value}}``, ...).
        source: provenance (``{"kind": "checkpoint" | "registry", "path", "registry_url", "version",
            "metadata"}``).
        training: what the checkpoint was trained on, over what its run directory says
            (:func:`training_provenance`): e.g. a registry version's ``tasks``, ``store``, ``control_hz``,
            ``store_episodes`` and ``parent_version`` (``fleet.lineage``).
        overwrite: replace an existing ``out_dir``.
        onnx_steps: DDIM step counts to also export the chunk sampler for as ONNX graphs
            (``policies.onnx.export_onnx``; ``onnx/chunk_ddim<steps>_b<batch>.onnx``, each checked against
            PyTorch, listed under ``export.json`` ``onnx``), which ``PolicyRuntime`` runs in ONNX Runtime.
            None / []: none.
        onnx_batch_size: the graphs' batch size (1: one robot). onnx_optimize: see ``export_onnx``.
    Raises:
        FileNotFoundError: a checkpoint file is missing. FileExistsError: ``out_dir`` exists and not
        ``overwrite``. ValueError: the checkpoint does not load (from its class's ``from_pretrained``).
        KeyError: an unknown policy type (``policies.factory``).
    """
    from policies.factory import load_policy

    src, out = Path(checkpoint_dir), Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"export folder {out} exists (pass overwrite=True / export.overwrite=true)")
    policy = load_policy(src)  # any registered type; validates names, shapes, stats (and tokenizer)
    cfg = policy.config
    files = [f for f in CHECKPOINT_FILES if (src / f).is_file()]
    with atomic_dir(out) as tmp:
        for f in files:
            shutil.copy2(src / f, tmp / f)
        graphs = []
        if onnx_steps:
            from policies.onnx import export_onnx, graph_name

            for steps in dict.fromkeys(int(n) for n in onnx_steps):
                rel = graph_name(steps, onnx_batch_size)
                graphs.append({"file": rel, **export_onnx(policy, tmp / rel, steps, onnx_batch_size, onnx_optimize)})
                files.append(rel)
        meta = {
            "format": EXPORT_FORMAT, "policy_type": policy.name,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "features": {"inputs": cfg.input_shapes,
                         "action": {"dim": cfg.action_dim, "names": ACTION_NAMES[:cfg.action_dim]
                                    if cfg.action_dim == len(ACTION_NAMES) else [f"a{i}" for i in range(cfg.action_dim)],
                                    "relative_dims": list(getattr(cfg, "relative_action_dims", [])),
                                    "absolute_dims": list(getattr(cfg, "absolute_action_dims", []))}},
            "control_hz": None if control_hz is None else float(control_hz),
            "parameters": policy.num_parameters(), "policy_config": cfg.to_dict(),
            "training": {**training_provenance(src), **{k: v for k, v in (training or {}).items()
                                                        if v is not None or k == "parent_version"}},
            "source": {"kind": "checkpoint", "path": str(src), **(source or {})},
            "git": git_commit(), "success_table": success_table,
            "files": {f: sha256_file(tmp / f) for f in files},
        }
        if graphs:
            meta["onnx"] = graphs
        (tmp / EXPORT_META).write_text(json.dumps(meta, indent=1))
        (tmp / MODEL_CARD).write_text(model_card(meta, success_table))
    return out
