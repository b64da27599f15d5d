"""Fusion rules over the core ops: linear with residual adds and constant scales.

TransformerEngine's ForwardLinearBiasAdd, ForwardLinearScaleAdd,
BackwardLinearAdd and BackwardLinearScale, as data. Each rule's comment gives
its ``lhs -> rhs``; the fused ops live in :mod:`functe.ops._fused`.
"""

from __future__ import annotations

from .._oplist import is_none
from ..ops import _core as core
from ..ops import _fused as fused
from ._parallel import backward_parallel_reason, first_reason, forward_parallel_reason, linear_parallel_param
from ._pattern import Match, Rule, RuleSet
from ._pattern import Pattern as P


def _forward_linear_add(m: Match):
    scale = m.params("scale")["scale"] if "scale" in m.eqns else None
    return m.fuse(
        fused.forward_linear_add,
        [m["x"], m["w"], m["b"], m["r"]],
        scale=scale,
        bias_op="bias" in m.eqns,
    )


# add_extra_input(linear(x, w, b), r) -> forward_linear_add(x, w, b, r)
FORWARD_LINEAR_BIAS_ADD = Rule(
    "forward_linear_bias_add",
    "forward",
    P(core._add_extra_input, P(core._linear, "x", "w", "b"), "r", commutative=True),
    _forward_linear_add,
    condition=forward_parallel_reason,
    doc="linear (+bias) + residual: one GEMM accumulating into the residual (TE ForwardLinearBiasAdd)",
)

# add_extra_input(bias(linear(x, w, None), b), r) -> forward_linear_add(x, w, b, r)
FORWARD_LINEAR_BIAS_OP_ADD = Rule(
    "forward_linear_bias_op_add",
    "forward",
    P(core._add_extra_input, P(core._bias, P(core._linear, "x", "w", None), "b", name="bias"), "r", commutative=True),
    _forward_linear_add,
    condition=forward_parallel_reason,
    doc="linear, separate bias op, residual add: one GEMM accumulating into the residual",
)


def _bias_free(m: Match) -> str | None:
    if is_none(m["b"]):
        return None
    return (
        "linear has a bias: without a GEMM epilogue taking both a bias and an accumulator, scale·(x·Wᵀ + b) "
        "would be rounded before the residual add, which can cancel (TE's ForwardLinearScaleAdd is bias-free)"
    )


# add_extra_input(constant_scale(linear(x, w, None), s), r) -> forward_linear_add(x, w, None, r, scale=s)
FORWARD_LINEAR_SCALE_ADD = Rule(
    "forward_linear_scale_add",
    "forward",
    P(
        core._add_extra_input,
        P(core._constant_scale, P(core._linear, "x", "w", "b"), name="scale"),
        "r",
        commutative=True,
    ),
    _forward_linear_add,
    condition=first_reason(forward_parallel_reason, _bias_free),
    doc="scale·linear + residual: one GEMM, alpha = scale, accumulating into the residual (TE ForwardLinearScaleAdd)",
)


def _backward_linear_add(m: Match):
    fork, lin = m.eqn("fork"), m.eqn("linear")
    other = fork.outputs[1 - m.edge("fork")]
    return m.fuse(
        fused.backward_linear_add,
        [m["x"], m["w"], m["b"]],
        [other, lin.outputs[0]],
        **linear_parallel_param(m, "linear"),
    )


# linear(make_extra_output(x)[k], w, b) -> backward_linear_add(x, w, b): dx = d_extra + dy·W in one GEMM
BACKWARD_LINEAR_ADD = Rule(
    "backward_linear_add",
    "backward",
    P(core._linear, P(core._make_extra_output, "x", name="fork"), "w", "b", name="linear"),
    _backward_linear_add,
    condition=backward_parallel_reason,
    doc="forked residual into a linear: the dgrad GEMM accumulates into the residual's gradient (TE BackwardLinearAdd)",
)


def _backward_linear_scale(m: Match):
    scale = m.params("scale")["scale"]
    return m.fuse(fused.backward_linear_scale, [m["x"], m["w"], m["b"]], scale=scale, **linear_parallel_param(m, "lin"))


# constant_scale(linear(x, w, b), s) -> backward_linear_scale(x, w, b, scale=s): alpha = s in both GEMMs
BACKWARD_LINEAR_SCALE = Rule(
    "backward_linear_scale",
    "backward",
    P(core._constant_scale, P(core._linear, "x", "w", "b", name="lin"), name="scale"),
    _backward_linear_scale,
    condition=backward_parallel_reason,
    doc="scale after a linear: alpha = scale in the dgrad and wgrad GEMMs (TE BackwardLinearScale)",
)

FORWARD_LINEAR_RULES = RuleSet([FORWARD_LINEAR_BIAS_ADD, FORWARD_LINEAR_BIAS_OP_ADD, FORWARD_LINEAR_SCALE_ADD])
BACKWARD_LINEAR_RULES = RuleSet([BACKWARD_LINEAR_ADD, BACKWARD_LINEAR_SCALE])
LINEAR_RULES = FORWARD_LINEAR_RULES + BACKWARD_LINEAR_RULES
