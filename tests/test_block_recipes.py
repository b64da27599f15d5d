"""Block recipes as configuration values, the public quantize/dequantize layouts, and clear errors."""

from __future__ import annotations

import pytest
import torch
from block_helpers import fp8_block_reference, nvfp4_reference
from fp8_helpers import same_values

import functe
from functe import Float8BlockScaling, Format, NVFP4BlockScaling, ops
from functe._block_quantize import cast_act_block, cast_block


def test_recipes_are_frozen_hashable_and_te_defaults():
    fp8, fp4 = Float8BlockScaling(), NVFP4BlockScaling()
    assert hash(fp8) == hash(Float8BlockScaling()) and fp8 != Float8BlockScaling(power_2_scales=False)
    assert {fp4: 1}[NVFP4BlockScaling()] == 1
    with pytest.raises(AttributeError):
        fp8.power_2_scales = False
    assert fp8.power_2_scales and fp8.amax_epsilon == 0.0 and fp8.fp8_format is Format.E4M3
    assert fp8.dtype("grad_output") == torch.float8_e4m3fn
    assert Float8BlockScaling(fp8_format=Format.HYBRID).dtype("grad_output") == torch.float8_e5m2
    assert [fp8.block_shape(r) for r in ("input", "weight", "grad_output")] == [(1, 128), (128, 128), (1, 128)]
    assert not (fp4.disable_rht or fp4.disable_stochastic_rounding or fp4.disable_2d_quantization)
    assert [fp4.block_shape(r) for r in ("input", "weight", "grad_output")] == [(1, 16), (16, 16), (1, 16)]
    assert NVFP4BlockScaling(disable_2d_quantization=True).block_shape("weight") == (1, 16)
    assert fp4.dtype("input") == torch.float4_e2m1fn_x2 and fp4.max("weight") == 6.0
    assert not fp8.stateful and not fp4.stateful
    assert functe.init_linear_scaling_state(fp4) is None


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: Float8BlockScaling(fp8_format=Format.E5M2), "pure E5M2"),
        (lambda: Float8BlockScaling(power_2_scales=1), "power_2_scales must be a bool"),
        (lambda: Float8BlockScaling(amax_epsilon=-1.0), "amax_epsilon"),
        (lambda: NVFP4BlockScaling(disable_rht="yes"), "disable_rht must be a bool"),
        (lambda: Float8BlockScaling().block_shape("bias"), "unknown tensor role"),
    ],
)
def test_bad_recipes_are_rejected(make, match):
    with pytest.raises(functe.RecipeError, match=match):
        make()


@pytest.mark.parametrize("role", ["input", "weight", "grad_output"])
def test_quantized_tensor_layouts_and_dequantize(role):
    x = torch.randn(40, 300) * 3
    q, state = functe.quantize(x, Float8BlockScaling(), role=role)
    rows = 128 if role == "weight" else 1
    ref_q, ref_sinv, ref_deq = fp8_block_reference(x, rows, torch.float8_e4m3fn)
    assert state is None and q.scale_inv is None and q.data.dtype == torch.float8_e4m3fn
    assert q.block_scales.dtype == torch.float32 and same_values(q.block_scales, ref_sinv)
    assert same_values(q.data.float(), ref_q) and same_values(functe.dequantize(q, torch.float64), ref_deq)

    q, _ = functe.quantize(x, NVFP4BlockScaling(), role=role, seed=4)
    assert q.data.dtype == torch.uint8 and q.data.shape == (40, 150) and q.scale_inv.shape == ()
    assert q.block_scales.dtype == torch.float8_e4m3fn
    assert q.block_scales.shape == ((3, 19) if role == "weight" else (40, 19))
    if role != "grad_output":  # (gradients are rounded stochastically)
        ref = nvfp4_reference(x, 16 if role == "weight" else 1)
        assert same_values(functe.dequantize(q), ref["deq"].float())
    # a quantized tensor is a pytree: it can be saved and loaded like any state
    leaves = functe.tree_leaves(q)
    assert [t.dtype for t in leaves] == [torch.uint8, torch.float32, torch.float8_e4m3fn]


def test_errors_name_the_argument():
    x = torch.randn(4, 32)
    with pytest.raises(functe.ShapeError, match="even last dim"):
        functe.quantize(torch.randn(4, 33), NVFP4BlockScaling())
    with pytest.raises(functe.ShapeError, match="expected a matrix for role 'weight'"):
        functe.quantize(torch.randn(2, 4, 32), Float8BlockScaling(), role="weight")
    with pytest.raises(functe.ShapeError, match="rank >= 1"):
        functe.quantize(torch.tensor(1.0), Float8BlockScaling())
    with pytest.raises(functe.StateError, match="stateless"):
        functe.quantize(x, NVFP4BlockScaling(), state=functe.init_scaling_state(4))
    with pytest.raises(functe.FuncteError, match=r"functe\.quantize: argument 'seed'.*needs a seed"):
        functe.quantize(x, NVFP4BlockScaling(), role="grad_output")
    functe.quantize(x, NVFP4BlockScaling(disable_stochastic_rounding=True), role="grad_output")  # no seed needed
    with pytest.raises(functe.DTypeError, match="seed"):
        functe.quantize(x, NVFP4BlockScaling(), role="grad_output", seed=torch.tensor(1.0))
    with pytest.raises(functe.FuncteError, match="stateless"):
        cast_block(x, Float8BlockScaling(), "input", torch.ones(()), torch.float32)
    with pytest.raises(functe.FuncteError, match="2-D blocks"):
        cast_act_block(x, "gelu", NVFP4BlockScaling(), "weight", None, torch.float32)
    with pytest.raises(functe.StateError, match="stateless"):
        ops.fp8_linear(
            x,
            torch.randn(8, 32),
            None,
            functe.init_linear_scaling_state(functe.DelayedScaling()),
            recipe=Float8BlockScaling(),
        )
    with pytest.raises(functe.RecipeError, match="NVFP4BlockScaling"):
        ops.fp8_linear(x, torch.randn(8, 32), None, None, recipe="nvfp4")
