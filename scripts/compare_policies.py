"""Compare policy variants as base policies: the same demonstrations, each variant's base trained the way the
main job trains its base, every variant on the same held-out trials, paired differences against a baseline.

    python scripts/compare_policies.py                     # the current policy against its earlier denoiser form
    python scripts/compare_policies.py 'compare.variants={p1: {action_patch: 1, condition_layers: null},
        p4: {action_patch: 4, condition_layers: null}, p4c1: {action_patch: 4, condition_layers: 1},
        p4c0: {action_patch: 4, condition_layers: 0}}' compare.baseline=p1 'job.seeds=[0,1]' \\
        eval.seed=23000 eval.trials_per_task=100          # experiment 23 (docs/RESULTS.md)
    python scripts/compare_policies.py hydra.run.dir=outputs/cmp   # a fixed run dir: finished stages resume

Per experiment seed ``s`` (``<run dir>/seed_<s>/``, resumable through ``job_state.json``): the main job's
demonstration stage (``fleet.experiment.bases``: ``job.demos_per_task`` demonstrations, ``job.val_demos_per_task``
held-out ones for the validation loss), then one base per variant by the main job's ``train_base`` (at most
``job.base_steps`` steps, the checkpoint with the lowest validation loss; train seed ``s``) with the variant's
fields merged into ``policy``; then every variant on the held-out units' plan (``eval.trials_per_task`` trials per
task, ``eval.seed``; ``fleet.experiment.evaluation.evaluate_arms``). Writes ``results.md/json`` (success, Wilson intervals,
pooled over seeds), ``paired.md/json`` (each variant against ``compare.baseline``, bootstrapped over seeds then
trials) and ``timing.json`` (each base's training wall time and chosen step).

Raises SystemExit naming the problem for no variants, an unknown baseline, or a variant that is not a mapping
of policy fields, before any work; a bad field value fails in ``AEDDiffusionConfig`` with its name when that
variant's base is built (after the demonstrations).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

import configs.typed  # noqa: F401 - registers the typed config groups before Hydra composes
from configs.scripts import CompareConfig
from fleet.experiment.job_config import JobConfig
from fleet.progress import calm_progress
from policies.threads import passive_wait

passive_wait()   # before torch loads: OpenMP's idle threads sleep instead of spinning (policies/threads.py)
calm_progress()  # off a terminal, a progress bar redraws every 30 s, not 15 times a second (fleet/progress.py)
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


DEFAULT_VARIANTS = {"current": {}, "earlier_form": {"action_patch": 1, "condition_layers": None}}


def variant_policies(policy: dict, variants: dict) -> dict[str, dict]:
    """``{name: policy node}``: each variant's fields deep-merged over the composed ``policy`` node.

    Raises:
        SystemExit: no variants, or a variant that is not a mapping.
    """
    if not variants:
        raise SystemExit("compare.variants: expected at least one {name: {policy field: value}}, given none")
    out = {}
    for name, over in variants.items():
        if over is not None and not isinstance(over, dict):
            raise SystemExit(f"compare.variants.{name}: expected a mapping of policy fields, given {over!r}")
        out[str(name)] = OmegaConf.to_container(OmegaConf.merge(policy, over or {}), resolve=True)
    return out


def run_seed(c: dict, sd: Path, seed: int, policies: dict[str, dict], stages) -> dict:
    """Demonstrations, one base per variant and the held-out evaluation for one experiment seed (resumable).
    Returns ``{"results": {variant: [episode results]}, "timing": {variant: {"wall_s", "best_step"}}}``."""
    from fleet.experiment.bases import stage_base, stage_demos
    from fleet.experiment.evaluation import evaluate_arms
    from fleet.experiment.state import JobState
    from sim import unit_lists

    state = JobState(sd / "job_state.json")
    reader, val = stage_demos(c, sd, seed, state, stages, progress=True)
    demos = reader.episodes(is_demo=True, success=True)
    chosen, timing = {}, {}
    for name, pol in policies.items():
        key = f"variant_{name}"
        stages.start(f"seed {seed}: train variant {name} on {len(demos)} demonstrations")
        rec = stage_base({**c, "policy": pol}, state, key, reader, demos, sd / name,
                         bool(pol.get("aed", {}).get("enabled", True)), val)
        chosen[name] = rec["checkpoint"]
        timing[name] = {"wall_s": rec["wall_s"], "best_step": rec["best_step"]}
    stages.start(f"seed {seed}: held-out evaluation of {len(chosen)} variants")
    _, heldout = unit_lists(c["robot"])
    results = evaluate_arms(c, chosen, sd / "eval", int(c["eval"]["trials_per_task"]), units=heldout)
    return {"results": results, "timing": timing}


@hydra.main(version_base=None, config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> None:
    from configs.schema import check_or_exit

    check_or_exit(cfg)
    from fleet.experiment.state import Stages, plain_config, seed_config
    from fleet.experiment.tables import paired_over_seeds, success_table, write_paired, write_table

    out = Path(cfg.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    c = plain_config(cfg, out)
    cmp_cfg = CompareConfig.from_dict(c.get("compare"))
    variants = DEFAULT_VARIANTS if cmp_cfg.variants is None else cmp_cfg.variants
    policies = variant_policies(c["policy"], variants)
    base = cmp_cfg.baseline
    if base not in policies:
        raise SystemExit(f"compare.baseline: expected one of the variants {sorted(policies)}, given {base!r}")
    seeds = list(JobConfig.from_dict(c["job"]).seeds)
    print(f"compare {sorted(policies)} against {base!r}: seeds {seeds}, {c['eval']['trials_per_task']} held-out trials "
          f"per task -> {out}", flush=True)
    stages = Stages(([2] + [6] * len(policies) + [4]) * len(seeds))
    per_seed = {s: run_seed(seed_config(c, out / f"seed_{s}", s), out / f"seed_{s}", s, policies, stages)
                for s in seeds}
    pooled = {v: [e | {"exp_seed": s} for s in seeds for e in per_seed[s]["results"][v]] for v in policies}
    table = success_table(pooled)
    table["meta"] = {"seeds": seeds, "baseline": base, "variants": variants}
    write_table(table, out, "results")
    paired = paired_over_seeds({s: r["results"] for s, r in per_seed.items()},
                               [(v, base) for v in policies if v != base])
    write_paired(paired, out, "paired")
    (out / "timing.json").write_text(json.dumps({s: r["timing"] for s, r in per_seed.items()}, indent=1))
    print((out / "results.md").read_text() + "\n" + (out / "paired.md").read_text(), flush=True)


if __name__ == "__main__":
    main()
