"""A pool of torch.distributed worker processes (gloo, CPU) shared by the distributed tests.

Starting processes is the slow part (each imports torch and functe: ~5 s for two on two cores),
so one pool serves every distributed test: ``shared_pool().run(check, *args)`` runs the
module-level function ``check`` on every rank and returns the per-rank results. Every wait is
bounded: collectives by the process group's timeout, a job by ``run``'s ``timeout``; a pool whose
job timed out or whose worker died is killed and replaced on the next call. Checks compare
inside the workers and return small Python values (never tensors: nothing crosses the process
boundary but pickled builtins).
"""

from __future__ import annotations

import atexit
import datetime
import importlib
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

WORLD = 2
COLLECTIVE_TIMEOUT = 30.0  # seconds: the process group's bound on any one collective
JOB_TIMEOUT = 90.0


class WorkerFailure(AssertionError):
    """A job raised on some rank, timed out, or a worker died."""


def _worker(rank: int, world: int, init_file: str, jobs, results, timeout: float, path: list[str]) -> None:
    sys.path[:] = path
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # two workers share the machine's cores
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
    )
    results.put((rank, True, "ready"))
    while (job := jobs.get()) is not None:
        module, name, args, kwargs = job
        try:
            torch.manual_seed(0)
            value = getattr(importlib.import_module(module), name)(*args, **kwargs)
            results.put((rank, True, value))
        except BaseException as e:  # report everything, KeyboardInterrupt included, and keep serving
            results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    dist.destroy_process_group()


class WorkerPool:
    """``world`` processes in one gloo process group, serving jobs until closed."""

    def __init__(self, world: int = WORLD, *, collective_timeout: float = COLLECTIVE_TIMEOUT):
        ctx = mp.get_context("spawn")
        self.world = world
        self._dir = tempfile.TemporaryDirectory(prefix="functe-dist-")
        init_file = os.path.join(self._dir.name, "store")
        self._jobs = [ctx.Queue() for _ in range(world)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world, init_file, self._jobs[r], self._results, collective_timeout, list(sys.path)),
                daemon=True,
            )
            for r in range(world)
        ]
        for p in self._procs:
            p.start()
        self._collect("start-up", 120.0)

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def _collect(self, what: str, timeout: float) -> list[tuple[bool, Any]]:
        deadline = time.monotonic() + timeout
        got: dict[int, tuple[bool, Any]] = {}
        while len(got) < self.world:
            try:
                rank, ok, value = self._results.get(timeout=0.2)
                got[rank] = (ok, value)
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in got]
            if dead or time.monotonic() > deadline:
                self.close()
                missing = sorted(set(range(self.world)) - set(got))
                why = f"worker(s) {dead} died" if dead else f"no answer from ranks {missing}"
                raise WorkerFailure(f"{what}: {why} within {timeout:.0f} s; partial results: {got}")
        return [got[r] for r in range(self.world)]

    def run_raw(self, fn: Callable, *args, timeout: float = JOB_TIMEOUT, **kwargs) -> list[tuple[bool, Any]]:
        """Run ``fn(*args, **kwargs)`` on every rank; ``[(ok, value or traceback text)]`` per rank."""
        for q in self._jobs:
            q.put((fn.__module__, fn.__qualname__, args, kwargs))
        return self._collect(fn.__qualname__, timeout)

    def run(self, fn: Callable, *args, timeout: float = JOB_TIMEOUT, **kwargs) -> list[Any]:
        """Run ``fn`` on every rank and return the per-rank values; raise if any rank failed."""
        outcome = self.run_raw(fn, *args, timeout=timeout, **kwargs)
        failed = [(r, v) for r, (ok, v) in enumerate(outcome) if not ok]
        if failed:
            self.close()  # ranks may have left collectives half-done: start afresh next time
            raise WorkerFailure("\n".join(f"--- rank {r} ---\n{v}" for r, v in failed))
        return [v for _, v in outcome]

    def close(self) -> None:
        for q, p in zip(self._jobs, self._procs):
            if p.is_alive():
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass
        for p in self._procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        self._dir.cleanup()


_pool: WorkerPool | None = None


def shared_pool() -> WorkerPool:
    """The pool every distributed test uses (started on first use, replaced after a failure)."""
    global _pool
    if _pool is None or not _pool.alive:
        _pool = WorkerPool()
    return _pool


@atexit.register
def _close_shared_pool() -> None:
    if _pool is not None and _pool.alive:
        _pool.close()
