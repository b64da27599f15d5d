"""Fusion rules around the quantized linear (``fp8_linear``).

* **q-in** (forward): a norm or an activation feeding an ``fp8_linear`` emits its output already
  quantized for that linear's input (TE: the next op's input quantizer inside ``layernorm_fwd`` /
  ``rmsnorm_fwd`` and the activation kernels);
* **quantized BackwardActivationBias** (backward): the activation's backward, the bias gradient
  and the cast of ``g`` with the producing linear's grad-output state in one pass (TE's
  ``dbias_dgelu`` / ``dbias_drelu``).

**Condition.** TE fuses these when a recipe is on and the neighbouring op owns the quantizer. In
functe the ``fp8_linear`` equation carries both, its ``recipe`` and its scaling state, so the rules
read the recipe from that equation; ``fuse(fn, recipe=r)`` is an optional assertion (a linear with
another recipe is reported and left unfused). The fused ops are in :mod:`functe.ops._fused_fp8`.

**Block recipes** (FP8 block scaling, NVFP4): their linear traces as ``block_linear``; sibling q-in
rules (``forward_norm_block_quantize``, ``forward_activation_block_quantize``) fuse a norm or an
activation into its row-wise block cast (:mod:`functe.ops._fused_block`). These recipes quantize the
wgrad copy again from the high-precision tensor, so the fused op still writes it (the norm kernel
writes both copies). MXFP8 is declined: it has no fused producer + MXFP8 cast kernel.
"""

from __future__ import annotations

from .._oplist import Literal
from .._recipe import MXFP8BlockScaling
from ..ops import _activation as act
from ..ops import _block_linear as block
from ..ops import _core as core
from ..ops import _fp8_linear as fp8
from ..ops import _fused_block as fused_block
from ..ops import _fused_fp8 as fused
from ._parallel import amax_group_param, any_parallel_reason, first_reason
from ._pattern import Match, Rule, RuleSet
from ._pattern import Pattern as P
from .activation import elementwise
from .norm import NORMS, norm_kind, stats_unused


def _recipe(m: Match) -> str | None:
    if (reason := any_parallel_reason(m)) is not None:
        return reason
    recipe = m.params("fp8")["recipe"]
    if isinstance(recipe, MXFP8BlockScaling):
        return (
            "MXFP8 recipe: no fused norm/activation + MXFP8 cast kernel (the per-tensor and block recipes "
            "have theirs); fp8_linear quantizes MXFP8's column-wise copies from the high-precision tensor"
        )
    return _recipe_given(m, "fp8_linear", recipe)


def _recipe_given(m: Match, op: str, recipe) -> str | None:
    if m.recipe is not None and m.recipe != recipe:
        return f"{op} uses {recipe!r}, not the recipe given to fuse ({m.recipe!r})"
    return None


def _block_recipe(m: Match) -> str | None:
    return any_parallel_reason(m) or _recipe_given(m, "block_linear", m.params("lin")["recipe"])


def _interleaved(m: Match) -> str | None:
    if m.params("act")["interleave"]:
        return "interleaved gated layout: the quantizing activation kernel reads the chunked layout"
    return None


def _activation_quantize_condition(m: Match) -> str | None:
    return _interleaved(m) or _recipe(m)


def _backward_condition(m: Match) -> str | None:
    return _recipe(m) or elementwise(m)


def _norm_q_in(fused_op, lin: str):
    """The rewrite of a norm feeding the quantized linear node ``lin`` into ``fused_op``: the norm's
    inputs, then the linear's weight, bias and state (or seed)."""

    def rewrite(m: Match):
        kind, beta = norm_kind(m)
        _, w, b, extra = m.args(lin)
        return m.fuse(
            fused_op,
            [m["x"], m["g"], beta, w, b, extra],
            kind=kind,
            **m.params("norm"),
            recipe=m.params(lin)["recipe"],
            **amax_group_param(m, lin),
        )

    return rewrite


def _activation_q_in(fused_op, lin: str):
    """The rewrite of an activation feeding the quantized linear node ``lin`` into ``fused_op``."""

    def rewrite(m: Match):
        p = m.params("act")
        _, w, b, extra = m.args(lin)
        static = {k: p[k] for k in ("name", "limit", "alpha", "offset")}
        static.update(recipe=m.params(lin)["recipe"], **amax_group_param(m, lin))
        return m.fuse(fused_op, [m["x"], w, b, extra], **static)

    return rewrite


_norm_quantize = _norm_q_in(fused.forward_norm_fp8_linear, "fp8")
_activation_quantize = _activation_q_in(fused.forward_activation_fp8_linear, "fp8")
_norm_block_quantize = _norm_q_in(fused_block.forward_norm_block_linear, "lin")
_activation_block_quantize = _activation_q_in(fused_block.forward_activation_block_linear, "lin")


def _fp8_activation(m: Match):
    x, w, b, state = m.args("fp8")
    extra = m["b2"] if "bias" in m.eqns else Literal(None)
    return m.fuse(
        fused.backward_fp8_linear_activation,
        [x, w, b, state, extra],
        activation=m.params("act")["name"],
        recipe=m.params("fp8")["recipe"],
        **amax_group_param(m, "fp8"),
    )


# fp8_linear(norm(x, g[, beta]), w, b, state) -> forward_norm_fp8_linear(x, g, beta, w, b, state)
FORWARD_NORM_QUANTIZE = Rule(
    "forward_norm_quantize",
    "forward",
    P(fp8._fp8_linear, P(NORMS, "x", "g", ..., name="norm", out=0), ..., name="fp8"),
    _norm_quantize,
    condition=first_reason(_recipe, stats_unused),
    doc="norm feeding an FP8 linear: the norm kernel emits the quantized input (q-in)",
)

# fp8_linear(activation(x), w, b, state) -> forward_activation_fp8_linear(x, w, b, state)
FORWARD_ACTIVATION_QUANTIZE = Rule(
    "forward_activation_quantize",
    "forward",
    P(fp8._fp8_linear, P(act._activation, "x", None, name="act"), ..., name="fp8"),
    _activation_quantize,
    condition=_activation_quantize_condition,
    doc="activation feeding an FP8 linear: the activation kernel emits the quantized input (q-in)",
)

# block_linear(norm(x, g[, beta]), w, b, seed) -> forward_norm_block_linear(x, g, beta, w, b, seed)
FORWARD_NORM_BLOCK_QUANTIZE = Rule(
    "forward_norm_block_quantize",
    "forward",
    P(block._block_linear, P(NORMS, "x", "g", ..., name="norm", out=0), ..., name="lin"),
    _norm_block_quantize,
    condition=first_reason(_block_recipe, stats_unused),
    doc="norm feeding a block-scaled linear: the norm kernel writes its output and the block-quantized input",
)

# block_linear(activation(x), w, b, seed) -> forward_activation_block_linear(x, w, b, seed)
FORWARD_ACTIVATION_BLOCK_QUANTIZE = Rule(
    "forward_activation_block_quantize",
    "forward",
    P(block._block_linear, P(act._activation, "x", None, name="act"), ..., name="lin"),
    _activation_block_quantize,
    condition=first_reason(_interleaved, _block_recipe),
    doc="activation feeding a block-scaled linear: the activation kernel emits the block-quantized input",
)

# activation(fp8_linear(x, w, b, state)) -> backward_fp8_linear_activation(x, w, b, state, None)
BACKWARD_FP8_LINEAR_ACTIVATION = Rule(
    "backward_fp8_linear_activation",
    "backward",
    P(act._activation, P(fp8._fp8_linear, "x", ..., name="fp8"), None, name="act"),
    _fp8_activation,
    condition=_backward_condition,
    doc="activation after an FP8 linear: dact + dbias + cast with the linear's grad-output state, one pass",
)

# activation(bias(fp8_linear(x, w, b, state), b2)) -> backward_fp8_linear_activation(x, w, b, state, b2)
BACKWARD_FP8_LINEAR_BIAS_ACTIVATION = Rule(
    "backward_fp8_linear_bias_activation",
    "backward",
    P(act._activation, P(core._bias, P(fp8._fp8_linear, "x", ..., name="fp8"), "b2", name="bias"), None, name="act"),
    _fp8_activation,
    condition=_backward_condition,
    doc="TE's window [linear, bias, activation] under FP8: dact + dbias + cast in one pass (BackwardActivationBias)",
)

FORWARD_QUANTIZE_RULES = RuleSet(
    [FORWARD_NORM_QUANTIZE, FORWARD_NORM_BLOCK_QUANTIZE, FORWARD_ACTIVATION_QUANTIZE, FORWARD_ACTIVATION_BLOCK_QUANTIZE]
)
BACKWARD_QUANTIZE_RULES = RuleSet([BACKWARD_FP8_LINEAR_ACTIVATION, BACKWARD_FP8_LINEAR_BIAS_ACTIVATION])
QUANTIZE_RULES = FORWARD_QUANTIZE_RULES + BACKWARD_QUANTIZE_RULES
