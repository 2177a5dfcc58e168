"""Evaluate any policy checkpoints on any units and tasks: the main job's table format, paired differences, videos.

    python scripts/eval.py eval.checkpoint=outputs/run/learner_fert/train/checkpoints/0000400/pretrained_model
    python scripts/eval.py 'eval.checkpoints={base: outputs/run/base/checkpoints/0001500/pretrained_model,
                                              fert: outputs/run/learner_fert/train/checkpoints/0000400/pretrained_model}' \\
        eval.baseline=base eval.trials_per_task=100 'eval.units=[100,101]' 'eval.tasks=[reach-v3]'
    python scripts/eval.py ... hydra.run.dir=outputs/eval_a     # a fixed dir: an interrupted evaluation resumes

Every arm runs the same held-out trial plan (``fleet.experiment.evaluation.evaluation_plan``: the same task, unit and reset
seed per trial), on the Ray fleet, committing its episodes to ``<run dir>/eval_store`` (never a training store).
Writes into the run dir: ``results.md`` / ``results.json`` (success with Wilson 95% intervals per task and on
average), ``paired.md`` / ``paired.json`` (every arm against ``eval.baseline`` trial by trial, when set),
``episodes/<arm>.json``, ``videos/<arm>/*.mp4`` (successes and failures) and, for multi-stage tasks
(``fleet.stages.STAGED_TASKS``), ``stages.md`` / ``stages.json``: at which stage each arm's failures stall.

Raises SystemExit with a message naming the problem for a missing checkpoint directory or no checkpoint given.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

import configs.typed  # noqa: F401 - registers the typed config groups before Hydra composes
from fleet.experiment.eval_config import EvalConfig
from fleet.progress import calm_progress
from fleet.refusals import one_line_refusals
from policies.threads import passive_wait

passive_wait()   # before torch loads: OpenMP's idle threads sleep instead of spinning (policies/threads.py)
calm_progress()  # off a terminal, a progress bar redraws every 30 s, not 15 times a second (fleet/progress.py)
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

log = logging.getLogger("eval")


def resolve_arms(ecfg) -> dict[str, str]:
    """``{arm name: pretrained_model directory}`` from ``eval.checkpoint`` / ``eval.checkpoints``.

    A directory holding a ``pretrained_model`` folder (a training checkpoint step) is resolved to it. The arm
    of a lone ``eval.checkpoint`` is named after the run folder above ``checkpoints/`` (else the folder itself).

    Raises:
        SystemExit: no checkpoint given, or a path that is not a directory with a ``config.json``.
    """
    ec = EvalConfig.from_dict(ecfg)   # the eval group (an EvalConfig, or a mapping of its keys)
    arms = {str(k): str(v) for k, v in (ec.checkpoints or {}).items()}
    if ec.checkpoint:
        p = Path(str(ec.checkpoint))
        parts = p.resolve().parts
        name = parts[parts.index("checkpoints") - 1] if "checkpoints" in parts[1:] else p.name
        arms.setdefault(name, str(p))
    if not arms:
        raise SystemExit("scripts/eval.py: give eval.checkpoint=<pretrained_model dir> or "
                         "'eval.checkpoints={name: dir, ...}'")
    out = {}
    for arm, path in arms.items():
        p = Path(path)
        if (p / "pretrained_model").is_dir():
            p = p / "pretrained_model"
        if not (p / "config.json").is_file():
            raise SystemExit(f"eval: arm {arm!r}: {path} is not a checkpoint directory (no config.json"
                             f"{' in it or in its pretrained_model/' if p.is_dir() else '; it does not exist'})")
        out[arm] = str(p.resolve())
    return out


@hydra.main(version_base=None, config_path="../configs", config_name="config")
@one_line_refusals("eval")   # a refusal (store, registry, policy): one line, exit 2, the trace in the run's log
def main(cfg: DictConfig) -> None:
    from configs.schema import check_or_exit

    check_or_exit(cfg)   # every value against its rule, before any work
    from fleet.experiment.evaluation import evaluate_arms, record_rollouts
    from fleet.experiment.tables import (
        paired_differences,
        paired_markdown,
        success_table,
        table_markdown,
        write_paired,
        write_table,
    )
    from fleet.stages import stall_markdown, write_stall_report
    from sim import unit_lists
    from sim.units import parse_units

    t0 = time.perf_counter()
    out = Path(cfg.output_dir).resolve()
    c = OmegaConf.to_container(cfg, resolve=True)
    ecfg = EvalConfig.from_dict(c["eval"])
    arms = resolve_arms(ecfg)
    _, heldout = unit_lists(c["robot"])
    try:
        units = parse_units(ecfg.units, "units") if ecfg.units is not None else heldout
    except ValueError as e:
        raise SystemExit(f"eval.units: {e}") from None
    tasks = list(ecfg.tasks or c["task"]["tasks"])
    c["task"] = {**c["task"], "tasks": tasks}
    c["store"] = {**c["store"], "url": str(out / "eval_store")}
    c["fleet"] = {**c["fleet"], "cache_dir": str(out / "cache")}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(c, indent=1))
    print(f"evaluating {list(arms)} on units {units}, tasks {tasks}, {ecfg.trials_per_task} trials per task "
          f"-> {out}", flush=True)
    results = evaluate_arms(c, arms, out, ecfg.trials_per_task, units=units, tasks=tasks)
    table = success_table(results)
    table["meta"] = {"units": units, "trials_per_task": ecfg.trials_per_task, "checkpoints": arms,
                     "eval_seed": ecfg.seed, "wall_s": time.perf_counter() - t0}
    write_table(table, out, "results")
    print("\nsuccess (Wilson 95% interval):\n" + table_markdown(table), flush=True)
    stalls = write_stall_report(results, out / "eval_store", out)   # multi-stage tasks: where failures stall
    if stalls:
        print("\nwhere the failures stall (stages.md):\n" + stall_markdown(stalls), flush=True)
    base = ecfg.baseline
    if base:
        if base not in arms:
            raise SystemExit(f"eval.baseline={base!r} is not one of the arms {list(arms)}")
        paired = paired_differences(results, [(a, base) for a in arms if a != base])
        write_paired(paired, out, "paired")
        print("\ntrial-by-trial differences (paired bootstrap 95% interval; wins/losses; McNemar p):\n"
              + paired_markdown(paired), flush=True)
    for arm, ckpt in arms.items():
        if ecfg.videos > 0 and not (out / "videos" / arm).is_dir():
            record_rollouts(c, ckpt, out / "videos" / arm, units, tasks, max_videos=ecfg.videos,
                            max_episodes=ecfg.video_episodes)
    print(f"outputs in {out} ({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
