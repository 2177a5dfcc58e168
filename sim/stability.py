"""Physics blow-up detection for one control step.

When a simulation diverges, MuJoCo does not raise: ``mj_checkPos`` / ``mj_checkVel`` / ``mj_checkAcc`` find a
NaN or huge value in ``qpos`` / ``qvel`` / ``qacc``, print a warning, **reset the data to the model's initial
state** (``mj_resetData``; simulation time back to 0) and count the event in ``mjData.warning`` (MuJoCo
documentation, "Simulation: Diverging"; ``mjtWarning``: ``mjWARN_BADQPOS``, ``mjWARN_BADQVEL``,
``mjWARN_BADQACC``). An episode that goes on after that is not the episode it was: the hand jumps to the home
pose. ``StepMonitor`` marks such a step so the env can end the episode with termination ``"sim_unstable"``.
"""

from __future__ import annotations

import logging

import mujoco

log = logging.getLogger("fleetmind.sim")

UNSTABLE_WARNINGS = (mujoco.mjtWarning.mjWARN_BADQPOS, mujoco.mjtWarning.mjWARN_BADQVEL,
                     mujoco.mjtWarning.mjWARN_BADQACC)
SIM_UNSTABLE = "sim_unstable"


class StepMonitor:
    """Call :meth:`before` with the ``mjData`` before a control step's physics steps and :meth:`after` after
    them; ``after`` returns a description when the step diverged (an instability warning was counted, or the
    simulation time went backwards: MuJoCo's automatic reset), else None."""

    def __init__(self) -> None:
        self._time, self._counts = 0.0, (0, 0, 0)

    def before(self, data) -> None:
        self._time = float(data.time)
        self._counts = tuple(int(data.warning[w].number) for w in UNSTABLE_WARNINGS)

    def after(self, data) -> str | None:
        counts = tuple(int(data.warning[w].number) for w in UNSTABLE_WARNINGS)
        names = [w.name for w, n0, n in zip(UNSTABLE_WARNINGS, self._counts, counts) if n > n0]
        if names or float(data.time) < self._time:
            what = (f"MuJoCo instability warnings {names}" if names else "no warning") + \
                f", simulation time {self._time:.4f} s -> {float(data.time):.4f} s"
            log.warning("physics diverged (%s): ending the episode as %s", what, SIM_UNSTABLE)
            return what
        return None
