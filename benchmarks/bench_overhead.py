"""Per-call overhead of functe ops at tiny shapes, against the same torch code.

At tiny shapes the time is the Python and dispatch around the math, which is what a small model
(or a large model's many small ops) pays per step. Each case runs in three modes:

* ``no grad``: forward under ``torch.no_grad()`` (functe runs the forward rule alone);
* ``autograd``: forward and ``torch.autograd.grad`` (functe's ops are autograd Functions);
* ``torch.func.grad``: the functional transform (functe goes through functorch's custom-Function
  machinery, which builds a Function class per call);

and in ``eager`` (plain torch: ``F.linear``, ``F.gelu(tanh)``, ``F.layer_norm``), ``functe`` (the
same code with functe ops) and, in autograd mode, ``compile`` (``torch.compile`` of the plain code).
Times are thread CPU time per call, the best of 15 rounds of 200 calls, the implementations timed in turn
(``_harness.per_call_each``), one thread.

Run: ``python -m benchmarks.bench_overhead``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from functe import ops

from ._harness import machine, per_call_each, table


def _case_inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 32, generator=g)
    p = {
        "w1": torch.randn(64, 32, generator=g) * 0.2,
        "b1": torch.zeros(64),
        "w2": torch.randn(8, 64, generator=g) * 0.1,
        "g": torch.ones(32),
        "beta": torch.zeros(32),
    }
    return x, p


CASES = {
    "linear": (
        lambda x, p: F.linear(x, p["w1"], p["b1"]),
        lambda x, p: ops.linear(x, p["w1"], p["b1"]),
    ),
    "gelu": (lambda x, p: F.gelu(x, approximate="tanh"), lambda x, p: ops.gelu(x)),
    "layer_norm": (
        lambda x, p: F.layer_norm(x, (32,), p["g"], p["beta"]),
        lambda x, p: ops.layer_norm(x, p["g"], p["beta"]),
    ),
    "MLP (linear, gelu, linear)": (
        lambda x, p: F.linear(F.gelu(F.linear(x, p["w1"], p["b1"]), approximate="tanh"), p["w2"]),
        lambda x, p: ops.linear(ops.gelu(ops.linear(x, p["w1"], p["b1"])), p["w2"]),
    ),
}


def _modes(fn, x, p):
    leaves = [x, *p.values()]

    def no_grad():
        with torch.no_grad():
            fn(x, p)

    xs = [t.detach().requires_grad_() for t in leaves]
    xg, pg = xs[0], dict(zip(p, xs[1:]))

    def autograd():
        torch.autograd.grad(fn(xg, pg).square().sum(), xs, allow_unused=True)

    grad_fn = torch.func.grad(lambda x, p: fn(x, p).square().sum(), argnums=(0, 1))
    return {"no grad": no_grad, "autograd": autograd, "torch.func.grad": lambda: grad_fn(x, p)}


def main():
    torch.set_num_threads(1)
    x, p = _case_inputs()
    print(machine(), "(1 thread for this benchmark)", flush=True)
    tables = {}
    for case, (torch_fn, functe_fn) in CASES.items():
        eager, functe_modes = _modes(torch_fn, x, p), _modes(functe_fn, x, p)
        compiled = _modes(torch.compile(torch_fn), x, p)["autograd"]
        for mode in eager:
            fns = {"eager": eager[mode], "functe": functe_modes[mode]}
            if mode == "autograd":
                fns["compile"] = compiled
            impls = per_call_each(fns)
            tables.setdefault(mode, []).append((case, impls))
            print(f"  {case} / {mode}: " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in impls.items()), flush=True)
    for mode, rows in tables.items():
        print()
        print(table(f"Per-call CPU time, {mode}, x f32[16,32] (best of 15 rounds)", rows, baseline="eager"))


if __name__ == "__main__":
    main()
