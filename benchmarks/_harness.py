"""Shared benchmark harness: timing, machine description, and ratio tables.

Every benchmark script compares functe with torch eager and torch.compile of
the same computation *in one run*, prints a table of times and ratios, and can
append it (with machine and date) to docs/benchmarks.md by hand.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch


def machine() -> str:
    """One line naming the machine, library versions and date."""
    if torch.cuda.is_available():
        where = torch.cuda.get_device_name()
    else:
        cpu = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        except (OSError, StopIteration):
            pass
        where = f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    import triton

    return f"{where}; torch {torch.__version__}, triton {triton.__version__}; {datetime.date.today().isoformat()}"


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench(fn: Callable[[], object], *, warmup: int = 3, reps: int = 10, min_time: float = 0.0) -> float:
    """Median wall time of ``fn()`` in seconds (synchronising the GPU if there is one).

    ``min_time`` repeats until at least that many seconds of samples were taken.
    """
    for _ in range(warmup):
        fn()
    _sync()
    samples: list[float] = []
    while len(samples) < reps or sum(samples) < min_time:
        start = time.perf_counter()
        fn()
        _sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def gpu_time(fn: Callable[[], object]) -> float:
    """Median seconds of ``fn()`` on the GPU, timed with CUDA events by ``triton.testing.do_bench``.

    do_bench writes over a buffer larger than L2 before each sample, so a kernel's inputs come
    from device memory (as at training sizes), and it repeats for ~100 ms. Host time is part of
    it where ``fn`` takes longer to issue than its kernels take to run (the events time the
    stream): right for forward + backward as a user sees it, wrong for a kernel's bandwidth
    (see :func:`gpu_kernel_time`).
    """
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3


def gpu_kernel_time(fn: Callable[[], object]) -> float:
    """Median seconds of the GPU work ``fn()`` issues, replayed from a CUDA graph (no host time).

    Why not :func:`gpu_time`: a launcher that issues a kernel and a few small reductions (the
    norms' backward) took 0.47-0.87 of a copy's bandwidth in do_bench from one round to the next
    on an H100 host, while the profiler timed its kernel at 0.144-0.149 ms every call: the host
    issuing the launches was being timed. A replayed graph does not flush L2 between samples;
    the tables' tensors (8192 x 8192 bf16 in, 64-128 MiB each) are several times its size.
    """
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") / 1e3


def per_call(fn, *, calls: int = 200, rounds: int = 15) -> float:
    """CPU seconds of this thread per call: the best of ``rounds`` batches of ``calls`` calls.

    The fixed cost of a call is CPU time on the calling thread; measuring it
    with the thread's CPU clock keeps other processes on a shared machine out
    of the numbers (wall time at microsecond scale mostly measures the
    scheduler). On a GPU this is the host-side cost of launching the work.
    """
    return per_call_each({"fn": fn}, calls=calls, rounds=rounds)["fn"]


def per_call_each(fns: dict[str, Callable[[], object]], *, calls: int = 200, rounds: int = 15) -> dict[str, float]:
    """:func:`per_call` of each of ``fns``, their batches taken in turn (round-robin).

    The thread's CPU clock still moves with the machine's load (a neighbour's cache and memory
    traffic, frequency): on a shared 2-core box the same row moved up to 2x between runs. Batches
    taken in turn see the same conditions, so the ratios between the implementations hold even
    where the absolute times drift.

    Example:
        >>> times = per_call_each({"a": lambda: None, "b": lambda: sum(range(100))}, calls=10, rounds=2)
        >>> sorted(times) == ["a", "b"] and all(t >= 0 for t in times.values())
        True
    """
    for fn in fns.values():
        for _ in range(calls):
            fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.thread_time()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.thread_time() - start) / calls)
    return best


def table(title: str, rows: list[tuple[str, dict[str, float]]], *, baseline: str) -> str:
    """Format ``rows`` of ``(case, {impl: seconds})`` with ratios ``baseline / impl``.

    A ratio above 1 means ``impl`` is faster than ``baseline``.
    """
    impls = list(rows[0][1]) if rows else []
    header = "| case | " + " | ".join(f"{i} (ms)" for i in impls)
    header += " | " + " | ".join(f"{baseline}/{i}" for i in impls if i != baseline) + " |"
    sep = "|" + "---|" * (1 + len(impls) + len([i for i in impls if i != baseline]))
    lines = [f"### {title}", "", header, sep]
    for case, times in rows:
        cells = [f"{times[i] * 1e3:.3f}" for i in impls]
        ratios = [f"{times[baseline] / times[i]:.2f}x" for i in impls if i != baseline]
        lines.append(f"| {case} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)
