"""The step loop's own bookkeeping costs the same at step 20,000 as at step 20 (the loop calls it
once per step: work proportional to a window of 10,000 steps there is a per-step cost)."""

from __future__ import annotations

from podtrain.train.goodput import GoodputClock


class CountedStep(int):
    """A step number that counts the order comparisons made between step numbers."""

    comparisons = 0

    def __lt__(self, other):
        CountedStep.comparisons += 1
        return int.__lt__(self, other)

    def __gt__(self, other):
        CountedStep.comparisons += 1
        return int.__gt__(self, other)


def test_booking_a_step_does_no_work_proportional_to_the_goodput_window():
    clock = GoodputClock(started=1000.0)
    clock.start_steps()
    for step in range(1, 10_001):
        clock.step_done(CountedStep(step))
    CountedStep.comparisons = 0
    for step in range(10_001, 10_101):  # past the window: every step drops the oldest
        clock.step_done(CountedStep(step))
    assert CountedStep.comparisons <= 100, CountedStep.comparisons  # a min() over the window: ~1M
    assert sorted(clock._recent) == list(range(101, 10_101))  # the newest 10,000 steps are kept
