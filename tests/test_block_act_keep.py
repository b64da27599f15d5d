"""The activation + block cast that also writes the activation's output (``cast_act_block_keep``).

``forward_activation_block_linear`` needs ``h = act(x)`` (``block_linear``'s residual) and its
block-quantized copy. The keep kernels write both: FP8 block scaling in one kernel
(``FP8_BLOCK_ACT_CAST_KEEP``), NVFP4 with an amax pass that writes ``h`` (``ACT_OUTPUT_AMAX``) and
the cast reading ``h``. Everything must equal the unfused pair bit for bit (the activation op, then
the block cast of its output): ``h``, ``q``, block scales, NVFP4's amax and global scale, for
every activation, fp32 and bf16, the twins and the interpreted kernels (which must also equal each
other); and the quantized values must match the float64 references of TE's formulas.
"""

from __future__ import annotations

import math

import pytest
import torch
from block_helpers import fp8_block_reference, nvfp4_reference
from fp8_helpers import same_values

import functe
from functe import ops
from functe._block_quantize import cast_act_block_keep, cast_block, operand_dtype
from functe._errors import DTypeError, FuncteError
from functe.kernels import _act
from functe.kernels import block_quantize as bq
from functe.kernels import quantize as qk
from functe.kernels.activation import ACTIVATION
from functe.testing import assert_close

E4M3 = torch.float8_e4m3fn
ACTS = [*_act.ACTIVATIONS, *_act.GATED, "clamped_swiglu"]
GATED = {*_act.GATED, "clamped_swiglu"}
FP8B, NVFP4 = functe.Float8BlockScaling(), functe.NVFP4BlockScaling()
CLAMP = (7.0, 1.702, 1.0)  # cast_act_block_keep's defaults = ops.activation's clamped-SwiGLU defaults


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits (NaN payloads and the sign of zero included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except that any NaN equals any NaN (kernels may differ in NaN payloads)."""
    return a.dtype == b.dtype and same_values(a, b) and (_same_bits(a, b) or bool(a.isnan().any()))


def _input(act: str, dtype: torch.dtype, *, special: bool = False) -> torch.Tensor:
    """[2, 3, 150] outputs (FP8: a full and a partial 1x128 block; NVFP4: 9 full 1x16 blocks and one of 6)
    with values beyond the clamped SwiGLU's limit, zeros and -0; ``special`` adds inf, -inf and NaN
    to rows 1, 3 and 4 (rows 0, 2 and 5 stay finite)."""
    g = torch.Generator().manual_seed(ACTS.index(act))
    cols = 300 if act in GATED else 150
    x = torch.randn(2, 3, cols, generator=g) * 3
    x[0, 0, :4] = torch.tensor([9.0, -9.0, 0.0, -0.0])
    x[1, 2, -3:] = torch.tensor([40.0, -25.0, 1e-3])
    if special:
        x[0, 1, 5], x[1, 0, 7], x[1, 1, 0] = math.inf, -math.inf, math.nan
    return x.to(dtype)


def _unfused(x, act, recipe, out_dtype):
    """The activation op, then the block cast of its output: (h, q, scale, amax)."""
    h = ops.activation(x, act)
    return (h, *cast_block(h.reshape(-1, h.shape[-1]), recipe, "input", None, out_dtype))


def _kernels(x, act):
    """The raw keep kernels: FP8 block with float8 storage, and NVFP4's amax pass."""
    return (*bq.FP8_BLOCK_ACT_CAST_KEEP(x, act, *CLAMP, E4M3, E4M3, True, 0.0), *qk.ACT_OUTPUT_AMAX(x, act, *CLAMP))


def _kernels_unfused(x, act):
    h = ACTIVATION(x, act, 0, *CLAMP)
    q, sinv = bq.FP8_BLOCK_CAST(h, "", 0.0, 0.0, 0.0, E4M3, E4M3, True, 0.0)
    _, amax = qk.CAST_AMAX(h, torch.ones(()), E4M3, E4M3, False)
    return h, q, sinv, h, amax


@pytest.mark.parametrize("recipe", [FP8B, NVFP4], ids=["fp8_block", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ACTS)
def test_act_block_cast_keep_equals_the_activation_then_the_block_cast(act, dtype, recipe, backend):
    out_dtype = operand_dtype(recipe, dtype)
    # FP8 block scaling: one input, inf/NaN confined to their rows' blocks. NVFP4: a NaN or inf sets the
    # tensor amax (every scale NaN, or global scale 1), so finite and special values are separate inputs.
    # (Through the interpreter NVFP4's special input is left out: its amax pass is ACT_OUTPUT_AMAX, run
    # on the special input below, and its cast the unfused NVFP4_CAST of h.)
    for special in (True,) if recipe is FP8B else (False, True) if backend == "torch" else (False,):
        x = _input(act, dtype, special=special)
        h, q, scale, amax = cast_act_block_keep(x.reshape(6, -1), act, recipe, "input", None, out_dtype)
        h_ref, q_ref, scale_ref, amax_ref = _unfused(x, act, recipe, out_dtype)
        what = f"{act} {dtype} special={special}"
        assert _same(h, h_ref.reshape(6, -1)) and _same(q, q_ref), what
        if recipe is NVFP4:
            assert _same(scale, scale_ref) and _same(amax, amax_ref), what
        else:
            assert scale is None and amax is None and scale_ref is None, what
        if recipe is FP8B or not special:  # the quantized values vs the float64 references of TE's formulas on h
            v = h_ref.reshape(6, -1)
            if recipe is FP8B:
                assert same_values(q, fp8_block_reference(v, 1, E4M3)[2].to(out_dtype)), what
            else:
                ref = nvfp4_reference(v, 1)
                per_element = ref["scales"].repeat_interleave(16, -1)[:, : v.shape[1]]
                assert same_values(q, ref["q"] * per_element) and same_values(scale, ref["global_encode"]), what
    if recipe is FP8B:  # the raw kernels, float8 storage: data bits and 1x128 scale_inv
        for special in (True,):
            x = _input(act, dtype, special=special)
            got, expected = _kernels(x, act), _kernels_unfused(x, act)
            assert all(_same(a, e) for a, e in zip(got, expected)), f"kernels {act} {dtype} special={special}"
            if backend == "interpret":  # vs the twins: h as close as ACTIVATION's kernel and twin are (the
                # twin is torch's native formula where one exists), the block cast and amax of h bit for bit
                with functe.use_backend("torch"):
                    twins = _kernels(x, act)
                    cast_twin = bq.FP8_BLOCK_CAST(got[0], "", 0.0, 0.0, 0.0, E4M3, E4M3, True, 0.0)
                    amax_twin = qk.CAST_AMAX(got[3], torch.ones(()), E4M3, E4M3, False)[1]
                for a, t in [(got[0], twins[0]), (got[3], twins[3])]:
                    assert_close(a, t, msg=f"twin h {act} {dtype}")
                assert _same(got[1], cast_twin[0]) and _same(got[2], cast_twin[1]) and _same(got[4], amax_twin)


@pytest.mark.parametrize("shape", [(37,), (2, 13), (32, 1, 32), (0, 26)])
def test_keep_kernels_odd_shapes_and_empty(shape, backend):
    for act in ("gelu", "swiglu"):
        if act == "swiglu" and shape[-1] % 2:
            continue
        x = (torch.randn(shape) * 4).to(torch.bfloat16)
        h, q, sinv = bq.FP8_BLOCK_ACT_CAST_KEEP(x, act, *CLAMP, E4M3, torch.bfloat16, True, 0.0)
        h2, amax = qk.ACT_OUTPUT_AMAX(x, act, *CLAMP)
        h_ref = ACTIVATION(x, act, 0, *CLAMP)
        q_ref, sinv_ref = bq.FP8_BLOCK_CAST(h_ref, "", 0.0, 0.0, 0.0, E4M3, torch.bfloat16, True, 0.0)
        _, amax_ref = qk.CAST_AMAX(h_ref, torch.ones(()), E4M3, E4M3, False)
        assert h.shape == h2.shape == (*shape[:-1], shape[-1] // (2 if act == "swiglu" else 1))
        for a, e in [(h, h_ref), (q, q_ref), (sinv, sinv_ref), (h2, h_ref), (amax, amax_ref)]:
            assert _same_bits(a, e), (shape, act)


def test_keep_kernels_take_non_contiguous_and_stride_0_inputs():
    row = torch.randn(1, 160)
    for x in (row.expand(6, 160), torch.randn(160, 6).t()):  # stride 0 (a .sum() gradient), transposed
        for act in ("silu", "geglu"):
            with functe.use_backend("interpret"):
                got, expected = _kernels(x, act), _kernels(x.contiguous(), act)
            assert all(_same_bits(a, e) for a, e in zip(got, expected)), act


def test_cast_act_block_keep_rejects_what_it_cannot_do():
    with pytest.raises(DTypeError, match=r"cast_act_block_keep: argument 'x' expected dtype f32\|f16\|bf16"):
        cast_act_block_keep(torch.zeros(2, 32, dtype=torch.float64), "gelu", FP8B, "input", None, torch.float32)
    with pytest.raises(FuncteError, match="role 'weight' uses 2-D blocks"):
        cast_act_block_keep(torch.zeros(2, 32), "gelu", NVFP4, "weight", None, torch.float32)
    with pytest.raises(FuncteError, match="stateless; argument 'scale' must be None"):
        cast_act_block_keep(torch.zeros(2, 32), "gelu", FP8B, "input", torch.ones(()), torch.float32)
