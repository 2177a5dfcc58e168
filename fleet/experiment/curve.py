"""The main job's learning curve: every published policy version on the same held-out trials, the weights alone
(K = 1) and with the version's success critic, and the background process that evaluates a round's new versions
while the next round works.

Why a background process: the learner's stages (critic fit, critic relabelling, training) run one torch thread
each (``learner.torch_threads``; two threads collapse on a shared 2-core machine, ``policies/threads.py``), so on
the 2-core default machine one core idles for most of a round. The curve's evaluation of the versions a round
published (~70 s of two processes on the default job) runs there, one process at ``nice`` 10, so that it takes
the idle core and yields the busy ones. A trial is a function of (task, unit, reset seed, checkpoint)
(``fleet.experiment.evaluation.run_plan_vectorised``), so where and when a version is evaluated does not change its
episodes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Self

from fleet.experiment.job_config import JobConfig

BACKGROUND_NICE = 10   # niceness of the background evaluation: ~10 % of a core it shares with a nice-0 process


def learning_curve(c: dict, sd: Path, reg, heldout: list[int], progress: bool,
                   have: list | None = None) -> list[dict]:
    """The learning curve's new points: every published version of ``reg`` not yet in ``have`` (the base, v1,
    first) on the held-out plan (``eval.seed``), ``job.curve_trials_per_task`` trials per task, the weights alone
    (K = 1) and with the version's success critic when it has one. The episodes go to ``<sd>/episodes`` like the
    final arms' (``curve_v<N>``, ``curve_v<N>_critic``), so an arm with the same checkpoint reuses them.

    Args:
        c: the seed's plain config dict. sd: the seed dir. reg: a ``fleet.registry.CheckpointRegistry``.
        heldout: the held-out unit ids. have: the points already recorded (their versions are skipped).

    Returns ``[{"round", "version", "kind", "heldout", "heldout_critic", "per_task", "per_task_critic",
    "successes", "trials", "successes_critic"}]`` (rates in [0, 1]; ``round`` -1 is the base; ``heldout_critic``
    None without a critic)."""
    from fleet.experiment.evaluation import evaluate_arms
    from fleet.experiment.protocol import success_by_task
    from fleet.registry import checkpoint_with_critic
    from policies.critic import CRITIC_FILES

    sd = Path(sd)
    have = have or []
    seen = {int(p["version"]) for p in have}
    n = JobConfig.from_dict(c["job"]).curve_trials_per_task
    out = []
    for v in reg.versions():
        if v in seen:
            continue
        md = reg.manifest(v).get("metadata") or {}
        d = reg.fetch(v, sd / "cache" / "curve" / f"v{v:06d}")
        arms = {f"curve_v{v}": checkpoint_with_critic(d, sd / "cache" / "curve" / f"v{v:06d}_alone", None)}
        critic = all((Path(d) / f).is_file() for f in CRITIC_FILES)
        if critic:
            arms[f"curve_v{v}_critic"] = str(d)
        res = evaluate_arms(c, arms, sd, n, units=heldout, progress=progress)
        pt = {"round": int(md.get("round", -1)), "version": int(v), "kind": md.get("kind")}
        for suffix, name in (("", f"curve_v{v}"), ("_critic", f"curve_v{v}_critic")):
            eps = res.get(name)
            k = sum(bool(e["success"]) for e in eps) if eps else None
            pt[f"heldout{suffix}"] = k / len(eps) if eps else None
            pt[f"successes{suffix}"] = k
            pt[f"per_task{suffix}"] = success_by_task(eps) if eps else None
        pt["trials"] = len(res[f"curve_v{v}"])
        out.append(pt)
    return out


def curve_lines(curve: list[dict], seed: int) -> list[str]:
    """The learning curve as text: a header and one line per published version (round -1: the base, v1)."""
    def pct(x):
        return "  -  " if x is None else f"{100 * x:5.1f}"

    lines = [f"learning curve (seed {seed}; held-out units, the same trials for every version):",
             "  round  version  policy alone (K=1)  with its critic  per task (K=1)"]
    for p in curve:
        tasks = ", ".join(f"{t} {k}/{n}" for t, (k, n) in sorted((p.get("per_task") or {}).items()))
        lines.append(f"  {p['round']:>5}  v{p['version']:<7} {pct(p['heldout']):>18}  {pct(p['heldout_critic']):>15}  {tasks}")
    return lines


def print_curve(curve: list[dict], seed: int) -> None:
    """Print the learning curve so far: one line per published version."""
    print("\n".join(curve_lines(curve, seed)), flush=True)


def _curve_in_background(conn, c: dict, sd: str, registry_url: str, heldout: list[int], have: list) -> None:
    """The background process: :func:`learning_curve` with one evaluation process (this one), at ``nice``
    :data:`BACKGROUND_NICE`; sends ``("ok", points)`` or ``("error", "<type>: <message>\n<traceback>")``."""
    import traceback

    os.nice(BACKGROUND_NICE)
    try:
        from fleet.registry import CheckpointRegistry

        c1 = {**c, "eval": {**c["eval"], "processes": 1}}
        conn.send(("ok", learning_curve(c1, Path(sd), CheckpointRegistry(registry_url), heldout, False, have=have)))
    except BaseException as e:   # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        conn.close()


class BackgroundCurve:
    """At most one :func:`learning_curve` call at a time in a spawned process at ``nice`` :data:`BACKGROUND_NICE`,
    one evaluation process, no progress bars; its points are collected (and recorded by the caller) with
    :meth:`collect`. A job killed while a call is pending loses only that call's unrecorded points: the next
    :func:`learning_curve` call recomputes them (its finished arms' episodes are cached in ``<sd>/episodes``).
    Use as a context manager, so that a job that fails stops the pending call."""

    def __init__(self):
        self._proc = None
        self._conn = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pending(self) -> bool:
        """Whether a call was started and not collected yet."""
        return self._proc is not None

    def start(self, c: dict, sd: Path, registry_url: str, heldout: list[int], have: list) -> None:
        """Evaluate the versions of ``registry_url`` not in ``have`` in the background.

        Raises:
            RuntimeError: a call is still pending (collect it first)."""
        import multiprocessing

        if self.pending:
            raise RuntimeError("BackgroundCurve.start: the previous call is not collected yet")
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_curve_in_background, name="learning-curve",
                                 args=(child, c, str(sd), str(registry_url), [int(u) for u in heldout], list(have)))
        self._proc.start()
        child.close()

    def collect(self) -> list[dict]:
        """Wait for the pending call and return its new points (``[]`` when none is pending).

        Raises:
            RuntimeError: the background evaluation failed or its process died (the next :func:`learning_curve`
                call recomputes what it did not record)."""
        if not self.pending:
            return []
        try:
            try:
                status, payload = self._conn.recv()
            except EOFError:
                self._proc.join()
                raise RuntimeError(f"the learning curve's background evaluation died (exit code "
                                   f"{self._proc.exitcode})") from None
            if status != "ok":
                raise RuntimeError(f"the learning curve's background evaluation failed: {payload}")
            self._proc.join(timeout=60)   # it has returned its points: let it exit by itself
            return payload
        finally:
            self.close()

    def close(self) -> None:
        """Stop a pending call (its process is terminated; nothing it did not return is recorded)."""
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.terminate()
            self._proc.join()
            self._conn.close()
        self._proc = self._conn = None
