"""functe: TransformerEngine's fusible ops as pure functions over PyTorch tensors.

Ops live in :mod:`functe.ops`. State is explicit (:class:`ScalingState`), ops are
defined with :func:`custom_vjp`, and kernels dispatch by device and backend
(:func:`use_backend`).
"""

from . import ops as ops
from . import rules as rules
from ._backend import BACKENDS as BACKENDS
from ._backend import get_backend as get_backend
from ._backend import set_backend as set_backend
from ._backend import use_backend as use_backend
from ._checkpoint import load_tree as load_tree
from ._checkpoint import save_tree as save_tree
from ._checkpoint import tree_from_dict as tree_from_dict
from ._checkpoint import tree_to_dict as tree_to_dict
from ._collectives import Group as Group
from ._collectives import collective_checks as collective_checks
from ._collectives import set_collective_checks as set_collective_checks
from ._data_parallel import all_reduce_gradients as all_reduce_gradients
from ._data_parallel import data_parallel_value_and_grad as data_parallel_value_and_grad
from ._errors import ArgumentError as ArgumentError
from ._errors import DeviceError as DeviceError
from ._errors import DistributedError as DistributedError
from ._errors import DTypeError as DTypeError
from ._errors import FuncteError as FuncteError
from ._errors import RecipeError as RecipeError
from ._errors import RuleError as RuleError
from ._errors import ShapeError as ShapeError
from ._errors import StateError as StateError
from ._errors import TraceError as TraceError
from ._errors import TransformError as TransformError
from ._fp8_state import LinearScalingState as LinearScalingState
from ._fp8_state import combine_state_gradients as combine_state_gradients
from ._fp8_state import current_scale as current_scale
from ._fp8_state import delayed_scaling_update as delayed_scaling_update
from ._fp8_state import init_linear_scaling_state as init_linear_scaling_state
from ._fp8_state import share_state as share_state
from ._fp8_state import state_from_gradient as state_from_gradient
from ._fuse import Fused as Fused
from ._fuse import Plan as Plan
from ._fuse import RetraceWarning as RetraceWarning
from ._fuse import explain as explain
from ._fuse import fuse as fuse
from ._opaque import opaque as opaque
from ._oplist import Eqn as Eqn
from ._oplist import Literal as Literal
from ._oplist import OpList as OpList
from ._oplist import Var as Var
from ._oplist import check_oplist as check_oplist
from ._parallel import LinearParallelism as LinearParallelism
from ._quantize import QuantizedTensor as QuantizedTensor
from ._quantize import dequantize as dequantize
from ._quantize import quantize as quantize
from ._recipe import CurrentScaling as CurrentScaling
from ._recipe import DelayedScaling as DelayedScaling
from ._recipe import Float8BlockScaling as Float8BlockScaling
from ._recipe import Format as Format
from ._recipe import MXFP8BlockScaling as MXFP8BlockScaling
from ._recipe import NVFP4BlockScaling as NVFP4BlockScaling
from ._state import ScalingState as ScalingState
from ._state import init_scaling_state as init_scaling_state
from ._trace import UnwatchedConstantWarning as UnwatchedConstantWarning
from ._trace import trace as trace
from ._train import value_and_grad as value_and_grad
from ._tree import pytree_dataclass as pytree_dataclass
from ._tree import tree_flatten as tree_flatten
from ._tree import tree_leaves as tree_leaves
from ._tree import tree_map as tree_map
from ._tree import tree_structure as tree_structure
from ._tree import tree_unflatten as tree_unflatten
from ._vjp import CustomVJP as CustomVJP
from ._vjp import custom_vjp as custom_vjp

__version__ = "0.1.0"
