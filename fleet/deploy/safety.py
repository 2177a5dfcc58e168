"""Safety limits on every joint-target action before it reaches a robot, and a policy deadline watchdog.

Core module: numpy and the standard library only (no LeRobot, MuJoCo or torch), so it runs on any deploy machine
and is tested in the core environment. ``fleet.deploy.lerobot_bridge`` / ``fleet.deploy.deployer`` wire it to a LeRobot robot.

Joint vectors are in the robot's (LeRobot's) units, in the order of ``SafetyLimits.names``: degrees for the arm
joints, 0..100 for the gripper (LeRobot's ``so101_follower`` with ``use_degrees=True``).

``SafetyFilter.filter(targets, current)`` applies, in order (each trigger is a ``SafetyEvent``, counted and logged):

1. ``non_finite``: a NaN/inf in the proposed targets (or the policy action) -> hold the measured position and
   latch a stop (every later call sends that same position until ``reset``);
2. ``stopped``: a latched stop (NaN or the watchdog) -> hold the position latched with the stop;
3. ``joint_limit``: targets clipped to ``joint_limits`` (default: the SO-100 MJCF ranges, see
   ``fleet.deploy.lerobot_bridge.so100_joint_limits``); an excess within ``LIMIT_ROUNDING`` is float rounding,
   clipped without an event;
4. ``max_step``: ``|target - current|`` clipped to ``max_step`` per joint per control step (as LeRobot's
   ``max_relative_target``, ``lerobot.robots.utils.ensure_safe_goal_position``);
5. ``workspace``: the end-effector position of the (clipped) targets, by forward kinematics, outside the
   ``workspace`` box and not closer to it than the current pose -> the command is rejected: the last targets sent
   (inside the box) are sent again, or the measured position before any was sent.

A stop holds the *measured* position (the arm stops where it is, mid-motion). A rejected command repeats the last
*sent* targets instead: re-sending the measured position every step would let a position servo's steady-state
error under gravity ratchet the arm downwards, step after step.

``Watchdog.call(fn)`` runs the policy in a worker thread; when it misses ``deadline_s`` the ``on_miss`` callback
(the deploy loop: hold the arm) runs at the deadline, the late result is discarded, and after
``max_misses`` consecutive misses the stop latches.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

log = logging.getLogger("fleetmind.safety")

LIMIT_ROUNDING = 1e-9
"""Robot units (degrees; gripper 0..100): a target beyond a joint limit by at most this is float rounding, clipped
without a ``joint_limit`` event. The SO-100 bridge's IK keeps its joints inside the MJCF ranges, but lands on a
range end to within ~1e-14 degrees after the radian-degree conversion: 205 of 205 ``joint_limit`` events of three
40-trial deployments on the twin were such (wrist_flex, at most 1.4e-14 degrees over), hiding real ones."""
EVENT_KINDS = ("non_finite", "bad_action", "stopped", "action_range", "joint_limit", "max_step", "workspace",
               "deadline")


@dataclasses.dataclass
class SafetyEvent:
    """One safety trigger: control ``step`` of the episode, ``kind`` (one of ``EVENT_KINDS``) and a JSON-able
    ``detail`` (joint names and values, distances, times)."""

    step: int
    kind: str
    detail: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "kind": self.kind, "detail": self.detail}


@dataclasses.dataclass
class SafetyLimits:
    """Every limit of the safety filter and the watchdog (all configurable from ``deploy.safety``).

    Attributes:
        names: joint names, the order of every joint vector (e.g. LeRobot's ``shoulder_pan`` ... ``gripper``).
        joint_limits: (J, 2) [low, high] per joint in the robot's units (degrees; gripper 0..100).
        max_step: (J,) largest allowed ``|target - current|`` per control step, same units (inf: no limit).
        workspace: (2, 3) [[x, y, z] low, [x, y, z] high] box for the end-effector position, metres, in the
            frame of the ``fk`` given to ``SafetyFilter`` (None: not checked).
        deadline_s: seconds the policy may take for one action before the watchdog holds the arm (None: off).
        max_misses: consecutive missed deadlines that latch a stop (1: stop at the first miss).
    Raises:
        ValueError: shapes that do not match ``names``, low > high, a negative step, a non-positive deadline.
    """

    names: Sequence[str]
    joint_limits: np.ndarray
    max_step: np.ndarray
    workspace: np.ndarray | None = None
    deadline_s: float | None = 0.25
    max_misses: int = 1

    def __post_init__(self) -> None:
        self.names = [str(n) for n in self.names]
        j = len(self.names)
        self.joint_limits = np.asarray(self.joint_limits, dtype=np.float64)
        if self.joint_limits.shape != (j, 2):
            raise ValueError(f"joint_limits: expected shape ({j}, 2) for joints {self.names}, "
                             f"given {self.joint_limits.shape}")
        bad = [n for n, (lo, hi) in zip(self.names, self.joint_limits) if not lo <= hi]
        if bad:
            raise ValueError(f"joint_limits: low > high (or NaN) for joint {bad[0]!r}: "
                             f"{self.joint_limits[self.names.index(bad[0])].tolist()}")
        self.max_step = np.broadcast_to(np.asarray(self.max_step, dtype=np.float64), (j,)).copy()
        if not np.all(self.max_step > 0):
            raise ValueError(f"max_step: expected > 0 per joint, given {dict(zip(self.names, self.max_step.tolist()))}")
        if self.workspace is not None:
            self.workspace = np.asarray(self.workspace, dtype=np.float64)
            if self.workspace.shape != (2, 3) or not np.all(self.workspace[0] <= self.workspace[1]):
                raise ValueError(f"workspace: expected [[x, y, z] low, [x, y, z] high] with low <= high, "
                                 f"given {self.workspace.tolist()}")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ValueError(f"deadline_s: expected > 0 seconds or None, given {self.deadline_s}")
        if int(self.max_misses) < 1:
            raise ValueError(f"max_misses: expected >= 1, given {self.max_misses}")
        self.max_misses = int(self.max_misses)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able copy (for the deploy report)."""
        return {"names": list(self.names), "joint_limits": self.joint_limits.tolist(),
                "max_step": [None if not np.isfinite(s) else float(s) for s in self.max_step],
                "workspace": None if self.workspace is None else self.workspace.tolist(),
                "deadline_s": self.deadline_s, "max_misses": self.max_misses}


class EventLog:
    """Counts ``SafetyEvent``s and logs them: the first of each kind at once, repeats of a kind at most once per
    ``interval_s`` with the number suppressed since (a limit that clips every step at 30 Hz stays readable).

    Attributes: ``events`` (every event, in order), ``counts`` (``Counter`` by kind).
    """

    def __init__(self, interval_s: float = 1.0, logger: logging.Logger = log) -> None:
        self.interval_s, self.logger = float(interval_s), logger
        self.events: list[SafetyEvent] = []
        self.counts: Counter = Counter()
        self._last: dict[str, float] = {}
        self._suppressed: Counter = Counter()
        self._lock = threading.Lock()

    def add(self, event: SafetyEvent) -> None:
        with self._lock:
            self.events.append(event)
            self.counts[event.kind] += 1
            now = time.monotonic()
            if now - self._last.get(event.kind, -np.inf) >= self.interval_s:
                more = self._suppressed.pop(event.kind, 0)
                self.logger.warning("safety %s at step %d: %s%s", event.kind, event.step, event.detail,
                                    f" (+{more} more since the last report)" if more else "")
                self._last[event.kind] = now
            else:
                self._suppressed[event.kind] += 1

    def summary(self) -> dict[str, Any]:
        """``{"counts": {kind: n}, "events": [event dicts]}`` (JSON-able)."""
        return {"counts": dict(self.counts), "events": [e.to_dict() for e in self.events]}


def _box_distance(p: np.ndarray, box: np.ndarray) -> float:
    """Euclidean distance (m) from point ``p`` (3,) to the axis-aligned ``box`` (2, 3); 0 inside."""
    return float(np.linalg.norm(np.maximum(box[0] - p, 0.0) + np.maximum(p - box[1], 0.0)))


class SafetyFilter:
    """Applies ``SafetyLimits`` to proposed joint targets (see the module doc for the order and the events).

    Args:
        limits: the limits.
        fk: joint vector (J,) in the robot's units -> end-effector position (3,) in metres; needed when
            ``limits.workspace`` is set.
        events: where triggers are recorded (default: a new ``EventLog``).
    Raises:
        ValueError: a workspace without ``fk``.
    """

    def __init__(self, limits: SafetyLimits, fk: Callable[[np.ndarray], np.ndarray] | None = None,
                 events: EventLog | None = None) -> None:
        if limits.workspace is not None and fk is None:
            raise ValueError("SafetyFilter: limits.workspace is set but no forward kinematics (fk) was given")
        self.limits, self.fk = limits, fk
        self.events = events if events is not None else EventLog()
        self.stopped: str | None = None  # the reason of a latched stop
        self.hold_targets: np.ndarray | None = None  # what a latched stop keeps sending
        self.last_sent: np.ndarray | None = None

    def reset(self) -> None:
        """Clear a latched stop and the last sent targets (an operator's decision at the start of an episode)."""
        self.stopped, self.hold_targets, self.last_sent = None, None, None

    def stop(self, step: int, reason: str, hold: np.ndarray, detail: dict[str, Any] | None = None) -> np.ndarray:
        """Latch a stop (``reason``: an event kind) holding ``hold`` (J,) (normally the measured position); every
        later ``filter`` call returns those targets until ``reset``. Returns the targets to send now."""
        if self.stopped is None:
            self.stopped = reason
            self.hold_targets = np.asarray(hold, dtype=np.float64).copy()
            log.warning("safety stop latched at step %d: %s %s", step, reason, detail or "")
        self.last_sent = self.hold_targets.copy()
        return self.hold_targets.copy()

    def _event(self, step: int, kind: str, **detail: Any) -> None:
        self.events.add(SafetyEvent(step, kind, detail))

    def _named(self, mask: np.ndarray, *arrays: np.ndarray) -> dict[str, list[float]]:
        return {n: [float(a[i]) for a in arrays] for i, n in enumerate(self.limits.names) if mask[i]}

    def filter(self, targets: np.ndarray, current: np.ndarray, step: int = 0,
               action: np.ndarray | None = None) -> tuple[np.ndarray, list[SafetyEvent]]:
        """Make proposed joint ``targets`` safe to send.

        Args:
            targets: (J,) proposed joint targets (robot units, ``limits.names`` order); may hold NaN/inf.
            current: (J,) measured joint positions (must be finite: it is what a hold sends).
            step: the control step (for the events).
            action: the policy's raw action, checked for NaN/inf too (optional).
        Returns:
            (J,) float64 targets to send, and the events triggered by this call.
        Raises:
            ValueError: wrong shapes, or a non-finite ``current`` (the robot's reading itself is broken).
        """
        lim = self.limits
        j = len(lim.names)
        t = np.asarray(targets, dtype=np.float64).reshape(-1)
        cur = np.asarray(current, dtype=np.float64).reshape(-1)
        if t.shape != (j,) or cur.shape != (j,):
            raise ValueError(f"SafetyFilter.filter: expected targets and current of shape ({j},) for {lim.names}, "
                             f"given {t.shape} and {cur.shape}")
        if not np.all(np.isfinite(cur)):
            raise ValueError(f"SafetyFilter.filter: the measured joint positions are not finite: "
                             f"{dict(zip(lim.names, cur.tolist()))}")
        n0 = len(self.events.events)
        bad_action = action is not None and not np.all(np.isfinite(np.asarray(action, dtype=np.float64)))
        if bad_action or not np.all(np.isfinite(t)):
            self._event(step, "non_finite", targets=[None if not np.isfinite(x) else float(x) for x in t],
                        action=None if action is None else [None if not np.isfinite(x) else float(x)
                                                             for x in np.asarray(action, dtype=np.float64)])
            return self.stop(step, "non_finite", cur), self.events.events[n0:]
        if self.stopped is not None:
            self._event(step, "stopped", reason=self.stopped)
            return self.stop(step, self.stopped, cur), self.events.events[n0:]
        lo, hi = lim.joint_limits[:, 0], lim.joint_limits[:, 1]
        if np.any((t < lo) | (t > hi)):
            clipped = np.clip(t, lo, hi)
            out = (t < lo - LIMIT_ROUNDING) | (t > hi + LIMIT_ROUNDING)
            if out.any():
                self._event(step, "joint_limit", joints=self._named(out, t, clipped))
            t = clipped
        d = t - cur
        big = np.abs(d) > lim.max_step
        if big.any():
            capped = cur + np.clip(d, -lim.max_step, lim.max_step)
            self._event(step, "max_step", joints=self._named(big, t, capped), max_step=
                        {n: float(s) for n, s, b in zip(lim.names, lim.max_step, big) if b})
            t = capped
        if lim.workspace is not None:
            p = np.asarray(self.fk(t), dtype=np.float64)
            dist = _box_distance(p, lim.workspace)
            if dist > 0.0:
                cur_dist = _box_distance(np.asarray(self.fk(cur), dtype=np.float64), lim.workspace)
                if dist > cur_dist - 1e-9:  # leaving the box, or not coming back towards it
                    self._event(step, "workspace", ee=[float(x) for x in p], distance_m=dist,
                                current_distance_m=cur_dist)
                    t = cur.copy() if self.last_sent is None else self.last_sent.copy()
        self.last_sent = t.copy()
        return t, self.events.events[n0:]

    def hold(self, current: np.ndarray) -> np.ndarray:
        """Targets that hold the arm at its measured ``current`` (J,) position now (the watchdog's hold): the
        stop's targets when one is latched; recorded as the last sent targets."""
        if self.stopped is not None:
            return self.hold_targets.copy()
        self.last_sent = np.asarray(current, dtype=np.float64).copy()
        return self.last_sent.copy()


@dataclasses.dataclass
class WatchdogResult:
    """What ``Watchdog.call`` returns: the callable's ``value`` (None when it missed the deadline: a late value is
    discarded), ``elapsed_s`` of the call, ``missed`` and ``miss_handled_s`` (seconds from the call's start to
    the moment ``on_miss`` ran, when it missed)."""

    value: Any
    elapsed_s: float
    missed: bool
    miss_handled_s: float | None = None


class Watchdog:
    """Runs the policy under a deadline in one worker thread.

    ``call(fn, *args, on_miss=...)`` waits at most ``deadline_s`` for ``fn(*args)``; on a miss it runs
    ``on_miss()`` right away (the deploy loop holds the arm there), then waits for the late call to end (the
    policy is not re-entrant) and discards its value. A call that does not end within ``hang_s`` raises
    ``TimeoutError`` (the arm was already held). ``deadline_s=None`` runs ``fn`` inline, unwatched.

    Args:
        deadline_s: seconds per call; hang_s: seconds after which a late call counts as hung.
    Raises:
        ValueError: a non-positive deadline or ``hang_s`` < ``deadline_s``.
    """

    def __init__(self, deadline_s: float | None, hang_s: float = 30.0) -> None:
        if deadline_s is not None and not deadline_s > 0:
            raise ValueError(f"Watchdog: deadline_s must be > 0 or None, given {deadline_s}")
        if deadline_s is not None and hang_s < deadline_s:
            raise ValueError(f"Watchdog: hang_s ({hang_s}) must be >= deadline_s ({deadline_s})")
        self.deadline_s, self.hang_s = deadline_s, float(hang_s)
        self.misses = 0            # consecutive misses
        self.total_misses = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="policy") if deadline_s else None

    def call(self, fn: Callable[..., Any], *args: Any, on_miss: Callable[[], None] | None = None,
             **kwargs: Any) -> WatchdogResult:
        """Run ``fn(*args, **kwargs)`` under the deadline (see the class doc). Exceptions of ``fn`` propagate.

        Raises:
            TimeoutError: the call is still running ``hang_s`` after its start.
        """
        t0 = time.perf_counter()
        if self._pool is None:
            value = fn(*args, **kwargs)
            self.misses = 0
            return WatchdogResult(value, time.perf_counter() - t0, False)
        fut = self._pool.submit(fn, *args, **kwargs)
        try:
            value = fut.result(timeout=self.deadline_s)
            self.misses = 0
            return WatchdogResult(value, time.perf_counter() - t0, False)
        except FutureTimeout:
            pass
        handled = time.perf_counter() - t0
        self.misses += 1
        self.total_misses += 1
        if on_miss is not None:
            on_miss()
        try:
            fut.result(timeout=max(self.hang_s - (time.perf_counter() - t0), 0.0))
        except FutureTimeout as e:
            raise TimeoutError(f"the policy call is still running {self.hang_s:.1f} s after it started "
                               f"(deadline {self.deadline_s} s): treated as hung") from e
        return WatchdogResult(None, time.perf_counter() - t0, True, handled)

    def close(self) -> None:
        """Stop the worker thread (waits for a running call)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
