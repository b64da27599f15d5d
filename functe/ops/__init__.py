"""functe's ops: pure functions, all ``torch.func``-compatible.

Every op is defined with :func:`functe.custom_vjp`, takes tensors of any leading
shape in fp32/fp16/bf16 (fp64 for checks), and runs Triton kernels on CUDA and
PyTorch twins on CPU (see :mod:`functe._backend`).
"""

from ._core import add_extra_input as add_extra_input
from ._core import bias as bias
from ._core import constant_scale as constant_scale
from ._core import identity as identity
from ._core import linear as linear
from ._core import make_extra_output as make_extra_output
from ._core import reshape as reshape
from ._fp8_linear import fp8_linear as fp8_linear

__all__ = [
    "add_extra_input",
    "bias",
    "constant_scale",
    "fp8_linear",
    "identity",
    "linear",
    "make_extra_output",
    "reshape",
]
