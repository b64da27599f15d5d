"""What a function reaches by name, and which storage a tensor is (for the trace's and opaque ops' checks).

A traced or opaque function can read tensors that are not its arguments: its closure, defaults and
globals, a bound method's object, a module's parameters and buffers. The trace refuses writes into
them and trainable ones it cannot differentiate; an opaque op undoes the extra updates of its
recomputations. These helpers find those values.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch

from ._tree import with_contents
from ._vjp import cell_filled

Tensor = torch.Tensor


def _reachable_storages(fn: Callable) -> set[int]:
    """Storages of the tensors ``fn`` reaches by name (:func:`_named_values`; a module's parameters and
    buffers): what a write inside a trace would change once only."""
    values = list(_named_values(fn))
    storages = set()
    for v in values:
        tensors = [v] if isinstance(v, Tensor) else []
        if isinstance(v, torch.nn.Module):
            tensors = [*v.parameters(), *v.buffers()]
        storages.update(storage_of(t) for t in tensors if t.device.type != "meta")
    return storages


def _named_values(fn: Callable, arguments: Any = ()) -> list:
    """What a callable reaches by name: a plain function's closure, defaults and the globals its code
    names; a partial's bound arguments; a bound method's object; a module itself (its parameters and
    buffers); another callable object's attributes; and, for the last three, what their function
    (``forward``, ``__call__``) reaches. (Only plain functions were looked at: ``opaque(module)``
    lost the module's gradients and ``fuse(module)`` wrote its buffers once.) The contents of the
    containers among them are included, except the call's own ``arguments`` (see
    :func:`functe._tree.with_contents`)."""
    return with_contents(_reached(fn), arguments)


def _reached(fn: Callable, depth: int = 0) -> list:
    """:func:`_named_values` without the containers' contents."""
    if isinstance(fn, types.FunctionType):
        values = [c.cell_contents for c in fn.__closure__ or () if cell_filled(c)]
        values += list(fn.__defaults__ or ()) + list((fn.__kwdefaults__ or {}).values())
        return values + [fn.__globals__[n] for n in fn.__code__.co_names if n in fn.__globals__]
    if depth > 3 or isinstance(fn, types.BuiltinFunctionType):  # (a chain of wrappers: enough levels)
        return []
    if isinstance(fn, functools.partial):
        return [*fn.args, *fn.keywords.values(), *_reached(fn.func, depth + 1)]
    if isinstance(fn, types.MethodType):
        return [*_object_values(fn.__self__), *_reached(fn.__func__, depth + 1)]
    if isinstance(fn, torch.nn.Module):
        return [fn, *_reached(type(fn).forward, depth + 1)]
    return [*_object_values(fn), *_reached(type(fn).__call__, depth + 1)]


def _object_values(obj: object) -> list:
    """An object a method is bound to, and (unless it is a module) its attributes."""
    if isinstance(obj, torch.nn.Module):
        return [obj]
    return [obj, *getattr(obj, "__dict__", {}).values()]


def _unwrapped(t: Tensor) -> Tensor:
    """The tensor under torch.func's wrappers (a vmap or grad inside the traced function wraps a
    captured tensor outside torch-function dispatch)."""
    f = torch._C._functorch
    while f.is_functorch_wrapped_tensor(t):
        t = f.get_unwrapped(t)
    return t


def storage_of(t: Tensor) -> int:
    """The address of ``t``'s storage (identifies what views share)."""
    try:
        storage = t.untyped_storage()
        if storage.device.type == "meta":
            # (a fake tensor's or a meta tensor's: no data, and asking a fake one for its data
            # pointer warns, soon fails; the storage object is what its views share)
            return storage._cdata
        return storage.data_ptr()
    except (RuntimeError, NotImplementedError):  # (a tensor without storage: treated as its own)
        return -id(t)
