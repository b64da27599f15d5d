"""Serving benchmarks: what a fused model holds while it answers requests.

* **Peak memory of one inference call** (a residual stack of RMSNorm -> GELU -> Linear blocks under
  ``torch.inference_mode``), eager against ``functe.fuse`` at two depths. Eager code frees each
  activation when its name is rebound; a fused plan frees an intermediate after its last use (it
  kept them all to the return before stop 30). On the CPU each case runs in a fresh process and
  reports how far its resident set peaked above its size before the call (Linux: the peak is reset
  through ``/proc/self/clear_refs``); on CUDA, ``max_memory_allocated`` above the allocated size.
* **Folded weight copies across plans**: a frozen two-layer MLP under ``torch.autocast(bfloat16)``
  called with prompts of 1..N tokens (one plan per length). The trace folds the bf16 casts of the
  weights; plans now share one copy instead of one per plan.
* **Per-call latency** of a decode step (batch 1, one token): eager, ``torch.compile`` and
  ``functe.fuse``, under ``inference_mode``.

Run: ``python -m benchmarks.bench_serving`` (``--width``, ``--lengths``).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import subprocess
import sys
import warnings

import torch

import functe
from functe import ops

from ._harness import machine, per_call_each, table

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _stack(depth: int, width: int):
    torch.manual_seed(0)
    weights = [torch.randn(width, width, device=DEVICE) / width**0.5 for _ in range(depth)]
    gain = torch.ones(width, device=DEVICE)

    def model(x):
        for w in weights:
            x = ops.linear(ops.gelu(ops.rms_norm(x, gain)), w) + x
        return x

    return model


def _peak_case(mode: str, depth: int, tokens: int, width: int) -> float:
    """MiB the peak grew by during one call (run in a fresh process on the CPU)."""
    model = _stack(depth, width)
    fn = functe.fuse(model) if mode == "fuse" else model
    x = torch.randn(tokens, width, device=DEVICE)
    with torch.inference_mode():
        fn(torch.randn(1, width, device=DEVICE))  # (a trace of another shape: not counted)
        fn(x)  # (this shape's trace)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            fn(x)
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated() - before) / 2**20
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # (freed memory back to the system: else reused unseen)
        with open("/proc/self/clear_refs", "w") as f:  # (Linux: resets the peak to the current size)
            f.write("5")
        before = _status_kib("VmRSS")
        fn(x)
        return (_status_kib("VmHWM") - before) / 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _peak(mode: str, depth: int, tokens: int, width: int) -> float:
    if DEVICE == "cuda":
        return _peak_case(mode, depth, tokens, width)
    code = (
        "from benchmarks.bench_serving import _peak_case; import json; "
        f"print(json.dumps(_peak_case({mode!r}, {depth}, {tokens}, {width})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _folded_copies(lengths: int, width: int) -> tuple[int, int, float]:
    """(plans, bf16 weight-shaped tensors alive, MiB of one bf16 copy of the weights)."""
    mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width))
    mlp = mlp.to(DEVICE).eval().requires_grad_(False)

    def forward(x):
        h = ops.gelu(ops.linear(x, mlp[0].weight, mlp[0].bias))
        return ops.linear(h, mlp[1].weight, mlp[1].bias)

    fused = functe.fuse(forward)
    with torch.autocast(DEVICE, dtype=torch.bfloat16), torch.inference_mode():
        for n in range(1, lengths + 1):
            with warnings.catch_warnings():  # (the RetraceWarning at 16 plans: this case makes them on purpose)
                warnings.simplefilter("ignore", functe.RetraceWarning)
                fused(torch.randn(1, n, width, device=DEVICE))
    gc.collect()
    shapes = {tuple(p.shape) for p in mlp.parameters() if p.dim() == 2}
    alive = sum(
        1
        for o in gc.get_objects()
        if type(o) is torch.Tensor and o.dtype == torch.bfloat16 and tuple(o.shape) in shapes
    )
    one_copy = sum(p.numel() for p in mlp.parameters()) * 2 / 2**20
    return fused.trace_count, alive, one_copy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--lengths", type=int, default=20)
    args = parser.parse_args()
    print(machine())
    activation = args.tokens * args.width * 4 / 2**20
    title = f"Peak memory of one inference call ({args.tokens}x{args.width} fp32, one activation {activation:.0f} MiB)"
    print(f"\n### {title}\n")
    print("| depth | eager (MiB) | fuse (MiB) |\n|---|---|---|")
    for depth in (4, 16):
        eager, fused = (_peak(m, depth, args.tokens, args.width) for m in ("eager", "fuse"))
        print(f"| {depth} | {eager:.0f} | {fused:.0f} |")
    plans, alive, one = _folded_copies(args.lengths, args.width)
    print(f"\n### Folded bf16 weight copies under autocast after {plans} prompt lengths\n")
    print(f"{alive} bf16 weight tensors alive (the model has 2 weight matrices; one bf16 copy = {one:.1f} MiB)")

    model = _stack(4, args.width)
    fused, compiled = functe.fuse(model), torch.compile(model)
    x = torch.randn(1, args.width, device=DEVICE)
    with torch.inference_mode():
        for fn in (fused, compiled):
            fn(x)
        rows = [
            (
                "decode step, depth 4",
                per_call_each({"eager": lambda: model(x), "compile": lambda: compiled(x), "fuse": lambda: fused(x)}),
            )
        ]
    print()
    print(table(f"Per-call latency, batch 1 x {args.width}, inference_mode (ms)", rows, baseline="eager"))


if __name__ == "__main__":
    main()
