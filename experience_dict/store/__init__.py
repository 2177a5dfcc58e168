"""The fleet's Zarr experience store (see :mod:`experience_dict.store.store` for layout and guarantees).

CLI: ``python -m experience_dict.store info|verify|stats URL``.
"""

from experience_dict.store.schema import (
    DEFAULT_PROGRESS_KEYS,
    LOWDIM,
    READABLE_SCHEMA_VERSIONS,
    SCHEMA_VERSION,
    CorruptChunkError,
    EpisodeMeta,
    NonFiniteError,
    SchemaVersionError,
    SpecMismatchError,
    StoreError,
    StoreNotFoundError,
    StoreUnreachableError,
    StoreWriteError,
    WriterBusyError,
)

# the reader, the writer and the storage options need zarr: imported on first use (PEP 562), so that a config
# (``experience_dict.store.config``) or the store's errors load without zarr, torch or the codecs
_LAZY = {"ExperienceStore": "reader", "copy_episodes": "reader", "EpisodeWriter": "writer",
         "configure_storage": "storage"}


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'experience_dict.store' has no attribute {name!r}")
    import importlib

    importlib.import_module("experience_dict.store.codecs")   # registers the store's codecs with zarr
    value = getattr(importlib.import_module(f"experience_dict.store.{mod}"), name)
    globals()[name] = value
    return value


__all__ = [
    "DEFAULT_PROGRESS_KEYS",
    "LOWDIM",
    "READABLE_SCHEMA_VERSIONS",
    "SCHEMA_VERSION",
    "CorruptChunkError",
    "EpisodeMeta",
    "EpisodeWriter",
    "ExperienceStore",
    "NonFiniteError",
    "SchemaVersionError",
    "SpecMismatchError",
    "StoreError",
    "StoreNotFoundError",
    "StoreUnreachableError",
    "StoreWriteError",
    "WriterBusyError",
    "configure_storage",
    "copy_episodes",
]
