"""The op-list IR: the canonical printer, the validator, and dependency ordering."""

from __future__ import annotations

import pytest
import torch

import functe
from functe import ops
from functe._oplist import Eqn, Literal, OpList, Var, check_oplist, toposort
from functe.ops import _core

F32 = torch.float32
CPU = torch.device("cpu")


def _v(*shape, dtype=F32):
    return Var(shape, dtype, CPU)


def test_printer_golden_params_literals_and_multiple_outputs():
    a, b, c = _v(4, 8), _v(6, 8), _v(4, 6)
    d, e, f, g = _v(4, 6), _v(4, 6), _v(4, 6), _v(4, 6)
    const = torch.ones(6, dtype=torch.bfloat16)
    oplist = OpList(
        [a, b, c],
        [
            Eqn(_core._linear, [a, b, Literal(None)], [d]),
            Eqn(_core._constant_scale, [d], [e], {"scale": -2.5}),
            Eqn(_core._make_extra_output, [e], [f, g]),
            Eqn(_core._add_extra_input, [f, Literal(const)], [_v(4, 6)]),
        ],
        [g, c],
    )
    assert str(oplist) == (
        "{ lambda a:f32[4,8] b:f32[6,8] c:f32[4,6]. let\n"
        "    d:f32[4,6] = linear a b None\n"
        "    e:f32[4,6] = constant_scale[scale=-2.5] d\n"
        "    f:f32[4,6] g:f32[4,6] = make_extra_output e\n"
        "    h:f32[4,6] = add_extra_input f const:bf16[6]\n"
        "  in (g, c) }"
    )
    check_oplist(oplist)


def test_names_continue_past_z_and_distinct_ops_sharing_a_name_are_told_apart():
    xs = [_v(3) for _ in range(30)]
    other = functe.custom_vjp("identity", lambda x: (x, None), lambda _, g: (g,))
    eqns = [Eqn(_core._identity, [xs[0]], [xs[1]]), Eqn(other, [xs[1]], [xs[2]])]
    eqns += [Eqn(_core._identity, [xs[i]], [xs[i + 1]]) for i in range(2, 29)]
    text = str(OpList([xs[0]], eqns, [xs[29]]))
    assert "    c:f32[3] = identity#2 b\n" in text
    assert "    ba:f32[3] = identity z\n" in text and text.endswith("  in (bd,) }")


def test_trace_records_pytree_structure_and_static_leaves():
    def fn(params, x, *, mode):
        return ops.linear(x, params["w"], params["b"]) if mode == "bias" else ops.linear(x, params["w"])

    params = {"w": torch.zeros(5, 3), "b": torch.zeros(5)}
    oplist = functe.trace(fn)(params, torch.zeros(2, 3), mode="bias")
    # optree orders dict keys: b, w, then x
    assert str(oplist).splitlines()[0] == "{ lambda a:f32[5] b:f32[5,3] c:f32[2,3]. let"
    assert list(oplist.static.values()) == ["bias"]
    assert oplist.in_tree.num_leaves == 4  # b, w, x and the static "bias"
    check_oplist(oplist)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a, d, e: [Eqn(_core._identity, [e], [d]), Eqn(_core._identity, [a], [e])], "uses Var.* before"),
        (lambda a, d, e: [Eqn(_core._identity, [a], [d]), Eqn(_core._identity, [a], [d])], "redefines"),
        (lambda a, d, e: [Eqn(_core._identity, [a, a], [d])], "has 2 inputs, its in_tree 1"),
        (lambda a, d, e: [Eqn(_core._identity, ["a"], [d])], "expected a Var or Literal"),
        (lambda a, d, e: [Eqn(_core._identity, [a], [d], phase="forward")], "needs both a phase and covers"),
    ],
    ids=["use-before-def", "redefine", "arity", "bad-atom", "fused-without-covers"],
)
def test_validator_names_the_problem(mutate, message):
    a, d, e = _v(3), _v(3), _v(3)
    eqns = mutate(a, d, e)
    if "in_tree 1" in message:
        eqns = [eqns[0].replace(in_tree=functe._oplist.flat_spec(1))]
    with pytest.raises(functe.TraceError, match=r"functe\.check_oplist: .*" + message):
        check_oplist(OpList([a], eqns, [d]))


def test_validator_rejects_undefined_outputs():
    a = _v(3)
    with pytest.raises(functe.TraceError, match="the program outputs uses"):
        check_oplist(OpList([a], [], [_v(3)]))


def test_toposort_keeps_priority_and_detects_cycles():
    a, b, c = _v(2), _v(2), _v(2)
    e1 = Eqn(_core._identity, [a], [b])
    e2 = Eqn(_core._identity, [b], [c])
    e3 = Eqn(_core._identity, [a], [_v(2)])
    assert toposort([e2, e1, e3], {e1: 5.0, e2: 0.0, e3: 1.0}) == [e3, e1, e2]
    loop = Eqn(_core._identity, [c], [a])
    assert toposort([e1, e2, loop], {e1: 0.0, e2: 1.0, loop: 2.0}) is None


def test_eqn_replace_and_originals():
    a, b = _v(2), _v(2)
    e = Eqn(_core._identity, [a], [b])
    fused = e.replace(op=_core._reshape, params={"shape": (2,)}, covers=(e,), phase="forward")
    assert fused.originals == (e,) and e.originals == (e,)
    assert fused.params == {"shape": (2,)} and e.params == {}
