"""The benchmark harness's timing helpers (benchmarks/_harness.py): what they call, and in what order."""

from __future__ import annotations

from benchmarks._harness import per_call, per_call_each


def test_per_call_each_times_the_implementations_in_turn():
    """Each implementation runs a warm-up batch, then the batches alternate round by round, so a
    drift in the machine's speed reaches every implementation alike."""
    log: list[str] = []
    times = per_call_each({"a": lambda: log.append("a"), "b": lambda: log.append("b")}, calls=3, rounds=2)
    assert list(times) == ["a", "b"]
    assert all(t >= 0.0 and t != float("inf") for t in times.values())
    batches = [log[i] for i in range(0, len(log), 3)]
    assert all(len(set(log[i : i + 3])) == 1 for i in range(0, len(log), 3))  # whole batches
    assert batches == ["a", "b", "a", "b", "a", "b"]  # warm-up, then rounds taken in turn


def test_per_call_is_the_best_batch_per_call():
    calls = []
    assert per_call(lambda: calls.append(1), calls=4, rounds=3) >= 0.0
    assert len(calls) == 4 * (3 + 1)
