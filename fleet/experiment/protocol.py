"""The experiment's trial plans: which (task, unit, reset seed) every stage runs, fixed before any result.

Nothing here depends on scheduling: a plan names the unit of every trial, and the coordinator runs each
unit's trials in order (``Fleet.run(plan=...)``), so the same config and seed give the same demonstrations,
the same fleet episodes and the same retries whatever unit finishes first.

Seed streams (``fleet.worker.episode_seed(stream, unit, k)``), apart per purpose and per experiment seed:

* demonstrations: ``3000 + seed``; fleet round ``r``: ``5000 + 100 * seed + r``; held-out evaluation:
  ``eval.seed`` (the same trials for every arm and every seed, so arms are paired trial by trial).

Failure-guided exploration (``retry_plan`` / ``run_retries``): a failed fleet episode of a training unit is
re-attempted on the same unit from the same reset seed, with temporally correlated action noise and/or a
higher temperature of the policy's initial denoising noise (``fleet.worker.Exploration``), up to ``attempts``
times, stopping at the first success; the noise grows by ``growth`` (the temperature by
``temperature_growth``) with every attempt, so the exploration scale adapts per failure until it is recovered. Retries
are capped at ``max_share`` of the round's fleet episodes and never run on held-out units. In simulation the
reset seed reproduces the failed trial's initial state; on a real robot, where a reset is impossible, the
retry starts from the failure state instead (not built here).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fleet.fert.config import RetryConfig

log = logging.getLogger(__name__)

DEMO_STREAM, FLEET_STREAM = 3000, 5000


def _plan(tasks: Sequence[str], units: Sequence[int], per_task: dict[str, int], stream: int,
          start: dict[int, int] | None = None) -> list[dict]:
    """Trials round-robin over ``units`` within each task; a unit's k-th trial resets with
    ``episode_seed(stream, unit, start[unit] + k)``."""
    from fleet.worker import episode_seed

    count = {int(u): (start or {}).get(int(u), 0) for u in units}
    plan, g = [], 0
    for task in tasks:
        for _ in range(int(per_task.get(task, 0))):
            u = int(units[g % len(units)])
            g += 1
            plan.append({"task": str(task), "unit_id": u, "seed": episode_seed(stream, u, count[u])})
            count[u] += 1
    return plan


def fleet_plan(tasks: Sequence[str], units: Sequence[int], episodes_per_unit: int, seed: int,
               round_idx: int = 0) -> list[dict]:
    """The fleet's trials of one round: every unit runs ``episodes_per_unit`` episodes, tasks round-robin.

    Returns ``[{"task", "unit_id", "seed"}]`` (``len(units) * episodes_per_unit`` trials).

    Raises:
        ValueError: no tasks or units, or ``episodes_per_unit < 0``.
    """
    from fleet.worker import episode_seed

    if not tasks or not units or int(episodes_per_unit) < 0:
        raise ValueError(f"fleet_plan: expected tasks, units and episodes_per_unit >= 0, given {tasks}, {units}, "
                         f"{episodes_per_unit}")
    stream = FLEET_STREAM + 100 * int(seed) + int(round_idx)
    return [{"task": str(tasks[k % len(tasks)]), "unit_id": int(u), "seed": episode_seed(stream, int(u), k)}
            for k in range(int(episodes_per_unit)) for u in units]


def collect_demos(cfg: dict, units: Sequence[int], demos_per_task: int, noise_std: float, seed: int,
                  store_url: str, max_waves: int = 5, progress: bool = True) -> dict:
    """Exactly ``demos_per_task`` successful scripted-expert demonstrations per task, from a fixed plan.

    Wave 1 runs ``demos_per_task`` trials per task, round-robin over ``units``; each later wave runs, per task,
    as many new trials (the next seeds of each unit's stream) as successes are missing. The plan depends only
    on the config and ``seed``; the expert's noise follows the reset seed, so the demonstrations are the same
    every run.

    Returns:
        ``{"episodes": n committed, "successes": {task: n}, "waves": w}``.

    Raises:
        RuntimeError: a task still lacks demonstrations after ``max_waves`` waves (the expert fails there).
    """
    from fleet.coordinator import Fleet

    tasks = list(cfg["task"]["tasks"])
    c = {**cfg, "fleet": {**cfg["fleet"], "tasks_per_unit": None}}
    need = {t: int(demos_per_task) for t in tasks}
    start: dict[int, int] = {}
    got = {t: 0 for t in tasks}
    n_eps, wave = 0, 0
    with Fleet(c, policy={"kind": "expert", "noise_std": float(noise_std)}, units=list(units), tasks=tasks,
               store_url=store_url, is_demo=True) as fleet:
        while any(need.values()) and wave < max_waves:
            plan = _plan(tasks, units, need, DEMO_STREAM + int(seed), start)
            res = fleet.run(plan=plan, progress=progress)
            for t in plan:
                start[t["unit_id"]] = start.get(t["unit_id"], 0) + 1
            for e in res.episodes:
                n_eps += 1
                if e["success"]:
                    got[e["task"]] += 1
            need = {t: int(demos_per_task) - got[t] for t in tasks}
            wave += 1
    if any(v > 0 for v in need.values()):
        raise RuntimeError(f"collect_demos: after {wave} waves the expert still lacks {need} successful "
                           "demonstrations; check scripts/sim_check.py")
    return {"episodes": n_eps, "successes": got, "waves": wave}


def policy_failures(failures: Sequence[dict], heldout: Sequence[int]) -> list[dict]:
    """The failed fleet trials of training units: ``failures`` without held-out units and without failed
    retries (``retry_of``: failures of the exploration, not of the policy). Retried and replayed alike."""
    held = {int(u) for u in heldout}
    return [f for f in failures if int(f["unit_id"]) not in held and not f.get("retry_of")]


def success_by_task(trials) -> dict[str, list[int]]:
    """``{task: [successes, trials]}`` of episode summaries or ``EpisodeMeta`` (``task``, ``success``)."""
    out: dict[str, list[int]] = {}
    for t in trials:
        task, ok = (t["task"], t["success"]) if isinstance(t, dict) else (t.task, t.success)
        cell = out.setdefault(str(task), [0, 0])
        cell[0] += int(bool(ok))
        cell[1] += 1
    return out


def retry_plan(failures: Sequence[dict], cfg: dict, attempt: int, heldout: Sequence[int], budget: int) -> list[dict]:
    """Retry trials of one exploration wave.

    Args:
        failures: failed fleet episode summaries (``episode_id``, ``task``, ``unit_id``, ``seed``) still
            unrecovered; retries and held-out units are skipped.
        cfg: ``fert.retry``: a :class:`fleet.fert.config.RetryConfig` or a mapping of its keys (a key
            left out takes its default). attempt: 0-based wave number (held action noise std
            ``action_noise_std * growth ** attempt``; denoising-noise temperature
            ``noise_temperature * temperature_growth ** attempt``). heldout: held-out unit ids (never retried).
        budget: retry episodes left (the plan is cut to it).

    Returns:
        ``[{"task", "unit_id", "seed", "explore": {...}}]``.

    Raises:
        configs.rules.ConfigError: (a ``ValueError``) an unknown ``fert.retry`` key or a value out of range.
    """
    cfg = RetryConfig.from_dict(cfg).to_dict()
    std = float(cfg["action_noise_std"]) * float(cfg["growth"]) ** int(attempt)
    temp = float(cfg["noise_temperature"]) * float(cfg["temperature_growth"]) ** int(attempt)
    out = []
    for f in policy_failures(failures, heldout):
        out.append({"task": f["task"], "unit_id": int(f["unit_id"]), "seed": int(f["seed"]),
                    "explore": {"action_noise_std": std, "hold_steps": int(cfg["hold_steps"]),
                                "noise_temperature": temp, "retry_of": f["episode_id"], "attempt": int(attempt)}})
    return out[:max(int(budget), 0)]


def committed_retries(reader, version: int | None = None) -> dict[tuple[str, int], dict]:
    """The retry episodes already in the store, by ``(retry_of, attempt)``: summaries ``{"episode_id", "task",
    "unit_id", "seed", "retry_of", "attempt", "success", "length", "policy_version"}`` (of acting version
    ``version`` when given). The store's own record decides what was committed (not a clock, not the driver's
    memory), so a resumed round finds the retries a killed one committed."""
    from fleet.fert.contexts import retry_of

    out = {}
    for m in reader.episodes(is_demo=False):
        parent = retry_of(m)
        if parent is None or (version is not None and int(m.policy_version) != int(version)):
            continue
        attempt = int((m.extra or {}).get("attempt", 0))
        out.setdefault((str(parent), attempt), {
            "episode_id": m.episode_id, "task": m.task, "unit_id": int(m.unit_id), "seed": int(m.seed),
            "retry_of": str(parent), "attempt": attempt, "success": bool(m.success), "length": int(m.length),
            "policy_version": int(m.policy_version)})
    return out


def run_retries(fleet, failures: Sequence[dict], cfg: dict, heldout: Sequence[int], n_fleet_episodes: int,
                progress: bool = True, committed: dict[tuple[str, int], dict] | None = None) -> dict[str, Any]:
    """Failure-guided exploration: re-attempt ``failures`` on ``fleet`` in waves until recovered or out of
    attempts / budget (``max_share * n_fleet_episodes`` retry episodes).

    ``committed``: retries already in the store (:func:`committed_retries`, a resumed round): those trials are taken
    from it, not run (and committed) again; the waves, the budget and the record are the same as a run without a
    stop.

    Returns:
        ``{"failures", "recovered", "recovered_share", "retries", "per_attempt": [{"attempt", "std",
        "temperature", "run", "recovered"}], "episodes": [summaries], "found": retries taken from the store}``.
    """
    cfg = RetryConfig.from_dict(cfg).to_dict()
    budget = int(float(cfg["max_share"]) * int(n_fleet_episodes))
    todo = policy_failures(failures, heldout)
    n_fail = len(todo)
    committed = committed or {}
    episodes, per_attempt, found = [], [], 0
    for attempt in range(int(cfg["attempts"])):
        plan = retry_plan(todo, cfg, attempt, heldout, budget - len(episodes))
        if not plan:
            break
        have = [committed[(t["explore"]["retry_of"], attempt)] for t in plan
                if (t["explore"]["retry_of"], attempt) in committed]
        run = [t for t in plan if (t["explore"]["retry_of"], attempt) not in committed]
        found += len(have)
        episodes += have
        if run:
            res = fleet.run(plan=run, progress=progress)
            episodes += res.episodes
        res_eps = have + (res.episodes if run else [])
        won = {e["retry_of"] for e in res_eps if e["success"]}
        per_attempt.append({"attempt": attempt, "std": round(plan[0]["explore"]["action_noise_std"], 4),
                            "temperature": round(plan[0]["explore"]["noise_temperature"], 4), "run": len(plan),
                            "recovered": len(won)})
        todo = [f for f in todo if f["episode_id"] not in won]
    recovered = n_fail - len(todo)
    return {"failures": n_fail, "recovered": recovered, "recovered_share": recovered / n_fail if n_fail else None,
            "retries": len(episodes), "per_attempt": per_attempt, "episodes": episodes, "found": found}


def failure_replay(cfg: dict, checkpoint: str, failures: Sequence[dict], store_url: str,
                   heldout: Sequence[int] = (), batch_size: int = 32) -> dict[str, Any]:
    """Did the fleet learn from its failures? Re-run a round's failed fleet trials with another policy version.

    Every failed fleet trial of a training unit (``{"task", "unit_id", "seed"}``; retries and held-out units are
    skipped) is played again, unperturbed, by ``checkpoint`` from the same reset seed, its denoising noise seeded
    by the reset seed as on a fleet worker (``fleet.experiment.evaluation.run_plan_vectorised``; the episodes go to
    ``store_url``, never the training store). The version that failed them fails every one again (each trial is
    a function of (task, unit, seed, weights)), so ``solved`` counts what the update changed on exactly the
    states where the fleet failed. It is a training-set figure: the held-out evaluation says whether it
    generalises. Measured on a frozen default store (docs/RESULTS.md): after fine-tuning on them, the policy
    solved 4 of 38 push failures although 14 of those had a successful noisy retry in its data, against 10 of
    38 with retries explored by denoising temperature; reach 11 of 20.

    Returns:
        ``{"failures": n, "solved": k, "share": k / n (None when n = 0), "per_task": {task: [k, n]}}``.
    """
    from fleet.experiment.evaluation import run_plan_vectorised

    plan = [{"task": str(f["task"]), "unit_id": int(f["unit_id"]), "seed": int(f["seed"])}
            for f in policy_failures(failures, heldout)]
    per_task = success_by_task(run_plan_vectorised(cfg, checkpoint, plan, store_url, batch_size=batch_size,
                                                   desc="failure replay")) if plan else {}
    solved = sum(v[0] for v in per_task.values())
    return {"failures": len(plan), "solved": solved, "share": solved / len(plan) if plan else None,
            "per_task": per_task}


def reexplore(c: dict, reader, policy: str, heldout: Sequence[int], dst_url: str,
              progress: bool = True) -> dict[str, Any]:
    """Re-run failure-guided exploration on a frozen fleet store with other ``fert.retry`` settings.

    The frozen store's episodes except its failure retries are copied into a new store at ``dst_url``
    (``experience_dict.store.copy_episodes``); then the failed fleet episodes of training units are
    re-attempted there by ``policy`` (the checkpoint the fleet acted with) under ``c["fert"]["retry"]``
    (:func:`run_retries`, the same seeds, units and budget rule as the fleet loop). The arms then train on the
    new store: the same demonstrations, fleet successes and failures, only the exploration differs, so two
    exploration schemes are compared on identical failures (``scripts/ablate.py ablate.reexplore=true``).

    Args:
        c: the run's config as a dict (``fert.retry``, ``robot``, ``fleet``, ...). reader: the frozen store.
        policy: checkpoint directory that acts in the retries. heldout: held-out units (never retried).
        dst_url: the new store (must not exist yet).

    Returns:
        :func:`run_retries`'s record without ``episodes``, plus ``"copied"`` (episodes copied) and
        ``"fleet_episodes"`` (the frozen store's fleet episodes, the budget base).

    Raises:
        FileExistsError: ``dst_url`` already holds a store.
    """
    import fsspec

    from experience_dict.store import copy_episodes
    from fleet.coordinator import Fleet
    from fleet.fert.contexts import retry_of

    fs, path = fsspec.core.url_to_fs(str(dst_url))
    if fs.exists(path):
        raise FileExistsError(f"reexplore: {dst_url} exists; the new store must start empty")
    reader.refresh()
    keep = [m for m in reader.episodes() if not retry_of(m)]
    ids = copy_episodes(reader, str(dst_url), keep)
    held = {int(u) for u in heldout}
    fleet_eps = [m for m in keep if not m.is_demo and int(m.unit_id) not in held]
    fails = [{"episode_id": ids[m.episode_id], "task": m.task, "unit_id": int(m.unit_id), "seed": int(m.seed)}
             for m in fleet_eps if not m.success]
    units = sorted({f["unit_id"] for f in fails})
    out = {"failures": len(fails), "recovered": 0, "recovered_share": None, "retries": 0, "per_attempt": []}
    if fails:
        with Fleet(c, policy=str(policy), units=units, store_url=str(dst_url)) as fleet:
            out = run_retries(fleet, fails, dict(c["fert"].get("retry") or {}), heldout, len(fleet_eps), progress)
        out.pop("episodes", None)
    return {**out, "copied": len(ids), "fleet_episodes": len(fleet_eps)}


class VectorFleet:
    """The synchronous protocol's fleet stepped in batches instead of Ray actors: a plan's trials (fleet episodes
    and failure retries alike) run through ``fleet.experiment.evaluation.run_plan_parallel``, ``batch_size`` robot units'
    envs stepped together with one batched policy call per control step, in ``processes`` spawned processes split
    by unit (each unit's store shard keeps one writer, ``fleet.worker.writer_id``, as on a Ray worker).

    Every trial's denoising noise comes from a generator seeded with its reset seed (a retry's from
    ``fleet.worker.retry_noise_seed``), so a trial's episode does not depend on which others share its batch,
    and a round is reproducible from its plan (its speed against the Ray fleet: docs/PERFORMANCE.md,
    ``scripts/bench_fleet.py``). It has the interface
    :func:`run_retries` uses: ``run(plan=..., progress=...)`` returning an object with ``episodes``.

    Args:
        cfg: the plain job config (``robot``, ``obs``, ``task``, ``store``; ``eval.max_envs`` bounds pooled envs).
        checkpoint: the ``pretrained_model`` directory every trial acts with (a registry version's copy: its
            ``MANIFEST.json`` gives the ``policy_version`` committed with each episode).
        store_url: the experience store the episodes are committed to.
        batch_size: envs stepped together per process. processes: spawned processes (1: this process).
        with_critic: False: the checkpoint's weights act alone (K = 1) even when it carries a success critic
            (``job.fleet_critic``); its episodes keep the version's number.
        acting: a ``fleet.labels.Acting`` (labels from a person or the success detector, recovery from the failure
            state; ``run(acting=)`` overrides it per call); None: the simulator labels and ends episodes.
    """

    def __init__(self, cfg: dict, checkpoint: str, store_url: str, batch_size: int = 32, processes: int = 2,
                 with_critic: bool = True, acting=None):
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        self.cfg, self.checkpoint, self.store_url = cfg, str(checkpoint), str(store_url)
        self.batch_size, self.processes = int(batch_size), max(1, int(processes))
        self.with_critic, self.acting = bool(with_critic), acting
        self._ex = (ProcessPoolExecutor(self.processes, mp_context=mp.get_context("spawn"))
                    if self.processes > 1 else None)
        self.steps = 0

    def run(self, plan: list[dict], progress: bool = True, desc: str = "fleet", acting=None):
        """Run ``plan`` (``[{"task", "unit_id", "seed"[, "explore"]}]``); returns a namespace with ``episodes``
        (one summary per trial, in plan order; ``fleet.experiment.evaluation.run_plan_vectorised``; a trial's
        recovery episodes under its ``recoveries``). ``acting``: this call's, else the fleet's."""
        from types import SimpleNamespace

        from fleet.experiment.evaluation import run_plan_parallel

        eps = run_plan_parallel(self.cfg, self.checkpoint, plan, self.store_url, self.batch_size, self.processes,
                                progress, desc, executor=self._ex, with_critic=self.with_critic,
                                acting=acting if acting is not None else self.acting) if plan else []
        self.steps += sum(int(e["length"]) + sum(int(x["length"]) for x in e.get("recoveries", ())) for e in eps)
        return SimpleNamespace(episodes=eps, failures=[])

    def close(self) -> None:
        if self._ex is not None:
            self._ex.shutdown()
            self._ex = None

    def __enter__(self) -> VectorFleet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
