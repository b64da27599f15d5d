"""Launch configurations of the GEMM kernel.

* On a GPU the kernel is autotuned (``triton.autotune``, keyed on M, N, K and
  the operand dtypes) over one list per operand class. The lists target Hopper
  (H100/H200): 128x256 / 256x128 tiles with 8 warps and 3 stages for 16-bit
  operands, BLOCK_K = 128 for FP8 (twice the elements per byte), smaller tiles
  for skinny shapes, grouped program order (GROUP_M = 8, so that consecutive
  programs reuse the same B columns from L2), and persistent variants (one
  program per SM looping over tiles), which the autotuner keeps only where they
  win. **None of these lists has been measured yet** (no GPU was available when
  they were written); ``benchmarks/bench_gemm.py`` is the script to do it.
* Under Triton's interpreter (tests on CPU) one small fixed configuration is
  used, so tests stay fast; its blocks are still >= 16, as ``tl.dot`` requires
  on a GPU.
"""

from __future__ import annotations

import triton

INTERPRET: dict = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "PERSISTENT": False}
"""The interpreter's configuration (tests may swap it to exercise other paths)."""

INTERPRET_PROGRAMS = 4
"""Programs of a persistent launch under the interpreter (stands in for the SM count)."""


def _config(bm: int, bn: int, bk: int, warps: int, stages: int, *, group: int = 8, persistent: bool = False):
    meta = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group, "PERSISTENT": persistent}
    return triton.Config(meta, num_warps=warps, num_stages=stages)


HOPPER_16BIT = [
    _config(128, 256, 64, 8, 3),
    _config(256, 128, 64, 8, 3),
    _config(128, 128, 64, 8, 4),
    _config(128, 128, 64, 4, 4),
    _config(128, 64, 64, 4, 4),
    _config(64, 128, 64, 4, 4),
    _config(64, 64, 64, 4, 5),
    _config(128, 256, 64, 8, 3, persistent=True),
    _config(128, 128, 64, 8, 4, persistent=True),
]
"""fp16/bf16 operands (wgmma tiles; 64-wide K slices of 2-byte elements = 128-byte rows)."""

HOPPER_FP8 = [
    _config(128, 256, 128, 8, 3),
    _config(256, 128, 128, 8, 3),
    _config(128, 128, 128, 8, 4),
    _config(128, 128, 128, 4, 4),
    _config(64, 128, 128, 4, 4),
    _config(64, 64, 128, 4, 5),
    _config(128, 256, 128, 8, 3, persistent=True),
    _config(128, 128, 128, 8, 4, persistent=True),
]
"""FP8 operands (same byte footprint per stage as 16-bit with BLOCK_K = 128)."""

WIDE = [
    _config(64, 64, 32, 4, 3),
    _config(128, 64, 32, 4, 3),
    _config(64, 128, 32, 4, 3),
    _config(32, 32, 32, 4, 2),
]
"""fp32 (IEEE, no TF32) and fp64 operands: accuracy paths (references, gradcheck), not tuned for speed."""


def configs_for(operand_bytes: int) -> list:
    """The autotune list for operands of ``operand_bytes`` bytes per element."""
    return HOPPER_FP8 if operand_bytes == 1 else HOPPER_16BIT if operand_bytes == 2 else WIDE


def smallest_tile(configs: list) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)`` bounds giving the most tiles any config of ``configs`` can launch."""
    return min(c.kwargs["BLOCK_M"] for c in configs), min(c.kwargs["BLOCK_N"] for c in configs)
