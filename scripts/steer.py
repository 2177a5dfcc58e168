"""Fit a noise actor (DSRL's noise steering, ``policies/noise_actor.py``) for a policy checkpoint against its critic.

    python scripts/steer.py steer.checkpoint=<run>/seed_0/cache/arms/v000004 store.url=<run>/seed_0/store task=mw10
    python scripts/eval.py 'eval.checkpoints={alone: <...>/v000004_alone, steered: <run dir>/steered}' eval.baseline=alone

The checkpoint must carry its success critic (``critic.safetensors``: a FERT version as published), or
``steer.critic`` names another checkpoint's (e.g. to steer the base with a later round's critic). The actor is
trained on ``steer.states_per_task`` stored states per task of the training units (demonstrations, fleet
episodes and their retries: the critic's own data), and written with the policy's files (not the critic's) to
``steer.out_dir`` (default ``<run dir>/steered``): that directory is the steered policy acting alone (K = 1), which
``scripts/eval.py`` and the fleet load like any checkpoint. ``fit.json`` in the run dir: the critic's scores of the
actor's chunks against the policy's own random-noise chunks, per task.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

import configs.typed  # noqa: F401 - registers the typed config groups before Hydra composes
from fleet.progress import calm_progress
from fleet.refusals import one_line_refusals
from policies.threads import passive_wait
from policies.train_config import TrainConfig

passive_wait()   # before torch loads: OpenMP's idle threads sleep instead of spinning (policies/threads.py)
calm_progress()  # off a terminal, a progress bar redraws every 30 s, not 15 times a second (fleet/progress.py)
os.environ.setdefault("WANDB_MODE", "offline")

log = logging.getLogger("steer")


@hydra.main(version_base=None, config_path="../configs", config_name="config")
@one_line_refusals("steer")
def main(cfg: DictConfig) -> None:
    from configs.schema import check_or_exit

    check_or_exit(cfg)
    import torch

    from experience_dict.sampler import WindowDataset
    from experience_dict.store import ExperienceStore
    from fleet.acting import load_checkpoint
    from policies.critic import CRITIC_FILES, load_critic
    from policies.distill import balanced_anchors
    from policies.noise_actor import ACTOR_CONFIG, ACTOR_FILE, SteerConfig, fit_noise_actor, save_noise_actor

    c = OmegaConf.to_container(cfg, resolve=True)
    sc = SteerConfig.from_dict(c["steer"])
    if not sc.checkpoint or not (Path(sc.checkpoint) / "config.json").is_file():
        raise SystemExit(f"steer.checkpoint: expected a pretrained_model directory, given {sc.checkpoint!r}")
    ckpt = Path(sc.checkpoint)
    found = load_critic(Path(sc.critic) if sc.critic else ckpt)
    if found is None:
        raise SystemExit(f"{'steer.critic ' + repr(sc.critic) if sc.critic else 'steer.checkpoint ' + repr(str(ckpt))}"
                         f" has no success critic ({CRITIC_FILES[0]}): the actor is trained against it")
    critic, _ = found
    if critic.image_keys:
        raise SystemExit(f"steer: the success critic sees cameras {critic.image_keys}; noise steering "
                         "(policies/noise_actor.py) conditions its actor on state vectors only, so it supports "
                         "state-only critics (fert.critic.images=false)")
    torch.set_num_threads(int(c["learner"].get("torch_threads") or 1))
    policy, _ = load_checkpoint(ckpt, "cpu", with_critic=False)
    reader = ExperienceStore.open(c["store"]["url"])
    heldout = {int(u) for u in c["robot"]["heldout_units"]}
    tasks = set(c["task"]["tasks"])
    eps = [m for m in reader.episodes() if int(m.unit_id) not in heldout and m.task in tasks
           and not getattr(m, "quarantined", False)]
    windows = WindowDataset(reader, eps, windows=policy.window_spec())
    anchors = balanced_anchors(windows, sc.states_per_task, sc.seed)
    log.info("steer: %d states over %d tasks from %d episodes", len(anchors), len(tasks), len(eps))
    actor, rec = fit_noise_actor(policy, critic, windows, anchors, sc, progress=TrainConfig.from_dict(c["train"]).progress)
    out = Path(sc.out_dir or Path(c["output_dir"]) / "steered")
    if out.exists():
        shutil.rmtree(out)
    skip = set(CRITIC_FILES) | {ACTOR_FILE, ACTOR_CONFIG, "MANIFEST.json"}
    shutil.copytree(ckpt, out, ignore=lambda d, names: [n for n in names if n in skip])
    save_noise_actor(actor, out, rec)
    (Path(c["output_dir"]) / "fit.json").write_text(json.dumps(rec, indent=1))
    print(json.dumps({k: v for k, v in rec.items() if k != "config"}, indent=1))
    print(f"steered policy (acting alone, K = 1): {out}")


if __name__ == "__main__":
    main()
