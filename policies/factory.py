"""One place that knows the policy types: make a fresh policy from its config, load a saved one.

    from policies.factory import make_policy, load_policy
    policy = make_policy(cfg["policy"], reader, episodes)    # Hydra policy node, "type" picks the class
    policy = load_policy("outputs/.../pretrained_model")     # config.json "type" picks the class

Adding a policy: a package ``policies/<name>/`` whose class implements ``policies.base.Policy``, one line in
``POLICY_TYPES`` and a ``configs/policy/<name>.yaml`` with ``type: <name>``. Nothing in ``fleet/`` or
``scripts/`` changes. The scripted expert and the random policy are not learned policies and are not here
(``fleet.policies``).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

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
