"""The offline arms (filtered BC, filtered BC + retries, demos BC, FERT ablations trained outside the loop):
fine-tuned from their base on the final store with the same budget (``fleet.experiment.arms``), in a background process
beside the last round's learner (``job.overlap_offline_arms``) or here; the critic arms are checkpoint copies."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import time
from pathlib import Path

from fleet.experiment.arms import critic_arm_checkpoint, train_offline_arm, train_offline_arms_process
from fleet.experiment.state import JobState, Stages


def _offline_arms_to_train(state: JobState, arms: list) -> list:
    """The offline arms (trained outside the fleet loop, with data) whose stage is not done yet."""
    return [a for a in arms if not a.in_loop and a.data != "none" and not state.done(a.name)]


def start_offline_arms(c: dict, sd: Path, state: JobState, arms: list, ckpt: dict, heldout: list[int],
                       seed: int) -> dict:
    """Start training the offline arms not done yet (``stage_offline_arms``' work, the same calls) in one
    background process (spawned; ``train.num_threads`` threads, 1 by default, so the weights are those a
    sequential run gives). Returns ``{"future", "executor", "arms", "t0"}`` or ``{}`` when there is nothing to
    train or an arm starts from a checkpoint the rounds have not made yet."""
    todo = _offline_arms_to_train(state, arms)
    if not todo or any(a.init not in ckpt for a in todo):
        return {}
    ex = concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    jobs = [(a, ckpt[a.init], str(sd / a.name)) for a in todo]
    print(f"  training {[a.name for a in todo]} in a background process beside the last round's learner", flush=True)
    return {"future": ex.submit(train_offline_arms_process, c, jobs, heldout, seed), "executor": ex,
            "arms": [a.name for a in todo], "t0": time.perf_counter()}


def stage_offline_arms(c: dict, sd: Path, seed: int, state: JobState, stages: Stages, arms: list, ckpt: dict,
                       reader, heldout: list[int], background: dict | None = None) -> None:
    """Fine-tune every arm trained outside the fleet loop (filtered BC, demos_bc, ...) on the final store; sets
    ``ckpt[arm]``. Arms without data (the bases) and in-loop arms are skipped; the critic arms
    (``fert_no_critic``, ``base_critic``) are copies of a checkpoint with or without FERT's success critic.
    ``background``: :func:`start_offline_arms`' handle; its arms are collected from that process (its error,
    if any, is raised here) instead of trained again.

    Raises:
        RuntimeError: the background training failed (the cause chained; re-running resumes it here)."""
    if background:   # the arms' own stage lines follow (the stage count stays the job's)
        print(f"  waiting for {background['arms']} (training in the background since the last fleet round)", flush=True)
        try:
            done = background["future"].result()
        except Exception as e:
            raise RuntimeError(f"training the offline arms {background['arms']} in the background failed: "
                               f"{type(e).__name__}: {e}; re-running the job trains them again") from e
        finally:
            background["executor"].shutdown()
        waited = time.perf_counter() - background["t0"]
        for name, (path, wall) in done.items():
            state.mark(name, {"checkpoint": path, "wall_s": wall, "background": True,
                              "wall_s_to_join": waited})
    for arm in arms:
        if arm.in_loop or arm.data == "none":
            continue
        stages.start(f"seed {seed}: fine-tune {arm.name} ({arm.description})")
        if not state.done(arm.name):
            t0 = time.perf_counter()
            state.mark(arm.name, {"checkpoint": train_offline_arm(c, arm, reader, ckpt[arm.init], sd / arm.name,
                                                                  heldout, seed),
                                  "wall_s": time.perf_counter() - t0})
        ckpt[arm.name] = state.get(arm.name)["checkpoint"]
    for arm in arms:   # FERT's weights without its critic, the base with it: copies, no training
        if arm.critic is not None:
            ckpt[arm.name] = critic_arm_checkpoint(arm, ckpt, sd / arm.name)
