"""A tensor-parallel MLP trained with functe on torch.distributed (gloo on CPU, NCCL on GPUs).

    torchrun --nproc-per-node 2 examples/tp_mlp.py                      # tensor parallel, 2 ranks
    torchrun --nproc-per-node 2 examples/tp_mlp.py --sequence-parallel  # + sequence parallelism
    torchrun --nproc-per-node 2 examples/tp_mlp.py --tp 1               # data parallel instead
    torchrun --nproc-per-node 2 examples/tp_mlp.py --fp8 --check        # FP8, compared with 1 process

The MLP is Megatron's: ``fc1`` column-parallel (each rank holds ``ffn / tp`` of its outputs),
GELU on the local shard, ``fc2`` row-parallel (its partial products are all-reduced, its bias
added once). Everything is a pure function of ``(params, state, batch)``: the parameters are
this rank's shards, the FP8 scaling states (``--fp8``) come back through the gradient, and the
data-parallel gradient average is one call. ``--check`` trains the unsharded model in the same
process and prints how far the loss curves are apart: about 1e-7, except ``--tp 1 --fp8`` (about
2e-3): each data-parallel rank's mean loss gives a dy twice the whole batch's, which the first
step casts to E5M2 with the initial scale 1, where subnormals round differently (input and weight
scales equal the one-process run's; grad-output scales are half of them, as dy is twice).
"""

from __future__ import annotations

import argparse
import functools
import math
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import functe
from functe import ops


def init_params(hidden: int, ffn: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """The full (unsharded) parameters; every rank draws the same ones."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(ffn, hidden, generator=g) / math.sqrt(hidden),
        "b1": torch.randn(ffn, generator=g) * 0.1,
        "w2": torch.randn(hidden, ffn, generator=g) / math.sqrt(ffn),
        "b2": torch.randn(hidden, generator=g) * 0.1,
    }


def shard_params(params: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """This tensor-parallel rank's shards: fc1 by output rows (column), fc2 by input columns (row)."""
    n = params["w1"].shape[0] // size
    part = slice(rank * n, (rank + 1) * n)
    return {"w1": params["w1"][part], "b1": params["b1"][part], "w2": params["w2"][:, part], "b2": params["b2"]}


def make_batch(step: int, seq: int, batch: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch ``[seq, batch, hidden]`` (Megatron's layout) of a fixed teacher; same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(seq, batch, hidden, generator=g)
    teacher = torch.linspace(-1.0, 1.0, hidden * hidden).reshape(hidden, hidden) / math.sqrt(hidden)
    return x, torch.sin(x @ teacher)


def local_batch(x, y, *, dp_rank: int, dp: int, tp_rank: int, tp: int, sequence_parallel: bool):
    """This rank's part: the batch split over data-parallel ranks, the sequence over tensor-parallel ones (SP)."""
    b = x.shape[1] // dp
    x, y = x[:, dp_rank * b : (dp_rank + 1) * b], y[:, dp_rank * b : (dp_rank + 1) * b]
    if sequence_parallel:
        s = x.shape[0] // tp
        x, y = x[tp_rank * s : (tp_rank + 1) * s], y[tp_rank * s : (tp_rank + 1) * s]
    return x, y


def dense(x, w, b, state, *, recipe=None, amax_group=None, **parallel):
    """``ops.linear``, or ``ops.fp8_linear`` with its scaling state when there is a recipe."""
    if recipe is None:
        return ops.linear(x, w, b, **parallel)
    return ops.fp8_linear(x, w, b, state, recipe=recipe, amax_group=amax_group, **parallel)


def mlp_loss(params, state, x, y, *, tp_group=None, tp: int = 1, sequence_parallel=False, recipe=None, amax_group=None):
    """Mean squared error of the MLP on this rank's batch.

    Without sequence parallelism every tensor-parallel rank computes the same (replicated) loss.
    With it, each rank sees ``1/tp`` of the sequence and its loss is its share of the global
    mean (``sum / global count``): the shares add up to the loss, and the gradients that the
    collectives' backward rules sum over ranks are those of the global loss.
    """
    fp8 = {"recipe": recipe, "amax_group": amax_group}
    column, row = {}, {}
    if tp > 1:
        column = {"tensor_parallel_mode": "column", "sequence_parallel": sequence_parallel, "group": tp_group}
        row = {**column, "tensor_parallel_mode": "row"}
    state = state or {"fc1": None, "fc2": None}
    h = ops.gelu(dense(x, params["w1"], params["b1"], state["fc1"], **fp8, **column))
    out = dense(h, params["w2"], params["b2"], state["fc2"], **fp8, **row)
    shards = tp if (tp > 1 and sequence_parallel) else 1
    return (out - y).square().sum() / (out.numel() * shards)


def train(
    steps: int,
    *,
    hidden: int = 32,
    ffn: int = 128,
    seq: int = 8,
    batch: int = 4,
    lr: float = 0.1,
    tp_group=None,
    dp_group=None,
    sequence_parallel: bool = False,
    fp8: bool = False,
    device: torch.device | str = "cpu",
) -> tuple[list[float], dict | None]:
    """Train for ``steps`` SGD steps; return the loss curve (the global loss) and the last state.

    ``tp_group`` / ``dp_group`` ``None``: a single process on the full model and batch.
    """
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    dp = dist.get_world_size(dp_group) if dp_group is not None else 1
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
    params = {k: v.to(device) for k, v in shard_params(init_params(hidden, ffn), tp_rank, tp).items()}
    recipe, state = None, None
    if fp8:
        recipe = functe.DelayedScaling(amax_history_len=4)
        state = {name: functe.init_linear_scaling_state(recipe, device=device) for name in ("fc1", "fc2")}
    world = dist.group.WORLD if (tp_group is not None or dp_group is not None) else None
    loss_fn = functools.partial(
        mlp_loss, tp_group=tp_group, tp=tp, sequence_parallel=sequence_parallel, recipe=recipe, amax_group=world
    )
    if dp_group is None:  # (group=None would mean the default group, i.e. all ranks)
        step_fn = functe.value_and_grad(loss_fn)
    else:
        step_fn = functe.data_parallel_value_and_grad(loss_fn, group=dp_group)
    curve = []
    for i in range(steps):
        x, y = (t.to(device) for t in make_batch(i, seq, batch, hidden))
        x, y = local_batch(x, y, dp_rank=dp_rank, dp=dp, tp_rank=tp_rank, tp=tp, sequence_parallel=sequence_parallel)
        loss, grads, state = step_fn(params, state, x, y)
        params = functe.tree_map(lambda p, g: p - lr * g, params, grads)
        if sequence_parallel and tp > 1:  # each rank holds its share of the loss: add them up for the log
            loss = ops.all_reduce(loss.detach(), group=tp_group)
        curve.append(loss.item())
    return curve, state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: all ranks)")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--fp8", action="store_true", help="FP8 linears, delayed scaling")
    parser.add_argument("--check", action="store_true", help="also train on one process and compare")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    tp = args.tp or world
    mesh = init_device_mesh("cuda" if cuda else "cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    device = "cuda" if cuda else "cpu"
    curve, _ = train(
        args.steps,
        tp_group=mesh.get_group("tp"),
        dp_group=mesh.get_group("dp"),
        sequence_parallel=args.sequence_parallel,
        fp8=args.fp8,
        device=device,
    )
    reference = train(args.steps, fp8=args.fp8, device=device)[0] if args.check else None
    if rank == 0:
        mode = f"tp={tp} dp={world // tp}" + (" +sp" if args.sequence_parallel else "") + (" fp8" if args.fp8 else "")
        for i in range(0, args.steps, max(1, args.steps // 10)):
            print(f"[{mode}] step {i:3d}  loss {curve[i]:.6f}")
        print(f"[{mode}] final loss {curve[-1]:.6f}")
        if reference is not None:
            gap = max(abs(a - b) / abs(b) for a, b in zip(curve, reference))
            print(f"[{mode}] single-process final loss {reference[-1]:.6f}; largest relative gap {gap:.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
