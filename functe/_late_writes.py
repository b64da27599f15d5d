"""Backward passes that write into a scaling state's leaves after :func:`functe.state_from_gradient`
replaced them (the classic autograd route).

On the classic route a state's leaves require grad and ``.grad`` carries the update. With forwards
interleaved over one state (a pipeline's 1F1B schedule: micro-batch 2's forward before micro-batch
1's backward), micro-batch 2's backward lands in the *old* leaves after ``state_from_gradient``
already turned them into the next state, whose ``.grad`` then stays ``None`` and reads as "not
reached": that micro-batch's amaxes were lost without a trace. A post-accumulate-grad hook on each
replaced leaf notes such a write, and the next ``state_from_gradient`` over the state that
replaced it reports it.

The registry is diagnostic only (no value a computation reads lives here): weak on both ends, so a
state that nothing references any more, and every predecessor no pending backward can still reach,
drops out by itself.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

# next-state leaf -> [(replaced predecessor leaf, its write count, the count when replaced)] for the
# predecessors still alive: a deep pipeline's backward may reach a state two or more updates back.
_predecessors: WeakIdKeyDictionary = WeakIdKeyDictionary()


# replaced leaf -> [backward writes into it so far]: one hook per leaf however often it is replaced
# (a dry run of state_from_gradient, a skipped step's retry); each replacement remembers the count
# it was made at, so a write before a later replacement of the same leaf is not that one's
_writes: WeakIdKeyDictionary = WeakIdKeyDictionary()


def watch_replaced(old: torch.Tensor, new: torch.Tensor) -> None:
    """Note that ``new`` replaces the leaf ``old``: a later backward writing ``old.grad`` marks ``new``."""
    if not old.is_leaf or torch.compiler.is_compiling():
        return  # (a non-leaf gets no .grad; a compiled step's hooks would be Dynamo's to trace)
    writes = _writes.get(old)
    if writes is None:
        writes = _writes[old] = [0]
        old.register_post_accumulate_grad_hook(lambda _leaf: writes.__setitem__(0, writes[0] + 1))
    inherited = [entry for entry in _predecessors.get(old, ()) if entry[0]() is not None]
    _predecessors[new] = [(weakref.ref(old), writes, writes[0]), *inherited]


def written_after_replacement(leaf: torch.Tensor) -> bool:
    """Whether a backward wrote into a leaf that ``leaf`` (or one of its predecessors) replaced,
    after the replacement."""
    return any(writes[0] > at for _, writes, at in _predecessors.get(leaf, ()))
