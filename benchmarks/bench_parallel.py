"""Tensor parallelism on two processes: functe vs hand-written torch (Megatron-style) vs torch.compile.

Two tables, each from one run on two ranks (gloo on the CPU; NCCL with one GPU per rank when
CUDA has at least two devices):

* **MLP block forward+backward** (column fc1 + bias, tanh GELU, row fc2 + bias; ``--sp`` adds
  sequence parallelism), gradients of the input and every parameter:

  - ``eager``: what a user writes without functe: ``F.linear`` and Megatron's communication
    mappings (``autograd.Function`` s around in-place ``torch.distributed`` collectives);
  - ``compile``: ``torch.compile`` of that code (gradients taken outside);
  - ``functe``: ``ops.linear(..., tensor_parallel_mode=...)`` with the cross-rank shape check on
    (the default) and ``functe-nochk`` with it off (``functe.set_collective_checks(False)``);
  - ``functe-compile``: ``torch.compile`` of the functe block.

* **Collectives**: one all-reduce and one all-gather of an fp32 tensor: in-place
  ``torch.distributed``, the functional collective (``_c10d_functional`` + wait), functe's op
  with and without the check.

Every sample is bracketed by barriers, implementations alternate within each round, and the
median over rounds is reported (rank 0's clock). Run: ``python -m benchmarks.bench_parallel``
(options ``--tokens``, ``--hidden``, ``--ffn``, ``--reps``, ``--sp``, ``--no-compile``); it
spawns its two processes itself.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import functe
from functe import ops

from ._harness import machine, table

# ----------------------------------------------------------------------------- the hand-written baseline


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, dy):
        dy = dy.clone()
        dist.all_reduce(dy)
        return dy


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, dy):
        return dy


def _gather0(x):
    out = x.new_empty((x.shape[0] * dist.get_world_size(), *x.shape[1:]))
    dist.all_gather_single(out, x.contiguous())
    return out


def _scatter0(x):
    out = x.new_empty((x.shape[0] // dist.get_world_size(), *x.shape[1:]))
    dist.reduce_scatter_single(out, x.contiguous())
    return out


class _GatherFromSP(torch.autograd.Function):
    """Sequence parallelism: all-gather forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x):
        return _gather0(x)

    @staticmethod
    def backward(ctx, dy):
        return _scatter0(dy)


class _ScatterToSP(torch.autograd.Function):
    """Sequence parallelism: reduce-scatter forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x):
        return _scatter0(x)

    @staticmethod
    def backward(ctx, dy):
        return _gather0(dy)


def mlp_torch(x, p, sp: bool):
    x_in = _GatherFromSP.apply(x) if sp else _CopyToTP.apply(x)
    h = F.gelu(F.linear(x_in, p["w1"], p["b1"]), approximate="tanh")
    partial = F.linear(h, p["w2"])
    if not sp:
        return _ReduceFromTP.apply(partial) + p["b2"]
    # The replicated bias meets a sequence shard: its gradient is a rank-local sum, all-reduced
    # (Megatron's sequence-parallel gradient all-reduce; functe's row linear does the same).
    return _ScatterToSP.apply(partial) + _CopyToTP.apply(p["b2"])


def mlp_functe(x, p, sp: bool):
    h = ops.gelu(ops.linear(x, p["w1"], p["b1"], tensor_parallel_mode="column", sequence_parallel=sp))
    return ops.linear(h, p["w2"], p["b2"], tensor_parallel_mode="row", sequence_parallel=sp)


# ----------------------------------------------------------------------------- timing


def _timed_rounds(impls: dict, reps: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in impls}
    for fn in impls.values():  # warm-up (and compilation)
        fn()
        fn()
    for _ in range(reps):
        for name, fn in impls.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            dist.barrier()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def _fwd_bwd(block, x, params, sp):
    leaves = [x, *params.values()]

    def run():
        out = block(leaves[0], dict(zip(params, leaves[1:])), sp)
        torch.autograd.grad(out.square().sum(), leaves)

    return run


def _checks_off(fn):
    def run():
        with functe.collective_checks(False):
            fn()

    return run


def _collective_impls(v: torch.Tensor) -> dict[str, dict]:
    """Per collective: in-place torch.distributed, the functional collective, functe with and without the check."""
    c10d, name = torch.ops._c10d_functional, dist.group.WORLD.group_name

    def reduce_inplace():
        w = v.clone()
        dist.all_reduce(w)

    def reduce_functe():
        ops.all_reduce(v)

    def gather_functe():
        ops.all_gather(v)

    return {
        "all_reduce": {
            "torch.distributed": reduce_inplace,
            "functional": lambda: c10d.wait_tensor(c10d.all_reduce(v, "sum", name)),
            "functe": reduce_functe,
            "functe-nochk": _checks_off(reduce_functe),
        },
        "all_gather": {
            "torch.distributed": lambda: _gather0(v),
            "functional": lambda: c10d.wait_tensor(c10d.all_gather_into_tensor(v, 2, name)),
            "functe": gather_functe,
            "functe-nochk": _checks_off(gather_functe),
        },
    }


def _worker(rank: int, args, init_file: str, queue) -> None:
    cuda = torch.cuda.device_count() >= 2
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=600),
    )
    device = "cuda" if cuda else "cpu"
    g = torch.Generator().manual_seed(0)
    t, hdim, ffn = args.tokens, args.hidden, args.ffn
    p = {
        "w1": torch.randn(ffn // 2, hdim, generator=g) / hdim**0.5,
        "b1": torch.zeros(ffn // 2),
        "w2": torch.randn(hdim, ffn // 2, generator=g) / ffn**0.5,
        "b2": torch.zeros(hdim),
    }
    p = {k: v.to(device).requires_grad_() for k, v in p.items()}
    x = torch.randn(t // 2 if args.sp else t, hdim, generator=g).to(device).requires_grad_()
    impls = {"eager": _fwd_bwd(mlp_torch, x, p, args.sp)}
    if not args.no_compile:
        impls["compile"] = _fwd_bwd(torch.compile(mlp_torch), x, p, args.sp)
    impls["functe"] = _fwd_bwd(mlp_functe, x, p, args.sp)
    impls["functe-nochk"] = _checks_off(impls["functe"])
    if not args.no_compile:
        impls["functe-compile"] = _fwd_bwd(torch.compile(mlp_functe), x, p, args.sp)
    mlp = _timed_rounds(impls, args.reps)

    rows = []
    for numel in (4096, 1 << 20):
        v = torch.randn(numel, device=device)
        for kind, impls in _collective_impls(v).items():
            rows.append((f"{kind} fp32[{numel}]", _timed_rounds(impls, args.reps * 10)))
    if rank == 0:
        queue.put((mlp, rows))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--sp", action="store_true", help="sequence parallelism")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(args, os.path.join(tmp, "store"), queue), nprocs=2, start_method="spawn")
    mlp, rows = queue.get(timeout=60)
    where = "2 GPUs, NCCL" if torch.cuda.device_count() >= 2 else "2 processes x 1 thread, gloo"
    print(f"Machine: {machine()}; {where}")
    print()
    shape = f"{args.tokens} tokens, {args.hidden} hidden, {args.ffn} ffn, fp32"
    shape += ", sequence parallel" if args.sp else ""
    print(table(f"Tensor-parallel MLP block fwd+bwd ({shape})", [("mlp", mlp)], baseline="eager"))
    print()
    print(table("Collectives (median per call)", rows, baseline="torch.distributed"))


if __name__ == "__main__":
    main()
