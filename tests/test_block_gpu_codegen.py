"""The block-scaled kernels compile for a GPU (sm_90) on a machine without one.

Triton's interpreter is more permissive than its compiler (it reads plain Python globals inside
kernels, for example), so a kernel that passes every interpreter test may still fail to compile
on the first GPU it meets. The compiles run after interpreted launches, in the same process, as
in a ``FUNCTE_TEST_CUDA=1`` run. Triton can compile to a cubin for a given target with the ptxas it
ships, no device needed: every specialisation the launchers use is compiled here (each variant
takes ~0.5-5 s). Numerics on a GPU remain untested (``docs/block_scaling.md``).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from codegen_helpers import HAVE_PTXAS, ASTSource, GPUTarget

from functe.kernels import _act
from functe.kernels import block_quantize as bq
from functe.kernels import hadamard as hd
from functe.kernels import norm_block_quantize as nbq
from functe.kernels import nvfp4 as nv

pytestmark = [
    pytest.mark.skipif(not HAVE_PTXAS, reason="Triton's NVIDIA backend (ptxas) is not installed"),
    pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset:UserWarning"),  # GPU launches see it too
]

_FP8_ARGS = {
    "X": "*bf16",
    "Q": "*u8",
    "S": "*fp32",
    "H": "*fp32",  # unused without KEEP (the launcher passes the scales)
    "n_rows": "i32",
    "n_cols": "i32",
    "n_blocks": "i32",
    "x_row_stride": "i32",
    "limit": "fp32",
    "alpha": "fp32",
    "offset": "fp32",
    "eps": "fp32",
}
_FP8_CONST = dict(
    MODE=0, ACT=0, GATED=False, CLAMPED=False, TILE_ROWS=1, ROW_CHUNK=1, POW2=True, MANT=3, BIAS=7,
    MIN_NORMAL=2.0**-6, SUB_STEPS=512.0, MAXV=448.0, INF_SCALE=bq.inf_scale(torch.bfloat16), DEQUANT=False,
    KEEP=False, BLOCK_RB=8, BLOCK_CB=2,
)  # fmt: skip
_NV_ARGS = {
    "X": "*bf16",
    "AMAX": "*fp32",
    "SEED": "*i64",
    "Q": "*u8",
    "S": "*u8",
    "n_rows": "i32",
    "n_cols": "i32",
    "n_blocks": "i32",
    "x_row_stride": "i32",
    "limit": "fp32",
    "alpha": "fp32",
    "offset": "fp32",
}
_NV_CONST = dict(
    MODE=0, ACT=0, GATED=False, CLAMPED=False, TILE_ROWS=1, STOCHASTIC=False, PACKED=True, BLOCK_RB=16, BLOCK_CB=8
)  # fmt: skip

_NORM_ARGS = {
    "X": "*bf16",
    "W": "*bf16",
    "B": "*bf16",
    "AMAX": "*fp32",
    "Y": "*bf16",
    "Q": "*u8",
    "S": "*fp32",
    "MEAN": "*fp32",
    "RSTD": "*fp32",
    "n_rows": "i32",
    "n_cols": "i32",
    "n_blocks": "i32",
    "count": "i32",
    "eps": "fp32",
    "amax_eps": "fp32",
}
_NORM_CONST = dict(
    CENTER=True, HAS_B=True, ZERO_CENTERED=False, NVFP4=False, POW2=True, MANT=3, BIAS=7, MIN_NORMAL=2.0**-6,
    SUB_STEPS=512.0, MAXV=448.0, INF_SCALE=bq.inf_scale(torch.bfloat16), BITS=True, BLOCK_R=4, BLOCK_N=1024,
    CB=128, COMPUTE=tl.float32,
)  # fmt: skip

VARIANTS = {
    "norm_fp8_block_layer": (nbq._norm_block_cast_kernel, _NORM_ARGS, _NORM_CONST),
    "norm_nvfp4_rms_dequant": (
        nbq._norm_block_cast_kernel,
        {**_NORM_ARGS, "Q": "*bf16", "S": "*u8"},
        {**_NORM_CONST, "CENTER": False, "HAS_B": False, "NVFP4": True, "BITS": False, "CB": 16},
    ),
    "fp8_1x128": (bq._fp8_block_kernel, _FP8_ARGS, _FP8_CONST),
    "fp8_1x128_swiglu_dequant": (
        bq._fp8_block_kernel,
        {**_FP8_ARGS, "Q": "*bf16"},
        {**_FP8_CONST, "MODE": 1, "ACT": 4, "GATED": True, "DEQUANT": True},
    ),
    "fp8_1x128_clamped_swiglu": (
        bq._fp8_block_kernel,
        _FP8_ARGS,
        {**_FP8_CONST, "MODE": 1, "GATED": True, "CLAMPED": True},
    ),
    "fp8_1x128_gelu_keep": (  # the activation's output stored too (cast_act_block_keep)
        bq._fp8_block_kernel,
        {**_FP8_ARGS, "Q": "*bf16", "H": "*bf16"},
        {**_FP8_CONST, "MODE": 1, "ACT": _act.ACTIVATIONS["gelu"], "DEQUANT": True, "KEEP": True},
    ),
    "fp8_128x128": (
        bq._fp8_block_kernel,
        _FP8_ARGS,
        {**_FP8_CONST, "TILE_ROWS": 128, "ROW_CHUNK": 32, "BLOCK_RB": 1, "BLOCK_CB": 1, "POW2": False},
    ),
    "nvfp4_1x16_packed": (nv._nvfp4_kernel, _NV_ARGS, _NV_CONST),
    "nvfp4_1x16_sr_gelu": (nv._nvfp4_kernel, _NV_ARGS, {**_NV_CONST, "STOCHASTIC": True, "MODE": 1}),
    "nvfp4_16x16_wide": (
        nv._nvfp4_kernel,
        {**_NV_ARGS, "Q": "*bf16"},
        {**_NV_CONST, "TILE_ROWS": 16, "BLOCK_RB": 1, "PACKED": False},
    ),
    "fp8_block_dequantize": (
        bq._fp8_block_dequantize_kernel,
        {"D": "*u8", "S": "*fp32", "Y": "*bf16", "n_rows": "i32", "n_cols": "i32", "n_blocks": "i32"},
        {"BLOCK_ROWS": 128, "MANT": 2, "BIAS": 15, "FN": False, "BLOCK_R": 16, "BLOCK_C": 128},
    ),
    "nvfp4_dequantize": (
        nv._nvfp4_dequantize_kernel,
        {"D": "*u8", "S": "*u8", "G": "*fp32", "Y": "*fp32", "n_rows": "i32", "n_cols": "i32", "n_blocks": "i32"},
        {"BLOCK_ROWS": 16, "BLOCK_R": 16, "BLOCK_C": 128},
    ),
    "rht16": (
        hd._rht_kernel,
        {"X": "*bf16", "SEED": "*i64", "Y": "*fp32", "n_rows": "i32"},
        {"INVERSE": False, "BLOCK_R": 64, "COMPUTE": tl.float32},
    ),
}


@pytest.fixture(scope="module", autouse=True)
def _interpreted_first():
    """Interpret kernels that call Triton's own helpers (tl.max, tl.zeros_like) before compiling:
    Triton's interpreter used to leave triton.language patched after such device-function calls
    (functe.kernels._triton restores it), which broke every later compile in the process."""
    import torch

    import functe

    x = torch.randn(4, 32)
    with functe.use_backend("interpret"):
        nv.nvfp4_cast(x, x.abs().max(), torch.tensor(1), "", 0.0, 0.0, 0.0, 1, True, torch.uint8)
        hd.rht16(x, torch.tensor(1), False, torch.float32)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_kernel_compiles_for_sm90(name, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a fresh compile, isolated from other processes
    fn, args, consts = VARIANTS[name]
    signature = {**args, **dict.fromkeys(consts, "constexpr")}
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=consts), target=GPUTarget("cuda", 90, 32)
    )
    assert compiled.asm["cubin"]
