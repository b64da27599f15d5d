"""One copy of each folded constant across the plans of one fused function.

A trace folds what the function computes from captured tensors alone into constants (autocast's
bf16 copy of a frozen weight, ``2 * w``, a merged LoRA weight ``w + b @ a``). Every input signature
gets its own plan and so its own trace: a served model that saw 20 prompt lengths kept 20 bf16
copies of its weights (90 MiB where the weights were 4), and a decode loop over growing lengths one
copy per step. Plans of one function fold the same values, so a new plan's folded tensor that
equals one an earlier plan holds takes that one instead (constants are never written: a program
output is copied per call, see ``Literal.fresh``).
"""

from __future__ import annotations

import weakref

import torch

from ._backend import has_values
from ._oplist import Literal, OpList


class FoldedConstants:
    """The folded tensors of a fused function's plans, weakly (a replaced plan's go with it)."""

    __slots__ = ("_by_key",)

    def __init__(self):
        # (device, dtype, shape, stride, fingerprint) -> folded tensors alive with that key
        self._by_key: dict[tuple, list[weakref.ref]] = {}

    def share(self, program: OpList) -> None:
        """Point each folded tensor of ``program`` at an equal one an earlier plan folded."""
        for literal in _folded_literals(program):
            key = _key(literal.value)
            if key is None:
                continue
            alive = [ref for ref in self._by_key.get(key, ()) if ref() is not None]
            same = next((t for ref in alive if (t := ref()) is not None and _same_bits(t, literal.value)), None)
            if same is not None:
                literal.value = same
            else:
                alive.append(weakref.ref(literal.value))
            self._by_key[key] = alive


def _folded_literals(program: OpList):
    seen = set()
    for atom in (*(a for e in program.eqns for a in e.inputs), *program.outputs):
        if isinstance(atom, Literal) and atom.fresh and id(atom) not in seen:
            seen.add(id(atom))
            yield atom


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality: ``torch.equal`` calls -0.0 and 0.0 equal (``1 / c`` tells them apart) and
    a NaN unequal to itself."""
    return torch.equal(_bytes(a), _bytes(b))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _key(t: object) -> tuple | None:
    """What two equal tensors share, cheaply: a large model's layers fold many tensors of one shape,
    so candidates are told apart by a fingerprint before ``torch.equal`` reads them whole."""
    if (
        not isinstance(t, torch.Tensor)
        or not has_values(t)
        or t.requires_grad
        or torch._C._functorch.is_functorch_wrapped_tensor(t)
        or t.layout is not torch.strided
        or t.is_nested
        or type(t) is not torch.Tensor
        # (a view of a captured tensor, w.t(): it reads w's values at every call, so an equal
        # tensor elsewhere is no stand-in for it; a tensor alone counts 2, itself and the query)
        or torch._C._storage_Use_Count(t.untyped_storage()._cdata) > 2
    ):
        return None
    raw = _bytes(t)
    # (a sum of the bytes: one read, and equal bits give equal sums whatever the dtype holds, NaN too)
    return (t.device, t.dtype, tuple(t.shape), t.stride(), raw.sum(dtype=torch.int64).item())
