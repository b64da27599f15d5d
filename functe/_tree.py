"""Thin pytree helpers over optree, plus one registration for both registries.

functe flattens pytrees with optree (fast, C++), in its own namespace so that a
registration here never leaks into a user's optree trees. torch.func, however,
only understands ``torch.utils._pytree`` registrations: a class registered with
optree alone is rejected by ``torch.func.grad`` ("Thing passed to transform API
must be Tensor"). :func:`pytree_dataclass` therefore registers a class with
both, so a state object can be a ``grad`` argument, a ``vmap`` input and a
``jacrev`` output alike.

``None`` is a leaf in functe's flattening (as in ``torch.utils._pytree``), so an
optional argument keeps its position when a call is flattened.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from typing import Any, TypeVar

import optree
import torch
import torch.utils._pytree as torch_pytree

from ._errors import ArgumentError, check_callable, describe

NAMESPACE = "functe"

T = TypeVar("T")
PyTreeSpec = optree.PyTreeSpec


def tree_flatten(tree: Any) -> tuple[list[Any], PyTreeSpec]:
    """Flatten ``tree`` into leaves and a spec (``None`` counts as a leaf).

    Example:
        >>> leaves, spec = tree_flatten({"w": 1, "b": None})
        >>> leaves
        [None, 1]
    """
    return optree.tree_flatten(tree, none_is_leaf=True, namespace=NAMESPACE)


def tree_unflatten(spec: PyTreeSpec, leaves) -> Any:
    """Inverse of :func:`tree_flatten`.

    Example:
        >>> leaves, spec = tree_flatten({"b": 2, "a": (1, None)})
        >>> tree_unflatten(spec, [10, 20, 30])
        {'b': 30, 'a': (10, 20)}
    """
    try:
        return optree.tree_unflatten(spec, leaves)
    except ValueError:
        # (optree's "Too few leaves for PyTreeSpec" named neither the function nor the argument)
        count = getattr(spec, "num_leaves", None)
        if not isinstance(count, int) or not hasattr(leaves, "__len__") or len(leaves) == count:
            raise
        raise ArgumentError(
            f"functe.tree_unflatten: argument 'leaves' expected {count} leaves (the spec's), got {len(leaves)}"
        ) from None
    except AttributeError:
        # (checked after the fact, and not as isinstance: a spec Dynamo made is its polyfill's)
        if hasattr(spec, "unflatten"):
            raise
        raise ArgumentError(
            f"functe.tree_unflatten: argument 'spec' expected a PyTreeSpec, got {describe(spec)}"
        ) from None


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of ``tree`` in flattening order (``None`` included).

    Example:
        >>> tree_leaves({"b": 2, "a": (1, None)})
        [1, None, 2]
    """
    return optree.tree_leaves(tree, none_is_leaf=True, namespace=NAMESPACE)


def tree_structure(tree: Any) -> PyTreeSpec:
    """The spec of ``tree`` without its leaves.

    Example:
        >>> tree_structure((1, [2, None])).num_leaves
        3
    """
    return optree.tree_structure(tree, none_is_leaf=True, namespace=NAMESPACE)


def same_structure(spec: PyTreeSpec, expected: PyTreeSpec) -> bool:
    """Whether two specs describe the same tree structure.

    Not always ``spec == expected``: a spec made while Dynamo traces is its polyfill of optree's,
    which keeps the namespace where optree drops it (a tree with no registered node), and a call
    that Dynamo hands back to eager (aliased arguments) carries it into eager code, where it compares
    unequal to the same structure flattened by optree. Rebuilt by optree, the two agree.
    """
    if spec == expected:
        return True
    if spec.num_leaves != expected.num_leaves:
        return False
    try:
        rebuilt = tree_structure(tree_unflatten(expected, [0] * expected.num_leaves))
    except Exception:  # (a spec optree cannot unflatten describes no tree of ours)
        return False
    return rebuilt == spec


_CONTENTS_LIMIT = 10_000
"""Container entries :func:`with_contents` looks at, at most (a larger table is not a parameter store)."""


def _entries(v: Any) -> Any:
    """A container's entries (a sized collection), or None for anything else."""
    if isinstance(v, (list, tuple)):
        return v
    if isinstance(v, dict):
        return v.values()
    if isinstance(v, types.SimpleNamespace):
        return vars(v).values()
    if dataclasses.is_dataclass(v) and not isinstance(v, type):  # (functe.pytree_dataclass states too)
        return [getattr(v, f.name, None) for f in dataclasses.fields(v)]
    return None


def with_contents(values: list, arguments: Any = ()) -> list:
    """``values`` and the entries of the containers among them (lists, tuples, dicts, namespaces,
    dataclasses), nested three levels deep, without the tensors that are the call's ``arguments``.

    What a function reaches by name (an opaque function, a custom_vjp rule's closure) is checked
    for tensors it would differentiate without taking them as arguments. Parameters are usually
    held in a container (``params["w"]``, a list of layers, a state dataclass): a trainable tensor
    reached through one was not seen, and its gradient was silently lost (``None`` under autograd,
    0 under ``torch.func.grad``). A tensor that is also passed as an argument is differentiated as
    one. Containers past a total of ``_CONTENTS_LIMIT`` entries are not opened (their size is read
    first).
    """
    result, level, budget = list(values), list(values), _CONTENTS_LIMIT
    passed = {id(a) for a in tree_leaves(arguments) if isinstance(a, torch.Tensor)} if arguments else ()
    for _ in range(3):
        inner = []
        for v in level:
            entries = _entries(v)
            if entries is None:
                continue
            budget -= len(entries)
            if budget < 0:
                return result
            inner += [e for e in entries if id(e) not in passed] if passed else entries
        if not inner:
            break
        result += inner
        level = inner
    return result


def tree_map(fn: Callable[..., Any], tree: Any, *rests: Any) -> Any:
    """Apply ``fn`` leafwise over ``tree`` and structurally identical ``rests``.

    ``None`` is a leaf (as in ``torch.utils._pytree``, unlike JAX): ``fn`` sees it, so a function
    over states that may be stateless (``None``) must pass it through.

    Example:
        >>> tree_map(lambda a, b: a + b, {"x": 1, "y": 2}, {"x": 10, "y": 20})
        {'x': 11, 'y': 22}
        >>> tree_map(lambda t: None if t is None else t * 2, {"fc1": None, "fc2": 3})
        {'fc1': None, 'fc2': 6}
    """
    check_callable("tree_map", "fn", fn)
    return optree.tree_map(fn, tree, *rests, none_is_leaf=True, namespace=NAMESPACE)


def _paths(spec: PyTreeSpec) -> list[str]:
    return ["".join(f"[{k!r}]" for k in path) or "<root>" for path in spec.paths()]


def argument_labels(args: PyTreeSpec, kwargs: PyTreeSpec | None = None, names=()) -> list[str]:
    """How errors name each leaf of a call: ``args`` is the spec of its positional arguments (a
    tuple), ``kwargs`` of its keyword arguments (a dict); ``names`` the callee's parameter names, where
    known, for the positional ones.

    Example:
        >>> args = tree_structure((1, {"w": 2, "b": 3}))
        >>> argument_labels(args, tree_structure({"seed": 4}), names=("x",))
        ["argument 'x'", "argument 1['b']", "argument 1['w']", "argument 'seed'"]
    """
    labels: list[str] = []
    for i, child in enumerate(args.children()):
        head = f"argument {names[i]!r}" if i < len(names) else f"argument {i}"
        labels.extend(head + "".join(f"[{k!r}]" for k in path) for path in child.paths())
    if kwargs is not None:
        for key, child in zip(kwargs.entries(), kwargs.children()):
            labels.extend(f"argument {key!r}" + "".join(f"[{k!r}]" for k in path) for path in child.paths())
    return labels


def leaf_paths(tree: Any) -> list[str]:
    """Printable key path of each leaf, e.g. ``['w']`` or ``[0]['scale']``."""
    return _paths(tree_structure(tree))


def pytree_dataclass(cls: type[T]) -> type[T]:
    """Make ``cls`` a frozen dataclass whose fields are pytree children.

    The class is registered with optree (functe namespace) *and* with
    ``torch.utils._pytree``, so it works with functe's own flattening and with
    every ``torch.func`` transform. Instances are immutable; use
    ``dataclasses.replace`` to make an updated copy.

    Example:
        >>> import torch
        >>> @pytree_dataclass
        ... class Pair:
        ...     a: torch.Tensor
        ...     b: torch.Tensor
        >>> g = torch.func.grad(lambda p: (p.a * p.b).sum())(Pair(torch.ones(2), torch.full((2,), 3.0)))
        >>> g.a.tolist()
        [3.0, 3.0]
    """
    if not isinstance(cls, type):
        raise ArgumentError(f"functe.pytree_dataclass: argument 'cls' expected a class, got {describe(cls)}")
    cls = dataclasses.dataclass(frozen=True)(cls)
    names = tuple(f.name for f in dataclasses.fields(cls))
    cls.__functe_pytree_fields__ = names  # (generated code rebuilds such nodes itself: functe._codegen)

    def children(obj):
        return tuple(getattr(obj, n) for n in names)

    def rebuild(_aux, kids):
        return rebuild_dataclass(cls, names, kids)

    optree.register_pytree_node(
        cls,
        lambda obj: (children(obj), None, names),
        rebuild,
        namespace=NAMESPACE,
    )
    torch_pytree.register_pytree_node(
        cls,
        lambda obj: (list(children(obj)), None),
        lambda kids, aux: rebuild(aux, kids),
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=lambda obj: (
            [(torch_pytree.GetAttrKey(n), getattr(obj, n)) for n in names],
            None,
        ),
    )
    return cls


def rebuild_dataclass(cls: type[T], names: tuple[str, ...], values) -> T:
    """A (frozen) dataclass instance with ``names`` set to ``values``, without ``__init__``.

    object.__new__ + setattr skips __init__/__post_init__: torch.func builds
    pytree_dataclass instances whose leaves are ints (vmap in_dims) or None
    (missing grads), and functe.fuse rebuilds the ones it traced.
    """
    obj = object.__new__(cls)
    for n, v in zip(names, values):
        object.__setattr__(obj, n, v)
    return obj


def is_pytree_dataclass(cls) -> bool:
    """Whether ``cls`` was made by :func:`pytree_dataclass` (its fields are its children, in order)."""
    return "__functe_pytree_fields__" in getattr(cls, "__dict__", {})
