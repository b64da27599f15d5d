"""Fusion rules over linears, biases and elementwise activations.

TransformerEngine's ForwardLinearBiasActivation with the activation in the GEMM epilogue (TE's
activation slot never matches) and BackwardActivationBias without a quantized output (TE fuses it
only under FP8; the FP8 variant is in :mod:`functe.rules.quantize`). Each rule's comment gives its
``lhs -> rhs``; the fused ops live in :mod:`functe.ops._fused`.
"""

from __future__ import annotations

import torch

from .._oplist import Literal
from ..kernels._act import ACTIVATIONS
from ..ops import _activation as act
from ..ops import _core as core
from ..ops import _fused as fused
from ._parallel import backward_parallel_reason, first_reason, forward_parallel_reason, linear_parallel_param
from ._pattern import Match, Rule, RuleSet
from ._pattern import Pattern as P

EPILOGUE_DTYPES = (torch.float16, torch.bfloat16)


def atom_dtype(atom) -> torch.dtype:
    """The dtype of a var or of a captured tensor constant."""
    return atom.value.dtype if isinstance(atom, Literal) else atom.dtype


def elementwise(m: Match) -> str | None:
    """Decline gated activations (2H -> H): the epilogues and the dact kernels are elementwise."""
    name = m.params("act")["name"]
    if name in ACTIVATIONS:
        return None
    return f"activation {name} is gated (2H -> H): the fused kernels apply elementwise activations only"


def _epilogue(m: Match) -> str | None:
    # TE's condition (cuBLAS fuses bias + activation for fp16/bf16 outputs only). functe's Triton GEMM
    # could run an fp32 epilogue, but its fp32 configurations are IEEE accuracy paths that cuBLAS beats
    # unfused; on the CPU there is no epilogue at all (the fused op runs the same BLAS call and the same
    # activation kernel). One device-independent condition keeps the plan traced on a CPU the plan a
    # GPU runs.
    dtype = atom_dtype(m["w"])
    if dtype not in EPILOGUE_DTYPES:
        return f"weight dtype {str(dtype).removeprefix('torch.')}: the fused epilogue needs fp16/bf16"
    return elementwise(m)


def _forward_linear_activation(m: Match):
    return m.fuse(
        fused.forward_linear_activation,
        [m["x"], m["w"], m["b"]],
        activation=m.params("act")["name"],
        bias_op="bias" in m.eqns,
    )


# activation(linear(x, w, b)) -> forward_linear_activation(x, w, b)
FORWARD_LINEAR_BIAS_ACTIVATION = Rule(
    "forward_linear_bias_activation",
    "forward",
    P(act._activation, P(core._linear, "x", "w", "b"), None, name="act"),
    _forward_linear_activation,
    condition=first_reason(forward_parallel_reason, _epilogue),
    doc="linear (+bias) then activation: bias and activation in the GEMM epilogue (TE ForwardLinearBiasActivation)",
)

# activation(bias(linear(x, w, None), b)) -> forward_linear_activation(x, w, b, bias_op=True)
FORWARD_LINEAR_BIAS_OP_ACTIVATION = Rule(
    "forward_linear_bias_op_activation",
    "forward",
    P(act._activation, P(core._bias, P(core._linear, "x", "w", None), "b", name="bias"), None, name="act"),
    _forward_linear_activation,
    condition=first_reason(forward_parallel_reason, _epilogue),
    doc="linear, separate bias op, activation: one GEMM with a bias + activation epilogue",
)


# activation(linear(x, w, b)) -> backward_linear_activation(x, w, b)
BACKWARD_LINEAR_BIAS_ACTIVATION = Rule(
    "backward_linear_bias_activation",
    "backward",
    P(act._activation, P(core._linear, "x", "w", "b", name="lin"), None, name="act"),
    lambda m: m.fuse(
        fused.backward_linear_activation,
        [m["x"], m["w"], m["b"]],
        activation=m.params("act")["name"],
        **linear_parallel_param(m, "lin"),
    ),
    condition=first_reason(backward_parallel_reason, elementwise),
    doc="activation after a linear: dact + dbias in one pass (or dact as dgrad's prologue), wgrad with dbias",
)

# activation(bias(h, b)) -> backward_activation_bias(h, b)
BACKWARD_ACTIVATION_BIAS = Rule(
    "backward_activation_bias",
    "backward",
    P(act._activation, P(core._bias, "h", "b"), None, name="act"),
    lambda m: m.fuse(fused.backward_activation_bias, [m["h"], m["b"]], activation=m.params("act")["name"]),
    condition=elementwise,
    doc="activation after a bias: dact and dbias in one pass (TE BackwardActivationBias, unquantized)",
)

FORWARD_ACTIVATION_RULES = RuleSet([FORWARD_LINEAR_BIAS_ACTIVATION, FORWARD_LINEAR_BIAS_OP_ACTIVATION])
BACKWARD_ACTIVATION_RULES = RuleSet([BACKWARD_LINEAR_BIAS_ACTIVATION, BACKWARD_ACTIVATION_BIAS])
ACTIVATION_RULES = FORWARD_ACTIVATION_RULES + BACKWARD_ACTIVATION_RULES
