"""The fleet's Zarr experience store (see :mod:`experience_dict.store.store` for layout and guarantees).

CLI: ``python -m experience_dict.store info|verify|stats URL``.
"""

from experience_dict.store import codecs  # noqa: F401  (registers the store's image codecs with zarr)
from experience_dict.store.reader import ExperienceStore, copy_episodes
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
from experience_dict.store.storage import configure_storage
from experience_dict.store.writer import EpisodeWriter

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
