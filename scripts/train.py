"""Train a policy on the experience store (demonstrations by default): the AED diffusion policy, or any
policy type of ``policies.factory`` (``policy=mlp_chunk``).

    python scripts/train.py task=mw_quick                                  # state-only, CPU is enough
    python scripts/train.py train.steps=4000 train.out_dir=outputs/train_quick   # fixed dir: re-run resumes
    python scripts/train.py policy.aed.enabled=false                       # ablation: no AED prefix
    python scripts/train.py policy.mt_loss.weight=0                        # no motion-aware transition loss
    python scripts/train.py policy=aed_diffusion_image obs=vision device=cuda train.amp_bf16=true train.compile=true
    python scripts/train.py policy=mlp_chunk                               # the small MLP action-chunk policy

Reads episodes of ``task.tasks`` from ``store.url`` filtered by ``train.episodes`` (``is_demo: true``), fits the
action tokenizer and normalization stats on them, trains with ``train_policy`` and writes checkpoints to
``<out_dir>/checkpoints/<step>/pretrained_model`` (the deployable EMA policy), ``metrics.jsonl`` and wandb
(offline) logs. Prints a JSON summary with the last checkpoint.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

import configs.typed  # noqa: F401 - registers the typed config groups before Hydra composes
from fleet.progress import calm_progress
from fleet.refusals import one_line_refusals
from policies.threads import passive_wait

passive_wait()   # before torch loads: OpenMP's idle threads sleep instead of spinning (policies/threads.py)
calm_progress()  # off a terminal, a progress bar redraws every 30 s, not 15 times a second (fleet/progress.py)

log = logging.getLogger("train")


@hydra.main(version_base=None, config_path="../configs", config_name="config")
@one_line_refusals("train")   # a refusal (store, registry, policy): one line, exit 2, the trace in the run's log
def main(cfg: DictConfig) -> None:
    from configs.schema import check_or_exit

    check_or_exit(cfg)   # every value against its rule, before any work (and before torch is imported)
    from experience_dict.store import CorruptChunkError, ExperienceStore
    from policies.aed_diffusion.training import train_policy
    from policies.factory import load_policy

    tcfg = OmegaConf.to_container(cfg.train, resolve=True)
    out_dir = Path(tcfg.pop("out_dir") or cfg.output_dir)
    init_from, ep_filter = tcfg.pop("init_from"), tcfg.pop("episodes") or {}
    reader = ExperienceStore.open(str(cfg.store.url))
    episodes = reader.episodes(task=list(cfg.task.tasks), **{k: v for k, v in ep_filter.items() if v is not None})
    if not episodes:
        raise SystemExit(f"no episodes in store {cfg.store.url!r} for tasks {list(cfg.task.tasks)} with {ep_filter}")
    n_all = len(episodes)
    try:
        episodes = reader.readable(episodes, on_corrupt=str(cfg.store.get("on_corrupt", "raise")))
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if len(episodes) < n_all:
        log.warning("store.on_corrupt=skip: training on %d of %d episodes (%d skipped: unreadable chunks)",
                    len(episodes), n_all, n_all - len(episodes))
    if not episodes:
        raise SystemExit(f"every episode of {cfg.store.url!r} selected for training has an unreadable chunk")
    log.info("%d episodes (%d steps) from %s", len(episodes), sum(e.length for e in episodes), cfg.store.url)
    policy, policy_cfg = None, None
    if init_from:
        policy = load_policy(init_from)
    else:
        policy_cfg = OmegaConf.to_container(cfg.policy, resolve=True)   # policies.factory.make_policy
    t0 = time.time()
    try:
        res = train_policy(tcfg, out_dir, policy=policy, policy_cfg=policy_cfg, reader=reader, episodes=episodes,
                           device=str(cfg.device), run_config={"task": OmegaConf.to_container(cfg.task, resolve=True),
                                                               "store": str(cfg.store.url)})
    except CorruptChunkError as e:   # names store, shard, array, chunk and episodes; checkpoints so far are kept
        raise SystemExit(f"train: {e}") from None
    tok = getattr(res["policy"], "tokenizer", None)
    summary = {"checkpoint": str(res["checkpoint"]), "step": res["step"], "wall_s": round(time.time() - t0, 1),
               "episodes": len(episodes), "parameters": res["policy"].num_parameters(),
               "store": str(cfg.store.url), "tasks": list(cfg.task.tasks), "control_hz": reader.control_hz,
               "last_metrics": res["metrics"], "tokenizer_fit": tok.fit_report if tok is not None else None}
    (out_dir / "train_summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
