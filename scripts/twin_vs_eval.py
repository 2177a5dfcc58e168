"""Does a policy deployed on the SO-100 twin through LeRobot reproduce fleetmind's own evaluation of the same export?

    python scripts/twin_vs_eval.py --export exports/so100_reach --trials 40 --out outputs/twin_vs_eval
    python scripts/twin_vs_eval.py --export exports/so100_reach --eval-dir outputs/twin_vs_eval/eval \\
        --variants nominal no_safety --out outputs/twin_vs_eval     # reuse the evaluation; diagnostic runs
    python scripts/twin_vs_eval.py --export ... -- robot=shifted   # Hydra overrides for both sides, after --

One export, the same held-out trials on both sides:

1. **fleetmind's evaluation** (``scripts/eval.py eval.checkpoint=<export>``): the export through the deploy runtime
   (its ONNX graph when it has one, as the ``fert_onnx`` arm), ``--trials`` trials of ``--task`` on the held-out
   units (``fleet.experiment.evaluation.evaluation_plan``: unit and reset seed per trial from ``eval.seed``; the
   denoising noise of a trial from its seed), each in ``sim.make_env(task, unit)`` stepped with the policy's
   end-effector actions. Writes ``<out>/eval/episodes/<arm>.json``.
2. **the deployed twin** (``scripts/deploy.py``): LeRobot's Robot API with robot type ``fleetmind_so100_sim``, the
   feature bridge (forward kinematics for the state, the twin's EE controller + mink IK for joint targets),
   real-time pacing at the export's ``control_hz``, the safety filter at its defaults, ``label=sim``, playing
   ``deploy.run.trials=<those episodes>``: each episode on the trial's unit (``FleetmindSO100Sim`` built as it)
   with its reset seed and its denoising noise seed (``deploy.run.seed_noise``). Writes
   ``<out>/twin/deploy_report.json``.
3. **the comparison** (``<out>/comparison.json`` and ``comparison.md``): per side the success with its Wilson 95%
   interval (``fleet.experiment.tables.success_table``), trial by trial (pairs: same unit and reset seed) the
   difference with a paired-bootstrap 95% interval, the disagreements and the exact McNemar p
   (``paired_differences``), per unit, the safety events and the policy latency per step of the deployment.

``--lerobot`` adds the side ``lerobot_rollout``: the same trials driven by LeRobot's own ``lerobot-rollout``
(``--strategy.type=base``, one process per trial) through the export's LeRobot policy folder (``python -m
lerobot_policy_fleetmind.export --robot so100``; for a point-cloud policy one folder per unit, each with that
unit's depth-camera calibration, as a real arm's hand-eye calibration would be), the twin robot built as the trial's
unit with its reset seed and ``max_steps`` of the evaluation, its outcome read from the twin's ``result_file``
(``<out>/lerobot_rollout/results.jsonl``). No safety filter (LeRobot's rollout has none) and LeRobot's own
denoising noise (not the trial's seed).

``--variants`` adds diagnostic deployments, each compared with the evaluation the same way: ``nominal`` (the
twin without units: the trials' seeds on the nominal robot), ``no_safety`` (step limits, workspace and watchdog
off), ``no_pacing`` (``deploy.run.realtime=false``), ``unseeded`` (``deploy.run.seed_noise=false``).
Exit status 0; the verdict is in the output (``consistent``: McNemar p >= 0.05).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from scripts.subproc import REPO, run_logged

VARIANTS = {
    "nominal": [],   # the trial file without unit ids (written below)
    "no_safety": ["deploy.safety.max_step_deg=null", "deploy.safety.max_step_gripper=null",
                  "deploy.safety.workspace_m=null", "deploy.safety.deadline_s=null"],
    "no_pacing": ["deploy.run.realtime=false"],
    "unseeded": ["deploy.run.seed_noise=false"],
}


def _run(cmd: list[str], log: Path) -> None:
    """Run a fleetmind script (``scripts.subproc.run_logged``, with this checkout first on the path)."""
    run_logged(cmd, log, env={"PYTHONPATH": str(REPO)})


def export_task(export: Path) -> str | None:
    """The export's training task when it is a single SO-100 task (``export.json``), else None."""
    meta = json.loads((export / "export.json").read_text())
    tasks = [t for t in (meta.get("training", {}) or {}).get("tasks") or [] if str(t).startswith("so100-")]
    return tasks[0] if len(tasks) == 1 else None


def evaluation_episodes(eval_dir: Path) -> list[dict]:
    """The one arm's episodes of a ``scripts/eval.py`` run dir (``episodes/<arm>.json``).

    Raises:
        SystemExit: none, or several arms.
    """
    files = [p for p in sorted((eval_dir / "episodes").glob("*.json")) if p.name != "fingerprints.json"]
    if len(files) != 1:
        raise SystemExit(f"twin_vs_eval: expected one arm's episodes in {eval_dir / 'episodes'}, found "
                         f"{[p.name for p in files]}")
    return json.loads(files[0].read_text())


def _latency(values: list[float]) -> dict[str, float | None]:
    a = np.asarray(values, dtype=np.float64)
    if not a.size:
        return {"steps": 0, "mean_ms": None, "p50_ms": None, "p95_ms": None, "max_ms": None}
    return {"steps": int(a.size), "mean_ms": 1e3 * float(a.mean()), "p50_ms": 1e3 * float(np.percentile(a, 50)),
            "p95_ms": 1e3 * float(np.percentile(a, 95)), "max_ms": 1e3 * float(a.max())}


def twin_episodes(report: dict, trials: list[dict], task: str) -> list[dict]:
    """A deploy report's episodes as evaluation-like results ``{task, unit_id, seed, success, ...}``, episode ``i``
    paired with trial ``i`` (a nominal-twin episode takes its trial's unit id for the pairing).

    Raises:
        ValueError: an episode whose seed is not its trial's (the deployment did not play the trial list).
    """
    out = []
    for i, (ep, tr) in enumerate(zip(report["episodes"], trials, strict=True)):
        if int(ep["seed"]) != int(tr["seed"]):
            raise ValueError(f"deploy episode {i} ran seed {ep['seed']}, its trial has seed {tr['seed']}")
        out.append({"task": task, "unit_id": int(tr["unit_id"]), "seed": int(ep["seed"]),
                    "success": bool(ep["success"]), "length": int(ep["steps"]), "stop_reason": ep["stop_reason"],
                    "safety_counts": ep["safety_counts"], "twin_unit_id": ep.get("unit_id")})
    return out


def deployment_summary(report: dict) -> dict[str, Any]:
    """Safety events, stop reasons, latency (policy call and whole step, ms) and pacing overruns of a report."""
    eps = report["episodes"]
    counts: Counter = Counter()
    for e in eps:
        counts.update(e["safety_counts"])
    return {"episodes": len(eps), "safety_events": dict(counts),
            "episodes_with_safety_events": sum(bool(e["safety_counts"]) for e in eps),
            "stop_reasons": dict(Counter(e["stop_reason"] for e in eps)),
            "policy_latency": _latency([x for e in eps for x in e["policy_s"]]),
            "step_latency": _latency([x for e in eps for x in e["step_s"]]),
            "overruns": sum(int(e["overruns"]) for e in eps),
            "realtime": bool(report["run"]["realtime"]), "control_hz": report["control_hz"],
            "safety": report["safety"]}


def compare(results: dict[str, list[dict]], baseline: str = "eval") -> dict[str, Any]:
    """Success tables and trial-by-trial comparisons of every arm of ``results`` against ``baseline``.

    Args:
        results: ``{arm: [{task, unit_id, seed, success, ...}]}``, every arm on the same trials.
    Returns:
        ``{"table": success_table, "paired": paired_differences, "per_unit": {arm: {unit: cell}},
        "disagreements": {arm: [{unit_id, seed, eval, arm, ...}]}, "verdict": {arm: {...}}}``.
    """
    from fleet.experiment.tables import paired_differences, success_table

    table = success_table(results)
    paired = paired_differences(results, [(a, baseline) for a in results if a != baseline])
    per_unit = {arm: success_table({str(u): [e for e in eps if int(e["unit_id"]) == u]
                                    for u in sorted({int(e["unit_id"]) for e in eps})})["arms"]
                for arm, eps in results.items()}
    base = {(e["task"], int(e["unit_id"]), int(e["seed"])): e for e in results[baseline]}
    disagreements, verdict = {}, {}
    for row in paired["pairs"]:
        arm = row["arm"]
        dis = []
        for e in results[arm]:
            b = base.get((e["task"], int(e["unit_id"]), int(e["seed"])))
            if b is not None and bool(b["success"]) != bool(e["success"]):
                dis.append({"unit_id": int(e["unit_id"]), "seed": int(e["seed"]), baseline: bool(b["success"]),
                            arm: bool(e["success"]), f"{baseline}_length": int(b.get("length", -1)),
                            f"{arm}_length": int(e.get("length", -1)), "stop_reason": e.get("stop_reason"),
                            "safety_counts": e.get("safety_counts")})
        disagreements[arm] = dis
        avg = row["average"]
        verdict[arm] = {"pairs": avg["pairs"], "disagreements": avg["wins"] + avg["losses"],
                        "arm_only_successes": avg["wins"], "baseline_only_successes": avg["losses"],
                        "diff": avg["diff"], "diff_ci95": avg["ci95"], "p_mcnemar": avg["p_mcnemar"],
                        "consistent": bool(avg["p_mcnemar"] >= 0.05)}
    return {"table": table, "paired": paired, "per_unit": per_unit, "disagreements": disagreements,
            "verdict": verdict}


def markdown(cmp: dict[str, Any], summaries: dict[str, dict]) -> str:
    """The comparison as Markdown: one row per arm (success, Wilson 95%, paired disagreements, McNemar p, safety
    events, policy latency)."""
    header = ("| side | trials | successes | success (Wilson 95%) | disagreements with eval (arm-only / eval-only) "
              "| McNemar p | paired diff [95% CI] | safety events (episodes) | policy latency per step, ms "
              "(mean / p95 / max) |")
    lines = [header, "|---" * 9 + "|"]
    for arm, row in cmp["table"]["arms"].items():
        c = row["average"]
        v = cmp["verdict"].get(arm)
        s = summaries.get(arm)
        dis = "–" if v is None else f"{v['disagreements']} ({v['arm_only_successes']} / {v['baseline_only_successes']})"
        p = "–" if v is None else f"{v['p_mcnemar']:.3g}"
        diff = "–" if v is None else (f"{100 * v['diff']:+.1f} [{100 * v['diff_ci95'][0]:+.1f}, "
                                      f"{100 * v['diff_ci95'][1]:+.1f}] pts")
        saf = "–" if s is None else (", ".join(f"{k} {n}" for k, n in sorted(s["safety_events"].items())) or "none") \
            + ("" if s is None else f" ({s['episodes_with_safety_events']})")
        lat = "–" if s is None or s["policy_latency"]["mean_ms"] is None else (
            f"{s['policy_latency']['mean_ms']:.1f} / {s['policy_latency']['p95_ms']:.1f} / "
            f"{s['policy_latency']['max_ms']:.1f}")
        lines.append(f"| {arm} | {c['trials']} | {c['successes']} | {100 * c['rate']:.1f}% "
                     f"[{100 * c['ci95'][0]:.1f}, {100 * c['ci95'][1]:.1f}] | {dis} | {p} | {diff} | {saf} | {lat} |")
    units = sorted({u for arm in cmp["per_unit"].values() for u in arm})
    lines += ["", "| side | " + " | ".join(f"unit {u}" for u in units) + " |", "|---" * (len(units) + 1) + "|"]
    for arm, per in cmp["per_unit"].items():
        cells = [f"{per[u]['average']['successes']}/{per[u]['average']['trials']}" if u in per else "–"
                 for u in units]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def lerobot_rollout_side(export: Path, trials: list[dict], task: str, ecfg: dict, out: Path,
                         timeout_s: float = 600.0) -> list[dict]:
    """Every trial driven by ``lerobot-rollout`` on the twin (see the module doc); resumable (a trial whose outcome
    is in ``<out>/results.jsonl`` is not run again). Returns evaluation-like results ``{task, unit_id, seed, success,
    length, stop_reason, wall_s}``, in the order of ``trials``.

    Raises:
        SystemExit: a rollout that fails or ends without the twin's outcome (its log named)."""
    import os
    import signal
    import subprocess
    import time

    from lerobot_policy_fleetmind.export import export_for_lerobot, twin_depth_calibration

    meta = json.loads((export / "export.json").read_text())
    inputs = meta["features"]["inputs"]
    cloud = "observation.point_cloud" in inputs
    cams = [k.split(".", 2)[2] for k in inputs if k.startswith("observation.images.")]
    ocfg = ecfg.get("obs") or {}
    dcams, dsize = list(ocfg.get("point_cameras") or []), int(ocfg.get("point_image_size") or 64)
    if cloud and not dcams:
        raise SystemExit("twin_vs_eval --lerobot: a point-cloud export needs the evaluation's obs.point_cameras "
                         "(pass obs=pointcloud 'obs.point_cameras=[...]' after --)")
    max_steps, fps = int(ecfg["task"]["max_episode_steps"]), float(meta.get("control_hz") or 30.0)
    out.mkdir(parents=True, exist_ok=True)
    results_file = out / "results.jsonl"
    done = {}
    if results_file.is_file():
        for line in results_file.read_text().splitlines():
            r = json.loads(line)
            done[(int(r["unit_id"]), int(r["seed"]))] = r
    folders: dict[int | None, Path] = {}

    def folder(unit: int) -> Path:
        key = unit if cloud else None   # a camera policy: one folder; a cloud policy: the unit's calibration
        if key not in folders:
            path = out / "policies" / (f"unit_{unit}" if cloud else "all")
            if not (path / "config.json").is_file():
                calib = twin_depth_calibration(dcams, dsize, unit, ecfg.get("robot")) if cloud else None
                export_for_lerobot(export, path, robot="so100", overwrite=True, depth_cameras=dcams or None,
                                   depth_size=dsize, depth_calibration=calib)
            folders[key] = path
        return folders[key]

    exe = str(Path(sys.executable).with_name("lerobot-rollout"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    results = []
    for i, tr in enumerate(trials):
        u, s = int(tr["unit_id"]), int(tr["seed"])
        if (u, s) not in done:
            log = out / "logs" / f"trial_{i:03d}_unit{u}_seed{s}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            sensors = [f"--robot.render_cameras=[{','.join(cams)}]",
                       f"--robot.image_size={int(inputs[f'observation.images.{cams[0]}'][0]) if cams else 64}"]
            if cloud:
                sensors += [f"--robot.depth_cameras=[{','.join(dcams)}]", f"--robot.depth_size={dsize}",
                            f"--robot.depth_color={str('observation.point_colors' in inputs).lower()}"]
            cmd = [exe, "--strategy.type=base", f"--policy.path={folder(u)}", "--policy.device=cpu",
                   "--robot.type=fleetmind_so100_sim", f"--robot.task={task}", f"--robot.unit_id={u}",
                   f"--robot.seed={s}", f"--robot.max_steps={max_steps}", f"--robot.result_file={results_file}",
                   "--robot.object_state=false", *sensors, f"--fps={round(fps)}",
                   f"--duration={int(timeout_s)}", "--display_data=false"]
            n_before = len(done)
            t0 = time.time()
            with log.open("w") as f:
                f.write(" ".join(cmd) + "\n")
                f.flush()
                proc = subprocess.Popen(cmd, cwd=str(out), env=env, stdout=f, stderr=subprocess.STDOUT)
                # the twin writes the trial's outcome after max_steps; then the rollout is stopped as a user
                # stops it (SIGINT: LeRobot's signal handler ends the loop and disconnects the robot)
                while proc.poll() is None:
                    time.sleep(0.5)
                    lines = results_file.read_text().splitlines() if results_file.is_file() else []
                    if len(lines) > n_before:
                        proc.send_signal(signal.SIGINT)
                        try:
                            proc.wait(timeout=60)
                        except subprocess.TimeoutExpired:
                            proc.kill()
                        break
            for line in (results_file.read_text().splitlines() if results_file.is_file() else []):
                r = json.loads(line)
                done.setdefault((int(r["unit_id"]), int(r["seed"])), {**r, "wall_s": time.time() - t0})
            if (u, s) not in done:
                raise SystemExit(f"twin_vs_eval --lerobot: trial {i} (unit {u}, seed {s}) ended without the twin's "
                                 f"outcome (exit {proc.returncode}); see {log}")
            print(f"  lerobot-rollout trial {i + 1}/{len(trials)}: unit {u} seed {s} "
                  f"{'success' if done[(u, s)]['success'] else 'failure'} ({time.time() - t0:.0f} s)", flush=True)
        r = done[(u, s)]
        results.append({"task": task, "unit_id": u, "seed": s, "success": bool(r["success"]),
                        "length": int(r["first_success_step"] or r["steps"]),
                        "stop_reason": "max_steps" if int(r["steps"]) >= max_steps else "stopped early",
                        "safety_counts": {}, "wall_s": r.get("wall_s")})
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", required=True, help="export folder (scripts/export.py)")
    ap.add_argument("--task", default=None, help="SO-100 task (default: the export's single training task)")
    ap.add_argument("--trials", type=int, default=40, help="held-out trials (eval.trials_per_task)")
    ap.add_argument("--out", default="outputs/twin_vs_eval", help="output folder")
    ap.add_argument("--eval-dir", default=None, help="reuse this scripts/eval.py run dir instead of evaluating")
    ap.add_argument("--no-realtime", action="store_true", help="deploy as fast as possible (pacing off)")
    ap.add_argument("--lerobot", action="store_true",
                    help="also drive the trials with LeRobot's own lerobot-rollout (the side lerobot_rollout)")
    ap.add_argument("--no-deploy", action="store_true", help="skip scripts/deploy.py's side (twin)")
    ap.add_argument("--variants", nargs="*", default=[], choices=sorted(VARIANTS),
                    help="diagnostic deployments also compared with the evaluation")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for both scripts (after --), e.g. robot=shifted")
    a = ap.parse_args()
    export = Path(a.export).resolve()
    if not (export / "export.json").is_file():
        raise SystemExit(f"twin_vs_eval: {export} is not an export folder (no export.json); write one with "
                         "scripts/export.py")
    task = a.task or export_task(export)
    if not task:
        raise SystemExit("twin_vs_eval: the export was not trained on a single SO-100 task; give --task")
    out = Path(a.out).resolve()
    py = sys.executable

    # 1. fleetmind's evaluation of the export on the held-out units
    eval_dir = Path(a.eval_dir).resolve() if a.eval_dir else out / "eval"
    if not a.eval_dir:
        _run([py, "scripts/eval.py", "task=so100", f"eval.tasks=[{task}]", f"eval.checkpoint={export}",
              f"eval.trials_per_task={a.trials}", "eval.videos=0", "eval.processes=1",
              f"hydra.run.dir={eval_dir}", *a.overrides], out / "logs" / "eval.log")
    evaluated = evaluation_episodes(eval_dir)
    trials = [{"task": e["task"], "unit_id": int(e["unit_id"]), "seed": int(e["seed"])} for e in evaluated]
    ecfg = json.loads((eval_dir / "config.json").read_text())
    trials_file = out / "trials.json"
    trials_file.parent.mkdir(parents=True, exist_ok=True)
    trials_file.write_text(json.dumps(trials, indent=1))
    nominal_file = out / "trials_nominal.json"
    nominal_file.write_text(json.dumps([{"task": t["task"], "seed": t["seed"]} for t in trials], indent=1))

    # 2. the same trials deployed on the twin through LeRobot (and the diagnostic variants)
    base = [py, "scripts/deploy.py", f"deploy.run.export_dir={export}", f"deploy.robot.task={task}",
            "deploy.run.label=sim", f"deploy.run.max_steps={int(ecfg['task']['max_episode_steps'])}",
            f"deploy.run.steps_after_success={int(ecfg['task']['steps_after_success'])}",
            f"deploy.run.realtime={str(not a.no_realtime).lower()}"]
    meta = json.loads((export / "export.json").read_text())
    if "observation.point_cloud" in meta["features"]["inputs"]:   # the twin's depth cameras, each unit's calibration
        ocfg = ecfg.get("obs") or {}
        base += [f"deploy.bridge.depth_cameras=[{','.join(ocfg.get('point_cameras') or [])}]",
                 f"+deploy.robot.depth_size={int(ocfg.get('point_image_size') or 64)}"]
    results: dict[str, list[dict]] = {"eval": [{**e, "task": str(e["task"])} for e in evaluated]}
    summaries: dict[str, dict] = {}
    for arm in [*([] if a.no_deploy else ["twin"]), *(f"twin_{v}" for v in a.variants)]:
        variant = arm.removeprefix("twin_") if arm != "twin" else None
        tf = nominal_file if variant == "nominal" else trials_file
        run_dir = out / arm
        if not (run_dir / "deploy_report.json").is_file():
            _run([*base, f"deploy.run.trials={tf}", *(VARIANTS[variant] if variant else []),
                  f"hydra.run.dir={run_dir}", *a.overrides], out / "logs" / f"{arm}.log")
        report = json.loads((run_dir / "deploy_report.json").read_text())
        results[arm] = twin_episodes(report, trials, task)
        summaries[arm] = deployment_summary(report)

    if a.lerobot:
        results["lerobot_rollout"] = lerobot_rollout_side(export, trials, task, ecfg, out / "lerobot_rollout")

    # 3. the comparison
    cmp = compare(results)
    eval_steps = [float(e["wall_s"]) / max(int(e["length"]), 1) for e in evaluated if "wall_s" in e]
    summaries_eval = {"per_step_wall_ms_mean": 1e3 * float(np.mean(eval_steps)) if eval_steps else None,
                      "note": "policy + simulation per control step, not real time (the evaluation's own pace)"}
    doc = {"export": str(export), "task": task, "trials": len(trials), "eval_dir": str(eval_dir),
           "eval_seed": ecfg.get("eval", {}).get("seed"), "overrides": a.overrides,
           "units": sorted({t["unit_id"] for t in trials}), **cmp,
           "deployments": summaries, "evaluation": summaries_eval}
    md = markdown(cmp, summaries)
    (out / "comparison.json").write_text(json.dumps(doc, indent=1))
    (out / "comparison.md").write_text(md)
    print("\n" + md)
    for arm, v in cmp["verdict"].items():
        print(f"{arm} vs eval: {v['disagreements']} of {v['pairs']} trials disagree, McNemar p = {v['p_mcnemar']:.3g}"
              f" -> {'consistent within trial noise' if v['consistent'] else 'DIFFERENT beyond trial noise'}")
    print(f"outputs in {out}")


if __name__ == "__main__":
    main()
