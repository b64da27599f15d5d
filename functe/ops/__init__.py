"""functe's ops: pure functions, all ``torch.func``-compatible.

Every op is defined with :func:`functe.custom_vjp`, takes tensors of any leading
shape in fp32/fp16/bf16 (fp64 for checks), and runs Triton kernels on CUDA and
PyTorch twins on CPU (see :mod:`functe._backend`).
"""

from ._activation import ACTIVATION_NAMES as ACTIVATION_NAMES
from ._activation import activation as activation
from ._activation import clamped_swiglu as clamped_swiglu
from ._activation import geglu as geglu
from ._activation import gelu as gelu
from ._activation import glu as glu
from ._activation import qgeglu as qgeglu
from ._activation import qgelu as qgelu
from ._activation import reglu as reglu
from ._activation import relu as relu
from ._activation import scaled_clamped_qgeglu as scaled_clamped_qgeglu
from ._activation import scaled_srelu as scaled_srelu
from ._activation import scaled_swiglu as scaled_swiglu
from ._activation import silu as silu
from ._activation import sreglu as sreglu
from ._activation import srelu as srelu
from ._activation import swiglu as swiglu
from ._core import add_extra_input as add_extra_input
from ._core import bias as bias
from ._core import constant_scale as constant_scale
from ._core import identity as identity
from ._core import linear as linear
from ._core import make_extra_output as make_extra_output
from ._core import reshape as reshape
from ._dropout import dropout as dropout
from ._fp8_linear import fp8_linear as fp8_linear
from ._norm import l2_normalize as l2_normalize
from ._norm import layer_norm as layer_norm
from ._norm import rms_norm as rms_norm
from ._parallel import all_gather as all_gather
from ._parallel import all_reduce as all_reduce
from ._parallel import reduce_scatter as reduce_scatter

__all__ = [
    "ACTIVATION_NAMES",
    "activation",
    "add_extra_input",
    "all_gather",
    "all_reduce",
    "bias",
    "clamped_swiglu",
    "constant_scale",
    "dropout",
    "fp8_linear",
    "geglu",
    "gelu",
    "glu",
    "identity",
    "l2_normalize",
    "layer_norm",
    "linear",
    "make_extra_output",
    "qgeglu",
    "qgelu",
    "reduce_scatter",
    "reglu",
    "relu",
    "reshape",
    "rms_norm",
    "scaled_clamped_qgeglu",
    "scaled_srelu",
    "scaled_swiglu",
    "silu",
    "sreglu",
    "srelu",
    "swiglu",
]
