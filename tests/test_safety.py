"""Safety filter and watchdog (fleet/deploy/safety.py): each limit on small hand-made joint vectors, the NaN latch, the
workspace check through a forward-kinematics callable, rate-limited logging and the watchdog's timing."""

import logging
import threading
import time

import numpy as np
import pytest

from fleet.deploy.safety import EventLog, SafetyFilter, SafetyLimits, Watchdog

NAMES = ["a", "b", "gripper"]


def _limits(**kw) -> SafetyLimits:
    base = {"names": NAMES, "joint_limits": [[-90, 90], [-45, 45], [0, 100]], "max_step": [10, 10, 50],
            "workspace": None, "deadline_s": 0.1}
    return SafetyLimits(**{**base, **kw})


def test_joint_limits_clip_and_are_reported_per_joint():
    f = SafetyFilter(_limits())
    sent, ev = f.filter([95.0, -50.0, 40.0], [88.0, -40.0, 40.0], step=3)
    np.testing.assert_allclose(sent, [90.0, -45.0, 40.0])
    assert [e.kind for e in ev] == ["joint_limit"] and ev[0].step == 3
    assert ev[0].detail["joints"] == {"a": [95.0, 90.0], "b": [-50.0, -45.0]}
    sent, ev = f.filter([10.0, 0.0, 0.0], [5.0, 0.0, 0.0])      # inside every limit: unchanged, no event
    np.testing.assert_array_equal(sent, [10.0, 0.0, 0.0])
    assert ev == [] and f.events.counts == {"joint_limit": 1}


def test_max_step_caps_the_change_from_the_measured_position():
    f = SafetyFilter(_limits())
    sent, ev = f.filter([30.0, -4.0, 100.0], [0.0, 0.0, 20.0])
    np.testing.assert_allclose(sent, [10.0, -4.0, 70.0])         # a: +10 cap, b: within, gripper: +50 cap
    assert [e.kind for e in ev] == ["max_step"] and set(ev[0].detail["joints"]) == {"a", "gripper"}
    # the joint limit is applied first, then the step cap from the measured position
    sent, _ = f.filter([200.0, 0.0, 20.0], [85.0, 0.0, 20.0])
    np.testing.assert_allclose(sent, [90.0, 0.0, 20.0])


def test_nan_or_inf_holds_and_latches_a_stop_until_reset():
    f = SafetyFilter(_limits())
    cur = np.array([1.0, 2.0, 3.0])
    sent, ev = f.filter([np.nan, 0.0, 0.0], cur, step=7)
    np.testing.assert_array_equal(sent, cur)
    assert [e.kind for e in ev] == ["non_finite"] and f.stopped == "non_finite"
    sent, ev = f.filter([1.5, 2.0, 3.0], cur - 0.5, step=8)      # a good action after the stop: still held,
    np.testing.assert_array_equal(sent, cur)                     # at the position latched with the stop
    assert [e.kind for e in ev] == ["stopped"] and ev[0].detail == {"reason": "non_finite"}
    f.reset()
    sent, ev = f.filter([1.5, 2.0, 3.0], cur)
    np.testing.assert_array_equal(sent, [1.5, 2.0, 3.0])
    assert ev == []
    # finite targets but a non-finite policy action also stop
    sent, ev = f.filter([1.5, 2.0, 3.0], cur, action=np.array([0.0, np.inf]))
    np.testing.assert_array_equal(sent, cur)
    assert ev[0].kind == "non_finite" and ev[0].detail["action"] == [0.0, None] and f.stopped


def test_workspace_rejects_commands_leaving_the_box_but_lets_the_arm_come_back():
    fk = lambda q: np.array([q[0], q[1], 0.0]) / 100.0            # joints "a", "b" are x, y in cm
    box = [[-0.2, -0.2, -0.1], [0.2, 0.2, 0.1]]
    f = SafetyFilter(_limits(workspace=box), fk=fk)
    sent, ev = f.filter([25.0, 0.0, 0.0], [15.0, 0.0, 0.0])     # would leave the box, nothing sent yet: hold here
    np.testing.assert_array_equal(sent, [15.0, 0.0, 0.0])
    assert [e.kind for e in ev] == ["workspace"] and ev[0].detail["distance_m"] == pytest.approx(0.05)
    sent, ev = f.filter([19.0, 0.0, 0.0], [15.0, 0.0, 0.0])     # inside: sent
    np.testing.assert_array_equal(sent, [19.0, 0.0, 0.0])
    assert ev == []
    sent, ev = f.filter([22.0, 1.0, 0.0], [18.5, 0.0, 0.0])     # leaving again: the last sent targets again,
    np.testing.assert_array_equal(sent, [19.0, 0.0, 0.0])       # not the (sagging) measured position
    assert [e.kind for e in ev] == ["workspace"]
    # already outside (e.g. the start pose): moves towards the box pass, moves away are held
    f.reset()
    sent, ev = f.filter([26.0, 0.0, 0.0], [30.0, 0.0, 0.0])
    np.testing.assert_array_equal(sent, [26.0, 0.0, 0.0])
    assert ev == []
    f.reset()
    sent, ev = f.filter([31.0, 0.0, 0.0], [30.0, 0.0, 0.0])
    np.testing.assert_array_equal(sent, [30.0, 0.0, 0.0])
    assert ev[0].kind == "workspace"
    with pytest.raises(ValueError, match="no forward kinematics"):
        SafetyFilter(_limits(workspace=box))


def test_watchdog_hold_and_external_stop_latch_the_measured_position():
    f = SafetyFilter(_limits())
    f.filter([5.0, 5.0, 5.0], [0.0, 0.0, 0.0])
    np.testing.assert_array_equal(f.hold([1.0, 1.0, 1.0]), [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(f.last_sent, [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(f.stop(4, "deadline", np.array([1.0, 1.0, 1.0])), [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(f.hold([0.5, 0.5, 0.5]), [1.0, 1.0, 1.0])   # the stop's position stays
    sent, ev = f.filter([2.0, 2.0, 2.0], [0.5, 0.5, 0.5], step=5)
    np.testing.assert_array_equal(sent, [1.0, 1.0, 1.0])
    assert ev[0].kind == "stopped" and ev[0].detail == {"reason": "deadline"}
    f.reset()
    assert f.stopped is None and f.last_sent is None


def test_bad_inputs_and_limits_are_refused():
    f = SafetyFilter(_limits())
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        f.filter([0.0, 0.0], [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="measured joint positions are not finite"):
        f.filter([0.0, 0.0, 0.0], [0.0, np.nan, 0.0])
    with pytest.raises(ValueError, match="low > high .* 'b'"):
        _limits(joint_limits=[[-90, 90], [45, -45], [0, 100]])
    with pytest.raises(ValueError, match="max_step"):
        _limits(max_step=[10, 0, 5])
    with pytest.raises(ValueError, match="workspace"):
        _limits(workspace=[[0, 0, 0], [-1, 1, 1]])
    with pytest.raises(ValueError, match="deadline_s"):
        _limits(deadline_s=0)


def test_event_log_counts_everything_and_rate_limits_the_log(caplog):
    log = EventLog(interval_s=60.0)
    f = SafetyFilter(_limits(), events=log)
    with caplog.at_level(logging.WARNING, logger="fleetmind.safety"):
        for i in range(5):
            f.filter([95.0, 0.0, 0.0], [88.0, 0.0, 0.0], step=i)
        f.filter([0.0, 0.0, 99.0], [0.0, 0.0, 0.0], step=5)
    assert log.counts == {"joint_limit": 5, "max_step": 1}
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2 and "joint_limit at step 0" in msgs[0] and "max_step at step 5" in msgs[1]
    assert [e["step"] for e in log.summary()["events"]] == [0, 1, 2, 3, 4, 5]


def test_watchdog_holds_at_the_deadline_not_when_the_slow_call_returns():
    wd = Watchdog(deadline_s=0.05, hang_s=5.0)
    t0 = time.perf_counter()
    held_at = []
    res = wd.call(lambda: (time.sleep(0.4), "late")[1], on_miss=lambda: held_at.append(time.perf_counter() - t0))
    assert res.missed and res.value is None and res.elapsed_s >= 0.4
    assert len(held_at) == 1 and 0.04 <= held_at[0] < 0.3          # held long before the call came back
    assert 0.04 <= res.miss_handled_s < 0.3 and wd.misses == 1
    res2 = wd.call(lambda: (time.sleep(0.4), 1)[1])
    assert res2.missed and wd.misses == 2 and wd.total_misses == 2
    fast = wd.call(lambda x: x * 2, 21, on_miss=lambda: pytest.fail("no miss expected"))
    assert not fast.missed and fast.value == 42 and wd.misses == 0 and wd.total_misses == 2
    wd.close()


def test_watchdog_calls_run_in_one_worker_thread_and_errors_propagate():
    wd = Watchdog(deadline_s=1.0)
    names = {wd.call(lambda: threading.current_thread().name).value for _ in range(3)}
    assert len(names) == 1 and names != {threading.current_thread().name}
    with pytest.raises(ZeroDivisionError):
        wd.call(lambda: 1 / 0)
    hung = Watchdog(deadline_s=0.02, hang_s=0.1)
    with pytest.raises(TimeoutError, match="treated as hung"):
        hung.call(time.sleep, 0.5)
    inline = Watchdog(deadline_s=None)
    assert inline.call(threading.current_thread).value is threading.current_thread()
    with pytest.raises(ValueError, match="hang_s"):
        Watchdog(deadline_s=1.0, hang_s=0.5)
    wd.close()
    hung.close()


@pytest.mark.parametrize("key", ["max_step_deg", "max_step_gripper", "deadline_s", "hang_s"])
def test_inf_cannot_switch_a_safety_limit_off_silently(key):
    """``inf`` would switch a limit off without the warning an explicit null gets: the config check refuses it,
    naming the key; null (where allowed) stays the way to switch a limit off."""
    from configs.rules import ConfigError
    from fleet.deploy.config import SafetyConfig

    with pytest.raises(ConfigError, match=rf"deploy\.safety\.{key}: expected .*finite"):
        SafetyConfig.from_dict({key: float("inf")})
    assert getattr(SafetyConfig.from_dict({key: 1.5}), key) == 1.5
    if key != "hang_s":
        assert getattr(SafetyConfig.from_dict({key: None}), key) is None
