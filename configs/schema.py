"""The config's value rules, checked before any work: every script calls :func:`check` on its composed config.

A wrong value fails at once, with one line per problem naming the key, what it expects and what it was given
(``fleet.units: expected an integer >= 1, given 'two'``), instead of deep inside Ray, torch or zarr. Keys not
listed here are free (their owners check them); a listed key missing from the config is skipped (scripts compose
the whole tree, tests sometimes part of it).
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from configs import typed
from configs.rules import (
    POS,
    ConfigError,
    Rule,
    boolean,
    int_list,
    integer,
    number,
    one_of,
    optional,
)
from policies.factory import POLICY_TYPES


def store_url(v) -> str | None:
    """A URL with a scheme passes (fsspec checks it when opened); a local path must be a directory or creatable:
    its nearest existing ancestor a writable directory."""
    if not isinstance(v, str) or not v:
        return "a store URL or directory path"
    if "://" in v and not v.startswith("file://"):
        return None
    p = Path(v.removeprefix("file://")).expanduser().absolute()
    if p.exists():
        return None if p.is_dir() else "a directory (a file is in the way)"
    anc = next((a for a in p.parents if a.exists()), None)
    if anc is None or not anc.is_dir():
        return f"a creatable directory ({anc} is not a directory)"
    try:   # a real test (os.access says yes to root on read-only or virtual filesystems); leaves nothing behind
        os.rmdir(tempfile.mkdtemp(prefix=".fleetmind-check-", dir=anc))
    except OSError as e:
        return f"a creatable directory (cannot create anything in {anc}: {e.strerror})"
    return None


RULES: dict[str, Rule] = {
    "seed": integer(0),
    "device": one_of("auto", "cpu", "cuda"),
    "store.url": store_url,
    "policy.type": one_of(*POLICY_TYPES, "expert", "random"),   # learned types: policies.factory
    # what reaches a model: the policy's shape and sampler (policies.aed_diffusion.AEDDiffusionConfig, mlp_chunk)
    "policy.action_dim": POS, "policy.n_obs_steps": POS, "policy.horizon": POS, "policy.n_action_steps": POS,
    "policy.dim": POS, "policy.n_layers": POS, "policy.n_heads": POS, "policy.mlp_ratio": number(0, open_lo=True),
    "policy.dropout": number(0, 1), "policy.action_patch": POS, "policy.condition_layers": optional(integer(0)),
    "policy.state_hidden": POS, "policy.hidden_dim": POS, "policy.image_pool": POS,
    "policy.point_channels": int_list(1), "policy.point_relative": boolean,
    "policy.num_train_timesteps": POS, "policy.num_inference_steps": POS,
    "policy.aed.history_actions": POS, "policy.aed.group_size": POS, "policy.aed.memory_queries": POS,
    "policy.aed.memory_layers": integer(0), "policy.aed.tokenizer_scale": number(0, open_lo=True),
    "policy.aed.tokenizer_vocab_size": POS, "policy.mt_loss.weight": number(0),
    "policy.mt_loss.decoder_layers": POS, "policy.mt_loss.image_feature_dim": POS,
    # what reaches a robot (real or simulated): episode length, safety limits, variation, the policy server
}


def _ints(cfg: Mapping, *keys: str) -> list[int] | None:
    vals = [_get(cfg, k) for k in keys]
    if not all(f and isinstance(v, int) and not isinstance(v, bool) for f, v in vals):
        return None   # a missing or non-integer value: its own rule says so
    return [v for _, v in vals]


def _cross(cfg: Mapping) -> list[str]:
    """Rules between keys (each key's own rule has passed or is reported already)."""
    out = []
    hz = _ints(cfg, "policy.n_action_steps", "policy.horizon")
    if hz and hz[0] > hz[1]:
        out.append(f"policy.n_action_steps: expected <= policy.horizon ({hz[1]}), given {hz[0]}")
    st = _ints(cfg, "policy.num_inference_steps", "policy.num_train_timesteps")
    if st and st[0] > st[1]:
        out.append(f"policy.num_inference_steps: expected <= policy.num_train_timesteps ({st[1]}), given {st[0]}")
    dh = _ints(cfg, "policy.dim", "policy.n_heads")
    if dh and dh[1] > 0 and dh[0] % dh[1]:
        out.append(f"policy.dim: expected a multiple of policy.n_heads ({dh[1]}), given {dh[0]}")
    hg = _ints(cfg, "policy.aed.history_actions", "policy.aed.group_size")
    if hg and hg[1] > 0 and hg[0] % hg[1]:
        out.append(f"policy.aed.history_actions: expected a multiple of policy.aed.group_size ({hg[1]}), given {hg[0]}")
    _, codec = _get(cfg, "store.image_codec")
    _, pix = _get(cfg, "store.image_pix_fmt")
    _, images = _get(cfg, "obs.images")
    size = _ints(cfg, "obs.image_size")
    if codec == "h264" and pix in (None, "yuv420p") and images and size and size[0] % 2:
        out.append(f"store.image_codec: h264 with store.image_pix_fmt yuv420p needs an even obs.image_size, given "
                   f"{size[0]} (set store.image_pix_fmt=yuv444p or an even size)")
    hp = _ints(cfg, "policy.horizon", "policy.action_patch")
    if hp and hp[1] > 0 and hp[0] % hp[1]:
        out.append(f"policy.horizon: expected a multiple of policy.action_patch ({hp[1]}), given {hp[0]}")
    return out


def _get(cfg: Mapping, dotted: str) -> tuple[bool, Any]:
    cur: Any = cfg
    for part in dotted.split("."):
        try:
            if part not in cur:
                return False, None
            cur = cur[part]
        except TypeError:
            return False, None
    return True, cur


CONFIG_DIR = Path(__file__).resolve().parent
# subtrees a script reads as a whole, added on the command line with `+` (e.g. `+bench.cluster=true`,
# `+store.storage_options={...}`): any key under a component of this name is accepted
FREE_FORM = frozenset({"bench", "cluster", "storage_options", "runtime_env", "worker_resources"})


def _flat_keys(node: Any, prefix: str, out: dict[str, Any]) -> None:
    if not isinstance(node, Mapping):
        return
    for k, v in node.items():
        if k in ("defaults", "hydra") and not prefix:
            continue
        key = f"{prefix}.{k}" if prefix else str(k)
        out[key] = v
        _flat_keys(v, key, out)


@functools.lru_cache(maxsize=4)
def declared_keys(config_dir: Path = CONFIG_DIR) -> tuple[frozenset[str], frozenset[str]]:
    """``(keys, open_keys)``: every dotted key some YAML file under ``config_dir`` declares (the root config's
    keys, each group option's keys under its group, ``configs/task/mw10.yaml``: ``task.*``, and an
    ``@package _global_`` file's keys as they stand), and those declared as ``{}`` or ``null``, whose value is the
    user's own mapping (``eval.checkpoints``, ``fleet.runtime_env``): keys below them are not checked. A composed
    config's key outside both (and outside ``FREE_FORM``) is read by no component."""
    import yaml

    keys: dict[str, Any] = {}
    for f in sorted(config_dir.rglob("*.yaml")):
        text = f.read_text()
        rel = f.relative_to(config_dir)
        top = "@package _global_" in "\n".join(text.splitlines()[:3]) or len(rel.parts) == 1
        prefix = "" if top else ".".join(rel.parts[:-1])
        if prefix:
            keys.setdefault(prefix, "<group>")   # the group itself (not a user mapping)
        _flat_keys(yaml.safe_load(text) or {}, prefix, keys)
    open_keys = frozenset(k for k, v in keys.items() if v is None or v == {})
    tk = typed.declared_keys()   # a typed field whose default is a mapping or null may hold the user's own keys
    typed_open = {k for k, v in tk.items() if v is None or isinstance(v, Mapping)}
    return frozenset(keys) | frozenset(tk), open_keys | typed_open


def unknown_keys(cfg: Mapping, declared: tuple[frozenset[str], frozenset[str]] | None = None) -> list[str]:
    """Dotted keys of ``cfg`` (a plain dict) that no YAML file declares, outside ``FREE_FORM`` subtrees and the
    user mappings of :func:`declared_keys`."""
    known, open_keys = declared_keys() if declared is None else declared
    flat: dict[str, Any] = {}
    _flat_keys(cfg, "", flat)

    def allowed(k: str) -> bool:
        parts = k.split(".")
        return (k in known or bool(FREE_FORM & set(parts))
                or any(".".join(parts[:i]) in open_keys for i in range(1, len(parts))))

    return sorted(k for k in flat if not allowed(k))


def problems(cfg: Mapping) -> list[str]:
    """Every rule a value of ``cfg`` (an OmegaConf config or a plain dict) breaks, one line each; for a composed
    root config (it has ``job``, ``fleet`` and ``task``) also every key no component reads."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=False)
    out = []
    if all(g in cfg for g in ("job", "fleet", "task")):
        out += [f"{k}: unknown key (no component reads it; check its spelling and group)" for k in unknown_keys(cfg)]
    for key, rule in RULES.items():
        found, v = _get(cfg, key)
        if not found:
            continue
        if isinstance(v, str) and "${" in v:      # an interpolation: check what it resolves to
            continue
        why = rule(v)
        if why is not None:
            out.append(f"{key}: expected {why}, given {v!r}")
    return out + typed.problems(cfg) + _cross(cfg)


def check(cfg: Mapping) -> None:
    """Raise :class:`ConfigError` listing every broken rule of ``cfg`` (resolving interpolations first).

    Raises:
        ConfigError: one line per problem, ``key: expected ..., given ...``.
    """
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        try:
            cfg = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
        except Exception:  # noqa: BLE001 - e.g. ${hydra:...} outside a Hydra app: check the raw values
            cfg = OmegaConf.to_container(cfg, resolve=False)
    bad = problems(cfg)
    if bad:
        raise ConfigError("invalid config (nothing was run):\n  " + "\n  ".join(bad))


def check_or_exit(cfg: Mapping) -> None:
    """:func:`check`, turned into ``SystemExit`` with the message (scripts: a clear error, no traceback); then
    the store's ``storage_options`` become this process's defaults for its URL's protocol
    (``experience_dict.store.configure_storage``), so the script's store handles reach the right server."""
    try:
        check(cfg)
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    store = cfg.get("store") if hasattr(cfg, "get") else None
    if store is not None and store.get("storage_options"):
        from omegaconf import DictConfig, OmegaConf

        from experience_dict.store import configure_storage

        configure_storage(OmegaConf.to_container(store, resolve=True) if isinstance(store, DictConfig) else store)
