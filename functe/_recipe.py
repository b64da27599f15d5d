"""FP8 formats and recipes: frozen, hashable configuration values passed explicitly.

TransformerEngine's semantics (``../shared/reference/transformer_engine_ops.md`` section 4):

* :class:`Format`: ``E4M3`` (max 448), ``E5M2`` (max 57344), and ``HYBRID`` (E4M3 for the
  forward tensors, input and weight; E5M2 for the gradients). Pure E5M2 is rejected by every
  recipe, as TE does.
* :class:`DelayedScaling`: per-tensor scales from an amax history (stateful: the scale and
  history live in a :class:`functe.ScalingState` per tensor role).
* :class:`CurrentScaling`: per-tensor scales from the tensor's own amax (stateless).
* :class:`MXFP8BlockScaling`: one E8M0 (power-of-two) scale per 32 consecutive elements
  (stateless).

A recipe is never a global or a context: ops take it as a keyword argument (``recipe=``), and
since it is hashable it is a valid static argument of :func:`functe.custom_vjp`.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from ._errors import RecipeError

FORWARD_ROLES = ("input", "weight")
BACKWARD_ROLES = ("grad_output",)
ROLES = FORWARD_ROLES + BACKWARD_ROLES


class Format(enum.Enum):
    """FP8 format of a recipe: which float8 dtype each tensor role is cast to.

    Example:
        >>> Format.HYBRID.dtype("input"), Format.HYBRID.dtype("grad_output")
        (torch.float8_e4m3fn, torch.float8_e5m2)
    """

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"

    def dtype(self, role: str) -> torch.dtype:
        """The float8 dtype of tensor ``role`` (``"input"``, ``"weight"`` or ``"grad_output"``)."""
        if role not in ROLES:
            raise RecipeError(f"functe.Format: unknown tensor role {role!r}; expected one of {ROLES}")
        if self is Format.E5M2 or (self is Format.HYBRID and role in BACKWARD_ROLES):
            return torch.float8_e5m2
        return torch.float8_e4m3fn


FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
"""Largest finite value of each float8 dtype."""

FP8_DTYPES = tuple(FP8_MAX)


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of a float8 dtype (448 for E4M3, 57344 for E5M2).

    Example:
        >>> fp8_max(torch.float8_e5m2)
        57344.0
    """
    return FP8_MAX[dtype]


def _check_format(name: str, fmt: object, allowed: tuple[Format, ...]) -> None:
    if not isinstance(fmt, Format):
        raise RecipeError(f"functe.{name}: fp8_format must be a functe.Format, got {fmt!r}")
    if fmt is Format.E5M2:
        raise RecipeError(f"functe.{name}: pure E5M2 training is not supported (as in TransformerEngine); use HYBRID")
    if fmt not in allowed:
        raise RecipeError(f"functe.{name}: fp8_format must be one of {[f.name for f in allowed]}, got {fmt.name}")


class _Recipe:
    """Shared behaviour: the dtype and largest value of each tensor role."""

    fp8_format: Format
    stateful = False

    def dtype(self, role: str) -> torch.dtype:
        """The float8 dtype of tensor ``role`` under this recipe."""
        return self.fp8_format.dtype(role)

    def max(self, role: str) -> float:
        """The largest finite value of tensor ``role``'s float8 dtype."""
        return FP8_MAX[self.dtype(role)]


@dataclasses.dataclass(frozen=True)
class DelayedScaling(_Recipe):
    """TransformerEngine's delayed scaling: scales derived from an amax history.

    A cast uses the role's current (delayed) scale and records the tensor's amax; the
    update then takes ``amax`` over the window (``"max"``) or the newest value
    (``"most_recent"``), rolls the history and sets ``scale = (fp8_max / amax) / 2**margin``
    (keeping the old scale when amax is 0, inf or NaN; an infinite scale becomes FLT_MAX).
    See :func:`functe.delayed_scaling_update`.

    Args:
        margin: extra headroom as a power of two (an int, as in TE).
        fp8_format: ``Format.HYBRID`` (default) or ``Format.E4M3``.
        amax_history_len: history window length (>= 1).
        amax_compute_algo: ``"max"`` or ``"most_recent"`` (TE's callable form is not
            supported: a recipe must be hashable configuration).

    Example:
        >>> DelayedScaling(margin=2, amax_history_len=8).dtype("grad_output")
        torch.float8_e5m2
        >>> DelayedScaling(fp8_format=Format.E5M2)
        Traceback (most recent call last):
        ...
        functe._errors.RecipeError: functe.DelayedScaling: pure E5M2 training is not supported ...
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    stateful = True

    def __post_init__(self):
        _check_format("DelayedScaling", self.fp8_format, (Format.E4M3, Format.HYBRID))
        if isinstance(self.margin, bool) or not isinstance(self.margin, int):
            raise RecipeError(f"functe.DelayedScaling: margin must be an int, got {self.margin!r}")
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int):
            raise RecipeError(f"functe.DelayedScaling: amax_history_len must be an int, got {self.amax_history_len!r}")
        if self.amax_history_len < 1:
            raise RecipeError(f"functe.DelayedScaling: amax_history_len must be >= 1, got {self.amax_history_len}")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise RecipeError(
                "functe.DelayedScaling: amax_compute_algo must be 'max' or 'most_recent', "
                f"got {self.amax_compute_algo!r}"
            )


@dataclasses.dataclass(frozen=True)
class CurrentScaling(_Recipe):
    """Per-tensor scaling from the tensor's own amax (TE's Float8CurrentScaling); stateless.

    ``scale = fp8_max / max(amax, amax_epsilon)``; an amax of 0, inf or NaN gives scale 1, an
    infinite scale becomes FLT_MAX, and ``power_2_scales`` rounds the scale *down* to a power of two.

    Example:
        >>> CurrentScaling().dtype("input")
        torch.float8_e4m3fn
    """

    fp8_format: Format = Format.HYBRID
    power_2_scales: bool = False
    amax_epsilon: float = 0.0

    def __post_init__(self):
        _check_format("CurrentScaling", self.fp8_format, (Format.E4M3, Format.HYBRID))
        if not isinstance(self.power_2_scales, bool):
            raise RecipeError(f"functe.CurrentScaling: power_2_scales must be a bool, got {self.power_2_scales!r}")
        eps = self.amax_epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0.0:
            raise RecipeError(f"functe.CurrentScaling: amax_epsilon must be a number >= 0, got {eps!r}")


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(_Recipe):
    """MXFP8: one E8M0 power-of-two scale per 32 consecutive elements (TE's MXFP8BlockScaling).

    The block scale is ``block_amax / fp8_max`` rounded *up* to a power of two, so no element
    saturates; stateless. ``HYBRID`` makes gradients E5M2.

    Example:
        >>> MXFP8BlockScaling().block_size
        32
    """

    fp8_format: Format = Format.E4M3
    block_size = 32

    def __post_init__(self):
        _check_format("MXFP8BlockScaling", self.fp8_format, (Format.E4M3, Format.HYBRID))


Recipe = DelayedScaling | CurrentScaling | MXFP8BlockScaling
RECIPES = (DelayedScaling, CurrentScaling, MXFP8BlockScaling)


def check_recipe(op: str, recipe: object) -> Recipe:
    """Require one of functe's recipe objects; return it."""
    if not isinstance(recipe, RECIPES):
        names = ", ".join(r.__name__ for r in RECIPES)
        raise RecipeError(f"functe.{op}: argument 'recipe' expected one of {names}, got {recipe!r}")
    return recipe
