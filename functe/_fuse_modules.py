"""The nn.Modules a fused function reaches: their tensors by name, their training flags, and the
submodule registrations that make a fused function look for them again."""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Callable

import torch

from . import _reach
from ._errors import (
    TraceError,
    describe,
)

Tensor = torch.Tensor


def _named_tensor(owner: torch.nn.Module, modules: tuple[str, ...], name: str) -> Tensor | None:
    """The parameter, buffer or plain tensor attribute ``name`` of ``owner``'s submodule at ``modules``,
    through the dicts that ``functional_call`` and attribute assignment write (a plan checks them per
    call: no ``getattr``)."""
    for part in modules:
        owner = owner._modules.get(part)
        if owner is None:
            return None
    t = owner._parameters.get(name)
    if t is None:
        t = owner._buffers.get(name)
    return owner.__dict__.get(name) if t is None else t  # (a plain attribute: pruning's weight)


def _submodules(fn: Callable) -> list[torch.nn.Module]:
    """The modules ``fn`` reaches by name and all their submodules, each once."""
    found: dict[int, torch.nn.Module] = {}
    for v in _reach._reached(fn):
        if isinstance(v, torch.nn.Module):
            found.update((id(m), m) for m in v.modules())
    return list(found.values())


_TRAINING = operator.attrgetter("training")


def _named_tensors(module: torch.nn.Module, *, attributes: bool = True):
    """``(name, tensor)`` of every parameter and buffer of ``module``, under every name a tied one has,
    and of its plain tensor attributes: a pruned or (classic) weight-normed module's ``weight``, which
    its pre-hook sets anew at every call of the module (read by ``fuse(module.forward)``, the old one
    stayed in the plan)."""
    tensors = (
        (f"{prefix}.{key}" if prefix else key, value)
        for prefix, sub in module.named_modules(remove_duplicate=False)
        for key, value in vars(sub).items()
        if isinstance(value, Tensor)
    )
    named = itertools.chain(
        module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)
    )
    return itertools.chain(named, tensors) if attributes else named


# (a module takes no parameters as arguments: what to do about a trainable one it captures)
_MODULE_REMEDY = (
    "call the unfused module, or fuse a function taking its parameters (torch.func.functional_call), "
    "or freeze it (requires_grad_(False))"
)


def _name_module_parameter(error: TraceError, reached: list) -> None:
    """Reword the trace's refusal of a trainable captured tensor when it is a parameter or buffer
    of a module the function reaches or called (``'0.weight'``): "pass it as an argument" is no
    remedy for ``fuse(model)``."""
    op_name, tensor = error.capture
    for module in reached:
        if isinstance(module, torch.nn.Module):
            # (parameters and buffers: a plain attribute such as pruning's weight is a product of
            # them, which "freeze it" cannot reach)
            name = next((name for name, t in _named_tensors(module, attributes=False) if t is tensor), None)
            if name is not None:
                error.args = (
                    f"functe.{op_name}: a tensor {describe(tensor)} (the module's {name!r}) captured "
                    f"from the enclosing scope requires gradients; {_MODULE_REMEDY}, otherwise its gradient "
                    "would be silently lost",
                )
                return


# Submodule registrations (`model.act = GELU()`, add_module) on a module some fused function tracks,
# counted by a global hook installed when a fused function first looks for modules: a changed count
# makes each fused function look for its module tree again (see Fused._training_flags). Other
# registrations (a model built elsewhere, make_fx's graph modules) do not count: every fused
# function walked its tree again after each (501 modules: +2.3 ms on the next call).
_REGISTRATIONS = [0]
_REGISTRATION_HOOK: list = []
_TRACKED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _count_module_registrations() -> None:
    if not _REGISTRATION_HOOK:

        def registered(module, name, submodule):
            if module in _TRACKED:
                _REGISTRATIONS[0] += 1

        registered._functe_check = True  # (no user hook: see _trace._refusing_module_hooks)
        _REGISTRATION_HOOK.append(torch.nn.modules.module.register_module_module_registration_hook(registered))
