"""Backend selection: which implementation of a kernel runs for a given tensor.

There are three backends:

* ``"auto"`` (the default): CUDA tensors run the Triton kernels, CPU tensors run
  the PyTorch twins.
* ``"torch"``: the PyTorch twins everywhere (a reference run on GPU).
* ``"interpret"``: the Triton kernels everywhere; on CPU they run through
  Triton's interpreter. This is how the test suite checks every kernel on a
  machine without a GPU. It needs numpy (Triton's interpreter imports it).

The choice is read from the ``FUNCTE_BACKEND`` environment variable at import,
can be set with :func:`set_backend`, and can be overridden for a block with
:func:`use_backend`. It is configuration, not state: no op result depends on it
beyond floating-point rounding.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch.autograd import forward_ad as _forward_ad

from ._errors import ArgumentError
from ._scoped import ScopedSetting

BACKENDS = ("auto", "torch", "interpret")


def _validated(name: str, where: str) -> str:
    """``name`` if it is a backend; ``where`` says where it was given, as the message starts."""
    if name not in BACKENDS:
        raise ArgumentError(f"{where} expected one of {BACKENDS}, got {name!r}")
    return name


def _publish(name: str) -> None:
    global _current
    _current = name


# A plain module global, not a ContextVar: torch.compile cannot trace
# ContextVar.get, and reads of a global are guarded (a change recompiles).
_current = "auto"
_setting = ScopedSetting(
    _validated(os.environ.get("FUNCTE_BACKEND", "auto") or "auto", "functe: the environment variable FUNCTE_BACKEND"),
    _publish,
)


def get_backend() -> str:
    """The backend in force: the innermost :func:`use_backend`, else the global one.

    Example:
        >>> get_backend() in BACKENDS
        True
    """
    return _current


def set_backend(name: str) -> None:
    """Set the global backend (``"auto"``, ``"torch"`` or ``"interpret"``): the one in force where no
    :func:`use_backend` block is open.

    Example:
        >>> import functe
        >>> previous = functe.get_backend()
        >>> functe.set_backend("torch"); functe.get_backend()
        'torch'
        >>> functe.set_backend(previous)  # (or functe.use_backend for a scoped change)
    """
    _setting.set_default(_validated(name, "functe.set_backend: argument 'name'"))


@contextlib.contextmanager
def use_backend(name: str):
    """Use backend ``name`` inside a ``with`` block.

    The setting is process-wide: while the block is open every thread sees it (the newest open
    block wins, wherever it was opened), and closing it restores what the other open blocks, or
    :func:`set_backend`, say (see docs/design.md, "Settings").

    Example:
        >>> import torch, functe
        >>> with functe.use_backend("torch"):
        ...     y = functe.ops.constant_scale(torch.ones(3), 2.0)
        >>> y.tolist()
        [2.0, 2.0, 2.0]
    """
    with _setting.scoped(_validated(name, "functe.use_backend: argument 'name'")):
        yield


# Tensor types that are plain tensors to a kernel: nn.Parameter disables __torch_function__, so
# nothing observes a twin's fast path on it (other subclasses, tracers and fake tensors may)
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def runs_triton(device: torch.device) -> bool:
    """Whether a kernel on ``device`` runs as Triton (compiled or interpreted)."""
    backend = _current
    if backend == "torch":
        return False
    if backend == "interpret":
        return True
    return device.type == "cuda"


def runs_triton_on(tensor: torch.Tensor) -> bool:
    """``runs_triton(tensor.device)``, reading a plain tensor's ``is_cuda`` under ``"auto"``:
    ``device.type`` costs ~1.5 us a read on the per-kernel-call path (a subclass, a fake tensor say,
    is asked its device)."""
    if _current == "auto" and type(tensor) in PLAIN_TENSOR_TYPES:
        return tensor.is_cuda
    return runs_triton(tensor.device)


def interpreting() -> bool:
    """Whether Triton launches must go through the interpreter."""
    return _current == "interpret"


def forward_ad_active() -> bool:
    """Whether a ``torch.autograd.forward_ad`` dual level is open (a cheap first test; see
    :func:`any_tangent` for whether a tensor is actually dual)."""
    return _forward_ad._current_level >= 0


def has_values(t: torch.Tensor) -> bool:
    """Whether ``t`` holds values a check could read back (not a meta or fake tensor: shapes only)."""
    return t.device.type != "meta" and not torch._subclasses.fake_tensor.is_fake(t)


def any_tangent(tensors) -> bool:
    """Whether one of ``tensors`` carries a tangent at the open ``torch.autograd.forward_ad`` level.

    An op given one must record it: the Function route (its ``jvp`` rule), no ``out=`` fast paths
    (forward AD refuses them) and no donated buffers (an in-place write would also change a dual
    argument's tangent). False with no level open or with forward grad mode off (inside a
    Function's ``forward`` nothing is dual), so those paths keep their bits. ``torch.func.jvp``
    is seen separately, through its wrapped tensors.
    """
    level = _forward_ad._current_level
    if level < 0 or not torch._C._is_fwd_grad_enabled():
        return False
    return any(
        isinstance(t, torch.Tensor) and not _is_wrapped(t) and _unpack_dual(t, level=level)[1] is not None
        for t in tensors
    )


def records(values) -> bool:
    """Whether autograd or a torch.func transform records an op on ``values`` (tensors among other
    arguments): one requires grad under grad mode, is a transform's wrapper, or carries a forward-mode
    tangent. An op then takes its Function, and must not write into a caller's buffer."""
    grad = torch.is_grad_enabled()
    for t in values:
        if isinstance(t, torch.Tensor) and ((grad and t.requires_grad) or _is_wrapped(t)):
            return True
    return any_tangent(values)


def donatable(target: torch.Tensor, others) -> bool:
    """Whether an op may write its result into ``target``, a buffer its caller donated, given the
    op's other tensor arguments ``others``: no autograd layer records the op (it would see the write),
    ``target`` is contiguous (no stride-0 broadcast), and no other argument shares its storage (an
    overlapping write raises, or changes an operand the op still reads; the same tensor passed twice
    counts), nor does any other live tensor: a view of it or its base (the write would show through
    ``make_extra_output``'s other output, or a caller's tensor that ``identity`` or ``reshape``
    viewed; ``_storage_Use_Count`` counts the storage's holders, 2 for a tensor alone: itself and
    the storage object asked). An inference tensor outside ``torch.inference_mode`` is not written
    either (torch forbids it: "Inplace update to inference tensor outside InferenceMode")."""
    if records((target, *others)) or not target.is_contiguous():
        return False
    if target.is_inference() and not torch.is_inference_mode_enabled():
        return False
    storage = target.untyped_storage()
    if torch._C._storage_Use_Count(storage._cdata) > 2:
        return False
    return all(t.untyped_storage().data_ptr() != storage.data_ptr() for t in others)


def result_view(x: torch.Tensor) -> torch.Tensor:
    """An op that returns its argument unchanged (dropout with p = 0, a collective on one rank) returns
    a view of it, not the caller's tensor itself: a result the caller then donates
    (``add_extra_input(..., in_place=True)``) would be written with the caller's tensor, where a view
    counts as another holder of its storage (:func:`donatable`). A trace's value or a fake tensor passes
    through unchanged (a trace records no op here). (Sparse and nested tensors, which have no view_as,
    never get here: check_tensor refuses them.)"""
    return x.view_as(x) if type(x) in PLAIN_TENSOR_TYPES else x


_unpack_dual = torch._VF._unpack_dual
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor  # (torch.func's own duals: not read here)


def unaliased_outputs(outputs: list, inputs) -> tuple[list, dict[int, torch.Tensor]]:
    """A Function's ``outputs`` with each view of a buffer the op made (a kernel's ``y.view(shape)``)
    replaced by its ``detach()``; also ``{id(view): replacement}``.

    ``detach()`` keeps the memory and the version counter, but autograd no longer sees a view, and
    autograd refuses an in-place op on a view a custom Function returned ("Output 0 of dropout is a
    view and is being modified inplace") where torch's own ops allow ``y.mul_(2)``. Left as views:
    views of an input (an in-place write must reach the input's history, so autograd refusing it
    is right), of another output, and of a buffer two outputs share (writing one would change the
    other behind autograd's back). A residual saved from the same buffer still catches a write
    through the shared version counter ("modified by an inplace operation"), as torch's ops do.
    """
    if torch.compiler.is_compiling():
        return _unaliased_compiled(outputs, inputs), _NOTHING_SWAPPED
    swapped = None
    for o in outputs:
        if type(o) in PLAIN_TENSOR_TYPES and o._is_view():
            base = o._base
            # (detach() would drop a tangent: a forward rule run on duals, or under torch.func.jvp)
            if _owned(base, inputs, outputs) and not _is_wrapped(o) and not (forward_ad_active() and any_tangent((o,))):
                if swapped is None:
                    swapped = {}
                swapped[id(o)] = (base, o.detach())
    if swapped is None:
        return outputs, _NOTHING_SWAPPED
    if len(swapped) > 1:  # (views of one buffer stay views: writing one would change the other)
        bases = [id(base) for base, _ in swapped.values()]
        swapped = {k: v for k, v in swapped.items() if bases.count(id(v[0])) == 1}
    replaced = {k: detached for k, (_, detached) in swapped.items()}
    return [replaced.get(id(o), o) for o in outputs], replaced


_NOTHING_SWAPPED: dict = {}


def _unaliased_compiled(outputs: list, inputs) -> list:
    """:func:`unaliased_outputs` as Dynamo traces it: ``_base`` (Dynamo does not trace ``_is_view``).
    Needed as eagerly: a compiled graph returns a view the Function made as a view of the graph's
    intermediate, which refuses an in-place write ("Output 0 of CompiledFunction is a view"): a 1-D
    or biased ``linear``'s output (torch's GEMM result reshaped). No replacements are reported: the
    compiled Function's residuals are not swapped (a detached view shares the version counter)."""
    bases = [o._base if isinstance(o, torch.Tensor) else None for o in outputs]
    if all(base is None for base in bases):
        return outputs
    result = list(outputs)
    for k, base in enumerate(bases):
        if base is not None and _owned(base, inputs, outputs) and sum(b is base for b in bases) == 1:
            result[k] = outputs[k].detach()
    return result


def _owned(base: torch.Tensor, inputs, outputs) -> bool:
    """Whether ``base`` is none of ``inputs`` (nor an input's base) and none of ``outputs``."""
    for a in inputs:
        if a is base or (type(a) in PLAIN_TENSOR_TYPES and a._base is base):
            return False
    for o in outputs:
        if o is base:
            return False
    return True
