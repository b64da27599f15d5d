"""``functe.rules.check``: a rule's fused program against the unfused one, on random inputs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from .._codegen import RULE_HINT
from .._errors import ArgumentError, RuleError, describe
from .._fuse import _check_fuse_recipe, fuse
from .._tree import leaf_paths, tree_flatten, tree_unflatten
from ..testing import assert_close
from ._pattern import Pattern, Rule, RuleSet, near_misses

Tensor = torch.Tensor


def _pattern_program(pattern: Pattern, static: dict[str, dict[str, Any]]) -> Callable:
    """The unfused program a pattern describes: its nodes called on its captures.

    The program takes the captures as keyword arguments and returns the
    outputs of pattern nodes that no other node consumes (a fork's other
    branch included), so the match has a single root and no dead ends.
    """

    def program(**captures):
        outs: list[Tensor] = []

        def call(node: Pattern, wanted: int | None):
            if node.variadic:
                raise ArgumentError(f"functe.rules.check: the pattern {node!r} ends in '...'; pass the program as fn=")
            args = []
            for i in node.inputs:
                if isinstance(i, Pattern):
                    args.append(call(i, i.out))
                elif i is None:
                    args.append(None)
                elif i not in captures:  # (a bare KeyError before; '_', the wildcard, is a key too)
                    raise ArgumentError(
                        f"functe.rules.check: the pattern {node!r} takes {i!r}, which example_args does not "
                        f"give (got {sorted(captures)}): add it, or pass the program as fn="
                    )
                else:
                    args.append(captures[i])
            result = node.op[0](*args, **static.get(node.name, {}))
            results = result if isinstance(result, tuple) else (result,)
            k = 0 if wanted is None else wanted
            outs.extend(r for j, r in enumerate(results) if j != k)
            return results[k]

        root = call(pattern, 0)
        return (root, *outs)

    return program


def check(
    rule: Rule,
    example_args: Any,
    *,
    fn: Callable | None = None,
    static: dict[str, dict[str, Any]] | None = None,
    recipe: Any = None,
    seed: int = 0,
) -> None:
    """Check that ``rule`` fires and that the fused program equals the unfused one.

    The program is ``fn`` if given (called as ``fn(*example_args)``), else the
    rule's own pattern: its nodes applied to the captures, which
    ``example_args`` (a dict ``capture -> tensor or None``) provides;
    ``static`` gives static arguments per named pattern node (e.g.
    ``{"scale": {"scale": 2.0}}``). Tensors in ``example_args`` only set
    shapes, dtypes and devices: the values are redrawn from a normal
    distribution (uniform [0, 1) for 16-bit dtypes, as TransformerEngine's
    tests draw them, so that rounding of intermediates cannot be amplified
    by cancellation).

    Asserts: the rule fires (else the declined reasons are reported); the
    fused outputs and the gradients of every floating-point input, computed
    in the inputs' dtype, match the unfused program evaluated in float64 on
    the same (rounded) inputs within :mod:`functe.testing`'s tolerance, also
    with each input frozen in turn (the fused op's ``needs_input_grad`` and
    ``prune_residuals`` paths: the other gradients must not change) (for
    float32 the float16 entry, TransformerEngine's convention for GEMM
    results; ``atol`` scaled to each tensor's largest value, since normal
    inputs make gradients sums of terms that can cancel); and, where the rule also fires in float64, fused and unfused
    agree within the float64 tolerance. A quantized program (an equation with a ``recipe``:
    ``fp8_linear``, a block-scaled linear) has no float64 version (the FP8 casts take
    fp32/fp16/bf16): its reference is the unfused program on the same inputs and cotangents, in
    their dtype, under the same tolerance (functe's own FP8 rules equal it bit for bit).

    Example:
        >>> import torch
        >>> from functe.rules import check
        >>> from functe.rules.core import FORWARD_LINEAR_BIAS_ADD
        >>> check(FORWARD_LINEAR_BIAS_ADD, {"x": torch.ones(4, 8), "w": torch.ones(6, 8),
        ...                                 "b": torch.ones(6), "r": torch.ones(4, 6)})
    """
    if not isinstance(rule, Rule):
        raise ArgumentError(f"functe.rules.check: argument 'rule' expected a functe.rules.Rule, got {describe(rule)}")
    _check_fuse_recipe("rules.check", recipe)
    if fn is None:
        if not isinstance(example_args, dict):
            raise ArgumentError(
                "functe.rules.check: without fn, example_args must map the pattern's captures to values"
            )
        program, call = _pattern_program(rule.pattern, static or {}), (lambda f, a: f(**a))
    else:
        if not isinstance(example_args, (tuple, list)):
            # (a dict was unpacked as fn(*dict): the op received the capture names as its arguments)
            raise ArgumentError(
                "functe.rules.check: with fn, example_args must be a tuple or list of fn's positional arguments "
                f"(called as fn(*example_args)), got {describe(example_args)}"
            )
        program, call = fn, (lambda f, a: f(*a))
    gen = torch.Generator().manual_seed(seed)
    args = _redraw(example_args, gen)
    fused = fuse(program, rules=RuleSet([rule]), recipe=recipe)
    plan = fused.plan(*args) if fn is not None else fused.plan(**args)
    stats = plan.stats[rule.phase]
    if not stats.fired.get(rule.name):
        reasons = "; ".join(f"{where}: {why}" for name, where, why in stats.declined if name == rule.name)
        if reasons:
            raise AssertionError(f"rule {rule.name} did not fire (declined: {reasons})")
        misses = "; ".join(near_misses(rule.pattern, plan.program))
        raise AssertionError(
            f"rule {rule.name} did not fire" + (f": its pattern does not match ({misses})" if misses else "")
        )
    with _naming(rule):
        got = _outputs_and_grads(fused, call, args, gen)
    unfused = fuse(program, rules=RuleSet(), recipe=recipe)
    quantized = any("recipe" in eqn.params for eqn in plan.traced.eqns)
    if quantized:  # (fp8_linear refused the float64 reference: "expected dtype f32|f16|bf16, got f64")
        expected = _outputs_and_grads(unfused, call, args, gen, cts=got[2])
        _compare(got, expected, rule.name, "fused vs unfused, quantized, in the inputs' dtype")
    else:
        wide = _map(args, lambda t: t.detach().to(torch.float64) if t.is_floating_point() else t)
        cts64 = [c.to(torch.float64) for c in got[2]]  # the reference reuses the rounded cotangents
        expected = _outputs_and_grads(unfused, call, wide, gen, cts=cts64)
        _compare(got, expected, rule.name, "fused vs unfused float64")
    # Each input frozen in turn: the fused op's needs_input_grad and prune_residuals paths (a
    # rule whose backward reads a residual its pruning dropped, or returns a wrong partial set)
    for path in got[1] if len(got[1]) > 1 else ():
        with _naming(rule):
            partial = _outputs_and_grads(fused, call, args, gen, cts=got[2], frozen=path)
        _compare(partial, expected, rule.name, f"fused with {path} frozen vs unfused")
    if quantized:
        return
    fused64 = fuse(program, rules=RuleSet([rule]), recipe=recipe)
    plan64 = fused64.plan(*wide) if fn is not None else fused64.plan(**wide)
    if plan64.stats[rule.phase].fired.get(rule.name):
        _compare(_outputs_and_grads(fused64, call, wide, gen, cts=cts64), expected, rule.name, "both float64")


@contextlib.contextmanager
def _naming(rule: Rule):
    """A RuleError of the fused program (a step's gradient of the wrong shape or dtype) names the
    rule under check: it is the only rule the program was rewritten with."""
    try:
        yield
    except RuleError as e:
        # (without the hint to run check: it is running)
        raise RuleError(f"functe.rules.check: rule {rule.name}: {str(e).replace(RULE_HINT, '')}") from e


def _map(tree: Any, f: Callable[[Tensor], Tensor]) -> Any:
    leaves, spec = tree_flatten(tree)
    return tree_unflatten(spec, [f(x) if isinstance(x, Tensor) else x for x in leaves])


def _redraw(tree: Any, gen: torch.Generator) -> Any:
    def draw(t: Tensor) -> Tensor:
        if not t.is_floating_point():
            return t
        if t.dtype in (torch.float16, torch.bfloat16):
            values = torch.rand(t.shape, generator=gen, dtype=torch.float64)
        else:
            values = torch.randn(t.shape, generator=gen, dtype=torch.float64)
        return values.to(t.dtype).to(t.device)

    return _map(tree, draw)


def _outputs_and_grads(fused, call, args, gen, cts=None, frozen: str | None = None):
    """Outputs, gradients (argument path -> gradient) for output cotangents ``cts`` (drawn in the
    outputs' dtypes if None), and ``cts``; the input at path ``frozen`` requires no gradient."""
    leaves, spec = tree_flatten(args)
    paths = leaf_paths(args)
    leaves = [
        t.detach().requires_grad_(p != frozen) if isinstance(t, Tensor) and t.is_floating_point() else t
        for p, t in zip(paths, leaves)
    ]
    args = tree_unflatten(spec, leaves)
    outs = [o for o in tree_flatten(call(fused, args))[0] if isinstance(o, Tensor)]
    if cts is None:
        cts = [_redraw(o.detach(), gen) for o in outs]
    wanted = [p for p, t in zip(paths, leaves) if isinstance(t, Tensor) and t.requires_grad]
    inputs = [t for t in leaves if isinstance(t, Tensor) and t.requires_grad]
    reached = [(o, c) for o, c in zip(outs, cts) if o.requires_grad]  # (a frozen input's branch is constant)
    if not reached:
        return outs, {p: None for p in wanted}, cts
    grads = torch.autograd.grad([o for o, _ in reached], inputs, [c for _, c in reached], allow_unused=True)
    return outs, dict(zip(wanted, grads)), cts


def _tolerance(t: Tensor) -> torch.dtype:
    # TransformerEngine compares float32 GEMM results with the float16 tolerance: a dot product's
    # rounding grows with its length and cancels. float64 keeps its own (the algebraic check).
    return torch.float16 if t.dtype == torch.float32 else t.dtype


def _compare(got, expected, name: str, what: str) -> None:
    for i, (g, e) in enumerate(zip(got[0], expected[0])):
        assert_close(g, e, dtype=_tolerance(g), msg=f"rule {name}, output {i} ({what})", scale_atol=True)
    for path, g in got[1].items():
        e = expected[1][path]
        if g is None or e is None:
            other = e if g is None else g
            assert other is None or not other.any(), f"rule {name}, gradient of {path} ({what}): one side is missing"
            continue
        assert_close(g, e, dtype=_tolerance(g), msg=f"rule {name}, gradient of {path} ({what})", scale_atol=True)
