"""FP8 scaling state: per-role states, TE's scale updates as tensor ops, and state cotangents.

**Updates.** :func:`delayed_scaling_update` is TransformerEngine's delayed-scaling update
(``_amax_and_scale_update``) written with tensor ops only: no host synchronisation and no Python
branch on a tensor value, so it runs inside ``vmap``, ``torch.compile`` and CUDA graphs.
:func:`current_scale` is TE's ``compute_scale_from_amax`` for current scaling.

**State through the gradient** (flax's and TE-JAX's "overwrite with gradient"). An op that
owns scaling states returns their *next values* from its backward rule as the cotangents of the
state argument, so ``torch.func.grad`` hands them back with the parameter gradients. Three traps
(``../shared/reference/jax_and_torch_func.md`` B6) are closed by one encoding: after an update,
``amax_history[0]`` is always 0 (the slot cleared for the next amax), so a cotangent carries a
*use count* there, 1 per use.

* A state the graph never reached gets a zero cotangent: count 0, the old state is kept (so a
  state whose op did not run is not rolled, as TE PR #825 requires).
* A state used twice gets the sum of two cotangents: count 2, which is meaningless as a value and
  is rejected (:func:`state_from_gradient`); :func:`share_state` is the explicit fan-out whose
  backward combines the uses by max, as flax's ``fp32_max_grad`` does.
* The state must reach the op unchanged: any op in between applies the chain rule to the
  cotangent (a scaled count is rejected too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import optree
import torch

from ._backend import PLAIN_TENSOR_TYPES, has_values
from ._errors import StateError, as_int, check_device, check_flag, describe
from ._late_writes import watch_replaced, written_after_replacement
from ._recipe import ROLES, CurrentScaling, DelayedScaling, Recipe, check_recipe
from ._state import ScalingState, check_scaling_state, init_scaling_state
from ._tree import NAMESPACE, pytree_dataclass, tree_unflatten
from ._vjp import custom_vjp
from .kernels._fp8_cast import FLT_MAX
from .kernels._fp8_cast import current_scale as scale_for_amax

Tensor = torch.Tensor


@pytree_dataclass
class LinearScalingState:
    """The scaling states of a quantized linear: one :class:`ScalingState` per tensor role.

    Fields:
        input: state of ``x`` (E4M3 under HYBRID).
        weight: state of the weight (E4M3 under HYBRID).
        grad_output: state of ``dy`` (E5M2 under HYBRID), updated in the backward pass.

    Example:
        >>> import functe
        >>> s = functe.init_linear_scaling_state(functe.DelayedScaling(amax_history_len=4))
        >>> s.grad_output.amax_history.tolist()
        [0.0, 0.0, 0.0, 0.0]
    """

    input: ScalingState
    weight: ScalingState
    grad_output: ScalingState


def init_linear_scaling_state(recipe: Recipe, *, device: torch.device | str | None = None) -> LinearScalingState | None:
    """Fresh states of a quantized linear under ``recipe``; ``None`` for stateless recipes.

    Delayed scaling starts every role at scale 1 with an all-zero history of the recipe's
    ``amax_history_len`` (as TE does). Current scaling and MXFP8 keep no state.

    Example:
        >>> import functe
        >>> functe.init_linear_scaling_state(functe.CurrentScaling()) is None
        True
    """
    # (the class itself, a string or None would otherwise read as a stateless recipe)
    stateful = isinstance(check_recipe("init_linear_scaling_state", recipe), DelayedScaling)
    check_device("init_linear_scaling_state", "device", device)
    if not stateful:
        return None
    make = lambda: init_scaling_state(recipe.amax_history_len, device=device)
    return LinearScalingState(input=make(), weight=make(), grad_output=make())


def check_linear_state(op: str, state: object, recipe: Recipe) -> LinearScalingState | None:
    """Validate the state argument of a quantized linear against its recipe (metadata only)."""
    if not isinstance(recipe, DelayedScaling):
        if state is not None:
            raise StateError(
                f"functe.{op}: argument 'state' expected None ({type(recipe).__name__} is stateless), "
                f"got {type(state).__name__}"
            )
        return None
    if not isinstance(state, LinearScalingState):
        raise StateError(
            f"functe.{op}: argument 'state' expected a LinearScalingState (functe.init_linear_scaling_state(recipe)), "
            f"got {type(state).__name__}"
        )
    for role in ("input", "weight", "grad_output"):
        check_delayed_state(op, f"state.{role}", getattr(state, role), recipe)
    return state


def check_delayed_state(op: str, arg: str, state: object, recipe: DelayedScaling) -> None:
    """A :class:`ScalingState` (fp32, 0-d scale, 1-d history) whose history is the recipe's length."""
    check_scaling_state(op, arg, state)
    if state.amax_history.shape[-1] != recipe.amax_history_len:
        raise StateError(
            f"functe.{op}: argument '{arg}.amax_history' expected f32[{recipe.amax_history_len}] "
            f"(the recipe's amax_history_len), got {describe(state.amax_history)}"
        )


# ----------------------------------------------------------------------------- scale updates


def _record(history: Tensor, amax: Tensor) -> Tensor:
    """The history with ``amax`` written into slot 0 (what TE's cast does through its pointer)."""
    return torch.cat([amax.reshape(1).to(torch.float32), history[1:]])


def _roll_and_clear(history: Tensor) -> Tensor:
    """``torch.roll(h, -1)`` then ``h[0] = 0``: the newest amax moves to the end, slot 0 is free."""
    if history.shape[-1] == 1:
        return torch.zeros_like(history)
    # (roll, then zeros in slot 0 batched alike: under a vmap over 0 members torch 2.13 fails to cat an
    # unbatched zeros or an empty history[2:])
    rolled = history.roll(-1, -1)
    return torch.cat([torch.zeros_like(rolled[..., :1]), rolled[..., 1:]], -1)


def _check_amax(op: str, amax: object, like: Tensor | None = None) -> None:
    """``amax`` is one float value (``f32[]`` or ``[1]``), on ``like``'s device when given."""
    if not isinstance(amax, Tensor) or not amax.is_floating_point() or amax.numel() != 1 or amax.dim() > 1:
        raise StateError(
            f"functe.{op}: argument 'amax' expected a float tensor of one value (f32[]), got {describe(amax)}"
        )
    if like is not None and amax.device != like.device:
        raise StateError(f"functe.{op}: argument 'amax' is on {amax.device}, the state on {like.device}")


def _check_role(op: str, role: object) -> None:
    if role not in ROLES:
        raise StateError(f"functe.{op}: argument 'role' expected one of {ROLES}, got {role!r}")


def delayed_scaling_update(state: ScalingState, amax: Tensor, *, recipe: DelayedScaling, role: str) -> ScalingState:
    """Record ``amax`` (of a tensor just cast with ``state.scale``) and update the state, exactly as TE.

    1. ``history[0] = amax``; the window amax is ``max(history)`` (``"max"``) or ``history[0]``
       (``"most_recent"``);
    2. the history rolls by -1 and slot 0 is cleared;
    3. ``scale = (fp8_max / amax) / 2**margin``, keeping the old scale unless the amax is positive
       and finite (0, inf, NaN, or a negative value), and FLT_MAX instead of an infinite scale.

    Example:
        >>> import torch, functe
        >>> recipe = functe.DelayedScaling(margin=2, amax_history_len=4)
        >>> s = functe.init_scaling_state(4)
        >>> s = functe.delayed_scaling_update(s, torch.tensor(7.0), recipe=recipe, role="input")
        >>> s.scale.item(), s.amax_history.tolist()  # (448 / 7) / 4
        (16.0, [0.0, 0.0, 0.0, 7.0])
    """
    op = "delayed_scaling_update"
    if not isinstance(recipe, DelayedScaling):
        raise StateError(f"functe.{op}: argument 'recipe' expected a DelayedScaling, got {recipe!r}")
    _check_role(op, role)
    check_delayed_state(op, "state", state, recipe)
    _check_amax(op, amax, state.amax_history)
    return update_state(state, amax, recipe=recipe, role=role)


def update_state(state: ScalingState, amax: Tensor, *, recipe: DelayedScaling, role: str) -> ScalingState:
    """:func:`delayed_scaling_update` without its argument checks (the ops' own calls, on values
    they validated)."""
    history = _record(state.amax_history, amax)
    window = history.amax(-1) if recipe.amax_compute_algo == "max" else history[0]
    # torch.full_like(...) / window, not fp8_max / window: a Python number divided by a tensor is
    # computed as reciprocal(window) * fp8_max, one rounding too many for TE's exact formula.
    scale = torch.full_like(window, recipe.max(role)) / window
    if recipe.margin:  # (x / 1.0 is x; and tensor / number fails under torch 2.13's vmap over 0 members)
        scale = scale / torch.full_like(scale, 2.0**recipe.margin)
    # (TE's amax > 0 test: a negative amax, only a caller's mistake, keeps the scale as 0 and NaN do)
    keep = ~((window > 0) & torch.isfinite(window))
    scale = torch.where(keep, state.scale, scale)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FLT_MAX), scale)
    return ScalingState(scale=scale, amax_history=_roll_and_clear(history))


def current_scale(amax: Tensor, *, recipe: CurrentScaling, role: str) -> Tensor:
    """TE's current-scaling scale from a tensor's amax (f32[], computed on the device).

    ``fp8_max / max(amax, amax_epsilon)``; 1 when that amax is 0, inf or NaN; FLT_MAX instead of
    inf; with ``power_2_scales`` the scale is rounded down to a power of two.

    Example:
        >>> import torch, functe
        >>> current_scale(torch.tensor(3.0), recipe=functe.CurrentScaling(power_2_scales=True), role="input").item()
        128.0
    """
    if not isinstance(recipe, CurrentScaling):
        raise StateError(f"functe.current_scale: argument 'recipe' expected a CurrentScaling, got {recipe!r}")
    _check_amax("current_scale", amax)
    _check_role("current_scale", role)
    return recipe_scale(amax.reshape(()), recipe=recipe, role=role)  # (f32[], also for an amax of shape [1])


def recipe_scale(amax: Tensor, *, recipe: Recipe, role: str) -> Tensor:
    """:func:`current_scale` for any recipe with ``amax_epsilon`` and ``power_2_scales`` (current
    scaling, FP8 blocks), without argument checks."""
    return scale_for_amax(amax, recipe.max(role), recipe.amax_epsilon, recipe.power_2_scales)


# ----------------------------------------------------------------------------- cotangent protocol


def as_cotangent(new: ScalingState, uses: Tensor | float = 1.0) -> ScalingState:
    """The cotangent that carries ``new`` back to the caller: its history with the use count in slot 0."""
    history = new.amax_history
    return ScalingState(scale=new.scale, amax_history=torch.cat([use_count(uses, history), history[1:]]))


def use_count(uses: Tensor | float, like: Tensor) -> Tensor:
    """``uses`` as an f32[1] on ``like``'s device; a Python number is made there (``torch.as_tensor``
    of one builds a host tensor and copies it: a synchronisation with the GPU, refused by CUDA graphs)."""
    if isinstance(uses, Tensor):
        return uses.to(device=like.device, dtype=torch.float32).reshape(1)
    return torch.full((1,), float(uses), dtype=torch.float32, device=like.device)


def _complete_cotangent(old: ScalingState, ct: ScalingState) -> ScalingState:
    """``ct`` with a missing half filled in: a cut history reads as count 0, a missing scale as 0
    (what :func:`_next_state` then judges)."""
    if ct.amax_history is None:
        # (the classic route's .grad of a history leaf cut off, `amax_history.detach()`, beside its
        # scale's: read as count 0, which beside a new scale is a cut below; it was "not reached",
        # and the state froze silently)
        ct = ScalingState(scale=ct.scale, amax_history=torch.zeros_like(old.amax_history))
    if ct.scale is None:
        # (a used state whose scale cotangent is missing had its scale leaf cut off on the way)
        ct = ScalingState(scale=torch.zeros_like(old.scale), amax_history=ct.amax_history)
    return ct


def _next_state(old: ScalingState, ct: ScalingState) -> tuple[ScalingState, Tensor]:
    """(next state, use count) from one state and its complete cotangent (:func:`_complete_cotangent`),
    without host synchronisation; elementwise, so also of a stack of states and their cotangents."""
    uses = ct.amax_history[..., 0]
    # A used state whose scale cotangent is 0 had its scale leaf cut off on the way (``scale.detach()``,
    # a replaced scale): a new scale is never 0, so this counts as a bad use. Likewise a count of 0
    # with a new scale: the history leaf was cut (see _leaf_cut).
    uses = torch.where(_leaf_cut(uses, ct.scale), torch.full_like(uses, -1.0), uses)
    history = torch.cat([torch.zeros_like(ct.amax_history[..., :1]), ct.amax_history[..., 1:]], -1)
    keep, take = uses == 0, uses == 1
    nan = torch.full_like(ct.scale, float("nan"))
    # A count other than 0 or 1 poisons the state with NaN (loud at the next step) when the check is off.
    scale = torch.where(keep, old.scale, torch.where(take, ct.scale, nan))
    keep_h, take_h = keep[..., None], take[..., None]
    history = torch.where(
        keep_h, old.amax_history, torch.where(take_h, history, torch.full_like(history, float("nan")))
    )
    return ScalingState(scale=scale, amax_history=history), uses


def _next_states(olds: list[ScalingState], cts: list[ScalingState]) -> tuple[list, list[Tensor], list[int]]:
    """:func:`_next_state` of each pair, states of one shape, dtype and device updated as one stack:
    the next states, their use counts (flat tensors) and, per count element, its state's index.

    The update is ~15 tensor ops a state: a deep FP8 model's 192 states took 14.1 ms of CPU a step
    one by one (and ~3,000 kernel launches on a GPU), where TransformerEngine updates all its
    states in one fused kernel. Stacked, a group costs those ~15 ops once, plus a copy out of the
    stack so that each next state owns its storage (a view into one buffer would make saving one
    state write them all, and safetensors refuses shared storage). The ops are elementwise: the
    stacked results are the per-state results bit for bit. (States of torch.func wrappers or tensor
    subclasses, and a compiled caller's, take the per-state path.)
    """
    news: list = [None] * len(olds)
    counts: list[Tensor] = []
    owners: list[int] = []
    groups: dict[tuple, list[int]] = {}
    for k, (old, ct) in enumerate(zip(olds, cts)):
        key = _stack_key(old, ct)
        if key is not None:
            groups.setdefault(key, []).append(k)
            continue
        news[k], uses = _next_state(old, ct)
        counts.append(uses.reshape(uses.numel()))  # (not -1: ambiguous for an empty vmapped batch)
        owners += [k] * uses.numel()
    for members in groups.values():
        stacked = [
            ScalingState(*(torch.stack([getattr(x[k], f) for k in members]) for f in ("scale", "amax_history")))
            for x in (olds, cts)
        ]
        new, uses = _next_state(*stacked)
        for k, scale, history in zip(members, _unstacked(new.scale), _unstacked(new.amax_history)):
            news[k] = ScalingState(scale=scale, amax_history=history)
        counts.append(uses.reshape(uses.numel()))
        owners += [k for k in members for _ in range(uses[0].numel())]
    return news, counts, owners


def _stack_key(old: ScalingState, ct: ScalingState) -> tuple | None:
    """What states must share to be updated in one stack, or ``None`` for the per-state path."""
    tensors = (old.scale, old.amax_history, ct.scale, ct.amax_history)
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    if torch.compiler.is_compiling() or any(type(t) not in PLAIN_TENSOR_TYPES or wrapped(t) for t in tensors):
        return None
    if old.scale.shape != old.amax_history.shape[:-1]:
        # (a scale of another shape, TE's [1] beside a 1-d history: the update broadcasts it against
        # the count, which stacked would mix the states; one at a time it is each state's own)
        return None
    return tuple((t.shape, t.dtype, t.device) for t in tensors)


def _unstacked(t: Tensor) -> list[Tensor]:
    """The slices of ``t`` along dim 0 as tensors of their own storage (one multi-tensor copy)."""
    views = t.detach().unbind(0)
    out = [torch.empty_like(v) for v in views]  # (allocations only: no kernel launch)
    torch._foreach_copy_(out, views)
    return out


def _leaf_cut(uses: Tensor, scale_ct: Tensor) -> Tensor:
    """Where a use had a leaf cut on its way: a count of 1 beside a zero scale cotangent (the scale
    cut: a new scale is never 0), or 0 beside a new scale (the history cut, ``amax_history.detach()``,
    a replaced history, while the op ran)."""
    return ((uses == 1) & (scale_ct == 0)) | ((uses == 0) & (scale_ct != 0))


def hides_tensors(x: Any, depth: int = 3, *, wrapped_only: bool = False) -> bool:
    """Whether a pytree leaf (an object functe cannot flatten) holds tensors or scaling states in its
    fields, items or attributes: they would never take part in a gradient (a recipe, a number or a
    string holds none). ``wrapped_only``: only ``torch.func`` wrappers count."""
    if isinstance(x, torch.Tensor):
        return not wrapped_only or torch._C._functorch.is_functorch_wrapped_tensor(x)
    if isinstance(x, ScalingState):
        return not wrapped_only
    if depth == 0 or x is None or isinstance(x, (int, float, str, bytes, bool, type)):
        return False
    if isinstance(x, dict):
        children = list(x.values())
    elif isinstance(x, (list, tuple, set, frozenset)):
        children = list(x)
    elif dataclasses.is_dataclass(x):
        children = [getattr(x, f.name, None) for f in dataclasses.fields(x)]
    else:
        children = list(getattr(x, "__dict__", {}).values())
    return any(hides_tensors(c, depth - 1, wrapped_only=wrapped_only) for c in children)


def _is_state(x: Any) -> bool:
    return isinstance(x, ScalingState)


def flatten_states(tree: Any):
    """Flatten a pytree down to its :class:`ScalingState` s (and other leaves); ``None`` is a leaf."""
    return optree.tree_flatten(tree, is_leaf=_is_state, none_is_leaf=True, namespace=NAMESPACE)


def loose_tensor(state: Any) -> tuple[str, Tensor] | None:
    """The key and value of the first tensor of ``state`` that is not inside a :class:`ScalingState`
    (a state pytree holds scaling states and ``None`` only), or ``None``."""
    leaves, spec = flatten_states(state)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            return _keystr(spec.paths()[i]), leaf  # (paths only then: ~30 us at 192 states)
    return None


def state_from_gradient(state: Any, grad: Any, *, check: bool = True) -> Any:
    """The next value of a state pytree from its "gradient" (the cotangents returned by the ops).

    For each :class:`ScalingState` in ``state``: a use count of 0 (the graph never reached it)
    keeps the old state, 1 takes the new value. A count other than 0 or 1 means the state was used
    twice (the cotangents were summed) or passed through an op before reaching its op (the chain
    rule scaled it): ``check=True`` raises :class:`functe.StateError` naming the state (one host
    synchronisation per call, skipped inside ``torch.func`` transforms); without the check the
    state becomes NaN, which the next step makes visible. The next state holds no autograd history:
    its tensors are fresh leaves, which require grad where the old state's did (the classic route).

    Example:
        >>> import torch, functe
        >>> old = functe.init_scaling_state(2)
        >>> untouched = functe.ScalingState(torch.zeros(()), torch.zeros(2))  # what grad gives
        >>> functe.state_from_gradient({"fc1": old}, {"fc1": untouched})["fc1"].scale.item()
        1.0
    """
    check = check_flag("state_from_gradient", "check", check)  # (bool("no") is True)
    old_leaves, spec = flatten_states(state)
    grad_leaves = _match(spec, grad)
    paths = spec.paths()
    new_leaves = list(old_leaves)
    states: list[int] = []  # positions of the scaling states
    used: list[int] = []  # of those, the ones whose cotangent carries an update
    for i, (old, ct) in enumerate(zip(old_leaves, grad_leaves)):
        if isinstance(old, torch.Tensor):
            raise StateError(
                f"functe.state_from_gradient: the state pytree holds a tensor {describe(old)} outside a "
                f"ScalingState at {_keystr(paths[i])}"
            )
        if not _is_state(old):
            if hides_tensors(old):
                raise StateError(
                    f"functe.state_from_gradient: the state pytree holds a {type(old).__name__} at "
                    f"{_keystr(paths[i])}, which functe cannot flatten (its states would never update): use dicts, "
                    "lists and tuples, or register the class with functe.pytree_dataclass"
                )
            continue
        states.append(i)
        _check_cotangent(old, ct, paths[i])
        if check and not torch.compiler.is_compiling():  # (no hooks are registered under compile)
            _check_no_late_write(old, paths[i])
        if ct is not None and (ct.amax_history is not None or ct.scale is not None):
            used.append(i)
    cotangents = [_complete_cotangent(old_leaves[i], grad_leaves[i]) for i in used]
    news, counts, owners = _next_states([old_leaves[i] for i in used], cotangents)
    for i, new in zip(used, news):
        new_leaves[i] = new
    for i in states:  # (untouched states too: fresh leaves, see _next_leaf)
        old, new = old_leaves[i], new_leaves[i]
        next_scale, next_history = _next_leaf(new.scale, old.scale), _next_leaf(new.amax_history, old.amax_history)
        new_leaves[i] = ScalingState(next_scale, next_history)
    if check and counts and not any(torch._C._functorch.is_functorch_wrapped_tensor(c) for c in counts):
        _check_counts(counts, owners, lambda k: _keystr(paths[used[k]]))
    return tree_unflatten(spec, new_leaves)


def _next_leaf(new: Tensor, old: Tensor) -> Tensor:
    """A next state's tensor with no autograd history, a leaf that requires grad where the old one did.

    A state is never differentiated, only updated from its cotangent: kept attached, the next state
    chained every step's graph to the last (``value_and_grad`` over trainable parameters kept them
    all alive), and on the classic route, whose state leaves require grad so that ``.grad`` carries
    the update, the next state was no leaf: its ``.grad`` stayed ``None`` (read as "not used", the
    state froze) and the next backward ran into the previous step's freed graph.
    """
    leaf = new.detach()
    if not old.requires_grad:
        return leaf
    # (a transform's wrapper, the old state's or a vmapped cotangent's: requires_grad is the
    # transform's business, mark the leaves outside it; Dynamo cannot ask)
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    if not torch.compiler.is_compiling() and (wrapped(old) or wrapped(leaf)):
        return leaf
    leaf.requires_grad_()
    watch_replaced(old, leaf)
    return leaf


def _check_no_late_write(state: ScalingState, path: tuple) -> None:
    if written_after_replacement(state.scale) or written_after_replacement(state.amax_history):
        raise StateError(
            f"functe.state_from_gradient: a backward pass wrote into the old leaves of {_keystr(path)} after "
            "state_from_gradient had already replaced them by this state (forwards interleaved over one state, "
            "as in a pipeline's 1F1B schedule): that use's amaxes would be lost. Give each micro-batch in flight "
            "its own copy of the state (functe.tree_map(lambda t: t.detach().clone().requires_grad_(), state)) "
            "and update once, after their backwards: state_from_gradient(state, "
            "functe.combine_state_gradients([each copy's gradient]))"
        )


def _match(spec, grad: Any) -> list:
    # The structures must be equal, not only their sizes: {"fc1", "fc2"} against {"fc2", "fc9"} would
    # pair fc1's state with fc2's update.
    leaves, grad_spec = flatten_states(grad)
    if grad_spec != spec:
        raise StateError(f"functe.state_from_gradient: the gradient's structure {grad_spec} does not match {spec}")
    return leaves


def _check_cotangent(old: ScalingState, ct: Any, path: tuple) -> None:
    """A state's cotangent is ``None`` or a :class:`ScalingState` of the state's shapes and dtype."""
    if ct is None:
        return
    if not _is_state(ct):
        raise StateError(
            f"functe.state_from_gradient: the gradient at {_keystr(path)} expected a ScalingState, got {describe(ct)}"
        )
    for name in ("scale", "amax_history"):
        value, like = getattr(ct, name), getattr(old, name)
        if value is not None and (
            not isinstance(value, torch.Tensor) or value.shape != like.shape or value.dtype != like.dtype
        ):
            raise StateError(
                f"functe.state_from_gradient: the gradient at {_keystr(path)}.{name} expected {describe(like)} "
                f"(the state's), got {describe(value)}"
            )


def _keystr(path: tuple) -> str:
    return "state" + "".join(f".{k}" if isinstance(k, str) and k.isidentifier() else f"[{k!r}]" for k in path)


def _check_counts(counts: list[Tensor], owners: list[int], name: Callable[[int], str]) -> None:
    """Refuse use counts other than 0 and 1; ``owners[j]``: the state of element ``j`` of the counts."""
    readable = [has_values(c) for c in counts]  # (meta counts are shapes only: nothing to read)
    if all(readable) and len({c.device for c in counts}) == 1:
        flat = torch.cat(counts)
        bad = ((flat != 0) & (flat != 1)).tolist()  # the one host synchronisation
    else:  # (states spread over devices, a pipeline's stages in one process: one read per tensor)
        bad = [
            b for c, r in zip(counts, readable) for b in (((c != 0) & (c != 1)).tolist() if r else [False] * c.numel())
        ]
    if any(bad):
        culprits = [name(k) for k in sorted({owners[j] for j, b in enumerate(bad) if b})]
        raise StateError(
            f"functe.state_from_gradient: the scaling state at {', '.join(culprits)} was used more than once in one "
            "step (its cotangents were summed), or reached its op through another op or with a leaf cut off "
            "(scale.detach(), amax_history.detach()), or its leaves' .grad accumulated over several backward "
            "calls (gradient accumulation, retain_graph: call state_from_gradient after each backward and run "
            "the next micro-batch with the state it returns, or give each micro-batch its own copy of the state "
            "and combine their gradients with functe.combine_state_gradients), or 'grad' is a state rather than "
            "the ops' cotangents (functe.value_and_grad returns the next state itself). Give each quantized op its "
            "own state, or fan one state out explicitly with functe.share_state(state, n, recipe=...), "
            "which combines the uses by max (under vmap: stack the n shares and batch them)."
        )


# ----------------------------------------------------------------------------- explicit fan-out


_ROLES = ("input", "weight", "grad_output")


def _combine(old: ScalingState, cts: list[ScalingState | None], recipe: DelayedScaling, role: str) -> ScalingState:
    """One cotangent for a state used by several copies: the update with the max of their amaxes."""
    used = [ct for ct in cts if ct is not None and ct.amax_history is not None]
    if not used:  # (a zero cotangent: count 0 beside a new scale would read as a cut history)
        return ScalingState(scale=torch.zeros_like(old.scale), amax_history=torch.zeros_like(old.amax_history))
    counts = torch.stack([ct.amax_history[..., 0] for ct in used])
    # Each used copy's history ends with the amax it recorded (slot -1 after the roll).
    amaxes = torch.stack([ct.amax_history[..., -1] for ct in used])
    amaxes = torch.where(counts > 0, amaxes, torch.zeros_like(amaxes))
    new = update_state(old, amaxes.amax(0), recipe=recipe, role=role)
    # Each copy's count is 0 or 1; any other (a copy used twice, or one that passed through an op,
    # 0.5 for a state scaled by 0.5) marks the shared state badly used (-1, which the check reports).
    bad = ((counts != 0) & (counts != 1)).any(0)
    uses = torch.where(bad, torch.full_like(counts[0], -1.0), (counts.amax(0) > 0).to(torch.float32))
    combined = as_cotangent(new, 0.0)
    history = torch.cat([uses.reshape(1), combined.amax_history[1:]])
    # (no copy ran its op: the scale cotangent is 0 too, as for a state never reached)
    scale = torch.where(uses == 0, torch.zeros_like(combined.scale), combined.scale)
    return ScalingState(scale=scale, amax_history=history)


def _share_fwd(state, *, n, recipe):
    return tuple(state for _ in range(n)), state


def _share_bwd(state, cts, *, n, recipe):
    roles = {
        role: _combine(getattr(state, role), [None if ct is None else getattr(ct, role) for ct in cts], recipe, role)
        for role in _ROLES
    }
    return (LinearScalingState(**roles),)


_share_state = custom_vjp("share_state", _share_fwd, _share_bwd, symbolic_zeros=True)


def share_state(state: LinearScalingState, n: int, *, recipe: DelayedScaling) -> tuple[LinearScalingState, ...]:
    """``n`` copies of one quantized linear's state, for ``n`` uses of it in one step.

    The next state is what one use would give with the *largest* amax of all uses (flax's
    ``fp32_max_grad``; TE's max-reduction of amaxes): the histories combine by max and the scale is
    recomputed from them. Uses whose op did not run are ignored; if none ran, the state is kept.
    Needs ``amax_history_len >= 2`` (the recorded amax travels in the history's last slot).

    Example:
        >>> import torch, functe
        >>> recipe = functe.DelayedScaling(amax_history_len=4)
        >>> a, b = functe.share_state(functe.init_linear_scaling_state(recipe), 2, recipe=recipe)
        >>> torch.equal(a.input.scale, b.input.scale)
        True
    """
    if not isinstance(recipe, DelayedScaling):
        raise StateError(f"functe.share_state: only DelayedScaling keeps state, got recipe {recipe!r}")
    check_linear_state("share_state", state, recipe)
    uses = as_int(n)
    if uses is None or uses < 1:
        raise StateError(f"functe.share_state: n must be an int >= 1, got {n!r}")
    n = uses
    if recipe.amax_history_len < 2:
        raise StateError(
            "functe.share_state: needs amax_history_len >= 2 (the recorded amax of each use travels in the "
            f"history), got {recipe.amax_history_len}"
        )
    return _share_state(state, n=n, recipe=recipe)


def combine_state_gradients(grads: Any) -> Any:
    """One gradient for a state pytree from the gradients of its uses in separate backward passes.

    :func:`share_state` combines the uses of one state inside one backward pass. When the uses run
    in separate passes (a pipeline's 1F1B schedule, micro-batches whose forwards run before the
    previous backward, or per-micro-batch ``torch.func.grad`` calls), give each use its own copy of
    the state, collect each copy's gradient, and combine them here: each :class:`ScalingState`
    takes the update of the use with the largest amax (flax's ``fp32_max_grad``, as
    :func:`share_state`), uses that did not reach the state are ignored, and a use counted other
    than once is reported by :func:`state_from_gradient`. Needs ``amax_history_len >= 2`` (each
    use's amax travels in its history's last slot).

    Example:
        >>> import torch, functe
        >>> recipe = functe.DelayedScaling(amax_history_len=4)
        >>> state, w = functe.init_linear_scaling_state(recipe), torch.randn(8, 16)
        >>> loss = lambda s, x: functe.ops.fp8_linear(x, w, None, s, recipe=recipe).sum()
        >>> g1 = torch.func.grad(loss)(state, torch.ones(4, 16))
        >>> g2 = torch.func.grad(loss)(state, torch.full((4, 16), 3.0))
        >>> nxt = functe.state_from_gradient(state, functe.combine_state_gradients([g1, g2]))
        >>> nxt.input.amax_history.tolist()
        [0.0, 0.0, 0.0, 3.0]
    """
    if not isinstance(grads, (list, tuple)) or not grads:
        raise StateError(
            f"functe.combine_state_gradients: grads expected a non-empty list of gradients, got {describe(grads)}"
        )
    flat, spec = flatten_states(grads[0])
    columns = [flat]
    for i, grad in enumerate(grads[1:], 1):
        leaves, other = flatten_states(grad)
        if other != spec:
            raise StateError(
                f"functe.combine_state_gradients: grads[{i}]'s structure {other} does not match grads[0]'s {spec}"
            )
        columns.append(leaves)
    combined = []
    for path, cts in zip(spec.paths(), zip(*columns)):
        combined.append(_max_use(list(cts), _keystr(path)) if any(map(_is_state, cts)) else cts[0])
    return tree_unflatten(spec, combined)


def _max_use(cts: list, where: str) -> ScalingState:
    """The cotangent of the use with the largest recorded amax; its count 0 or 1, or -1 for a bad use."""
    first: dict[str, Tensor] = {}
    for i, ct in enumerate(cts):
        if ct is not None and not _is_state(ct):
            raise StateError(
                f"functe.combine_state_gradients: grads[{i}] at {where} expected a ScalingState, got {describe(ct)}"
            )
        for name in ("scale", "amax_history"):
            value = None if ct is None else getattr(ct, name)
            if value is None:
                continue  # (the classic route's .grad of a leaf the backward never reached)
            like = first.setdefault(name, value)
            if not isinstance(value, Tensor) or value.dtype != torch.float32 or value.shape != like.shape:
                raise StateError(
                    f"functe.combine_state_gradients: grads[{i}] at {where}.{name} expected "
                    f"{describe(like) if value is not like else 'a float32 tensor'}, got {describe(value)}"
                )
    history_like = first.get("amax_history")
    if history_like is None:
        # No use recorded an amax: nothing to choose between (a scale beside no history is a cut
        # history, which state_from_gradient reports).
        return next(ct for ct in cts if _is_state(ct))
    if history_like.dim() == 0 or history_like.shape[-1] < 2:
        raise StateError(
            f"functe.combine_state_gradients: needs amax_history_len >= 2 (each use's amax travels in its "
            f"history's last slot), got {where}.amax_history {describe(history_like)}"
        )

    def field(ct, name: str, missing: Tensor) -> Tensor:
        value = None if ct is None else getattr(ct, name)
        return missing if value is None else value

    missing_history = torch.zeros_like(history_like)
    missing_scale = history_like.new_zeros(history_like.shape[:-1])
    histories = torch.stack([field(ct, "amax_history", missing_history) for ct in cts])
    scales = torch.stack([field(ct, "scale", missing_scale) for ct in cts])
    counts, amaxes = histories[..., 0], histories[..., -1]
    # As state_from_gradient reads one use: a count other than 0 or 1, or a cut leaf (a count of 1
    # beside a zero scale, 0 beside a new one), is a bad use, and one bad use spoils the state.
    bad = (((counts != 0) & (counts != 1)) | _leaf_cut(counts, scales)).any(0)
    # The largest amax among the uses that ran (a NaN amax wins, as the max of the amaxes would be).
    pick = torch.where(counts == 1, amaxes, torch.full_like(amaxes, float("-inf"))).argmax(0)
    history = torch.take_along_dim(histories, pick[None, ..., None], 0)[0]
    scale = torch.take_along_dim(scales, pick[None], 0)[0]
    uses = torch.where(bad, torch.full_like(counts[0], -1.0), counts.amax(0))
    return ScalingState(scale=scale, amax_history=torch.cat([uses[..., None], history[..., 1:]], -1))
