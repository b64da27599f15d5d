"""Fusion rules over norms: a forked residual feeding a LayerNorm or RMSNorm (TE's BackwardAddRMSNorm).

The q-in fusion of a norm with the next FP8 linear is in :mod:`functe.rules.quantize`.
"""

from __future__ import annotations

from .._oplist import Literal
from ..ops import _core as core
from ..ops import _fused as fused
from ..ops import _norm as norm
from ._pattern import Match, Rule, RuleSet
from ._pattern import Pattern as P

NORMS = (norm._layer_norm, norm._rms_norm)


def norm_kind(m: Match, name: str = "norm") -> tuple[str, object]:
    """``("layer", β atom)`` or ``("rms", None literal)`` for the norm equation captured as ``name``."""
    e = m.eqn(name)
    return ("layer", e.inputs[2]) if e.op is norm._layer_norm else ("rms", Literal(None))


def stats_unused(m: Match, name: str = "norm") -> str | None:
    """Decline a LayerNorm whose statistics (outputs ``mean``, ``rstd``) are used outside the match:
    the fused ops return only ``y``."""
    used = [v for v in m.eqn(name).outputs[1:] if any(v is o for o in m.outputs)]
    return "the LayerNorm statistics (mean, rstd) are used outside the match" if used else None


def _backward_add_norm(m: Match):
    fork, n = m.eqn("fork"), m.eqn("norm")
    other = fork.outputs[1 - m.edge("fork")]
    kind, beta = norm_kind(m)
    return m.fuse(fused.backward_add_norm, [m["x"], m["g"], beta], [other, n.outputs[0]], kind=kind, **n.params)


# norm(make_extra_output(x)[k], g[, beta]) -> backward_add_norm(x, g, beta): dx = d_extra + norm'(dy), one kernel
BACKWARD_ADD_NORM = Rule(
    "backward_add_norm",
    "backward",
    P(NORMS, P(core._make_extra_output, "x", name="fork"), "g", ..., name="norm"),
    _backward_add_norm,
    condition=stats_unused,
    doc="forked residual into a norm: the norm's backward adds the residual's gradient (TE BackwardAddRMSNorm)",
)

BACKWARD_NORM_RULES = RuleSet([BACKWARD_ADD_NORM])
NORM_RULES = BACKWARD_NORM_RULES
