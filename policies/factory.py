"""One place that knows the policy types: make a fresh policy from its config, load a saved one.

    from policies.factory import make_policy, load_policy
    policy = make_policy(cfg["policy"], reader, episodes)    # Hydra policy node, "type" picks the class
    policy = load_policy("outputs/.../pretrained_model")     # config.json "type" picks the class

Adding a policy: a package ``policies/<name>/`` whose class implements ``policies.base.Policy``, one line in
``POLICY_TYPES`` and a ``configs/policy/<name>.yaml`` with ``type: <name>``. Nothing in ``fleet/`` or
``scripts/`` changes. The scripted expert and the random policy are not learned policies and are not here
(``fleet.acting``).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from experience_dict.atomic import atomic_dir

# config.json / Hydra "type" -> "module:Class" (imported lazily: expert and random workers never import torch)
POLICY_TYPES: dict[str, str] = {
    "aed_diffusion": "policies.aed_diffusion.modeling_aed_diffusion:AEDDiffusionPolicy",
    "mlp_chunk": "policies.mlp_chunk.modeling_mlp_chunk:MLPChunkPolicy",
}
DEFAULT_TYPE = "aed_diffusion"   # a checkpoint whose config.json has no "type" (written before types existed)


def policy_class(ptype: str) -> type:
    """The class registered for ``ptype``.

    Raises:
        KeyError: an unknown type (the message lists the known ones).
    """
    if ptype not in POLICY_TYPES:
        raise KeyError(f"unknown policy type {ptype!r}; known: {sorted(POLICY_TYPES)}")
    module, cls = POLICY_TYPES[ptype].split(":")
    return getattr(importlib.import_module(module), cls)


def policy_type(directory: str | Path) -> str:
    """The ``type`` of a saved policy directory (``config.json``; ``DEFAULT_TYPE`` when absent).

    Raises:
        FileNotFoundError: no ``config.json``. ValueError: ``config.json`` is not a JSON object.
    """
    f = Path(directory) / "config.json"
    if not f.is_file():
        raise FileNotFoundError(f"checkpoint {str(directory)!r} has no config.json")
    try:
        cfg = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"checkpoint {str(directory)!r}: config.json is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"checkpoint {str(directory)!r}: config.json is not a JSON object")  # noqa: TRY004 (bad file content)
    return str(cfg.get("type", DEFAULT_TYPE))


def load_policy(directory: str | Path, device: str = "cpu") -> Any:
    """Load a saved policy (any registered type) in eval mode on ``device``.

    Raises:
        FileNotFoundError: no ``config.json`` or a missing weight file. KeyError: an unknown type.
        ValueError: weights that do not fit the config (from the class's ``from_pretrained``).
    """
    return policy_class(policy_type(directory)).from_pretrained(directory, device=device)


def make_policy(cfg: dict, reader, episodes) -> Any:
    """A fresh policy from the Hydra ``policy`` node ``cfg`` (``type`` picks the class; default
    ``aed_diffusion``) with shapes from ``reader``'s features and statistics over ``episodes``.

    Raises:
        KeyError: an unknown type. ValueError: a bad config value (from the class's ``build``).
    """
    cfg = dict(cfg)
    ptype = str(cfg.get("type", DEFAULT_TYPE))
    if ptype in ("expert", "random"):
        raise ValueError(f"policy type {ptype!r} is not learned; give a learned policy (known: {sorted(POLICY_TYPES)})")
    return policy_class(ptype).build(cfg, reader, episodes)


def interpolate_checkpoint(init_dir: str | Path, tuned_dir: str | Path, alpha: float, out_dir: str | Path) -> Path:
    """Weight-space interpolation of a fine-tuned policy toward the policy it started from (WiSE-FT: Wortsman
    et al., "Robust fine-tuning of zero-shot models", CVPR 2022): every floating-point tensor of
    ``model.safetensors`` becomes ``init + alpha * (tuned - init)`` (computed in float32, stored in the tuned
    tensor's dtype); other tensors and every other file (``config.json``, statistics, tokenizer) come from
    ``tuned_dir``. ``alpha = 1`` is the fine-tuned policy, ``0`` the initial one. Written to ``out_dir``
    atomically (a temporary sibling renamed into place); an existing ``out_dir`` is replaced.

    Args:
        init_dir, tuned_dir: ``pretrained_model`` directories of the same policy type and architecture.
        alpha: weight of the fine-tuning update, in [0, 1].
        out_dir: the interpolated ``pretrained_model`` directory.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ValueError: ``alpha`` outside [0, 1]; the two policies differ in type, tensor names, shapes or dtypes
            (the message names the first difference).
        FileNotFoundError: a missing ``config.json`` or ``model.safetensors``.
    """
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    alpha = float(alpha)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"interpolate_checkpoint: alpha must be in [0, 1], given {alpha}")
    init_dir, tuned_dir, out_dir = Path(init_dir), Path(tuned_dir), Path(out_dir)
    if policy_type(init_dir) != policy_type(tuned_dir):
        raise ValueError(f"interpolate_checkpoint: policy types differ ({policy_type(init_dir)!r} at {init_dir}, "
                         f"{policy_type(tuned_dir)!r} at {tuned_dir})")
    for d in (init_dir, tuned_dir):
        if not (d / "model.safetensors").is_file():
            raise FileNotFoundError(f"checkpoint {str(d)!r} has no model.safetensors")
    a, b = load_file(str(init_dir / "model.safetensors")), load_file(str(tuned_dir / "model.safetensors"))
    if a.keys() != b.keys():
        diff = sorted(a.keys() ^ b.keys())
        raise ValueError(f"interpolate_checkpoint: tensor names differ between {init_dir} and {tuned_dir}: "
                         f"{diff[:5]}{' ...' if len(diff) > 5 else ''}")
    out = {}
    for k, t in b.items():
        if a[k].shape != t.shape or a[k].dtype != t.dtype:
            raise ValueError(f"interpolate_checkpoint: tensor {k!r} is {tuple(a[k].shape)} {a[k].dtype} in {init_dir} "
                             f"but {tuple(t.shape)} {t.dtype} in {tuned_dir}")
        if t.is_floating_point():
            a32 = a[k].to(torch.float32)
            out[k] = (a32 + alpha * (t.to(torch.float32) - a32)).to(t.dtype).contiguous()
        else:
            out[k] = t.contiguous()
    with atomic_dir(out_dir) as tmp:
        shutil.copytree(tuned_dir, tmp, ignore=shutil.ignore_patterns("model.safetensors"), dirs_exist_ok=True)
        save_file(out, str(tmp / "model.safetensors"))
    return out_dir


def deployed_checkpoint(alpha: float | None, init_dir: str | Path, tuned_dir: str | Path, out_dir: str | Path) -> str:
    """The policy a fine-tuning run hands on (``learner.wise_alpha``): ``tuned_dir`` itself when ``alpha`` is None,
    else ``interpolate_checkpoint(init_dir, tuned_dir, alpha, out_dir)``. Raises as ``interpolate_checkpoint``."""
    if alpha is None:
        return str(tuned_dir)
    return str(interpolate_checkpoint(init_dir, tuned_dir, float(alpha), out_dir))
