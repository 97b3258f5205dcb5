"""StepDeadline (dspark_ray/runtime/deadline.py): the per-step deadline follows the steps answered lately."""

from __future__ import annotations

import pytest

from dspark_ray.runtime.deadline import StepDeadline


def test_the_ceiling_holds_until_enough_steps_were_seen():
    d = StepDeadline(ceiling_s=120.0, floor_s=1.0, factor=10.0, warmup=3)
    for seconds in (0.01, 0.02):
        d.observe(seconds)
        assert not d.measured and d.timeout_s() == 120.0
    d.observe(0.015)
    assert d.measured and d.timeout_s() == 1.0  # 10 x 20 ms is below the floor


def test_the_deadline_is_factor_times_the_slowest_recent_step_within_floor_and_ceiling():
    d = StepDeadline(ceiling_s=30.0, floor_s=0.5, factor=10.0, window=4, warmup=1)
    for seconds in (0.2, 0.9, 0.1):
        d.observe(seconds)
    assert d.timeout_s() == pytest.approx(9.0)
    d.observe(5.0)
    assert d.timeout_s() == 30.0  # never past the ceiling
    for _ in range(4):  # the slow steps leave the window
        d.observe(0.01)
    assert d.timeout_s() == 0.5  # never below the floor


@pytest.mark.parametrize("kwargs, message", [
    (dict(ceiling_s=10.0, floor_s=20.0), "floor"),
    (dict(ceiling_s=10.0, floor_s=0.0), "floor"),
    (dict(ceiling_s=10.0, factor=0.5), "factor"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StepDeadline(**kwargs)
