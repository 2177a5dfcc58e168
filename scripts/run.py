"""The main job: the whole fleet-learning experiment on real Meta-World tasks, from a fresh machine.

    make run                                            # embedded default: mw_mid, state-only, CPU, one seed
    python scripts/run.py 'job.seeds=[0,1,2]'           # the protocol: every stage and arm per seed, intervals
                                                        # bootstrapped over seeds, then trials
    python scripts/run.py hydra.run.dir=outputs/myrun   # a fixed run dir: re-running resumes finished stages
    python scripts/run.py 'job.arms=[base,filtered_bc,filtered_bc_retries,fert,fert_no_retries,fert_no_gate]'
    python scripts/run.py robot=shifted                 # demos on near-nominal units, fleet + held-out wider
    python scripts/run.py 'job.fleet_sizes=[1,2,4]'     # + the loop per fleet size -> success_vs_fleet_size.png
    python scripts/run.py experiment=deployed           # recovery, a learned success detector, no sim progress

The protocol is fixed before any result (``fleet.experiment.protocol``): every trial's (task, unit, reset seed) comes
from a plan that does not depend on scheduling. Per experiment seed ``s`` (``<run dir>/seed_<s>/``), stages
(each resumable, recorded in ``seed_<s>/job_state.json``):

1. demos: exactly ``job.demos_per_task`` successful scripted-expert demonstrations per task, from a fixed plan
   on ``robot.demo_units`` (the training units by default; the only expert data).
2. base policies: the AED diffusion policy and the same policy without AED, trained on the demonstrations.
3. fleet rounds (``fert.rounds``): the training units run a fixed plan of ``job.fleet_episodes_per_unit``
   episodes each with the newest published version (v1 = base; ``job.fleet_backend: vector`` steps every unit's
   env in batches, ``fleet.experiment.protocol.VectorFleet``); failed episodes are re-attempted with exploration
   (``fert.retry``: same task, unit and reset seed, growing action noise, tagged ``retry_of``, capped, never on
   held-out units); then the in-loop arms' learners run their FERT round on the store (by default, from the
   version the fleet runs: the success critic refitted on the whole store, its chosen chunks distilled into the
   weights, ``learner.round_init: published``) and ``fert`` publishes the next version through the gate; the new
   version plays the held-out plan alone and with its critic (the learning curve, ``job.curve_trials_per_task``).
4. offline arms (filtered BC, filtered BC + retries, FERT ablations): fine-tuned from their base on the final
   store with the same budget (``fleet.experiment.arms``).
5. held-out evaluation: every arm on the held-out units, the same ``eval.trials_per_task`` trials per task.

Then, over all seeds: ``results.md/json`` (success with Wilson intervals, pooled over seeds; ``learning_curve`` per
seed), ``paired.md/json`` (paired differences, bootstrapped over seeds then trials), ``arms.png`` (with the curve); with ``job.fleet_sizes``, the
fleet-size sweep on seed ``job.seeds[0]``. Ctrl-C stops cleanly; re-running with the same run dir resumes.

This script composes and checks the config; the job itself is library code: ``fleet/experiment/`` (``job.run_job``,
one module per part: state, bases, rounds, offline, sweep, reports).
"""

from __future__ import annotations

import os

import hydra
from omegaconf import DictConfig

import configs.typed  # noqa: F401 - registers the typed config groups before Hydra composes
from fleet.progress import calm_progress
from fleet.refusals import one_line_refusals
from policies.threads import passive_wait

passive_wait()   # before torch loads: OpenMP's idle threads sleep instead of spinning (policies/threads.py)
calm_progress()  # off a terminal, a progress bar redraws every 30 s, not 15 times a second (fleet/progress.py)
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from fleet.experiment.job import run_job  # imported after passive_wait and calm_progress


@hydra.main(version_base=None, config_path="../configs", config_name="config")
@one_line_refusals("job")   # a refusal (store, registry, policy): one line, exit 2, the trace in the run's log
def main(cfg: DictConfig) -> None:
    from configs.schema import check_or_exit

    check_or_exit(cfg)   # every value against its rule, before any work
    from fleet.progress import tee_stdout_to_log

    with tee_stdout_to_log():   # run.log holds the stage lines, the learning curve and the tables too
        run_job(cfg)


if __name__ == "__main__":
    main()
