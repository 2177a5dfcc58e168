"""A run directory's bookkeeping: each experiment seed's config (its store, registry and caches inside its own
directory), which stages are finished (``job_state.json``) and the stage lines printed as the job goes."""

from __future__ import annotations

import json
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from experience_dict.atomic import atomic_write_text


class JobState:
    """Which stages of a run are finished, with their outputs (``job_state.json``, written atomically)."""

    def __init__(self, path: Path):
        self.path = path
        self.data = json.loads(path.read_text()) if path.is_file() else {}

    def done(self, stage: str) -> bool:
        return stage in self.data

    def get(self, stage: str):
        return self.data[stage]

    def mark(self, stage: str, value) -> None:
        self.data[stage] = value
        atomic_write_text(self.path, json.dumps(self.data, indent=1, default=str))


class Stages:
    """Stage headers with an overall progress line: ``[stage k/n] name (elapsed, estimate left)``.

    ``weights``: the expected relative cost of each stage, in order (the estimate scales the elapsed time by
    the weight still to come); a stage already finished in an earlier run is skipped quickly, so the estimate
    is only meaningful from the first stage that really runs."""

    def __init__(self, weights: list[float]):
        self.w, self.k, self.t0 = [float(x) for x in weights], 0, time.perf_counter()

    def start(self, name: str) -> None:
        self.k += 1
        el = time.perf_counter() - self.t0
        done = sum(self.w[: self.k - 1])
        eta = f", ~{el / done * sum(self.w[self.k - 1:]) / 60:.0f} min left" if done > 0 and el > 5 else ""
        print(f"\n=== [stage {self.k}/{len(self.w)}] {name} ({el / 60:.1f} min elapsed{eta}) ===", flush=True)


def plain_config(cfg: DictConfig, out: Path) -> dict:
    """Resolved plain dict of the composed config, with the run's store, registry and caches in ``out``."""
    c = OmegaConf.to_container(cfg, resolve=True)
    return seed_config(c, out, int(c.get("seed", 0)))


def seed_config(c: dict, sd: Path, seed: int) -> dict:
    """``c`` for experiment seed ``seed``: store, registry and cache in ``sd``; ``seed`` set."""
    return {**c, "seed": int(seed), "train": {**c["train"], "seed": int(seed)},
            "store": {**c["store"], "url": str(sd / "store")},
            "fleet": {**c["fleet"], "registry_url": str(sd / "registry"), "cache_dir": str(sd / "cache")}}
