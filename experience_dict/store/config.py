"""The experience store's typed config: Hydra's config group ``store``, and the one place its defaults live.

:class:`StoreConfig` (nested :class:`DemosConfig` for ``scripts/collect_demos.py`` and :class:`StoreBenchConfig` for
``scripts/bench_store.py``) is registered in Hydra's ConfigStore as ``store/default`` (:mod:`configs.typed`): an
unknown key or a wrong type is refused while composing, a value out of range by ``configs.schema.check`` (which
also checks that ``store.url`` is a creatable directory, at startup only).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from configs.rules import POS, TypedConfig, boolean, integer, number, one_of


@dataclass
class DemosConfig(TypedConfig):
    """``scripts/collect_demos.py``: scripted-expert demonstrations (``is_demo=True``, policy version -1)."""

    per_task: int = 10
    """Demonstrations per task, spread round-robin over the units."""
    units: Any = None
    """Unit ids (a list or ``"start:stop"``); null: ``robot.demo_units`` (else ``robot.train_units``)."""
    noise_std: float = 0.0
    """Gaussian noise on the expert's actions, in action units."""
    seed: int = 0
    """Episode seeds: seed + 1000 x task index + demonstration index."""
    successful_only: bool = True
    """Retry (a new seed) until an episode succeeds; false: keep failures too."""
    max_attempts: int = 3
    """Attempts per demonstration when ``successful_only``."""
    writer_id: str = "demos"
    """Shard prefix; one shard per unit: ``<writer_id>-unit-<id>``."""
    on_fleet: bool = False
    """True: collect in parallel on the Ray fleet (``fleet.coordinator.collect``)."""


DemosConfig._group, DemosConfig._rules = "store.demos", {
    "per_task": POS, "noise_std": number(0), "seed": integer(0), "successful_only": boolean, "max_attempts": POS,
    "on_fleet": boolean}


@dataclass
class StoreBenchConfig(TypedConfig):
    """``scripts/bench_store.py``: write throughput against ``numpy.save``, window sampling throughput (JSON)."""

    episodes: int = 16
    """Episodes written (each timed against ``numpy.save`` of the same arrays)."""
    steps: int = 150
    """Steps per episode."""
    image_size: int = 96
    """Image side, pixels."""
    image_source: str = "sim"
    """sim (real Meta-World renders, the push-v3 expert) | synthetic."""
    windows: int = 3000
    """Windows timed per loader configuration."""
    batch_size: int = 64
    """Loader batch size."""
    repeats: int = 3
    """Timed write runs (and checked / unchecked read runs), after one untimed warm-up."""
    dir: str | None = None
    """Where the stores are written; null: ``<output_dir>/bench_store``."""
    out: str | None = None
    """JSON path; null: ``<output_dir>/bench_store.json``."""


StoreBenchConfig._group, StoreBenchConfig._rules = "store.bench", {
    "episodes": POS, "steps": POS, "image_size": POS, "image_source": one_of("sim", "synthetic"), "windows": POS,
    "batch_size": POS, "repeats": POS}


@dataclass
class StoreConfig(TypedConfig):
    """The fleet's experience store: any fsspec URL (a local directory, ``memory://``, ``s3://bucket/prefix``)."""

    url: str = "outputs/store"
    """The store's URL or local directory."""
    storage_options: Any = field(default_factory=dict)
    """fsspec options for the URL's protocol, applied in every process that opens the store (scripts, fleet
    workers, learner, evaluation), e.g. ``{endpoint_url: "http://127.0.0.1:9000", key: ..., secret: ...}`` for
    S3 or an S3-compatible server (credentials may also come from the environment: ``AWS_ENDPOINT_URL``, ...);
    null: none. Typed Any, so a command-line mapping merges."""
    on_corrupt: str = "raise"
    """A chunk that cannot be read (checksum, truncated, missing): raise (the error names the store, shard,
    array, chunk and episodes) | skip (training reads every chunk of its episodes first and leaves the bad ones
    out, logged)."""
    chunk_bytes: int = 1 << 20
    """New stores: the target uncompressed chunk size along time, bytes (1 MiB: 37 rows of a 96x96x3 image;
    episodes start on these chunks)."""
    max_chunk_rows: int = 1024
    """New stores: the cap on rows per chunk (the packed low-dimensional array: a commit re-encodes its partly
    filled last chunk, so this bounds that cost)."""
    image_clevel: int = 1
    """New stores: the Blosc / zstd level of image arrays."""
    image_codec: str = "delta-zstd"
    """New stores: how camera frames are encoded. delta-zstd (lossless: each frame minus the one before, then
    Blosc/zstd at ``image_clevel``) | zstd (lossless: the frames as they are; stores before 2026-12-05) | h264
    (lossy: each chunk one H.264 stream at ``image_crf``; ~4x smaller than LeRobot's AV1 video at about its error,
    docs/PERFORMANCE.md)."""
    image_crf: int = 18
    """New stores with ``image_codec=h264``: libx264's constant rate factor (0-51; lower is better quality)."""
    image_pix_fmt: str = "yuv420p"
    """New stores with ``image_codec=h264``: yuv420p (chroma at half resolution; even frame sizes only) | yuv444p
    (full chroma, any frame size)."""
    demos: DemosConfig = field(default_factory=DemosConfig)
    """``scripts/collect_demos.py``."""
    bench: StoreBenchConfig = field(default_factory=StoreBenchConfig)
    """``scripts/bench_store.py``."""


LAYOUT_KEYS = ("chunk_bytes", "max_chunk_rows", "image_clevel", "image_codec", "image_crf", "image_pix_fmt")
"""The ``store`` keys that set a new store's layout: ``ExperienceStore.create_or_open``'s keyword arguments."""


def store_layout(store_cfg: Mapping | StoreConfig) -> dict:
    """``ExperienceStore.create_or_open`` keyword arguments (:data:`LAYOUT_KEYS`) from a ``store`` config (a
    :class:`StoreConfig` or its mapping; keys it lacks keep their defaults). They apply to a store being created;
    an existing store keeps the layout it was made with."""
    get = (lambda k: getattr(store_cfg, k)) if isinstance(store_cfg, StoreConfig) else store_cfg.get
    default = StoreConfig()
    return {k: (v if (v := get(k)) is not None else getattr(default, k)) for k in LAYOUT_KEYS}


StoreConfig._group, StoreConfig._rules = "store", {
    "storage_options": lambda v: None if v is None or isinstance(v, Mapping) else "a mapping of fsspec options",
    "on_corrupt": one_of("raise", "skip"), "chunk_bytes": POS, "max_chunk_rows": POS,
    "image_clevel": lambda v: integer(0)(v) or (None if v <= 9 else "an integer 0..9 (Blosc's zstd levels)"),
    "image_codec": one_of("delta-zstd", "zstd", "h264"),
    "image_crf": lambda v: integer(0)(v) or (None if v <= 51 else "an integer 0..51 (libx264's CRF)"),
    "image_pix_fmt": one_of("yuv420p", "yuv444p")}
StoreConfig._nested = {"demos": DemosConfig, "bench": StoreBenchConfig}
