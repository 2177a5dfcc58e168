"""The experiment protocol and the main job as library code (``scripts/run.py`` composes and checks the config,
then calls ``job.run_job``).

The protocol, used by the job, ``scripts/eval.py``, ``scripts/ablate.py`` and ``scripts/async_run.py``:

- ``protocol``: fixed trial plans (``fleet_plan``, ``collect_demos``), the failure retries (``retry_plan``,
  ``run_retries``) and ``VectorFleet``, a round's fleet stepped in batches;
- ``arms``: the compared policies (``ARMS``), their learners and offline training;
- ``evaluation`` / ``eval_config``: held-out evaluation plans and ``evaluate_arms``; the typed ``eval`` group;
- ``tables``: Wilson success tables, paired differences (over trials and over seeds), plots;
- ``curve``: the learning curve of the published versions.

The job's stages, in the order it runs them:

- ``state``: each seed's config (``seed_config``: its store, registry and caches in ``<run dir>/seed_<s>/``),
  ``JobState`` (the finished stages and their outputs, ``job_state.json``) and ``Stages`` (the stage lines);
- ``bases``: the demonstrations (``stage_demos``, ``demo_config``) and the base policies (``stage_base``,
  ``train_base``, ``select_base_by_success``);
- ``rounds``: the fleet rounds (``stage_fleet_rounds``, ``fleet_round``), the in-loop learners, failure replay and
  the learning curve (``record_curve``); ``staleness_summary`` for ``scripts/async_run.py``;
- ``offline``: the offline arms (``stage_offline_arms``, in the background with ``start_offline_arms``);
- ``sweep``: the fleet-size sweep (``fleet_size_sweep``, ``sweep_report``);
- ``reports``: ``results.md/json``, ``paired.md/json``, ``arms.png``, the unit table, videos and the wandb log;
- ``job``: ``run_seed`` (every stage of one experiment seed) and ``run_job`` (the whole job over the seeds).

Importing these modules loads neither torch nor MuJoCo: ``sim`` (which picks the GL backend when imported), the
trainer, the window sampler and ``fleet.fert`` are imported inside the functions that use them,
so a config refused by ``scripts/run.py`` or ``--cfg job`` stays quick and ``policies.threads.passive_wait``
runs before torch loads.
"""
