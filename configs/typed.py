"""The typed config groups: dataclasses registered in Hydra's ConfigStore, each the one place its defaults live.

A typed group has no YAML file of defaults: ``configs/config.yaml``'s defaults list names ``<group>: default``,
and Hydra finds that option here, in its ConfigStore. Presets (task suites, ``robot=shifted``, experiments) stay
YAML and override fields of it. Hydra types the composed node, so an unknown key or a wrong type is refused while
composing, naming the key; :func:`problems` adds each dataclass's range checks to ``configs.schema.check``.

Importing this module registers the groups (:func:`register`); every entry point that composes the config
imports it first (``import configs.typed`` in each Hydra script, ``tests/conftest.py``).

Migrated so far: ``learner`` (:class:`fleet.fert.learner_config.LearnerConfig`), ``train``
(:class:`policies.train_config.TrainConfig`), ``fert`` (:class:`fleet.fert.config.FertConfig`), ``eval`` (:class:`fleet.experiment.eval_config.EvalConfig`), ``job``
(:class:`fleet.experiment.job_config.JobConfig`), the scripts' ``sim``, ``chaos``, ``async_run``, ``ablate`` and ``compare``
(:mod:`configs.scripts`), ``deploy`` (:class:`fleet.deploy.config.DeployConfig`), ``fleet``
(:class:`fleet.fleet_config.FleetConfig`), ``robot``, ``obs`` and ``task`` (:mod:`configs.sim_groups`; their presets extend
the dataclass), ``store`` (:class:`experience_dict.store.config.StoreConfig`); new groups are typed from the start: ``steer``
(:class:`policies.steer_config.SteerConfig`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from configs.rules import ConfigError
from configs.scripts import (
    AblateConfig,
    AsyncRunConfig,
    ChaosConfig,
    CompareConfig,
    FleetSizeConfig,
    SimConfig,
)
from configs.sim_groups import ObsConfig, RobotConfig, TaskConfig
from experience_dict.store.config import StoreConfig
from fleet.deploy.config import DeployConfig
from fleet.experiment.eval_config import EvalConfig
from fleet.experiment.job_config import JobConfig
from fleet.fert.config import FertConfig
from fleet.fert.learner_config import LearnerConfig
from fleet.fleet_config import FleetConfig
from fleet.labels_config import LabelsConfig
from policies.steer_config import SteerConfig
from policies.train_config import TrainConfig

TYPED_GROUPS: dict[str, type] = {"learner": LearnerConfig, "steer": SteerConfig, "train": TrainConfig,
                                 "fert": FertConfig, "eval": EvalConfig,
                                 "job": JobConfig, "sim": SimConfig, "chaos": ChaosConfig, "async_run": AsyncRunConfig,
                                 "ablate": AblateConfig, "compare": CompareConfig, "deploy": DeployConfig,
                                 "fleet": FleetConfig, "robot": RobotConfig, "obs": ObsConfig, "task": TaskConfig,
                                 "store": StoreConfig, "labels": LabelsConfig, "fleet_size": FleetSizeConfig}


def register() -> None:
    """Store every typed group's dataclass as ``<group>/default`` in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for group, cls in TYPED_GROUPS.items():
        cs.store(group=group, name="default", node=cls)


def declared_keys() -> dict[str, Any]:
    """``{dotted key: default}`` of every typed group's fields (``learner.lr``, ...), nested groups' fields
    (``train.wandb.mode``) and the groups themselves (``"<group>"``). A field whose default is a mapping
    (``fert.onset.signals``, ``train.bench``) or null (``eval.checkpoints``) may hold the user's own keys."""
    out: dict[str, Any] = {}

    def fields(prefix: str, cls: type) -> None:
        nested = getattr(cls, "_nested", {})
        for f in dataclasses.fields(cls):
            key = f"{prefix}.{f.name}"
            if f.name in nested:
                out[key] = "<group>"
                fields(key, nested[f.name])
            elif f.default is not dataclasses.MISSING:
                out[key] = f.default
            else:
                out[key] = f.default_factory() if f.default_factory is not dataclasses.MISSING else None

    for group, cls in TYPED_GROUPS.items():
        out[group] = "<group>"
        fields(group, cls)
    return out


def problems(cfg: Mapping) -> list[str]:
    """Every typed group of ``cfg`` (a plain dict) that is present, built into its dataclass: the lines of each
    field out of range (and of unknown keys, for configs not composed by Hydra)."""
    out: list[str] = []
    for group, cls in TYPED_GROUPS.items():
        node = cfg.get(group)
        if not isinstance(node, Mapping):
            continue
        try:
            cls.from_dict(node)
        except ConfigError as e:
            out += e.lines()
    return out


register()
