"""Fusion executor benchmarks: per-call overhead, and the MLP block forward+backward.

The block is TransformerEngine's LayerNormMLP shape: LayerNorm, Linear+bias, GELU (tanh),
Linear+bias, residual add. The overhead table adds a block without the norm and the activation
(Linear+bias, constant scale, Linear+bias, residual add). Each case compares, in one run, the same
computation in

* ``eager``: plain torch (``F.layer_norm``, ``F.linear``, ``F.gelu``, ``+``);
* ``compile``: ``torch.compile`` of that code, gradients taken outside;
* ``functe``: the block written with functe ops, unfused (every op its own custom_vjp);
* ``fuse``: ``functe.fuse`` of the functe block (cached plan, forward and backward fusions).

The functe block uses ``functe.ops.layer_norm`` and ``functe.ops.gelu``. In bf16 the fused plan
puts fc1's bias and GELU into one GEMM epilogue, fc2's residual add into its GEMM, and the GELU
backward with fc1's bias gradient into one pass; in fp32 the epilogue rule declines (TE's
condition). On a CUDA machine everything runs on the GPU, the fused GEMMs as functe's Triton
kernels (16-bit).

Run: ``python -m benchmarks.bench_fuse`` (``--skip-large`` for the overhead table only, ``--func``
to also take the large case's gradients through ``torch.func.vjp``, ``--frozen`` for the block with
frozen weights alone, ``--vmap`` for gradients over a batch of examples through ``torch.func.vmap``).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import functe
from functe import ops

from ._harness import machine, per_call_each, table

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def mlp_torch(x, p):
    h = F.layer_norm(x, (x.shape[-1],), p["ln.weight"], p["ln.bias"])
    h = F.gelu(F.linear(h, p["fc1.weight"], p["fc1.bias"]), approximate="tanh")
    return F.linear(h, p["fc2.weight"], p["fc2.bias"]) + x


def mlp_functe(x, p):
    h = ops.layer_norm(x, p["ln.weight"], p["ln.bias"])
    h = ops.gelu(ops.linear(h, p["fc1.weight"], p["fc1.bias"]))
    return ops.linear(h, p["fc2.weight"], p["fc2.bias"]) + x


def native_torch(x, p):
    h = F.linear(x, p["fc1.weight"], p["fc1.bias"]) * 0.5
    return F.linear(h, p["fc2.weight"], p["fc2.bias"]) + x


def native_functe(x, p):
    h = ops.linear(x, p["fc1.weight"], p["fc1.bias"]) * 0.5
    return ops.linear(h, p["fc2.weight"], p["fc2.bias"]) + x


def make_inputs(tokens: int, hidden: int, ffn: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=DEVICE).requires_grad_()

    x = rand(tokens, hidden)
    p = {
        "ln.weight": rand(hidden),
        "ln.bias": rand(hidden),
        "fc1.weight": rand(ffn, hidden, scale=hidden**-0.5),
        "fc1.bias": rand(ffn),
        "fc2.weight": rand(hidden, ffn, scale=ffn**-0.5),
        "fc2.bias": rand(hidden),
    }
    return x, p


def implementations(torch_fn=mlp_torch, functe_fn=mlp_functe):
    return {
        "eager": torch_fn,
        "compile": torch.compile(torch_fn),
        "functe": functe_fn,
        "fuse": functe.fuse(functe_fn),
    }


def _fwd_bwd(fn, x, p, cotangent):
    leaves = [x, *p.values()]

    def step():
        torch.autograd.grad(fn(x, p), leaves, cotangent, allow_unused=True)

    return step


def _func_fwd_bwd(fn, x, p, cotangent):
    """Forward + backward through ``torch.func.vjp``, as a functional training loop takes gradients."""
    x, p = x.detach(), {k: v.detach() for k, v in p.items()}

    def step():
        _, pull = torch.func.vjp(fn, x, p)
        pull(cotangent)

    return step


def interleaved(steps: dict, *, reps: int) -> tuple[dict, dict]:
    """Best-of-``reps`` wall and process-CPU seconds per step, the implementations timed in turn.

    On a shared machine the other processes' load changes within seconds; timing the candidates
    round-robin and keeping each one's best round compares them under the same conditions.
    """
    for step in steps.values():  # warm up (torch.compile compiles here)
        step()
    wall = {k: float("inf") for k in steps}
    cpu = dict(wall)
    for _ in range(reps):
        for k, step in steps.items():
            w, c = time.perf_counter(), time.process_time()
            step()
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            wall[k] = min(wall[k], time.perf_counter() - w)
            cpu[k] = min(cpu[k], time.process_time() - c)
    return wall, cpu


def overhead() -> str:
    """Per-call time at tiny shapes (4 tokens, hidden 8, ffn 16), fp32: the fixed cost of a call."""
    x, p = make_inputs(4, 8, 16, torch.float32)
    cot = torch.ones(4, 8, device=DEVICE)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors never use the intra-op pool; one thread makes CPU time = cost
    rows = []
    for block, impls in [("MLP", implementations()), ("native", implementations(native_torch, native_functe))]:
        forwards = {k: (lambda f=f: f(x, p)) for k, f in impls.items()}
        rows.append((f"{block}: forward", per_call_each(forwards)))
        steps = {k: _fwd_bwd(f, x, p, cot) for k, f in impls.items()}
        rows.append((f"{block}: forward + backward", per_call_each(steps)))
        with torch.no_grad():
            rows.append((f"{block}: forward, no grad", per_call_each(forwards)))
    torch.set_num_threads(threads)
    return table("Per-call CPU time, tiny blocks (4 tokens, 8 hidden, 16 ffn, fp32, 1 thread)", rows, baseline="eager")


def large(dtypes, reps: int, *, func: bool = False) -> str:
    """The block at 4096 tokens; ``func``: gradients through ``torch.func.vjp`` (no compile column:
    compiling a torch.func transform is not what functional training loops do)."""
    wall, cpu = [], []
    for dtype in dtypes:
        x, p = make_inputs(4096, 1024, 4096, dtype)
        cot = torch.randn(4096, 1024, generator=torch.Generator().manual_seed(1)).to(dtype=dtype, device=DEVICE)
        impls = implementations()
        if func:
            del impls["compile"]
        make_step = _func_fwd_bwd if func else _fwd_bwd
        steps = {k: make_step(f, x, p, cot) for k, f in impls.items()}
        name = f"fwd+bwd {str(dtype).removeprefix('torch.')}"
        w, c = interleaved(steps, reps=reps)
        wall.append((name, w))
        cpu.append((name, c))
    how = ", torch.func.vjp" if func else ""
    title = f"MLP block forward+backward{how} (4096 tokens, 1024 hidden, 4096 ffn), best of {reps} interleaved rounds"
    tables = [table(f"{title}, wall time", wall, baseline="eager")]
    if DEVICE == "cpu":
        tables.append(table(f"{title}, process CPU time", cpu, baseline="eager"))
    return "\n\n".join(tables)


def batched() -> str:
    """Parameter gradients over a batch of 32 examples (tiny blocks, fp32, 1 thread) through
    ``torch.func``: per-example (``vmap(grad)``) and of the summed loss taken outside the vmap
    (``grad(vmap)``). Both differentiate the parameters ``p``, not the inputs."""
    _, p = make_inputs(4, 8, 16, torch.float32)
    xs = torch.randn(32, 4, 8, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    p = {k: v.detach() for k, v in p.items()}
    impls = implementations()
    del impls["compile"]  # (compiling a torch.func transform is refused by functe: docs/design.md)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    for case, transform in (
        ("vmap(grad)", lambda loss: torch.func.vmap(torch.func.grad(loss, argnums=1), in_dims=(0, None))),
        (
            "grad(vmap)",
            lambda loss: (
                lambda xs, p: torch.func.grad(lambda p: torch.func.vmap(loss, in_dims=(0, None))(xs, p).sum())(p)
            ),
        ),
    ):
        steps = {}
        for k, f in impls.items():
            step = transform(lambda x, p, f=f: f(x, p).square().sum())
            steps[k] = lambda step=step: step(xs, p)
        rows.append((f"MLP, 32 examples: {case}", per_call_each(steps, calls=20, rounds=7)))
    torch.set_num_threads(threads)
    return table(
        "Per-call CPU time, batched gradients (32 examples of 4 tokens, 8 hidden, 16 ffn, fp32, 1 thread)",
        rows,
        baseline="eager",
    )


def frozen(reps: int) -> str:
    """The block at 2048 tokens, fp32, gradients of the input only (frozen weights, as in adapter or
    bias-only fine-tuning): backward rules skip the weight gradients nobody asked for."""
    x, p = make_inputs(2048, 1024, 4096, torch.float32)
    p = {k: v.detach() for k, v in p.items()}
    cot = torch.randn(2048, 1024, generator=torch.Generator().manual_seed(1)).to(device=DEVICE)
    impls = implementations()
    steps = {k: (lambda f=f: torch.autograd.grad(f(x, p), x, cot)) for k, f in impls.items()}
    wall, _ = interleaved(steps, reps=reps)
    title = f"MLP block fwd+bwd, frozen weights (2048 tokens, 1024 hidden, 4096 ffn, fp32), best of {reps}, wall"
    timing = table(title, [("input gradient only", wall)], baseline="eager")
    # What each keeps for its backward, beyond the parameters (which the caller holds anyway).
    params = {t.untyped_storage().data_ptr() for t in p.values()}
    saved = {k: _saved_mib(lambda f=f: f(x, p), params) for k, f in impls.items() if k != "compile"}
    lines = ["### Saved for the backward, frozen weights (MiB, parameters excluded; compile: not visible to hooks)", ""]
    lines += [
        "| " + " | ".join(saved) + " |",
        "|" + "---|" * len(saved),
        "| " + " | ".join(f"{v:.0f}" for v in saved.values()) + " |",
    ]
    return timing + "\n\n" + "\n".join(lines)


def _saved_mib(run, exclude: set) -> float:
    """MiB of the distinct storages autograd saves while ``run()`` records, those whose pointer is in
    ``exclude`` left out."""
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(storages.values()) / 2**20


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-large", action="store_true", help="only the per-call overhead table")
    parser.add_argument("--reps", type=int, default=5, help="timed rounds of the large case")
    parser.add_argument("--func", action="store_true", help="also time the large case through torch.func.vjp")
    parser.add_argument("--frozen", action="store_true", help="only the frozen-weights case (input gradient only)")
    parser.add_argument("--vmap", action="store_true", help="only the batched-gradients case (torch.func.vmap)")
    args = parser.parse_args()
    if args.vmap:
        print(machine())
        print()
        print(batched())
        return
    if args.frozen:
        print(machine())
        print()
        print(frozen(args.reps))
        return
    print(machine())
    print()
    print(overhead())
    if not args.skip_large:
        print()
        print(large([torch.float32, torch.bfloat16], reps=args.reps))
        if args.func:
            print()
            print(large([torch.float32, torch.bfloat16], reps=args.reps, func=True))


if __name__ == "__main__":
    main()
