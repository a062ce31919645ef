"""The measured replay-or-eager choice for wide extend graphs (worker/graph_choice.py), on a
host clock whose steps take what the test says."""

from __future__ import annotations

import pytest

from tokenspeed.worker.graph_choice import GraphChoice

WIDE = (1920, 1024)


class Clock:
    """Each mark advances the clock; the mark that ends a step advances it by that way's cost."""

    def __init__(self, replay_ms: float, eager_ms: float) -> None:
        self.t, self.cost = 0.0, {True: replay_ms / 1e3, False: eager_ms / 1e3}
        self.replay = True

    def __call__(self) -> float:
        self.t += self.cost[self.replay]
        return self.t


def run(choice: GraphChoice, clock: Clock, steps: int, shape: tuple[int, int] = WIDE) -> list[bool]:
    taken = []
    for _ in range(steps):
        clock.replay = choice.begin(shape)  # the start mark is taken before: only the end's counts
        choice.end()
        taken.append(clock.replay)
    return taken


def test_times_both_ways_then_takes_the_faster() -> None:
    clock = Clock(replay_ms=79.0, eager_ms=73.0)
    choice = GraphChoice(now=clock)
    taken = run(choice, clock, 40)
    assert taken[:6] == [True, False] * 3
    assert not any(taken[6:]), "eager was faster"
    assert choice.median_ms(WIDE, True) == pytest.approx(79.0)
    assert choice.median_ms(WIDE, False) == pytest.approx(73.0)


def test_a_host_bound_eager_step_keeps_the_replay() -> None:
    clock = Clock(replay_ms=44.0, eager_ms=53.0)
    taken = run(GraphChoice(now=clock), clock, 40)
    assert all(taken[6:])


def test_the_way_not_taken_is_timed_again_and_can_win_back() -> None:
    clock = Clock(replay_ms=79.0, eager_ms=73.0)
    choice = GraphChoice(now=clock)
    taken = run(choice, clock, GraphChoice.RETRY_EVERY + 1)
    assert taken[GraphChoice.RETRY_EVERY] is True and taken.count(True) == 4  # 3 trials + 1 retry
    clock.cost[False] = 0.090  # the host got busy: eager slows past the replay
    taken = run(choice, clock, 3 * GraphChoice.RETRY_EVERY)
    # Two slow eager steps outvote the old time; then eager is only re-timed.
    assert taken[:2] == [False, False] and taken[2:].count(False) == 3, taken


def test_each_shape_is_timed_on_its_own() -> None:
    clock = Clock(replay_ms=79.0, eager_ms=73.0)
    choice = GraphChoice(now=clock)
    run(choice, clock, 10)
    assert run(choice, clock, 2, shape=(896, 1024)) == [True, False], "a new shape starts its trials"


def test_times_the_gpu_has_not_passed_wait() -> None:
    """Events still queued on the GPU are read later, in order, never waited for."""

    class Event:
        passed = False

        def record(self) -> None:
            pass

        def query(self) -> bool:
            return Event.passed

        def elapsed_time(self, end: object) -> float:
            return 5.0

    choice = GraphChoice(new_event=Event)
    for _ in range(8):
        choice.begin(WIDE)
        choice.end()
    assert choice.median_ms(WIDE, True) is None
    Event.passed = True
    assert choice.begin(WIDE) is True  # drains the eight, ties go to the replay
    assert choice.median_ms(WIDE, True) == choice.median_ms(WIDE, False) == 5.0
