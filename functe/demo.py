"""functe's main demo: a functional training loop over functe ops.

Run with ``python -m functe.demo``. It trains a small residual MLP on a
synthetic regression task on the CPU with ``torch.func.grad_and_value``: the
parameters are a plain dict, the optimizer is a pure function, nothing is
mutated in place, and the loss printed every few steps falls.

Section 2 trains the same MLP with its two hidden linears in FP8 under delayed
scaling (HYBRID: E4M3 forward, E5M2 gradients). The FP8 scaling state is one
more explicit pytree; ``functe.value_and_grad`` returns the next state with the
gradients, so a training step stays one line.

Section 3 trains a pre-norm residual MLP block (LayerNorm, Linear+bias, GELU,
Linear+bias, residual add) under ``functe.fuse``: the block is traced once,
rewritten by the fusion rules (``functe.explain`` prints what fired and what
declined, with the reason) and runs as one custom VJP inside ``torch.func``.
"""

from __future__ import annotations

import time

import torch

import functe
from functe import ops

HIDDEN, FFN, BATCH = 32, 64, 128


def init_params(key: int) -> dict[str, torch.Tensor]:
    """Initial parameters of the residual MLP, drawn from an explicit seed."""
    g = torch.Generator().manual_seed(key)

    def uniform(*shape, fan_in):
        bound = fan_in**-0.5
        return (torch.rand(*shape, generator=g) * 2 - 1) * bound

    return {
        "fc1.weight": uniform(FFN, HIDDEN, fan_in=HIDDEN),
        "fc1.bias": torch.zeros(FFN),
        "fc2.weight": uniform(HIDDEN, FFN, fan_in=FFN),
        "fc2.bias": torch.zeros(HIDDEN),
        "head.weight": uniform(1, HIDDEN, fan_in=HIDDEN),
    }


def model(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``head(x + fc2(tanh(fc1(x))))``, written with functe ops."""
    h = ops.linear(x, params["fc1.weight"], params["fc1.bias"])
    h = torch.tanh(h)
    h = ops.linear(h, params["fc2.weight"], params["fc2.bias"])
    h = ops.add_extra_input(h, x)
    return ops.linear(h, params["head.weight"])


def loss_fn(params, x, y):
    return ((model(params, x).squeeze(-1) - y) ** 2).mean()


def adam_init(params):
    zeros = functe.tree_map(torch.zeros_like, params)
    return {"m": zeros, "v": zeros, "t": torch.zeros(())}


def adam_update(params, grads, state, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8):
    """One Adam step as a pure function: returns new params and new optimizer state."""
    t = state["t"] + 1
    m = functe.tree_map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
    v = functe.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)

    def step(p, m, v):
        return p - lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)

    return functe.tree_map(step, params, m, v), {"m": m, "v": v, "t": t}


def make_data(key: int, n: int):
    g = torch.Generator().manual_seed(key)
    x = torch.randn(n, HIDDEN, generator=g)
    direction = torch.randn(HIDDEN, generator=g) / HIDDEN**0.5
    y = torch.sin(2 * x @ direction) + 0.1 * (x[:, 0] * x[:, 1])
    return x, y


def train(steps: int = 200, log_every: int = 25) -> list[float]:
    """Train the MLP and return the logged losses."""
    losses, _ = _train_loop(loss_fn, init_params(0), steps, log_every)
    return losses


def _train_loop(loss, params, steps: int, log_every: int) -> tuple[list[float], float]:
    """Adam steps of ``torch.func.grad_and_value(loss)`` on the synthetic task: (logged losses, seconds)."""
    opt = adam_init(params)
    x_all, y_all = make_data(1, 4096)
    value_and_grad = torch.func.grad_and_value(loss)
    losses = []
    start = time.perf_counter()
    for step in range(steps + 1):
        idx = torch.arange(step * BATCH, (step + 1) * BATCH) % x_all.shape[0]
        grads, value = value_and_grad(params, x_all[idx], y_all[idx])
        params, opt = adam_update(params, grads, opt)
        if step % log_every == 0:
            losses.append(value.item())
            print(f"  step {step:4d}  loss {value.item():.4f}")
    seconds = time.perf_counter() - start
    print(f"  {steps} steps in {seconds:.2f} s")
    return losses, seconds


# ----------------------------------------------------------------------------- 2) FP8


FP8_RECIPE = functe.DelayedScaling(fp8_format=functe.Format.HYBRID, amax_history_len=16)


def init_fp8_state() -> dict[str, functe.LinearScalingState]:
    """One :class:`functe.LinearScalingState` per FP8 linear (input, weight, grad_output roles)."""
    return {name: functe.init_linear_scaling_state(FP8_RECIPE) for name in ("fc1", "fc2")}


def fp8_model(params, state, x):
    """The same residual MLP with ``fc1`` and ``fc2`` as FP8 linears (the 1-wide head stays high precision)."""
    h = ops.fp8_linear(x, params["fc1.weight"], params["fc1.bias"], state["fc1"], recipe=FP8_RECIPE)
    h = torch.tanh(h)
    h = ops.fp8_linear(h, params["fc2.weight"], params["fc2.bias"], state["fc2"], recipe=FP8_RECIPE)
    h = ops.add_extra_input(h, x)
    return ops.linear(h, params["head.weight"])


def fp8_loss_fn(params, state, x, y):
    return ((fp8_model(params, state, x).squeeze(-1) - y) ** 2).mean()


def fp8_steps(params, opt, state, start: int, stop: int, *, log_every: int = 0):
    """Steps ``start..stop-1`` of FP8 training; returns (params, opt, state, losses). Pure: same inputs, same bits."""
    x_all, y_all = make_data(1, 4096)
    step_fn = functe.value_and_grad(fp8_loss_fn)
    losses = []
    for step in range(start, stop):
        idx = torch.arange(step * BATCH, (step + 1) * BATCH) % x_all.shape[0]
        loss, grads, state = step_fn(params, state, x_all[idx], y_all[idx])  # the whole step
        params, opt = adam_update(params, grads, opt)
        losses.append(loss.item())
        if log_every and step % log_every == 0:
            fc1, fc2 = state["fc1"], state["fc2"]
            print(
                f"  step {step:4d}  loss {loss.item():.4f}  scales: fc1.input {fc1.input.scale.item():8.2f}"
                f"  fc2.weight {fc2.weight.scale.item():8.2f}  fc2.grad_output {fc2.grad_output.scale.item():10.1f}"
            )
    return params, opt, state, losses


def train_fp8(steps: int = 200, log_every: int = 25) -> list[float]:
    """Train the FP8 MLP from the same initial parameters; return the per-step losses."""
    params = init_params(0)
    start = time.perf_counter()
    *_, losses = fp8_steps(params, adam_init(params), init_fp8_state(), 0, steps + 1, log_every=log_every)
    print(f"  {steps} steps in {time.perf_counter() - start:.2f} s")
    return losses


# ----------------------------------------------------------------------------- 3) functe.fuse


def init_block_params(key: int) -> dict[str, torch.Tensor]:
    """Parameters of the pre-norm residual MLP block plus the 1-wide head."""
    params = init_params(key)
    params["ln.weight"], params["ln.bias"] = torch.ones(HIDDEN), torch.zeros(HIDDEN)
    return params


@functe.fuse
def mlp_block(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``x + fc2(gelu(fc1(layer_norm(x))))``; the fork makes the residual explicit (TE's MakeExtraOutput)."""
    y, skip = ops.make_extra_output(x)
    h = ops.layer_norm(y, p["ln.weight"], p["ln.bias"])
    h = ops.gelu(ops.linear(h, p["fc1.weight"], p["fc1.bias"]))
    return ops.linear(h, p["fc2.weight"], p["fc2.bias"]) + skip


def block_loss_fn(params, x, y):
    block = {k: v for k, v in params.items() if k != "head.weight"}
    h = mlp_block(block, x)
    return ((ops.linear(h, params["head.weight"]).squeeze(-1) - y) ** 2).mean()


def train_fused(steps: int = 60, log_every: int = 20) -> list[float]:
    """Explain the fused block once, then train it; return the logged losses."""
    params = init_block_params(0)
    x_all, _ = make_data(1, 4096)
    functe.explain(mlp_block, {k: v for k, v in params.items() if k != "head.weight"}, x_all[:BATCH])
    losses, _ = _train_loop(block_loss_fn, params, steps, log_every)
    print(f"  (the block was traced {mlp_block.trace_count}x)")
    return losses


def main() -> None:
    print(f"functe {functe.__version__} demo (backend: {functe.get_backend()})")
    print("1) residual MLP, fp32, torch.func.grad_and_value over functe ops")
    losses = train()
    print(f"  loss fell from {losses[0]:.4f} to {losses[-1]:.4f}")
    if not losses[-1] < losses[0]:
        raise SystemExit("demo failed: the loss did not fall")
    print("2) the same MLP with FP8 linears, DelayedScaling(HYBRID), one-line functe.value_and_grad steps")
    losses = train_fp8()
    print(f"  loss fell from {losses[0]:.4f} to {losses[-1]:.4f}")
    if not losses[-1] < losses[0]:
        raise SystemExit("demo failed: the FP8 loss did not fall")
    print("3) a pre-norm residual MLP block under functe.fuse (traced once, rewritten by the fusion rules)")
    losses = train_fused()
    print(f"  loss fell from {losses[0]:.4f} to {losses[-1]:.4f}")
    if not losses[-1] < losses[0]:
        raise SystemExit("demo failed: the fused block's loss did not fall")


if __name__ == "__main__":
    main()
