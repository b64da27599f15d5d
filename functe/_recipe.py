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
* :class:`Float8BlockScaling` (DeepSeek-style 1x128 / 128x128 fp32 scales) and
  :class:`NVFP4BlockScaling` (E2M1 with E4M3 block scales and an fp32 tensor scale): stateless,
  implemented in :mod:`functe._block_quantize`.

A recipe is never a global or a context: ops take it as a keyword argument (``recipe=``), and
since it is hashable it is a valid static argument of :func:`functe.custom_vjp`.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from ._errors import RecipeError, as_float, as_int, shown_number
from ._state import HISTORY_LEN_LIMIT

FORWARD_ROLES = ("input", "weight")
BACKWARD_ROLES = ("grad_output",)
ROLES = FORWARD_ROLES + BACKWARD_ROLES


_FP32_MAX = torch.finfo(torch.float32).max


def _check_amax_epsilon(recipe: str, eps) -> float:
    """``eps`` as a float: a Python or numpy number in ``[0, FLT_MAX]``, else a :class:`RecipeError`."""
    # (inf would give every block scale 1, saturating everything; NaN compares false everywhere; and
    # TE's epsilon is a C float: one above FLT_MAX overflowed torch's fp32 clamp, an error naming
    # nothing, while a Triton kernel read it as inf and scaled every block by 1)
    number = as_float(eps)
    if number is None or not 0.0 <= number <= _FP32_MAX:
        raise RecipeError(
            f"functe.{recipe}: amax_epsilon must be a number >= 0 that fp32 holds (at most {_FP32_MAX:.6g}), "
            f"got {shown_number(eps)}"
        )
    return number


def _check_role(method: str, role: object) -> None:
    """Refuse an unknown tensor role, naming ``functe.<method>``."""
    if role not in ROLES:
        raise RecipeError(f"functe.{method}: argument 'role' expected one of {ROLES}, got {role!r}")


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
        _check_role("Format.dtype", role)
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
        _check_role(f"{type(self).__name__}.dtype", role)
        return self.fp8_format.dtype(role)

    def max(self, role: str) -> float:
        """The largest finite value of tensor ``role``'s float8 dtype."""
        _check_role(f"{type(self).__name__}.max", role)
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
        # (margin >= -127: 2**margin stays a finite float32 factor, 2000 failed at the first update;
        # margin <= 30: (448 / FLT_MAX) / 2**31 rounds to 0, a scale that casts everything to 0 and
        # that the state protocol would read as a cut scale leaf, see state_from_gradient)
        # (numpy integers stored as ints: a recipe keys plan caches and prints in errors)
        for field in ("margin", "amax_history_len"):
            number = as_int(getattr(self, field))
            if number is not None:
                object.__setattr__(self, field, number)
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or not -127 <= self.margin <= 30:
            raise RecipeError(
                f"functe.DelayedScaling: margin must be an int in [-127, 30] (a larger margin can round a "
                f"scale to 0), got {self.margin!r}"
            )
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int):
            raise RecipeError(f"functe.DelayedScaling: amax_history_len must be an int, got {self.amax_history_len!r}")
        # (init_scaling_state's bound: a recipe beyond it was accepted only for every state made from it to fail)
        if not 1 <= self.amax_history_len < HISTORY_LEN_LIMIT:
            raise RecipeError(
                f"functe.DelayedScaling: amax_history_len must be an int from 1 to 2**61 - 1, "
                f"got {self.amax_history_len}"
            )
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
        # (stored as a float: a numpy scalar reached kernels and hashes as itself)
        object.__setattr__(self, "amax_epsilon", _check_amax_epsilon("CurrentScaling", self.amax_epsilon))


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


# ----------------------------------------------------------------------------- block-scaled recipes


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling(_Recipe):
    """DeepSeek-style FP8 block scaling (TE's Float8BlockScaling); stateless.

    One fp32 scale per block: 1x128 (128 consecutive elements of a row) for inputs and
    gradients, 128x128 for weights. ``scale = fp8_max / max(block_amax, amax_epsilon)``, 1 for an
    amax of 0, inf or NaN, the input dtype's largest value instead of inf (TE's block kernels), and
    with ``power_2_scales`` (TE's default) the scale is rounded *down* to a power of two. A
    dimension that is not a multiple of 128 ends in a partial block, quantized as if zero-padded to
    128 (TE requires multiples of 128; its reference pads the same way). See ``docs/block_scaling.md``.

    Args:
        fp8_format: ``Format.E4M3`` (default, gradients too) or ``Format.HYBRID`` (E5M2 gradients).
        power_2_scales: power-of-two scales (TE's default); ``False`` keeps plain fp32 scales
            (TE's ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``).
        amax_epsilon: lower bound of a block's amax (>= 0, at most FLT_MAX).

    Example:
        >>> r = Float8BlockScaling()
        >>> r.block_size, r.block_shape("input"), r.block_shape("weight"), r.dtype("grad_output")
        (128, (1, 128), (128, 128), torch.float8_e4m3fn)
    """

    fp8_format: Format = Format.E4M3
    power_2_scales: bool = True
    amax_epsilon: float = 0.0
    block_size = 128

    def __post_init__(self):
        _check_format("Float8BlockScaling", self.fp8_format, (Format.E4M3, Format.HYBRID))
        if not isinstance(self.power_2_scales, bool):
            raise RecipeError(f"functe.Float8BlockScaling: power_2_scales must be a bool, got {self.power_2_scales!r}")
        object.__setattr__(self, "amax_epsilon", _check_amax_epsilon("Float8BlockScaling", self.amax_epsilon))

    def block_shape(self, role: str) -> tuple[int, int]:
        """``(rows, cols)`` of one scaling block of tensor ``role``: 128x128 for weights, else 1x128."""
        _check_role(f"{type(self).__name__}.block_shape", role)
        return (128, 128) if role == "weight" else (1, 128)


E2M1_MAX = 6.0
"""Largest E2M1 magnitude (the grid is 0, 0.5, 1, 1.5, 2, 3, 4, 6)."""


@dataclasses.dataclass(frozen=True)
class NVFP4BlockScaling(_Recipe):
    """NVFP4 (TE's NVFP4BlockScaling): E2M1 values, one E4M3 scale per 16 values, one fp32 scale per tensor.

    Quantization of a tensor ``x`` (TE's reference ``reference_nvfp4.py``):
    ``global_encode = 448 * 6 / amax(x)`` (FLT_MAX instead of inf, 1 instead of 0),
    per block ``s = e4m3(clamp(block_amax * (global_encode / 6), 448))`` and
    ``q = e2m1(clamp(x / (s * global_decode), ±6))`` with ``global_decode = 1 / global_encode``;
    ``dequantize = q * s * global_decode``. Stateless.

    TE's three training techniques, each switchable with TE's flag names:

    * weights use 16x16 blocks (one scale per tile, so the transpose is the same quantized
      tensor): ``disable_2d_quantization``;
    * the wgrad copies of inputs and gradients (quantized along the token dimension) get a
      random Hadamard transform (16x16, random signs): ``disable_rht``;
    * gradients are rounded stochastically: ``disable_stochastic_rounding``.

    The randomness comes from an explicit ``seed`` argument of the ops (no global RNG).

    Example:
        >>> r = NVFP4BlockScaling()
        >>> r.block_shape("weight"), r.block_shape("input"), r.max("input")
        ((16, 16), (1, 16), 6.0)
        >>> r.uses_seed, NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True).uses_seed
        (True, False)
    """

    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    fp8_format = Format.E4M3  # the block scales' format
    block_size = 16

    def __post_init__(self):
        for name in ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization"):
            if not isinstance(getattr(self, name), bool):
                raise RecipeError(f"functe.NVFP4BlockScaling: {name} must be a bool, got {getattr(self, name)!r}")

    def dtype(self, role: str) -> torch.dtype:
        """``torch.float4_e2m1fn_x2`` (two E2M1 values per byte) for every role."""
        _check_role(f"{type(self).__name__}.dtype", role)
        return torch.float4_e2m1fn_x2

    def max(self, role: str) -> float:
        """6.0, the largest E2M1 magnitude."""
        _check_role(f"{type(self).__name__}.max", role)
        return E2M1_MAX

    def block_shape(self, role: str) -> tuple[int, int]:
        """``(rows, cols)`` of one scaling block: 16x16 for weights (unless disabled), else 1x16."""
        _check_role(f"{type(self).__name__}.block_shape", role)
        return (16, 16) if role == "weight" and not self.disable_2d_quantization else (1, 16)

    @property
    def uses_seed(self) -> bool:
        """Whether the quantized linear needs a ``seed`` (RHT or stochastic rounding enabled)."""
        return not (self.disable_rht and self.disable_stochastic_rounding)


BLOCK_RECIPES = (Float8BlockScaling, NVFP4BlockScaling)

Recipe = DelayedScaling | CurrentScaling | MXFP8BlockScaling | Float8BlockScaling | NVFP4BlockScaling
RECIPES = (DelayedScaling, CurrentScaling, MXFP8BlockScaling, *BLOCK_RECIPES)


def check_recipe(op: str, recipe: object) -> Recipe:
    """Require one of functe's recipe objects; return it."""
    if not isinstance(recipe, RECIPES):
        names = ", ".join(r.__name__ for r in RECIPES)
        raise RecipeError(f"functe.{op}: argument 'recipe' expected one of {names}, got {recipe!r}")
    return recipe
