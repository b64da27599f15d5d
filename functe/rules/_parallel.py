"""Conditions that keep fusions away from tensor-parallel linears (TransformerEngine's rules).

A parallel linear (``ops.linear`` / ``ops.fp8_linear`` with ``tensor_parallel_mode``) carries a
:class:`functe.LinearParallelism` in its ``parallel`` parameter, and its rules communicate around
the GEMMs (``functe/_parallel.py``). A fused op that replaces the linear's forward or backward
does not communicate, so a rule covering such a linear must decline where the communication sits
between the GEMM and what the fusion folds into it:

* **forward** (GEMM epilogues: residual add, scale, bias + activation, output cast): decline a
  row-parallel linear (its GEMM output is a partial sum, reduced across ranks first; TE's
  ForwardLinear* fusions require "not row-TP") and a column-parallel one with sequence
  parallelism (its input is all-gathered before the GEMM);
* **backward** (dgrad accumulating a residual's gradient, a scale as alpha): decline a
  column-parallel linear (dx is a partial sum, reduced across ranks after the dgrad; TE's
  BackwardLinear* fusions require "not column-TP") and a row-parallel one with sequence
  parallelism (dy is all-gathered before the GEMMs).

Every rule whose match covers a linear calls :func:`forward_parallel_reason` or
:func:`backward_parallel_reason` (for its phase) in its condition.
"""

from __future__ import annotations

from collections.abc import Callable

from ._pattern import Match


def _parallel_linears(m: Match):
    for eqn in m.covered:
        parallel = eqn.params.get("parallel")
        if parallel is not None and parallel.mode is not None:
            yield eqn, parallel


def forward_parallel_reason(m: Match) -> str | None:
    """Why a forward fusion covering a tensor-parallel linear declines (``None``: it need not).

    Example (a plain linear fuses; ``docs/parallel.md`` shows the tensor-parallel declines):
        >>> import torch, functe
        >>> from functe import ops
        >>> from functe.rules import DEFAULT_RULES, rewrite
        >>> args = torch.ones(4, 8), torch.ones(16, 8), torch.ones(4, 16)
        >>> program = functe.trace(lambda x, w, r: ops.linear(x, w) + r)(*args)
        >>> rewrite(program, DEFAULT_RULES, "forward")[1].fired  # its condition is forward_parallel_reason
        {'forward_linear_bias_add': 1}
    """
    for eqn, p in _parallel_linears(m):
        if p.mode == "row":
            return (
                f"row tensor-parallel {eqn.name}: its GEMM output is a partial sum that is "
                f"{'reduce-scattered' if p.sequence_parallel else 'all-reduced'} across ranks before the bias and "
                "anything after it apply, so no GEMM epilogue can fuse (TE: not with row tensor parallelism)"
            )
        if p.gathers_input:
            return (
                f"column tensor-parallel {eqn.name} with sequence parallelism: its input is all-gathered before the "
                "GEMM, which the fused op does not do"
            )
    return None


def backward_parallel_reason(m: Match) -> str | None:
    """Why a backward fusion covering a tensor-parallel linear declines (``None``: it need not).

    Example (a plain linear fuses; ``docs/parallel.md`` shows the tensor-parallel declines):
        >>> import torch, functe
        >>> from functe import ops
        >>> from functe.rules import DEFAULT_RULES, rewrite
        >>> program = functe.trace(lambda x, w: ops.linear(x, w) * 0.5)(torch.ones(4, 8), torch.ones(16, 8))
        >>> rewrite(program, DEFAULT_RULES, "backward")[1].fired  # its condition is backward_parallel_reason
        {'backward_linear_scale': 1}
    """
    for eqn, p in _parallel_linears(m):
        if p.mode == "column":
            return (
                f"column tensor-parallel {eqn.name}: dx is a partial sum that is "
                f"{'reduce-scattered' if p.sequence_parallel else 'all-reduced'} across ranks after the dgrad GEMM, "
                "which the fused backward does not do (TE: not with column tensor parallelism)"
            )
        if p.gathers_grad_output:
            return (
                f"row tensor-parallel {eqn.name} with sequence parallelism: dy is all-gathered before the GEMMs, "
                "which the fused backward does not do"
            )
    return None


def any_parallel_reason(m: Match) -> str | None:
    """Why a fusion around a tensor-parallel FP8 linear declines, in either phase.

    The fused FP8 ops (q-in casts, dact + dbias + cast) call the linear's quantized forward or
    backward directly, which do not communicate activations, so any tensor-parallel mode keeps the
    unfused ops. An ``amax_group`` alone (data-parallel replicas) fuses: the fused op's backward
    reduces the amaxes over the group as the linear's does (see :func:`amax_group_param`).

    Example (an FP8 linear without parallelism fuses with its activation's backward):
        >>> import torch, functe
        >>> from functe import ops
        >>> from functe.rules import DEFAULT_RULES, rewrite
        >>> recipe = functe.CurrentScaling()
        >>> fn = lambda x, w: ops.gelu(ops.fp8_linear(x, w, None, None, recipe=recipe))
        >>> program = functe.trace(fn)(torch.ones(4, 16), torch.ones(16, 16))
        >>> rewrite(program, DEFAULT_RULES, "backward", recipe=recipe)[1].fired
        {'backward_fp8_linear_activation': 1}
    """
    for eqn, p in _parallel_linears(m):
        return (
            f"{p.mode} tensor-parallel {eqn.name}: the fused FP8 op does not communicate, so the linear "
            "keeps its own rules"
        )
    return None


def amax_group_param(m: Match, name: str) -> dict:
    """``{"parallel": p}`` for the FP8 linear captured as ``name`` when it reduces its amaxes over
    more than one rank (an ``amax_group``, no tensor-parallel mode: :func:`any_parallel_reason`
    declined the others), else ``{}``: the fused op's backward reduces the amaxes over the group,
    as the linear's own does; before, each replica's fused state silently followed its own batch."""
    p = m.params(name).get("parallel")
    return {"parallel": p} if p is not None and p.amax_group.size > 1 else {}


def first_reason(*conditions: Callable[[Match], str | None]) -> Callable[[Match], str | None]:
    """A condition declining with the first reason any of ``conditions`` gives.

    Example:
        >>> condition = first_reason(lambda m: None, lambda m: "second says no", lambda m: "third")
        >>> condition(None)
        'second says no'
    """

    def condition(m: Match) -> str | None:
        for c in conditions:
            if (reason := c(m)) is not None:
                return reason
        return None

    return condition


def linear_parallel_param(m: Match, name: str) -> dict:
    """``{"parallel": p}`` for the linear captured as ``name`` if it is tensor-parallel, else ``{}``
    (op lists of plain programs unchanged). Backward rules over a row-parallel linear pass it to
    the fused op, which runs the linear's own backward (it marks the replicated ``dy``)."""
    p = m.params(name).get("parallel")
    return {} if p is None else {"parallel": p}
