"""Fine-tune arm variants on a frozen fleet store and evaluate them paired: fast iteration on the learning
method without re-running demonstrations, base training or the fleet.

    python scripts/ablate.py ablate.run_dir=outputs/run/seed_0
    python scripts/ablate.py ablate.run_dir=outputs/run/seed_0 'ablate.arms=[fert]' fert.gate.beta=0.1 \\
        learner.updates_per_version=1200 'ablate.seeds=[0,1,2]' hydra.run.dir=outputs/ablate_beta
    python scripts/ablate.py 'ablate.pool=[outputs/abl_s0,outputs/abl_s1]' hydra.run.dir=outputs/abl_pooled
    python scripts/ablate.py ablate.run_dir=outputs/run/seed_0 ablate.reexplore=true fert.retry.action_noise_std=0 \
        fert.retry.noise_temperature=1.5 fert.retry.temperature_growth=1.25 'ablate.arms=[filtered_bc_retries]'

The run directory's store is opened read-only for the data (its failures, retries and successes as the fleet
left them) and its base checkpoints are the starting points; every variant (``fleet.experiment.arms`` names, with the
command line's ``fert.*`` / ``learner.*`` overrides) is fine-tuned per ``ablate.seeds`` seed into this run's
directory, then all of them and the baseline run the same held-out trials (the run's plan, or a development
plan with ``ablate.eval_seed``, so that iterating never looks at the run's test trials). Outputs: ``ablate.md/json``
(success, Wilson intervals) and ``ablate_paired.md/json`` (paired differences bootstrapped over the fine-tuning
seeds, then trials). The held-out units and tasks are the frozen run's.

``ablate.reexplore=true``: the frozen run's failures are explored again with this command line's ``fert.retry``
(``fleet.experiment.protocol.reexplore``) into a new store in this run's directory, and the arms train on it: the same
demonstrations, fleet successes and failures, another exploration scheme.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

import configs.typed  # noqa: F401 - registers the typed config groups before Hydra composes
from fleet.progress import calm_progress
from policies.threads import passive_wait

passive_wait()   # before torch loads: OpenMP's idle threads sleep instead of spinning (policies/threads.py)
calm_progress()  # off a terminal, a progress bar redraws every 30 s, not 15 times a second (fleet/progress.py)
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from fleet.experiment.tables import (
    paired_markdown,
    paired_over_seeds,
    success_table,
    table_markdown,
    write_paired,
    write_table,
)


def frozen_run(run_dir: Path) -> tuple[dict, dict]:
    """``(config, job_state)`` of a finished ``scripts/run.py`` seed directory.

    Raises:
        SystemExit: the directory lacks ``config.json``/``job_state.json``, a store or the base policies.
    """
    cfg_p, st_p = run_dir / "config.json", run_dir / "job_state.json"
    if not cfg_p.is_file() or not st_p.is_file() or not (run_dir / "store").is_dir():
        raise SystemExit(f"ablate.run_dir={run_dir}: not a scripts/run.py seed directory (expected config.json, "
                         "job_state.json and store/ in it, e.g. outputs/<run>/seed_0)")
    state = json.loads(st_p.read_text())
    if "base" not in state:   # base_no_aed is needed only by the arms that start from it (checked in main)
        raise SystemExit(f"ablate.run_dir={run_dir}: the base policy is not trained yet")
    return json.loads(cfg_p.read_text()), state


@hydra.main(version_base=None, config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> None:
    from configs.schema import check_or_exit

    check_or_exit(cfg)   # every value against its rule, before any work
    from configs.scripts import AblateConfig
    from experience_dict.store import ExperienceStore
    from fleet.experiment.arms import fert_config, get_arms, train_offline_arm
    from fleet.experiment.evaluation import evaluate_arms

    a = AblateConfig.from_dict(cfg.ablate)
    if a.pool:
        return pool([Path(p) for p in a.pool], Path(cfg.output_dir).resolve(), str(a.baseline))
    if not a.run_dir:
        raise SystemExit("ablate.run_dir: give a finished scripts/run.py seed directory, e.g. outputs/<run>/seed_0")
    run_dir = Path(a.run_dir).resolve()
    frozen, state = frozen_run(run_dir)
    arms = get_arms(a.arms)
    baseline = str(a.baseline)
    get_arms([baseline])
    out = Path(cfg.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    here = OmegaConf.to_container(cfg, resolve=True)
    # the frozen run's data, units, tasks and evaluation; this command line's method settings
    c = {**frozen, "fert": here["fert"], "learner": here["learner"], "train": {**frozen["train"], "progress": False},
         "fleet": {**frozen["fleet"], "registry_url": str(out / "registry"), "cache_dir": str(out / "cache")}}
    c["fert"]["gate"] = {**c["fert"].get("gate", {})}
    if a.eval_seed is not None:   # a development trial plan, apart from the run's test plan
        c["eval"] = {**frozen["eval"], "seed": a.eval_seed}
    reader = ExperienceStore.open(frozen["store"]["url"])
    heldout = [int(u) for u in frozen["robot"]["heldout_units"]]
    base = {k: state[k]["checkpoint"] for k in ("base", "base_no_aed") if k in state}
    missing = sorted({x.init for x in arms} - set(base))
    if missing:
        raise ValueError(f"ablate.arms: {[x.name for x in arms if x.init in missing]} start from {missing}, which "
                         f"{run_dir} did not train (its job.arms had no arm that starts from it)")
    if a.reexplore:   # the same failures, explored again with this command line's fert.retry
        reader = reexplore_store(c, reader, base["base"], heldout, out)
    seeds = list(a.seeds)
    results = {}
    for s in seeds:
        ckpts = {baseline: base.get(baseline) or state[baseline]["checkpoint"]}
        for arm in arms:
            if arm.data == "none":
                ckpts[arm.name] = base[arm.init]
                continue
            d = out / f"seed_{s}" / arm.name
            done = d / "checkpoint.txt"
            if not done.is_file():
                print(f"fine-tuning {arm.name} (seed {s}) on the store {c['store']['url']}", flush=True)
                done.parent.mkdir(parents=True, exist_ok=True)
                done.write_text(train_offline_arm(c, arm, reader, base[arm.init], d, heldout, s))
            ckpts[arm.name] = done.read_text()
        results[s] = evaluate_arms(c, ckpts, out / f"seed_{s}", int(frozen["eval"]["trials_per_task"]), units=heldout)
    names = [baseline] + [x.name for x in arms if x.name != baseline]
    table = success_table({n: [e for s in seeds for e in results[s][n]] for n in names})
    table["meta"] = {"run_dir": str(run_dir), "seeds": seeds, "store": c["store"]["url"], "held_out_units": heldout, "eval_seed": c["eval"]["seed"],
                     "fert": {x.name: fert_config(c, x)["fert"] for x in arms}, "learner": c["learner"]}
    pairs = [(n, baseline) for n in names if n != baseline]
    if "filtered_bc_retries" in names:
        pairs += [(n, "filtered_bc_retries") for n in names if n not in (baseline, "filtered_bc_retries")]
    paired = paired_over_seeds(results, pairs)
    write_table(table, out, "ablate")
    write_paired(paired, out, "ablate_paired")
    print("\nheld-out success (Wilson 95% interval):\n" + table_markdown(table), flush=True)
    print("\npaired differences (bootstrap over fine-tuning seeds, then trials):\n" + paired_markdown(paired), flush=True)
    print(f"outputs in {out}: ablate.md/json, ablate_paired.md/json", flush=True)


def reexplore_store(c: dict, reader, policy: str, heldout: list[int], out: Path):
    """The new store ``<out>/store``: the frozen store without its retries plus retries of its failures explored
    with ``c["fert"]["retry"]`` (``fleet.experiment.protocol.reexplore``); ``c["store"]["url"]`` is pointed at it. Done once:
    ``<out>/reexplore.json`` records the recovery; an unfinished store from a killed run is rebuilt."""
    import shutil

    from experience_dict.store import ExperienceStore
    from fleet.experiment.protocol import reexplore

    dst, rec = out / "store", out / "reexplore.json"
    if not rec.is_file():
        if dst.exists():
            shutil.rmtree(dst)
        print(f"re-exploring the failures of {c['store']['url']} with fert.retry={c['fert'].get('retry')} into {dst}",
              flush=True)
        r = reexplore(c, reader, policy, heldout, str(dst))
        rec.write_text(json.dumps({**r, "retry": c["fert"].get("retry"), "source": c["store"]["url"]}, indent=1))
    r = json.loads(rec.read_text())
    print(f"re-exploration: {r['recovered']} of {r['failures']} failures recovered by {r['retries']} retries "
          f"{r['per_attempt']}", flush=True)
    c["store"] = {**c["store"], "url": str(dst)}
    return ExperienceStore.open(str(dst))


def pool(dirs: list[Path], out: Path, baseline: str) -> None:
    """Pool finished ablation directories (one per frozen run, e.g. the seeds of an experiment): every
    ``<dir>/seed_<s>/episodes/<arm>.json`` is one unit of the bootstrap (frozen run x fine-tuning seed), and the
    arms that all of them ran are compared with ``baseline``, bootstrapped over those units, then trials.
    Writes ``ablate.md/json`` and ``ablate_paired.md/json`` into ``out``.

    Raises:
        SystemExit: a directory without evaluated arms, or no arm common to all of them.
    """
    from fleet.experiment.arms import PAIRS

    results: dict[int, dict] = {}
    units = []
    for d in dirs:
        for sd in sorted(Path(d).glob("seed_*")):
            eps = {f.stem: json.loads(f.read_text()) for f in sorted((sd / "episodes").glob("*.json"))}
            if eps:
                units.append(f"{d}/{sd.name}")
                results[len(results)] = eps
    if not results:
        raise SystemExit(f"ablate.pool: no evaluated arms under {[str(d) for d in dirs]} (<dir>/seed_<s>/episodes)")
    common = set.intersection(*(set(r) for r in results.values()))
    if baseline not in common or len(common) < 2:
        raise SystemExit(f"ablate.pool: arms common to every directory: {sorted(common)}; need {baseline!r} and another")
    names = [baseline] + sorted(common - {baseline})
    out.mkdir(parents=True, exist_ok=True)
    table = success_table({n: [e for r in results.values() for e in r[n]] for n in names})
    table["meta"] = {"pooled": units}
    pairs = [(n, baseline) for n in names if n != baseline]
    pairs += [(n, m) for n in names for m in names if n != m and baseline not in (n, m) and n.startswith("fert")
              and not m.startswith("fert")]
    pairs += [p for p in PAIRS if p[0] in common and p[1] in common and p not in pairs]   # e.g. variant - fert
    paired = paired_over_seeds(results, pairs)
    paired["units"] = units
    write_table(table, out, "ablate")
    write_paired(paired, out, "ablate_paired")
    print("pooled: " + ", ".join(units))
    print("\nheld-out success (Wilson 95% interval):\n" + table_markdown(table), flush=True)
    print("\npaired differences (bootstrap over the pooled runs, then trials):\n" + paired_markdown(paired), flush=True)
    print(f"outputs in {out}: ablate.md/json, ablate_paired.md/json", flush=True)


if __name__ == "__main__":
    main()
