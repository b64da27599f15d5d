"""Checkpoints of pytrees (parameters, optimizer and FP8 states): exact, by flattened key paths.

A pytree becomes a flat ``{"fc1.input.scale": tensor, ...}`` dict (:func:`tree_to_dict`), which
both ``torch.save`` and safetensors store bit for bit; :func:`tree_from_dict` puts the tensors back
into the structure of a template tree (``like``), checking names, shapes and dtypes. Nothing is
pickled but tensors, so loading needs no unsafe unpickling (TE's extra state does).
"""

from __future__ import annotations

import os
from typing import Any

import optree
import torch

from ._errors import ArgumentError, StateError, describe
from ._tree import NAMESPACE


def _key(path: tuple) -> str:
    return ".".join(str(k) for k in path)


def _keyed_leaves(tree: Any, op: str) -> tuple[list[tuple[str, Any]], Any]:
    """``([(dotted key, leaf)], treespec)``; refuses two paths with one key (``{"a.b": ..}`` next to
    ``{"a": {"b": ..}}``, or the keys ``1`` and ``"1"``): a flat dict would keep only one of them."""
    paths, leaves, spec = optree.tree_flatten_with_path(tree, none_is_leaf=True, namespace=NAMESPACE)
    seen: dict[str, tuple] = {}
    keyed = []
    for path, leaf in zip(paths, leaves):
        key = _key(path)
        if leaf is not None:
            if key in seen:
                raise StateError(
                    f"functe.{op}: the paths {seen[key]!r} and {path!r} both flatten to the key {key!r}; "
                    "rename one of them"
                )
            seen[key] = path
        keyed.append((key, leaf))
    return keyed, spec


def tree_to_dict(tree: Any) -> dict[str, torch.Tensor]:
    """The tensor leaves of ``tree`` by dotted key path (``None`` leaves are left out).

    Example:
        >>> import torch, functe
        >>> sorted(functe.tree_to_dict({"fc1": functe.init_scaling_state(2), "step": torch.zeros(())}))
        ['fc1.amax_history', 'fc1.scale', 'step']
    """
    out = {}
    for key, leaf in _keyed_leaves(tree, "tree_to_dict")[0]:
        if leaf is None:
            continue
        if not isinstance(leaf, torch.Tensor):
            raise StateError(f"functe.tree_to_dict: leaf {key!r} is {describe(leaf)}, not a tensor")
        out[key] = leaf
    return out


def tree_from_dict(like: Any, flat: dict[str, torch.Tensor]) -> Any:
    """Rebuild a tree shaped like ``like`` from :func:`tree_to_dict`'s output, checking each tensor.

    Example:
        >>> import functe
        >>> s = functe.init_scaling_state(2)
        >>> functe.tree_from_dict(s, functe.tree_to_dict(s)).scale.item()
        1.0
    """
    if not isinstance(flat, dict) or not all(isinstance(k, str) for k in flat):
        # (load_tree hands on what torch.load read: a file holding a bare tensor reached the key
        # check below as torch's "Boolean value of Tensor ... is ambiguous")
        raise StateError(
            f"functe.tree_from_dict: 'flat' expected a dict of tensors by dotted key (tree_to_dict's output), "
            f"got {_what(flat)}"
        )
    keyed, spec = _keyed_leaves(like, "tree_from_dict")
    for key, leaf in keyed:  # (before the key check: such a key can never be in tree_to_dict's output)
        if leaf is not None and not isinstance(leaf, torch.Tensor):
            raise StateError(f"functe.tree_from_dict: template leaf {key!r} is {describe(leaf)}, not a tensor")
    wanted = {key for key, leaf in keyed if leaf is not None}
    missing, extra = sorted(wanted - set(flat)), sorted(set(flat) - wanted)  # (str keys: checked above)
    if missing or extra:
        # (both lists: a renamed leaf shows as one of each)
        parts = [f"{what} {_listed(keys)}" for what, keys in (("missing", missing), ("unexpected", extra)) if keys]
        raise StateError(f"functe.tree_from_dict: {'; '.join(parts)}")
    out = []
    for key, leaf in keyed:
        if leaf is None:
            out.append(None)
            continue
        value = flat[key]
        if not isinstance(value, torch.Tensor):
            raise StateError(f"functe.tree_from_dict: {key!r} expected {describe(leaf)}, got {describe(value)}")
        if value.shape != leaf.shape or value.dtype != leaf.dtype:
            raise StateError(
                f"functe.tree_from_dict: {key!r} expected {describe(leaf)} (as in the template), got {describe(value)}"
            )
        # (a template on the meta device describes shapes and dtypes only: the values stay where they are)
        out.append(_marked_like(value if leaf.device.type == "meta" else value.to(leaf.device), leaf))
    return optree.tree_unflatten(spec, out)


def _marked_like(value: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    """``value`` requiring grad where the template's leaf does, as a fresh leaf, and an
    ``nn.Parameter`` where the leaf is one. A checkpoint holds values only: loaded unmarked, a
    classic-route FP8 state's .grad stayed None after a resume (read as "not reached": its scale
    froze) and restored adapters got no gradient, both silently; and a frozen ``nn.Parameter``
    (the mark :func:`functe.value_and_grad` gives a ``None`` gradient) came back a plain tensor,
    so a LoRA base trained again after a resume."""
    if torch._C._functorch.is_functorch_wrapped_tensor(leaf) or value.is_inference():
        # (a transform's wrapper: requires_grad is the transform's business; a value read under
        # inference_mode, for serving: torch refuses to mark it outside)
        return value
    if value.requires_grad:
        return value  # (computed from trainable tensors, MAML-style: wrapping it would cut its graph)
    if isinstance(leaf, torch.nn.Parameter):
        return torch.nn.Parameter(value, requires_grad=leaf.requires_grad)
    if not leaf.requires_grad:
        return value
    return value.detach().requires_grad_()


def _what(flat: Any) -> str:
    if isinstance(flat, dict):
        odd = next(k for k in flat if not isinstance(k, str))
        return f"a dict with the key {odd!r} ({type(odd).__name__})"
    return describe(flat)


def _listed(keys: list[str], shown: int = 10) -> str:
    """``keys`` as a list, the first ``shown`` of them and a count of the rest."""
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return f"{keys[:shown]}{more}"


def save_tree(path: str | os.PathLike, tree: Any) -> None:
    """Save ``tree``'s tensors: safetensors for a ``.safetensors`` path, ``torch.save`` otherwise.

    Tied leaves (one tensor under two keys) load from a ``torch.save`` file as two leaves sharing
    storage, and from safetensors, which stores no shared memory, as two copies.

    Example:
        >>> import tempfile, os, torch, functe
        >>> with tempfile.TemporaryDirectory() as d:
        ...     functe.save_tree(os.path.join(d, "params.pt"), {"w": torch.ones(2)})
        ...     sorted(torch.load(os.path.join(d, "params.pt"), weights_only=True))
        ['w']
    """
    _check_file_path("save_tree", path, writing=True)
    flat = {k: v.detach().contiguous() for k, v in tree_to_dict(tree).items()}
    if str(path).endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file({k: v.clone() for k, v in flat.items()}, str(path))  # no shared storage allowed
    else:
        # (torch.save writes a view's whole storage: one row of a 1000x1000 tensor took 4 MB)
        torch.save({k: v.clone() if _shares_a_larger_storage(v) else v for k, v in flat.items()}, path)


def _check_file_path(op: str, path: Any, *, writing: bool = False) -> None:
    """Refuse a directory (torch's error was "[enforce fail at inline_container.cc]", safetensors'
    "No such device"), and when ``writing`` a path whose directory is missing (safetensors' error
    named a temporary file, ".tmpXYZ", in it; torch's named no function). A file object, which
    torch.save and torch.load take too, passes."""
    if not isinstance(path, (str, os.PathLike)):
        return
    if os.path.isdir(path):
        raise ArgumentError(f"functe.{op}: argument 'path' expected a file path, got the directory {os.fspath(path)!r}")
    if not writing:
        return
    parent = os.path.dirname(os.path.abspath(os.fspath(path)))
    if not os.path.isdir(parent):
        raise ArgumentError(
            f"functe.{op}: argument 'path' expected a file in an existing directory, got "
            f"{os.fspath(path)!r} ({parent!r} does not exist)"
        )


def _shares_a_larger_storage(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() > t.numel() * t.element_size()


def load_tree(path: str | os.PathLike, like: Any) -> Any:
    """Load what :func:`save_tree` wrote into the structure of ``like`` (exactly, bit for bit).

    Example:
        >>> import tempfile, os, torch, functe
        >>> state = functe.init_scaling_state(4)
        >>> with tempfile.TemporaryDirectory() as d:
        ...     functe.save_tree(os.path.join(d, "s.safetensors"), state)
        ...     back = functe.load_tree(os.path.join(d, "s.safetensors"), state)
        >>> torch.equal(back.amax_history, state.amax_history)
        True
    """
    _check_file_path("load_tree", path)
    if str(path).endswith(".safetensors"):
        from safetensors.torch import load_file

        flat = load_file(str(path))
    else:
        # (onto the CPU first: a GPU checkpoint loads on a CPU-only or a smaller machine, and
        # tree_from_dict puts every tensor on its template's device)
        flat = torch.load(path, weights_only=True, map_location="cpu")
    return tree_from_dict(like, flat)
