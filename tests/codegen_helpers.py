"""Compiling Triton kernels for a GPU target on a machine without one (Triton's bundled ptxas)."""

from __future__ import annotations

import os

import triton

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    HAVE_PTXAS = os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))
except ImportError:  # pragma: no cover - other Triton layouts
    GPUTarget = ASTSource = None
    HAVE_PTXAS = False

__all__ = ["HAVE_PTXAS", "ASTSource", "GPUTarget", "triton"]
