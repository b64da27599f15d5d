"""Threads and processes: the CPU fast path's worker pool under the caller's modes, after a fork, and
with other threads changing torch's thread count; settings scoped by ``with`` blocks in several
threads."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import make

import functe
from functe import _collectives, ops
from functe.kernels import _fast

LARGE = (512, 1024)  # several chunks: the worker pool computes them


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # (one thread runs every chunk inline, in the caller's modes)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", ["swiglu", "rms_norm", "dropout", "srelu"])
def test_the_pool_computes_under_inference_mode(name, two_threads):
    # Inference mode is per thread: the workers wrote into an output made in inference mode from
    # outside it ("Inplace update to inference tensor outside InferenceMode is not allowed").
    fns = {
        "rms_norm": lambda x: ops.rms_norm(x, torch.ones(x.shape[-1])),
        "dropout": lambda x: ops.dropout(x, 0.25, seed=3),
    }
    fn = fns.get(name, getattr(ops, name, None))
    x = make(LARGE)
    with torch.no_grad():
        expected = fn(x)
    with torch.inference_mode():
        got = fn(x)
    assert torch.equal(got, expected)


_FORK_SCRIPT = """
import os, signal, sys, torch
from functe import ops
torch.set_num_threads(2)
x, g = torch.randn(512, 1024), torch.ones(1024)
expected = ops.rms_norm(x, g)  # starts the pool
pid = os.fork()
if pid == 0:
    signal.alarm(30)  # (a hung child dies of it)
    os._exit(0 if torch.equal(ops.rms_norm(x, g), expected) else 1)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_starts_its_own_pool():
    # The child inherited the pool without its threads, and its first submission waited forever. (In
    # a fresh interpreter: libgomp's own pool hangs a child forked after OpenMP ran in the parent.)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", _FORK_SCRIPT], cwd=root, timeout=120, capture_output=True)
    assert done.returncode == 0, (done.returncode, done.stderr.decode()[-2000:])


def test_pool_workers_stay_single_threaded_when_another_thread_sets_a_count():
    # torch gives a thread the last count any thread set, lazily at its first op: a set_num_threads(3)
    # between a worker's own set_num_threads(1) and its first op reached it (3 OpenMP threads per
    # worker, and results that changed by an ulp with other threads' settings).
    threads = torch.get_num_threads()
    started, release = threading.Barrier(3), threading.Event()

    def first_task():
        started.wait()  # (both workers are past their initializer, before any op of theirs)
        release.wait()
        return torch.get_num_threads()

    _fast._forget_pool()
    try:
        pool = _fast._executor(2)
        tasks = [pool.submit(first_task) for _ in range(2)]
        started.wait()
        torch.set_num_threads(3)
        release.set()
        counts = [f.result() for f in tasks]
    finally:
        torch.set_num_threads(threads)
        _fast._forget_pool()
    assert counts == [1, 1]


def test_blocks_closed_in_another_order_than_opened_leave_the_default():
    # A block restored the value it saw on entry: blocks opened in two threads and closed in the
    # opposite order left the backend 'torch' (and collective checks off) after both had closed.
    opened = [threading.Event(), threading.Event()]
    close = [threading.Event(), threading.Event()]

    def block(i, scope):
        with scope:
            opened[i].set()
            close[i].wait()

    for scopes, current in [
        ((functe.use_backend("torch"), functe.use_backend("interpret")), functe.get_backend),
        ((functe.collective_checks(False), functe.collective_checks(True)), lambda: _collectives._checks),
    ]:
        before = current()
        threads = [threading.Thread(target=block, args=(i, scope)) for i, scope in enumerate(scopes)]
        threads[0].start()
        opened[0].wait()
        threads[1].start()
        opened[1].wait()
        close[0].set()
        threads[0].join()
        close[1].set()
        threads[1].join()
        assert current() == before
        for event in (*opened, *close):
            event.clear()


def test_interpreted_launches_from_several_threads():
    # Triton's interpreter patches the language's builtins during a launch, process-wide: concurrent
    # launches of different kernels raised "_semantic argument must be provided outside of JIT
    # functions" (2 to 4 of 14).
    x, w = make((8, 64)), make((64,))
    jobs = [
        lambda: ops.layer_norm(x, w, w),
        lambda: ops.rms_norm(x.bfloat16(), w.bfloat16()),
        lambda: ops.swiglu(x),
        lambda: ops.gelu(x.bfloat16()),
        lambda: ops.dropout(x, 0.3, seed=4),
    ]
    with functe.use_backend("interpret"):
        expected = [job() for job in jobs]
        with ThreadPoolExecutor(3) as pool:
            got = [f.result() for f in [pool.submit(job) for job in jobs * 3]]
    for i, g in enumerate(got):
        assert torch.equal(g, expected[i % len(jobs)])


def test_scoped_settings_compile_fullgraph():
    # (a lock in the blocks' bookkeeping made Dynamo refuse them: "Unsupported context manager")
    def f(x):
        with functe.use_backend("torch"), functe.collective_checks(False):
            return ops.gelu(x) * 2

    torch._dynamo.reset()
    x = make((3, 8))
    assert torch.equal(torch.compile(f, fullgraph=True, backend="aot_eager")(x), f(x))
    assert functe.get_backend() == "auto" and _collectives._checks
    torch._dynamo.reset()
