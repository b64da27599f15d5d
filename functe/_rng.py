"""The random number generators' states at a point of a program, to replay its draws.

An op that recomputes a random forward (an opaque op's backward, which differentiates its
function again; a ``jvp`` rule, which reruns the forward rule on dual tensors) restores the state
the forward started from, so it differentiates the very draw the forward made.
"""

from __future__ import annotations

import contextlib

import torch

from ._tree import tree_flatten

Tensor = torch.Tensor


class RandomState:
    """The random number generators' states an op's forward started from (CPU, and each CUDA
    device among its arguments), restored while its backward recomputes the forward, as
    ``torch.utils.checkpoint`` does: a random function (dropout) gets the gradient of the very draw
    its forward made. Not a tensor, so a constant residual (the op keeps exact second order).

    While a CUDA graph is being captured the CUDA generators' states cannot be read (torch refuses),
    so they are neither saved nor restored there: a deterministic opaque function captures as before,
    a random one replays only its CPU draws.
    """

    __slots__ = ("cpu", "cuda", "own")

    def __init__(self, args: tuple, generators: tuple[torch.Generator, ...] = ()):
        self.cpu = torch.get_rng_state()
        # (the torch.Generator objects the function reaches or takes: its backward drew a new mask
        # from an advanced generator, a wrong gradient, and advanced it a second time)
        self.own = [(g, g.get_state()) for g in generators]
        self.cuda = {}
        if not torch.cuda.is_initialized():  # (no CUDA tensor can exist: skip the walk)
            return
        devices = {t.device.index for t in tree_flatten(args)[0] if isinstance(t, Tensor) and t.device.type == "cuda"}
        if devices and not torch.cuda.is_current_stream_capturing():
            self.cuda = {index: torch.cuda.get_rng_state(index) for index in devices}

    @contextlib.contextmanager
    def restored(self):
        # (by hand, not torch.random.fork_rng: that costs ~25 us per backward in warnings and device logic)
        cuda = self.cuda if self.cuda and not torch.cuda.is_current_stream_capturing() else {}
        now_cpu, now_cuda = torch.get_rng_state(), {index: torch.cuda.get_rng_state(index) for index in cuda}
        now_own = [(g, g.get_state()) for g, _ in self.own]
        torch.set_rng_state(self.cpu)
        for index, state in cuda.items():
            torch.cuda.set_rng_state(state, index)
        for g, state in self.own:
            g.set_state(state)
        try:
            yield
        finally:
            torch.set_rng_state(now_cpu)
            for index, state in now_cuda.items():
                torch.cuda.set_rng_state(state, index)
            for g, state in now_own:
                g.set_state(state)
