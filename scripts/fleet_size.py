"""The fleet-size sweep on a finished seed: does a larger fleet learn more at a fixed collection per robot?

    python scripts/fleet_size.py fleet_size.from_dir=outputs/<date>/<time>/seed_0 'fleet_size.sizes=[4,16,64]'

After the seed paper's figure ("Learning from Fleet Experience": at fixed collection time per robot, 79.2 -> 98.3 %
with 96 robots). For every fleet size ``n`` the main loop runs again (``fleet.experiment.sweep.fleet_size_sweep``):
the first ``n`` units of ``fleet_size.train_units`` each run the same episodes per round (the seed's
``job.fleet_episodes_per_unit`` unless ``fleet_size.episodes_per_unit``), the same rounds, retries or recovery
attempts, labels (the seed's success detector under ``experiment=deployed``: the labelling effort is paid once),
learner and gate, from the seed's demonstrations and base. Then filtered BC + retries is fine-tuned on each size's
store with the same budget, and the base, every size's ``fert`` (K = 1) and filtered BC play the seed's held-out
plan. Outputs in the run dir: ``fleet_size.md/json``, ``fleet_size_paired.md/json`` (each size against the next
smaller, fert against filtered BC per size), ``success_vs_fleet_size.png``, ``sweep/n<n>/`` per size. Resumable:
re-run with the same ``hydra.run.dir``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from configs.scripts import FleetSizeConfig
from fleet.progress import calm_progress
from policies.threads import passive_wait

passive_wait()   # before torch loads: OpenMP's idle threads sleep instead of spinning (policies/threads.py)
calm_progress()  # off a terminal, a progress bar redraws every 30 s, not 15 times a second (fleet/progress.py)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def run(cfg) -> dict:
    """The sweep of ``cfg.fleet_size`` in ``cfg.output_dir``; returns ``fleet_size_sweep``'s record.

    Raises:
        SystemExit: no or an unfinished ``from_dir``; sizes outside the training units.
    """
    from fleet.experiment.state import seed_config
    from fleet.experiment.sweep import sweep_report
    from sim import unit_lists

    a = FleetSizeConfig.from_dict(cfg.fleet_size)
    if not a.from_dir:
        raise SystemExit("fleet_size.from_dir: give a finished seed dir, e.g. "
                         "fleet_size.from_dir=outputs/<date>/<time>/seed_0")
    src = Path(a.from_dir).resolve()
    state_path = src / "job_state.json"
    if not state_path.is_file() or not (src / "config.json").is_file():
        raise SystemExit(f"fleet_size.from_dir={src}: not a seed dir (no job_state.json / config.json; run "
                         "scripts/run.py first)")
    base = (json.loads(state_path.read_text()).get("base") or {}).get("checkpoint")
    if not base:
        raise SystemExit(f"fleet_size.from_dir={src}: its base policy is not trained yet")
    out = Path(str(cfg.output_dir)).resolve()
    out.mkdir(parents=True, exist_ok=True)
    src_c = json.loads((src / "config.json").read_text())
    c = seed_config(src_c, src, int(src_c["seed"]))   # the seed's store: the demonstrations are read from it
    c["robot"] = {**c["robot"], "train_units": a.train_units}
    if a.episodes_per_unit is not None:
        c["job"] = {**c["job"], "sweep_episodes_per_unit": int(a.episodes_per_unit)}
    else:
        c["job"] = {**c["job"], "sweep_episodes_per_unit": int(c["job"]["fleet_episodes_per_unit"])}
    train_units, heldout = unit_lists(c["robot"])
    if (src / "detector").is_dir() and not (out / "detector").exists():
        import shutil

        shutil.copytree(src / "detector", out / "detector")
    (out / "config.json").write_text(json.dumps({**c, "fleet_size": a.to_dict()}, indent=1))
    print(f"fleet-size sweep -> {out}\n  from {src}; sizes {a.sizes} of units {train_units[:max(a.sizes)]}; "
          f"{c['job']['sweep_episodes_per_unit']} episodes per unit per round, {c['fert']['rounds']} rounds; "
          f"held-out units {heldout}", flush=True)
    try:
        return sweep_report({"config": c, "checkpoints": {"base": base}}, out, out, list(a.sizes), train_units,
                            heldout)
    except ValueError as e:
        raise SystemExit(f"fleet_size: {e}") from None


def main() -> None:
    import hydra

    import configs.typed  # noqa: F401 - registers the typed config groups before Hydra composes
    from fleet.refusals import one_line_refusals

    @hydra.main(version_base=None, config_path="../configs", config_name="config")
    @one_line_refusals("fleet-size sweep")
    def _main(cfg) -> None:
        from configs.schema import check_or_exit

        check_or_exit(cfg)
        run(cfg)

    _main()


if __name__ == "__main__":
    main()
