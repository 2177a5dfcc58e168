"""Held-out evaluation of policy arms and rollout videos.

``evaluate_arms`` runs every arm's checkpoint on the held-out units through the fleet
(``fleet.coordinator.evaluate``: Ray workers, episodes committed to a separate evaluation store, never to the
training store) and returns the episode results; ``record_rollouts`` renders a few held-out episodes of a
checkpoint into MP4 files labelled success / failure.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from fleet.experiment.eval_config import EvalConfig

log = logging.getLogger(__name__)


def evaluation_plan(tasks: list[str], units: list[int], trials_per_task: int, seed: int = 1000) -> list[dict]:
    """The held-out trials every arm runs: the same ``(task, unit, reset seed)`` list for every policy.

    Giving each arm the same initial states (common random numbers) removes the initial-state variance from
    the differences between arms, so they can be compared trial by trial (:func:`fleet.experiment.tables.paired_differences`).
    The ``g``-th trial overall (tasks in order, ``trials_per_task`` each) runs on ``units[g % len(units)]``, so units
    get equal shares; a unit's ``k``-th trial resets with ``fleet.worker.episode_seed(seed, unit, k)``. With tasks
    of several embodiments (a mixed fleet), ``g`` and ``k`` count within each embodiment's tasks: its trials are
    those of a plan of its tasks alone (paired with single-embodiment runs on the same plan seed).

    Args:
        tasks: task names; units: unit ids (>= 1); trials_per_task: >= 1; seed: the seed stream of the plan
            (``eval.seed``), apart from the training fleet's ``seed``.

    Returns:
        ``[{"task": str, "unit_id": int, "seed": int, "trial": int}, ...]``, ``len(tasks) * trials_per_task`` trials.

    Raises:
        ValueError: no tasks, no units or ``trials_per_task < 1``.
    """
    from fleet.worker import episode_seed

    if not tasks or not units or int(trials_per_task) < 1:
        raise ValueError(f"evaluation_plan: expected tasks, units and trials_per_task >= 1, given tasks={tasks}, "
                         f"units={units}, trials_per_task={trials_per_task}")
    groups: dict[str, list[str]] = {}   # a mixed fleet's tasks, per embodiment in order of first appearance
    for task in tasks:
        groups.setdefault(_embodiment_of(task), []).append(task)
    plan = []
    for group in groups.values():   # each embodiment's trials are those of a plan of its tasks alone, so a mixed
        count = {int(u): 0 for u in units}   # fleet's arms pair trial for trial with single-embodiment runs
        for i, task in enumerate(group):
            for j in range(int(trials_per_task)):
                u = int(units[(i * int(trials_per_task) + j) % len(units)])
                plan.append({"task": str(task), "unit_id": u, "seed": episode_seed(int(seed), u, count[u]),
                             "trial": j})
                count[u] += 1
    order = {t: k for k, t in enumerate(tasks)}
    return sorted(plan, key=lambda tr: order[tr["task"]])   # tasks in the given order (stable within a task)


def _embodiment_of(task: str) -> str:
    """The embodiment of ``task``'s registered suite (``sim.suite_of``); a name no suite knows keeps its own group."""
    import sim

    try:
        return sim.suite_of(task).embodiment
    except (KeyError, ValueError):
        return "?"


def evaluate_arms(cfg: dict, arms: dict[str, str], out_dir: str | Path, trials_per_task: int,
                  units: list[int] | None = None, progress: bool = True,
                  tasks: list[str] | None = None, acting=None) -> dict[str, list[dict]]:
    """Evaluate each arm's checkpoint on held-out units, one arm after the other on one set of workers.

    Args:
        cfg: plain config dict (``robot``, ``obs``, ``task``, ``store``, ``fleet``, ``seed``; ``eval.seed``).
        arms: ``{arm name: pretrained_model directory}``.
        out_dir: the evaluation episodes are committed to ``<out_dir>/eval_store`` (never the training
            store); each arm's episode summaries go to ``<out_dir>/episodes/<arm>.json`` (an arm whose file
            exists is not run again, so an interrupted evaluation resumes).
        trials_per_task: episodes per task per arm, spread over ``units``.
        units: default ``cfg["robot"]["heldout_units"]``.
        tasks: default ``cfg["task"]["tasks"]``.
        acting: a ``fleet.labels.Acting`` whose labels the episodes get (the validation gate of a fleet labelled by
            its success detector; vectorised backend only); None: the simulator's (every held-out evaluation).

    Returns:
        ``{arm: [{"task", "unit_id", "seed", "success", "length", "policy_version", "episode_id", ...}, ...]}``.
        Every arm runs the same :func:`evaluation_plan` (same units, tasks and reset seeds; the denoising noise
        follows the seed too), so arms are compared on identical initial states. With the vectorised backend an
        arm whose checkpoint has the same :func:`checkpoint_fingerprint` as an arm already run in this call
        reuses that arm's episodes (marked ``same_checkpoint_as``; nothing is committed again): e.g. ``fert``
        and ``fert_finetuned`` when the gate published the fine-tuned candidate. So does an arm whose checkpoint
        an earlier call into the same ``out_dir`` ran on the same plan (``episodes/fingerprints.json``), e.g. the
        final ``fert`` arm and the learning curve's last point.
    """
    out = Path(out_dir)
    results: dict[str, list[dict]] = {}
    todo = {}
    for arm, ckpt in arms.items():
        cache = out / "episodes" / f"{arm}.json"
        if cache.is_file():
            results[arm] = json.loads(cache.read_text())
        else:
            todo[arm] = ckpt
    if not todo:
        return results
    c = {**cfg, "fleet": {**cfg["fleet"], "tasks_per_unit": None}}
    units = [int(u) for u in (units if units is not None else c["robot"]["heldout_units"])]
    tasks = list(tasks or c["task"]["tasks"])
    ecfg = EvalConfig.from_dict(c.get("eval"))
    plan = evaluation_plan(tasks, units, int(trials_per_task), ecfg.seed)
    if ecfg.backend == "vector":
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        n_proc = max(1, min(ecfg.processes, len(units)))
        # one pool for every arm: its processes keep their envs (fleet.experiment.evaluation._ENVS) from arm to arm
        ex = ProcessPoolExecutor(n_proc, mp_context=mp.get_context("spawn")) if n_proc > 1 else None
        import hashlib

        plan_id = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]
        index_path = out / "episodes" / "fingerprints.json"   # (checkpoint, plan) -> arm, across calls
        index = json.loads(index_path.read_text()) if index_path.is_file() else {}
        try:
            evaluated: dict[str, str] = {}   # checkpoint fingerprint -> the arm that ran it
            for key, src in index.items():   # arms of earlier calls on this plan; their episodes read when used
                if key.endswith(plan_id) and (out / "episodes" / f"{src}.json").is_file():
                    evaluated[key[: -len(plan_id) - 1]] = src
            for arm, ckpt in todo.items():
                fp = checkpoint_fingerprint(ckpt)
                if fp in evaluated:   # a trial is a function of (task, unit, reset seed, checkpoint): same episodes
                    if evaluated[fp] not in results:
                        results[evaluated[fp]] = json.loads((out / "episodes" / f"{evaluated[fp]}.json").read_text())
                    src = evaluated[fp]
                    log.info("arm %s: the same checkpoint as arm %s (weights, critic, config); its %d episodes "
                             "are reused", arm, src, len(results[src]))
                    eps = [e | {"arm": arm, "same_checkpoint_as": src} for e in results[src]]
                else:
                    log.info("evaluating arm %s (%s) on units %s (vectorised)", arm, ckpt, units)
                    eps = [e | {"arm": arm} for e in run_plan_parallel(c, str(ckpt), plan, out / "eval_store",
                                                                      ecfg.batch_size, n_proc,
                                                                      progress, arm, executor=ex, acting=acting)]
                    evaluated[fp] = arm
                cache = out / "episodes" / f"{arm}.json"
                cache.parent.mkdir(parents=True, exist_ok=True)
                cache.write_text(json.dumps(eps))
                results[arm] = eps
                if eps and "same_checkpoint_as" not in eps[0]:
                    index[f"{fp}:{plan_id}"] = arm
                    index_path.write_text(json.dumps(index, indent=1))
        finally:
            if ex is not None:
                ex.shutdown()
        return {a: results[a] for a in arms}
    from fleet.coordinator import Fleet

    if acting is not None:
        raise ValueError("evaluate_arms: labels other than the simulator's need eval.backend=vector")
    first = next(iter(todo.values()))
    with Fleet(c, policy=str(first), units=units, tasks=tasks, store_url=str(out / "eval_store"),
               is_demo=False) as fleet:
        for arm, ckpt in todo.items():
            log.info("evaluating arm %s (%s) on units %s", arm, ckpt, units)
            res = fleet.run(plan=plan, progress=progress, policy=str(ckpt))
            if res.failures:
                log.warning("arm %s: %d failed calls: %s", arm, len(res.failures), "; ".join(res.failures[-3:]))
            eps = [{k: _jsonable(v) for k, v in e.items()} | {"arm": arm} for e in res.episodes]
            cache = out / "episodes" / f"{arm}.json"
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(eps))
            results[arm] = eps
    return {a: results[a] for a in arms}


def checkpoint_fingerprint(checkpoint: str | Path) -> str:
    """SHA-256 over the names and bytes of a ``pretrained_model`` directory's files (weights, config, statistics,
    tokenizer, success critic), leaving out the registry's ``MANIFEST.json``: two directories with the same
    fingerprint act identically (a registry copy of a version and the directory it was published from agree).

    Raises:
        FileNotFoundError: ``checkpoint`` is not a directory.
    """
    import hashlib

    from fleet.registry import MANIFEST, sha256_file

    d = Path(checkpoint)
    if not d.is_dir():
        raise FileNotFoundError(f"checkpoint {str(d)!r} is not a directory")
    files = sorted(p for p in d.iterdir() if p.is_file() and p.name != MANIFEST)
    return hashlib.sha256("\n".join(f"{f.name} {sha256_file(f)[0]}" for f in files).encode()).hexdigest()


def run_plan_parallel(cfg: dict, checkpoint: str, plan: list[dict], store_url: str | Path, batch_size: int = 32,
                      processes: int = 2, progress: bool = True, desc: str = "eval", executor=None,
                      with_critic: bool = True, acting=None) -> list[dict]:
    """:func:`run_plan_vectorised` split over ``processes`` spawned processes by unit (so each unit's store shard
    has one writer), one torch thread each; summaries returned in plan order. ``processes <= 1`` runs here.
    ``executor``: a spawn-context ``ProcessPoolExecutor`` to reuse (its processes keep their envs).
    ``with_critic``, ``acting``: as in :func:`run_plan_vectorised`."""
    units = sorted({int(t["unit_id"]) for t in plan})
    parts = [[t for t in plan if units.index(int(t["unit_id"])) % max(processes, 1) == k] for k in range(max(processes, 1))]
    parts = [p for p in parts if p]
    if len(parts) <= 1:
        res = run_plan_vectorised(cfg, checkpoint, plan, store_url, batch_size, 1, progress, desc, with_critic, acting)
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        ex = executor or ProcessPoolExecutor(len(parts), mp_context=mp.get_context("spawn"))
        try:
            futs = [ex.submit(run_plan_vectorised, cfg, checkpoint, p, store_url, batch_size, 1, progress and k == 0,
                              f"{desc} (1 of {len(parts)} processes)", with_critic, acting)
                    for k, p in enumerate(parts)]
            res = [e for f in futs for e in f.result()]
        finally:
            if executor is None:
                ex.shutdown()
    by_trial = {(e["task"], e["unit_id"], e["seed"]): e for e in res}
    return [by_trial[(str(t["task"]), int(t["unit_id"]), int(t["seed"]))] for t in plan]


def _jsonable(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    return v


def record_rollouts(cfg: dict, checkpoint: str | Path, out_dir: str | Path, units: list[int], tasks: list[str],
                    max_videos: int = 2, max_episodes: int = 12, camera: str = "corner", size: int = 128,
                    seed: int = 10_000) -> list[Path]:
    """Roll a checkpoint out on held-out units with a camera on and save MP4s of successes and failures.

    Runs in this process (no Ray): for each task in turn, episodes on ``units`` until ``max_videos``
    successes and ``max_videos`` failures are saved overall or ``max_episodes`` episodes are spent. The
    policy acts on the same observation keys as in training; the camera image is only recorded.

    Returns:
        paths of ``<out_dir>/<task>_unit<id>_<success|failure>_<n>.mp4`` (80 Hz control rendered at 20 fps,
        every 4th step).
    """
    import imageio.v2 as imageio

    from fleet.acting import TorchPolicy, load_checkpoint
    from sim import make_env

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, version = load_checkpoint(checkpoint, "cpu")
    policy = TorchPolicy(model, version)
    img_key = f"observation.images.{camera}"
    policy_keys = set(getattr(model.config, "input_shapes", {}) or {})
    uses_camera = img_key in policy_keys
    cams = list(dict.fromkeys([*(cfg["obs"].get("cameras") or []), camera])) if uses_camera else [camera]
    obs_cfg = {**dict(cfg["obs"]), "images": True, "cameras": cams,
               "image_size": int(cfg["obs"]["image_size"] if uses_camera else size)}
    saved: list[Path] = []
    counts = {True: 0, False: 0}
    for i in range(max_episodes):
        if counts[True] >= max_videos and counts[False] >= max_videos:
            break
        task, unit = tasks[i % len(tasks)], units[(i // len(tasks)) % len(units)]
        env = make_env(task=task, unit_id=unit, robot_cfg=cfg["robot"], obs_cfg=obs_cfg, task_cfg=cfg["task"])
        obs, info = env.reset(seed=seed + i)
        policy.reset()
        frames, success, done, t = [obs[img_key]], False, False, 0
        while not done:
            action = policy.select_action({k: v for k, v in obs.items() if k != img_key or uses_camera})
            obs, _, terminated, truncated, info = env.step(action)
            success = success or bool(info["success"])
            done = terminated or truncated
            t += 1
            if t % 4 == 0:
                frames.append(obs[img_key])
        env.close()
        if counts[success] >= max_videos:
            continue
        counts[success] += 1
        path = out / f"{task}_unit{unit}_{'success' if success else 'failure'}_{counts[success]}.mp4"
        imageio.mimsave(path, frames, fps=20, macro_block_size=1)
        saved.append(path)
    return saved


# ---------------------------------------------------------------------------------------------------- vectorised
def run_plan_vectorised(cfg: dict, checkpoint: str | Path, plan: list[dict], store_url: str | Path,
                        batch_size: int = 32, torch_threads: int = 1, progress: bool = False,
                        desc: str = "eval", with_critic: bool = True, acting=None) -> list[dict]:
    """Run ``plan``'s trials with one policy in this process, ``batch_size`` envs stepped together and one
    batched policy call per step for all of them (Diffusion Policy's vectorised env runners do the same).

    Stepping 20 trials together with one batched policy call was 2.0x faster than one env at a time on this
    2-core machine (policy time 5.5x less); a batch-32 action chunk costs ~2.3 ms per sample against 13.8 ms
    at batch 1 on the CPU. Every trial resets with its own seed, and its initial denoising noise comes from a
    generator seeded with that seed (``AEDDiffusionPolicy.select_action(generators=...)``), so a trial's outcome
    does not depend on which others share its batch. A finished episode's env stops stepping; its row still
    rides along in the batch until the wave ends. Episodes are committed to ``store_url`` (one shard per
    unit, ``fleet.worker.writer_id``) once they end.

    Args:
        cfg: plain config (``robot``, ``obs``, ``task``; ``eval.max_envs``: the bound on pooled envs, null for
            4 x ``batch_size``, 2 x with images; see :func:`_wave_envs`). checkpoint: a saved policy directory.
        plan: ``[{"task", "unit_id", "seed"}]`` (:func:`evaluation_plan`, ``fleet.experiment.protocol.fleet_plan``), a trial
            optionally with ``"explore"``: a failure retry's ``fleet.worker.Exploration`` dict (held action noise,
            denoising-noise temperature; its tags ``retry_of``, ``attempt``, ``exploration`` are committed with the
            episode, and the retry draws its denoising noise from ``fleet.worker.retry_noise_seed(seed, attempt)``,
            fresh noise as on a fleet worker). store_url: the store the episodes are committed to.
        batch_size: envs per wave (>= 1). torch_threads: torch threads of this process.
        with_critic: False: a checkpoint's success critic is not installed, its weights act alone (K = 1) while
            its episodes still carry its registry version (the round's fleet with ``job.fleet_critic: false``).
        acting: a :class:`fleet.labels.Acting`: how episodes are labelled (a deployment's success detector, or a
            person's labels with the detector's frames recorded) and whether failures are followed by recovery
            attempts from their final state (:func:`_step_wave`); None: the simulator labels and ends episodes.

    Returns:
        One summary per trial, in plan order: ``{"episode_id", "unit_id", "task", "seed", "success", "length",
        "policy_version", "is_demo", "return", "wall_s"}``; under ``acting`` also ``label_source`` and
        ``oracle_success``, and ``recoveries`` (the recovery episodes' summaries) when there were any.

    Raises:
        ValueError: ``batch_size < 1``. (A non-finite action or observation, or diverging physics, ends that
        trial as a failure with its ``termination``, as on a fleet worker.)
    """
    import time

    import torch

    from experience_dict.store import ExperienceStore, configure_storage
    from fleet.worker import Exploration, writer_id

    if int(batch_size) < 1:
        raise ValueError(f"batch_size: expected >= 1, given {batch_size}")
    torch.set_num_threads(int(torch_threads))
    configure_storage({**dict(cfg.get("store") or {}), "url": str(store_url)})
    labeller = None
    if acting is not None:
        from fleet.labels import Acting, OnlineLabeller

        acting = acting if isinstance(acting, Acting) else Acting(**acting)
        cfg = {**cfg, "task": acting.task_config(cfg["task"])}   # the detector, not the simulator, ends episodes
        labeller = OnlineLabeller(acting) if acting.source in ("human", "detector") else None
    model, version, graph_batch = load_acting_policy(checkpoint, with_critic)
    if graph_batch is not None:   # an export's ONNX graph runs at the batch size it was exported for
        batch_size = graph_batch
    takes_generators = bool(model.denoising)   # policies.base.Policy: a denoising policy takes per-row generators
    max_steps = int(cfg["task"]["max_episode_steps"])
    pool = env_pool(cfg)
    max_envs = (cfg.get("eval") or {}).get("max_envs")   # bound on this process's pooled envs (_wave_envs); null:
    if max_envs is None:                                  # 4 x batch_size state-only (the default job never evicts),
        o = cfg.get("obs") or {}                          # 2 x with images or point clouds (a GL context each)
        max_envs = (2 if o.get("images") or o.get("point_cloud") else 4) * int(batch_size)
    store, writers = None, {}
    out: list[dict] = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(plan), desc=desc, unit="ep", dynamic_ncols=True)
    for w0 in range(0, len(plan), int(batch_size)):
        wave = plan[w0:w0 + int(batch_size)]
        t0 = time.perf_counter()
        envs = _wave_envs(pool, wave, cfg, max_envs)
        if store is None:
            spec = envs[0].spec_dict()
            store = ExperienceStore.create_or_open(str(store_url), spec=spec, control_hz=spec.get("control_hz"))
        segs = _step_wave(model, envs, wave, max_steps, takes_generators, acting, labeller)
        wall = (time.perf_counter() - t0) / len(wave)
        for i, tr in enumerate(wave):
            u = int(tr["unit_id"])
            if u not in writers:
                writers[u] = store.writer(writer_id(u))
            tags = Exploration.from_dict(tr["explore"]).tags() if tr.get("explore") else {}
            out.append(_commit_segments(writers[u], envs[i], tr, segs[i], int(version), tags, wall, acting))
        if bar is not None:
            bar.update(len(wave))
            bar.set_postfix_str(f"success={np.mean([e['success'] for e in out]):.2f}", refresh=False)
    if bar is not None:
        bar.close()
    for w in writers.values():
        w.close()
    if labeller is not None:
        labeller.close()
    return out


def load_acting_policy(checkpoint: str | Path, with_critic: bool = True):
    """``(policy, version, graph batch size or None)`` for :func:`run_plan_vectorised`: a checkpoint directory
    through ``fleet.acting.load_checkpoint``, or an export folder (``export.json``, ``scripts/export.py``) through
    the deploy runtime (``policies.runtime.PolicyRuntime``) exactly as a robot loads it: with ONNX graphs, every
    chunk comes from the graph in ONNX Runtime (``backend="onnx"``) at the graph's batch size, which is returned so
    the trials run in waves of that size; the version is the exported registry version (0 when unknown).

    Raises:
        as ``load_checkpoint`` / ``PolicyRuntime.load``.
    """
    from fleet.acting import load_checkpoint
    from policies.runtime import EXPORT_META, PolicyRuntime

    d = Path(checkpoint)
    if not (d / EXPORT_META).is_file():
        return (*load_checkpoint(d, "cpu", with_critic), None)
    meta = json.loads((d / EXPORT_META).read_text())
    graphs = meta.get("onnx") or []
    rt = PolicyRuntime.load(d, backend="onnx" if graphs else "torch")
    version = int((meta.get("source") or {}).get("version") or 0)
    return rt.policy, version, (int(graphs[0]["batch_size"]) if graphs else None)


def _wave_envs(pool: dict[tuple[str, int], list], wave: list[dict], cfg: dict, max_envs: int | None = None) -> list:
    """One env per trial of ``wave`` from this process's ``pool`` ((task, unit) -> envs), made when missing (two
    trials of one (task, unit) in a wave get two envs).

    ``max_envs``: at most this many pooled envs (at least the wave's own). Before making new ones, the envs of
    the (task, unit) pairs used least recently, and not by this wave, are closed and dropped. The plan runs
    task by task, so without a bound the pool grows to ``batch_size`` envs per (task, unit) pair. On a CPU
    renderer that was ~9 GB per process with 96x96 images at batch 32; state-only envs take ~40 MB each.
    ``None``: no bound.
    """
    from sim import make_env

    keys = [(str(tr["task"]), int(tr["unit_id"])) for tr in wave]
    need = Counter(keys)
    if max_envs is not None:
        total = sum(len(v) for v in pool.values())
        new = sum(max(0, n - len(pool.get(k, []))) for k, n in need.items())
        for key in [k for k in pool if k not in need]:  # dict order: least recently used first
            if total + new <= max(int(max_envs), len(wave)):
                break
            for env in pool.pop(key):
                env.close()
                total -= 1
    used: dict[tuple[str, int], int] = {}
    envs = []
    for key in keys:
        k = used.get(key, 0)
        used[key] = k + 1
        lst = pool.setdefault(key, [])
        if len(lst) <= k:
            lst.append(make_env(task=key[0], unit_id=key[1], robot_cfg=cfg["robot"], obs_cfg=cfg["obs"],
                                task_cfg=cfg["task"]))
        envs.append(lst[k])
    for key in need:  # most recently used last
        pool[key] = pool.pop(key)
    return envs


def _step_wave(model, envs: list, wave: list[dict], max_steps: int, takes_generators: bool, acting=None,
               labeller=None):
    """Reset every env of the wave with its trial's seed and step them together, one batched
    ``model.select_action`` per step, until all are done.

    Returns per trial the list of its episodes (segments), each ``{"steps": store rows (obs, action, reward,
    progress), "success": the episode's label, "sim_success": the simulator's verdict, "return", "length", "why":
    termination, "label": {"source", "fired_at", "p_max"[, "threshold"]} or None, "first_success": the simulator's first success
    step or None, "explore": the recovery's ``fleet.worker.Exploration`` or None, "record": the labelled budget's
    detector frames or None}``. Without ``acting`` a trial is one episode labelled by the simulator (as
    ``fleet.worker.RobotWorker.run_episode``). With ``acting`` (:class:`fleet.labels.Acting`) and its
    ``labeller`` (:class:`fleet.labels.OnlineLabeller`): ``source="detector"``: the detector judges every
    ``labels.every`` steps and the episode ends ``task.steps_after_success`` steps after it fires (the env's own
    success never ends it); ``"human"``: frames are recorded for the detector. With ``acting.recovery``, a failed
    episode (by its label; not a fault) is followed at once by recovery attempts from the state where it ended
    (``env.continue_episode``), each a new episode with its exploration, until one succeeds or they run out."""
    import torch

    from fleet.labels import Recovery
    from fleet.rollout import step_trial
    from fleet.worker import Exploration, retry_noise_seed

    obs = [env.reset(seed=int(tr["seed"]))[0] for env, tr in zip(envs, wave)]
    explore = [Exploration.from_dict(tr["explore"]) if tr.get("explore") else None for tr in wave]
    gens = [torch.Generator().manual_seed(int(tr["seed"]) if ex is None else retry_noise_seed(int(tr["seed"]), ex.attempt))
            for tr, ex in zip(wave, explore)]
    temps = [1.0 if ex is None else ex.temperature for ex in explore]
    recovery = Recovery(acting.recovery) if acting is not None and acting.recovery else None
    detects = labeller is not None and labeller.detects
    records = labeller is not None and acting.source == "human"
    sas = int(getattr(envs[0], "steps_after_success", 0)) if envs else 0
    model.reset()
    B = len(wave)
    done = np.zeros(B, bool)
    segs: list[list[dict]] = [[] for _ in range(B)]

    def fresh(ex) -> dict:
        return {"steps": [], "success": False, "sim_success": False, "return": 0.0, "length": 0, "why": "max_steps",
                "label": None, "first_success": None, "explore": ex, "fired_at": None, "p_max": 0.0,
                "record": ([], [], [], [], []) if records else None, "t": 0, "now": False}

    cur = [fresh(None) for _ in range(B)]
    last_obs = list(obs)

    def end(i: int, why: str, label: bool) -> None:
        c = cur[i]
        c["why"], c["success"] = why, bool(label)
        if acting is not None:
            c["label"] = {"source": acting.source, "fired_at": c["fired_at"], "p_max": round(float(c["p_max"]), 4)}
            if detects:   # the threshold the verdict was judged against (fleet.labels.trusted_label reads it)
                c["label"]["threshold"] = round(float(labeller.threshold_of(str(wave[i]["task"]))), 4)
        segs[i].append(c)
        attempt = len(segs[i]) - 1      # recovery attempts so far
        if (recovery is not None and not label and why == "truncated" and attempt < recovery.attempts):
            ex = recovery.exploration(attempt)
            envs[i].continue_episode(recovery.steps)
            explore[i], temps[i] = ex, ex.temperature
            cur[i] = fresh(ex)
        else:
            done[i] = True

    def state_at(i: int, s: int) -> np.ndarray:
        """(S,) float32: trial ``i``'s proprioception at step ``s`` of its current episode (``s`` <= its step)."""
        c = cur[i]
        row = c["steps"][s] if s < c["t"] else None
        return np.asarray((last_obs[i] if row is None else row[0])["observation.state"], np.float32)

    with torch.inference_mode():
        while not done.all():
            batch = {k: torch.as_tensor(np.stack([o[k] for o in last_obs])) for k in last_obs[0]}
            kw = {"noise_scale": torch.tensor(temps, dtype=torch.float32)} if any(t != 1.0 for t in temps) else {}
            a = model.select_action(batch, generators=gens, **kw) if takes_generators else model.select_action(batch)
            acts = a.detach().cpu().numpy().astype(np.float32).reshape(B, -1)
            live = np.flatnonzero(~done)
            ended: dict[int, tuple[str, bool]] = {}
            for i in live:
                c = cur[i]
                if explore[i] is not None:
                    acts[i] = explore[i].perturb(acts[i], c["t"], int(wave[i]["seed"]))
                row, fault, stepped = step_trial(envs[i], last_obs[i], acts[i])   # the worker's fault rules
                if row is not None:
                    c["steps"].append(row)
                if fault is not None:    # a NaN/inf or diverging physics: the trial ends as a failure
                    c["length"] = len(c["steps"])
                    ended[i] = (fault, False)
                    continue
                nxt, r, term, trunc, info = stepped
                c["t"] += 1
                c["now"] = bool(info["success"])
                if info["success"] and c["first_success"] is None:
                    c["first_success"] = c["t"]
                c["sim_success"] |= bool(info["success"])
                c["return"] += float(r)
                c["length"] = c["t"]
                last_obs[i] = nxt
                if term or trunc:
                    ended[i] = ("terminated" if term else "truncated", c["sim_success"])
                elif not segs[i] and c["t"] >= max_steps:   # the plan's length bound (a longer per-robot limit)
                    ended[i] = ("max_steps", c["sim_success"])
            if labeller is not None:
                due = [i for i in live if i not in ended or ended[i][0] in ("terminated", "truncated")]
                due = [i for i in due if labeller.due(cur[i]["t"]) and (not detects or cur[i]["fired_at"] is None)]
                if due:
                    frames = np.stack([labeller.frames(envs[i]) for i in due])
                    states = np.stack([last_obs[i]["observation.state"] for i in due]).astype(np.float32)
                    clouds = [labeller.cloud(envs[i]) for i in due]
                    clouds = None if clouds[0] is None else np.stack(clouds)
                    if detects:
                        hist = [[state_at(i, s) for s in labeller.history_steps(cur[i]["t"])] for i in due]
                        hist = np.asarray(hist, np.float32) if hist[0] else None
                        p = labeller.judge(frames, states, [str(wave[i]["task"]) for i in due], clouds, hist)
                        for j, i in enumerate(due):
                            cur[i]["p_max"] = max(cur[i]["p_max"], float(p[j]))
                            if p[j] > labeller.threshold_of(str(wave[i]["task"])):
                                cur[i]["fired_at"] = cur[i]["t"]
                    else:
                        for j, i in enumerate(due):
                            rec = cur[i]["record"]
                            rec[0].append(frames[j])
                            rec[1].append(states[j])
                            rec[2].append(cur[i]["t"])
                            rec[3].append(cur[i]["now"])
                            if clouds is not None:
                                rec[4].append(clouds[j])
            for i in live:
                c = cur[i]
                if i in ended and ended[i][0] not in ("terminated", "truncated"):
                    end(i, *ended[i])          # a fault: no recovery
                elif detects:
                    if c["fired_at"] is not None and (c["t"] - c["fired_at"] >= sas or i in ended):
                        end(i, "terminated" if c["t"] - c["fired_at"] >= sas else "truncated", True)
                    elif i in ended:
                        end(i, "truncated", False)
                elif i in ended:
                    end(i, *ended[i])
    return segs


def _commit_segments(w, env, tr: dict, segs: list[dict], version: int, tags: dict, wall: float, acting) -> dict:
    """Commit one trial's episodes (:func:`_step_wave`'s segments) to its unit's writer ``w``; returns the trial's
    summary (its first episode's; with recovery attempts, ``"recoveries"``: theirs). Each recovery episode names
    the one before it in ``retry_of``; under ``acting`` every episode carries ``extra.label`` and ``extra.oracle``,
    and a labelled-budget episode's detector frames are saved (``fleet.labels.save_record``); one that ran past its
    success for them (``labels.budget_full_length``) is committed up to where the success would have ended it."""
    from fleet.labels import save_record

    out, prev = [], None
    for k, sg in enumerate(segs):
        seg_tags = dict(tags) if k == 0 else {**sg["explore"].tags(), "retry_of": prev, "recovery": True}
        if acting is not None:
            seg_tags.update(label=sg["label"], oracle={"success": bool(sg["sim_success"]),
                                                       "first_success": sg["first_success"]})
        steps, why, length, ret = sg["steps"], sg["why"], int(sg["length"]), float(sg["return"])
        if acting is not None and acting.source == "human" and not acting.stop_on_success \
                and sg["first_success"] is not None:
            # a labelled episode ran on past its success for the detector's frames (labels.budget_full_length):
            # the store gets the episode as the simulator's success would have ended it
            length = min(length, int(sg["first_success"]) + int(getattr(env, "steps_after_success", 0)))
            steps, why = steps[:length], "terminated"
            ret = float(sum(float(row[2]) for row in steps))
        ep_id = _commit_trial(w, env, tr, steps, bool(sg["success"]), why, version, seg_tags)
        if sg["record"] is not None and ep_id is not None and sg["record"][0]:
            frames, states, steps, now, clouds = sg["record"]
            save_record(acting.record_dir, ep_id, str(tr["task"]), frames, states, steps, bool(sg["success"]),
                        sg["first_success"], done_now=now, clouds=clouds, cameras=acting.labels["cameras"])
        summ = {"episode_id": ep_id, "unit_id": int(tr["unit_id"]), "task": str(tr["task"]), "seed": int(tr["seed"]),
                "success": bool(sg["success"]), "length": length, "policy_version": int(version),
                "is_demo": False, "return": ret, "wall_s": wall, "termination": why,
                **{kk: v for kk, v in seg_tags.items() if kk not in ("exploration", "label", "oracle")}}
        if acting is not None:
            summ.update(label_source=acting.source, oracle_success=bool(sg["sim_success"]))
        out.append(summ)
        prev = ep_id
    return {**out[0], "recoveries": out[1:]} if len(out) > 1 else out[0]


def _commit_trial(w, env, tr: dict, steps: list, success: bool, termination: str, version: int,
                  tags: dict | None = None) -> str | None:
    """Write one trial's rows to its unit's writer ``w`` and commit it (``tags``: extra metadata such as a
    retry's ``retry_of`` / ``attempt`` / ``exploration``); None (aborted) without rows."""
    extra = {"unit": env.unit.to_dict()} if hasattr(env.unit, "to_dict") else {}
    extra.update(tags or {})
    w.begin_episode(unit_id=int(tr["unit_id"]), embodiment=str(env.unit.embodiment), task=str(tr["task"]),
                    policy_version=version, seed=int(tr["seed"]), is_demo=False, extra=extra or None,
                    control_hz=getattr(env, "control_hz", None) or None)
    for o, act, r, prog in steps:
        w.add_step(o, act, r, prog)
    if not steps:
        w.abort()
        return None
    return w.commit(success=success, termination=termination)


_ENVS: dict[str, dict[tuple[str, int], list]] = {}   # this process's envs, kept across calls (making one: ~0.4 s)


def env_pool(cfg: dict) -> dict[tuple[str, int], list]:
    """This process's pooled envs of ``cfg``'s ``robot``, ``obs`` and ``task`` ((task, unit) -> envs, least recently
    used first), kept across :func:`run_plan_vectorised` calls."""
    return _ENVS.setdefault(json.dumps([cfg["robot"], cfg["obs"], cfg["task"]], sort_keys=True, default=str), {})
