"""The fleet rounds (``fert.rounds``): each round the training units run their fixed plan with the newest
published version, failed trials are retried with exploration, every in-loop arm's learner runs its FERT round
(``fert`` publishes through the validation gate), and the new version's held-out points join the learning curve.
Also ``staleness_summary``, over the episodes of a fleet that follows the newest version (``scripts/async_run.py``)."""

from __future__ import annotations

import time
from pathlib import Path

from experience_dict.store import ExperienceStore
from fleet.coordinator import Fleet
from fleet.experiment.arms import make_learner
from fleet.experiment.curve import BackgroundCurve, learning_curve, print_curve
from fleet.experiment.eval_config import EvalConfig
from fleet.experiment.job_config import JobConfig
from fleet.experiment.protocol import (
    VectorFleet,
    committed_retries,
    failure_replay,
    fleet_plan,
    run_retries,
    success_by_task,
)
from fleet.experiment.state import JobState, Stages
from fleet.fert.config import RetryConfig
from fleet.fert.gate import make_validator
from fleet.fert.learner_config import LearnerConfig
from fleet.labels_config import LabelsConfig
from fleet.registry import CheckpointRegistry, checkpoint_with_critic


def round_trials(reader, plan: list[dict], version: int) -> list:
    """The committed fleet episodes of a round's plan (no retries, acting version ``version``)."""
    from fleet.fert.contexts import retry_of

    want = {(int(t["unit_id"]), int(t["seed"])) for t in plan}
    return [m for m in reader.episodes(is_demo=False) if (int(m.unit_id), int(m.seed)) in want
            and not retry_of(m) and int(m.policy_version) == int(version)]


def fleet_round(c: dict, r: int, units: list[int], heldout: list[int], progress: bool = True,
                sd: Path | None = None) -> dict:
    """One fleet round: the fixed plan of fleet episodes with the newest version, then failure retries.

    With ``fert.retry.start: recovery`` a failure is followed at once by recovery attempts from the state where it
    ended (no reset) instead of retries from its reset seed. With ``labels.source: detector`` the first
    ``labels.budget_episodes`` trials of round 0 are labelled by a person (their detector frames recorded under
    ``<sd>/detector/records``), the success detector is fitted on them (``<sd>/detector``), and it labels and ends
    every later fleet episode (:func:`fleet_acting`).

    Resumable: trials already committed with that version are not run again. Returns the round's record
    (success, failures, retries and how many failures they recovered)."""
    reg = CheckpointRegistry(c["fleet"]["registry_url"])
    version = reg.latest_version()
    job = JobConfig.from_dict(c["job"])
    plan = fleet_plan(list(c["task"]["tasks"]), units, job.fleet_episodes_per_unit, int(c["seed"]), r)
    rcfg = dict(c["fert"].get("retry") or {})
    recovering = RetryConfig.from_dict(rcfg).start == "recovery"
    backend, with_critic = job.fleet_backend, job.fleet_critic
    if (recovering or LabelsConfig.from_dict(c.get("labels")).source != "sim") and backend != "vector":
        raise ValueError("fert.retry.start=recovery and labels.source=detector need job.fleet_backend=vector")
    t0 = time.perf_counter()
    if backend == "vector":    # every unit's envs stepped in batches, one policy call per step (fleet.experiment.protocol)
        ckpt = reg.fetch(version, Path(c["fleet"]["cache_dir"]) / "fleet" / f"v{version:06d}")
        ec = EvalConfig.from_dict(c["eval"])
        fleet = VectorFleet(c, str(ckpt), c["store"]["url"], ec.batch_size, ec.processes, with_critic=with_critic)
    elif backend == "ray" and not with_critic:
        raise ValueError("job.fleet_critic=false (the fleet acts with the weights alone) needs job.fleet_backend=vector")
    elif backend == "ray":
        fleet = Fleet(c, policy="latest", units=units, store_url=c["store"]["url"])
    else:
        raise ValueError(f"job.fleet_backend: expected 'vector' or 'ray', given {backend!r}")
    detector = None
    with fleet:
        reader = ExperienceStore.open(c["store"]["url"])
        done = {(int(m.unit_id), int(m.seed)) for m in round_trials(reader, plan, version)}
        todo = [t for t in plan if (t["unit_id"], t["seed"]) not in done]
        for part, acting in fleet_acting(c, r, plan, todo, sd, progress):
            if part:
                fleet.run(plan=part, progress=progress, **({"acting": acting} if acting is not None else {}))
            if acting is not None and acting.source == "human":
                detector = fit_detector_once(c, sd, progress)
        t_fleet = time.perf_counter() - t0
        reader.refresh()
        eps = round_trials(reader, plan, version)
        fails = [{"episode_id": m.episode_id, "task": m.task, "unit_id": int(m.unit_id), "seed": int(m.seed)}
                 for m in eps if not m.success]
        retries = {"failures": len(fails), "recovered": 0, "recovered_share": None, "retries": 0, "per_attempt": []}
        if recovering:
            retries = recovery_record(reader, eps, heldout)
        elif rcfg.get("enabled", True) and fails:
            # a resumed round: the retries a stopped one committed are read from the store, not run again
            retries = run_retries(fleet, fails, rcfg, heldout, len(plan), progress,
                                  committed=committed_retries(reader, version))
            retries["steps"] = sum(int(e.get("length", 0)) for e in retries.pop("episodes", []))
    wall = time.perf_counter() - t0
    succ = sum(bool(m.success) for m in eps)
    per_task = success_by_task(eps)
    steps = sum(int(m.length) for m in eps)
    # the rate counts the trials run now: a resumed round finds some (or all) of its trials already in the store
    ran = {(t["unit_id"], t["seed"]) for t in todo}
    ran_steps = sum(int(m.length) for m in eps if (int(m.unit_id), int(m.seed)) in ran)
    rate = ran_steps / max(t_fleet, 1e-9) if ran_steps else None
    speed = f"{rate:.0f} env steps/s" if rate is not None else f"all {len(eps)} trials found in the store"
    how = "recovery attempts from the failure state" if recovering else "retries"
    print(f"round {r}: fleet v{version}{'' if with_critic else ' (K = 1)'} {succ}/{len(eps)} successes on units {units} ({speed}, "
          f"{backend}); {retries['failures']} failures, {retries['retries']} {how} recovered "
          f"{retries['recovered']} ({_pct(retries['recovered_share'])}) {retries['per_attempt']}", flush=True)
    rec = {"version": version, "successes": succ, "episodes": len(eps), "per_task": per_task, "retries": retries,
           "failed_trials": [{k: f[k] for k in ("task", "unit_id", "seed")} for f in fails],
           "wall_s": wall, "times": {"fleet_s": t_fleet, "retries_s": wall - t_fleet}, "backend": backend,
           "with_critic": with_critic,
           "env_steps": steps, "env_steps_per_s": rate}
    if LabelsConfig.from_dict(c.get("labels")).source == "detector":
        from fleet.labels import label_audit

        reader.refresh()
        if detector is None and r == 0:   # a resumed round 0 fitted its detector before: its record
            detector = fit_detector_once(c, sd, progress)
        audit = label_audit([m for m in reader.episodes(is_demo=False) if int(m.policy_version) == int(version)])
        rec["labels"] = {"audit": audit, "detector": detector}
        o = audit["overall"]
        print(f"  labels: the success detector labelled {o['n']} episodes of v{version}; against the simulator "
              f"(audit only): precision {_frac(o['precision'])}, recall {_frac(o['recall'])}, "
              f"accuracy {_frac(o['accuracy'])}", flush=True)
    return rec


def fleet_acting(c: dict, r: int, plan: list[dict], todo: list[dict], sd: Path | None, progress: bool = True):
    """The parts of a round's remaining trials ``todo`` and how each is labelled and continued: ``[(trials,
    fleet.labels.Acting or None)]``, run in order.

    ``labels.source: sim`` and no recovery: ``[(todo, None)]`` (the simulator labels; retries come after). With
    recovery: one part whose failures are followed by recovery attempts. ``labels.source: detector``: in round 0,
    the first ``labels.budget_episodes`` trials of the plan labelled by a person (frames recorded), then the rest
    labelled by the detector (fitted between the two parts; :func:`fit_detector_once`); later rounds: all by it.

    Raises:
        ValueError: detector labels without a seed directory ``sd``, or a round after 0 with no fitted detector.
    """
    from fleet.labels import Acting

    lc = LabelsConfig.from_dict(c.get("labels"))
    retry = RetryConfig.from_dict(c["fert"].get("retry"))
    recovery = retry.to_dict() if retry.enabled and retry.start == "recovery" else None
    if lc.source == "sim":
        return [(todo, Acting("sim", lc.to_dict(), recovery=recovery) if recovery else None)]
    if sd is None:
        raise ValueError("labels.source=detector: the round needs its seed directory for the detector")
    det = Path(sd) / "detector"
    acting = Acting("detector", lc.to_dict(), detector_dir=str(det), recovery=recovery)
    if (det / "detector.json").is_file():
        return [(todo, acting)]
    if r != 0:
        raise ValueError(f"labels.source=detector: round {r} found no fitted detector in {det}")
    budget = {(t["unit_id"], t["seed"]) for t in plan[:lc.budget_episodes]}
    human = Acting("human", lc.to_dict(), record_dir=str(det / "records"))
    return [([t for t in todo if (t["unit_id"], t["seed"]) in budget], human),
            ([t for t in todo if (t["unit_id"], t["seed"]) not in budget], acting)]


def fit_detector_once(c: dict, sd: Path, progress: bool = True) -> dict:
    """Fit the success detector on the labelled budget's records (``fleet.labels.fit_from_records``) into
    ``<sd>/detector`` unless it is there; returns its fit record (``fit.json``)."""
    import json

    from fleet.labels import fit_from_records

    det = Path(sd) / "detector"
    if (det / "detector.json").is_file():
        return json.loads((det / "fit.json").read_text()) if (det / "fit.json").is_file() else {}
    out = fit_from_records(det / "records", c["labels"], list(c["task"]["tasks"]), det, seed=int(c["seed"]))
    v = out["validation"]
    print(f"  success detector: fitted on {out['episodes']} labelled episodes ({out['successes']} successes, "
          f"{out['frames']} frames) in {out['fit_s']:.0f} s; threshold {out['threshold']}; on its "
          f"{v['n']} held-out labelled episodes precision {_frac(v['precision'])}, recall {_frac(v['recall'])}",
          flush=True)
    return out


def recovery_record(reader, eps: list, heldout: list[int]) -> dict:
    """The round's recovery figures from the store: ``{"failures", "recovered", "recovered_share", "retries",
    "per_attempt": [{"attempt", "run", "recovered"}], "steps"}`` over the fleet episodes ``eps`` of training units
    that failed (by their labels) and the recovery episodes chained after them (``retry_of``)."""
    from fleet.fert.contexts import retry_of

    held = {int(u) for u in heldout}
    failed = {m.episode_id for m in eps if not m.success and int(m.unit_id) not in held}
    chains = {}
    reader.refresh()
    by_prev = {retry_of(m): m for m in reader.episodes(is_demo=False) if retry_of(m)}
    for ep in failed:
        chain, prev = [], ep
        while prev in by_prev:
            chain.append(by_prev[prev])
            prev = by_prev[prev].episode_id
        chains[ep] = chain
    per_attempt: dict[int, list[int]] = {}
    for chain in chains.values():
        for m in chain:
            cell = per_attempt.setdefault(int(m.extra.get("attempt", 0)), [0, 0])
            cell[0] += 1
            cell[1] += int(bool(m.success))
    recovered = sum(any(m.success for m in chain) for chain in chains.values())
    return {"failures": len(failed), "recovered": recovered,
            "recovered_share": recovered / len(failed) if failed else None,
            "retries": sum(len(ch) for ch in chains.values()),
            "per_attempt": [{"attempt": a, "run": n, "recovered": k} for a, (n, k) in sorted(per_attempt.items())],
            "steps": sum(int(m.length) for ch in chains.values() for m in ch)}


def _frac(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def _fleet_round_and_learners(c: dict, sd: Path, seed: int, state: JobState, stages: Stages, in_loop: list,
                              ckpt: dict, fleet_units: list[int], heldout: list[int], reg, progress: bool,
                              after_last_fleet, r: int, rounds: int, bg) -> None:
    """Round ``r`` of :func:`stage_fleet_rounds` (skipped when ``job_state.json`` has it): the fleet and its
    retries, each in-loop learner's round, the round's record, and the learning curve's new points (evaluated in
    the background while the next round works, except after the last round)."""
    stages.start(f"seed {seed}: fleet round {r + 1}/{rounds} (units {fleet_units}) + learners "
                 f"{[a.name for a in in_loop]}")
    if state.done(f"round_{r}"):
        return
    t_round = time.perf_counter()
    rec = fleet_round(c, r, fleet_units, heldout, progress, sd)
    if r == rounds - 1 and after_last_fleet is not None:
        after_last_fleet()
    rec["learners"] = {}
    for arm in in_loop:
        publishing = arm.name == "fert"
        lrn = make_learner(c, arm, sd / f"learner_{arm.name}", ckpt[arm.init],
                           c["fleet"]["registry_url"] if publishing else None, seed, offline=True,
                           validator=make_validator(c, fleet_units, sd, progress) if publishing else None)
        if lrn.state["round"] > r:
            continue
        out = lrn.run_round()
        print(f"  {arm.name} round {r}: {out['contexts']} failure contexts, {out['retrieved']} retrieved "
              f"segments ({out.get('own_retry_entries', 0)} from the failures' own retries), "
              f"{out['dataset']} training windows, loss {out['loss']}, "
              + (f"published v{out['version']} ({out.get('published_candidate')})" if out["version"]
                 else "not published"), flush=True)
        if out.get("critic"):
            cr = out["critic"]
            print(f"  {arm.name} round {r}: success critic on {cr['episodes']} episodes ({cr['steps']} steps, "
                  f"{100 * cr['positive_share']:.0f}% on the way to a success), validation BCE "
                  f"{cr['val_loss'] if cr['val_loss'] is None else round(cr['val_loss'], 3)} (predicting the mean: "
                  f"{cr.get('val_loss_constant') if cr.get('val_loss_constant') is None else round(cr['val_loss_constant'], 3)}), "
                  f"{cr['fit_s']:.0f} s", flush=True)
        if out.get("mix"):
            dist = out["mix"].get("distill")
            print(f"  {arm.name} round {r}: training windows {out['mix']['slots']}"
                  + (f"; critic targets at {dist['states']} states: best of {dist['candidates']} chunks scores "
                     f"{dist['q_chosen']:.3f} vs the policy's own sample {dist['q_own']:.3f} (own kept at "
                     f"{100 * dist['picked_own']:.0f}% of states)" if dist else "")
                  + f"; times {({k: round(v) for k, v in (out.get('times') or {}).items()})}", flush=True)
        rec["learners"][arm.name] = {k: out.get(k) for k in ("contexts", "retrieved", "dataset", "loss", "version",
                                                             "validation", "own_retry_entries", "critic",
                                                             "published_candidate", "mix", "times")}
        if publishing and LearnerConfig.from_dict(c["learner"]).failure_replay:
            rec["learners"][arm.name]["failure_replay"] = replay_round_failures(
                c, lrn.final_checkpoint(), rec, sd / "failure_replay" / f"round_{r}", heldout)
    rec["round_s"] = time.perf_counter() - t_round   # the fleet, its retries and every learner, up to publishing
    split = {**rec["times"], **((rec["learners"].get("fert") or {}).get("times") or {})}
    print(f"  round {r} wall time {rec['round_s']:.0f} s: " + ", ".join(f"{k[:-2]} {v:.0f} s" for k, v in split.items()),
          flush=True)
    state.mark(f"round_{r}", rec)
    record_curve(c, sd, seed, state, in_loop, heldout, reg, progress, bg, background=r < rounds - 1)


def record_curve(c: dict, sd: Path, seed: int, state: JobState, in_loop: list, heldout: list[int], reg,
                 progress: bool, bg, background: bool) -> None:
    """Record (``state["curve"]``) and print the learning curve's new points (``fleet.experiment.curve``): first those of the
    background call ``bg`` (a ``fleet.experiment.curve.BackgroundCurve``) started after the previous round, then, with
    ``background`` and ``job.background_curve``, start a background call for the versions published since;
    otherwise evaluate them here. Nothing without ``job.curve_trials_per_task`` or a ``fert`` arm in the loop.

    Raises:
        RuntimeError: the background evaluation failed (re-running the job evaluates its versions again)."""
    if JobConfig.from_dict(c["job"]).curve_trials_per_task <= 0 or not any(a.name == "fert" for a in in_loop):
        return
    curve = state.get("curve") if state.done("curve") else []

    def add(points: list[dict]) -> None:
        seen = {int(p["version"]) for p in curve}
        points = [p for p in points if int(p["version"]) not in seen]
        if points:
            curve.extend(points)
            state.mark("curve", curve)
            print_curve(curve, seed)

    add(bg.collect())
    if background and JobConfig.from_dict(c["job"]).background_curve:
        if set(reg.versions()) - {int(p["version"]) for p in curve}:
            bg.start(c, sd, c["fleet"]["registry_url"], heldout, curve)
    else:
        add(learning_curve(c, sd, reg, heldout, progress, have=curve))


def stage_fleet_rounds(c: dict, sd: Path, seed: int, state: JobState, stages: Stages, in_loop: list, ckpt: dict,
                       fleet_units: list[int], heldout: list[int], reg, progress: bool,
                       after_last_fleet=None) -> None:
    """``fert.rounds`` rounds of fleet collection (``fleet_round``), each followed by one round of every in-loop
    learner (FERT publishes through the validation gate); sets ``ckpt[arm]`` for the in-loop arms (``fert``: the
    newest published version, the base when every round was rejected). ``after_last_fleet()`` is called once the
    last round's fleet episodes and retries are committed, before that round's learners (not on a resumed job
    whose last round is done)."""
    rounds = int(c["fert"]["rounds"])
    with BackgroundCurve() as bg:
        for r in range(rounds):
            _fleet_round_and_learners(c, sd, seed, state, stages, in_loop, ckpt, fleet_units, heldout, reg, progress,
                                      after_last_fleet, r, rounds, bg)
        record_curve(c, sd, seed, state, in_loop, heldout, reg, progress, bg, background=False)
    published_mode = LearnerConfig.from_dict(c["learner"]).round_init != "continue"   # the weights alone (K = 1)
    for arm in in_loop:
        ckpt[arm.name] = make_learner(c, arm, sd / f"learner_{arm.name}", ckpt[arm.init], None, seed).final_checkpoint()
        if published_mode and arm.name != "fert":
            # an in-loop ablation is credited like fert: its weights alone (K = 1); its last round's checkpoint
            # carries that learner's success critic, with which it would run K chunks per decision (experiment
            # 32's table compared those, with their critics, against fert alone)
            ckpt[arm.name] = checkpoint_with_critic(ckpt[arm.name], sd / "cache" / "arms" / f"{arm.name}_alone", None)
    if any(a.name == "fert" for a in in_loop):
        v = reg.latest_version()
        meta = reg.manifest(v).get("metadata") or {}
        # the fert arm is what the fleet runs: the newest published version (the base when every round was
        # rejected by the validation gate); fert_finetuned: the last round's fine-tuned weights (with their critic)
        ckpt["fert_finetuned"] = ckpt["fert"]
        if meta.get("run_id") != "fert":
            ckpt["fert"] = ckpt["base"]
        else:
            ckpt["fert"] = str(reg.fetch(v, sd / "cache" / "arms" / f"v{v:06d}"))
        # fert_critic: that version as published (with its success critic); with learner.round_init: published the
        # fert arm is its weights alone (K = 1), what a robot running the ONNX export executes
        ckpt["fert_version"] = ckpt["fert"]
        if published_mode:
            ckpt["fert"] = checkpoint_with_critic(ckpt["fert"], sd / "cache" / "arms" / f"v{v:06d}_alone", None)


def replay_round_failures(c: dict, checkpoint: str, rec: dict, out: Path, heldout: list[int]) -> dict:
    """``fleet.experiment.protocol.failure_replay`` of a round's failed fleet trials with the round's new weights; printed."""
    fr = failure_replay(c, checkpoint, rec["failed_trials"], str(out / "store"), heldout,
                        batch_size=EvalConfig.from_dict(c["eval"]).batch_size)
    tasks = ", ".join(f"{t} {k}/{n}" for t, (k, n) in sorted(fr["per_task"].items()))
    print(f"  failure replay: the new weights solve {fr['solved']} of the {fr['failures']} fleet trials that "
          f"v{rec['version']} failed ({tasks or 'none'}; each replayed from its reset seed, no exploration)", flush=True)
    return fr


def staleness_summary(episodes: list[dict]) -> dict:
    """``{"episodes", "max", "mean", "counts": {versions behind: episodes}}`` over the fleet episodes that
    report a staleness (units following the newest version; ``fleet.worker.RobotWorker.run_episode``)."""
    vals = [int(e["staleness"]) for e in episodes if e.get("staleness") is not None]
    counts: dict[str, int] = {}
    for v in sorted(vals):
        counts[str(v)] = counts.get(str(v), 0) + 1
    return {"episodes": len(vals), "max": max(vals) if vals else None,
            "mean": sum(vals) / len(vals) if vals else None, "counts": counts}
