"""Pickling: ops and rules load by reference, fused functions without their plans."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from helpers import make

import functe
from functe import ops
from functe.ops import _core
from functe.rules import DEFAULT_RULES, Pattern, Rule, RuleSet
from functe.testing import assert_close


def _cube_fwd(x):
    return x**3, x


def _cube_bwd(x, g):
    return (3 * x**2 * g,)


CUBE = functe.custom_vjp("cube", _cube_fwd, _cube_bwd)
# (an op made here from another package's rules: found where it was made, not only in its rules' module)
IDENTITY_AGAIN = functe.custom_vjp("identity_again", _core._identity_fwd, _core._identity_bwd)


def _scale_twice(m):
    return m.fuse(_core._constant_scale, [m["x"]], scale=m.eqns["outer"].params["scale"] * 2.0)


# (a user's rule at module level: it pickles by reference, its condition a lambda notwithstanding)
DOUBLE_SCALE = Rule(
    "double_scale",
    "forward",
    Pattern(_core._constant_scale, "x", name="outer"),
    _scale_twice,
    condition=lambda m: None,
)


def _block(x, w, b, r):
    return ops.gelu(ops.linear(x, w, b)) + r


class _FrozenMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8).requires_grad_(False)
        self.fused = functe.fuse(self._impl)

    def _impl(self, x):
        return ops.gelu(ops.linear(x, self.fc.weight, self.fc.bias)) + x

    def forward(self, x):
        return self.fused(x)


def _round_trip(obj):
    return pickle.loads(pickle.dumps(obj))


def test_ops_and_rule_sets_load_by_reference():
    # (every op's rules are wrapped to run without autocast: "Can't pickle <function _linear_fwd>:
    # it's not the same object as functe.ops._core._linear_fwd", for every rule set and fused function)
    loaded = _round_trip(DEFAULT_RULES + DOUBLE_SCALE)
    assert isinstance(loaded, RuleSet) and loaded.names == (DEFAULT_RULES + DOUBLE_SCALE).names
    assert all(a is b for a, b in zip(loaded.rules, (DEFAULT_RULES + DOUBLE_SCALE).rules, strict=True))
    assert _round_trip(_core._linear) is _core._linear and _round_trip(CUBE) is CUBE
    assert _round_trip(IDENTITY_AGAIN) is IDENTITY_AGAIN


def test_an_op_or_rule_without_a_global_name_says_why_it_cannot_be_pickled():
    local = functe.custom_vjp("local_cube", _cube_fwd, _cube_bwd)
    with pytest.raises(pickle.PicklingError, match=r"functe.local_cube: .* bound to a module-level name"):
        pickle.dumps(local)
    # (a rule with no global name pickles by value: its lambda fails as any lambda does)
    rule = Rule("anonymous", "forward", Pattern(_core._constant_scale, "x"), lambda m: None)
    with pytest.raises((pickle.PicklingError, AttributeError), match="lambda"):
        pickle.dumps(rule)


def test_a_fused_function_pickles_without_its_plans_and_retraces():
    fused = functe.fuse(_block, rules=DEFAULT_RULES + DOUBLE_SCALE)
    args = [make(s) for s in ((3, 8), (8, 8), (8,), (3, 8))]
    expected = fused(*args)
    loaded = _round_trip(fused)
    assert loaded.trace_count == 0 and loaded.rules.names == fused.rules.names
    assert_close(loaded(*args), expected)
    assert loaded.trace_count == 1 and fused.trace_count == 1


def test_a_saved_module_with_a_fused_forward_computes_with_its_loaded_weights():
    model, x = _FrozenMLP(), make((3, 8))
    model(x)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert_close(loaded(x), model(x))
    with torch.no_grad():
        loaded.fc.weight.mul_(-1.0)
    assert_close(loaded(x), torch.nn.functional.gelu(x @ -model.fc.weight.T + model.fc.bias, approximate="tanh") + x)
    assert_close(model(x), torch.nn.functional.gelu(model.fc(x), approximate="tanh") + x)


def test_an_opaque_op_pickles_as_its_function():
    tanh = functe.opaque(torch.tanh, name="tanh")
    assert _round_trip(tanh) is tanh  # (the same function: opaque's table gives the same op)
    sub = torch.nn.Linear(4, 4).requires_grad_(False)
    op = functe.opaque(sub)
    loaded_sub, loaded_op = _round_trip((sub, op))
    assert loaded_op is functe.opaque(loaded_sub) and loaded_op is not op
    x = make((2, 4))
    assert_close(loaded_op(x), sub(x))


def test_a_deep_copy_of_a_module_holding_an_opaque_op_calls_its_own_submodule():
    # (copied attribute by attribute, the op kept calling the original submodule)
    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sub = torch.nn.Linear(4, 4).requires_grad_(False)
            self.op = functe.opaque(self.sub)

    holder, x = Holder(), make((2, 4))
    twin = copy.deepcopy(holder)
    with torch.no_grad():
        twin.sub.weight.mul_(-1.0)
    assert twin.op is functe.opaque(twin.sub) and holder.op is functe.opaque(holder.sub)
    assert_close(twin.op(x), twin.sub(x))
    assert_close(holder.op(x), holder.sub(x))
    # (an op is a value: its copies are itself, also one bound to no global name, which does not pickle)
    local = functe.custom_vjp("local_cube", _cube_fwd, _cube_bwd)
    assert copy.deepcopy(_core._linear) is _core._linear and copy.deepcopy([local])[0] is local


def test_a_deep_copy_of_an_opaque_callable_object_leaves_no_global_entry():
    # (a callable object's op lives in a global table keyed by it: an op made per deepcopy kept each
    # copy, and its tensors, alive for the process)
    from functe import _opaque

    class Scale:
        def __init__(self):
            self.factor = torch.full((4,), 2.0)

        def __call__(self, x):
            return x * self.factor

    scale = Scale()
    op, before = functe.opaque(scale), len(_opaque._OPAQUE)
    for _ in range(5):
        holder = copy.deepcopy({"scale": scale, "op": op})
        holder["scale"].factor.fill_(3.0)  # (the copy's op calls the copied object)
        assert torch.equal(holder["op"](torch.ones(4)), torch.full((4,), 3.0))
    assert len(_opaque._OPAQUE) == before and torch.equal(op(torch.ones(4)), torch.full((4,), 2.0))


def test_a_pickle_naming_the_op_table_where_it_lived_before_the_split_loads():
    # (opaque(module) keeps its ops in an _OpTable in the module's __dict__, pickled by class path;
    # stop 37 moved the class from functe._trace to functe._opaque, and older pickles name the former)
    from functe import _opaque

    table = pickle.loads(b"cfuncte._trace\n_OpTable\n)R.")
    assert type(table) is _opaque._OpTable and table.ops == {}


@functe.fuse
def _decorated_block(x, w):
    return ops.gelu(ops.linear(x, w))


@functe.opaque
def _decorated_swish(x):
    return x * torch.sigmoid(x)


def test_decorated_fused_functions_and_opaque_ops_pickle_by_their_name():
    # (@functe.fuse and @functe.opaque bind the function's name to the wrapper: pickling the wrapped
    # function by reference failed, "not the same object as test_pickling._decorated_block")
    x, w = make((4, 8)), make((16, 8))
    holder = {"block": _decorated_block, "swish": _decorated_swish}
    for loaded in (pickle.loads(pickle.dumps(holder)), torch.load(_saved(holder), weights_only=False)):
        assert loaded["block"] is _decorated_block and loaded["swish"] is _decorated_swish
    assert torch.equal(pickle.loads(pickle.dumps(_decorated_block))(x, w), ops.gelu(ops.linear(x, w)))
    # a plain function's Fused still pickles its function, rules and recipe
    fused = functe.fuse(_scale_twice)
    loaded = pickle.loads(pickle.dumps(fused))
    assert loaded is not fused and loaded.__wrapped__ is _scale_twice


def _saved(obj) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def test_a_deep_copied_opaque_op_over_a_builtin_is_the_op():
    # (deepcopy(torch.tanh) is torch.tanh: the copy made a new op, which a rule matching
    # opaque(torch.tanh) no longer matched; pickling already gave the op itself)
    op = functe.opaque(torch.tanh)
    assert copy.deepcopy(op) is op and copy.deepcopy({"f": op})["f"] is op


def _scaled_op(factor: float):
    def fwd(x):
        return x * factor, None

    return functe.custom_vjp(f"scaled_{factor}", fwd, lambda _, g: (g * factor,))


def test_an_op_a_factory_made_pickles_by_the_name_another_module_binds_it_to(monkeypatch):
    # (only the factory's and the forward rule's packages were searched: bound in a user's module,
    # the op refused to pickle, "none of the globals of ...")
    import types

    user = types.ModuleType("functe_test_user_module")
    user.TRIPLE = _scaled_op(3.0)
    monkeypatch.setitem(__import__("sys").modules, user.__name__, user)
    assert pickle.loads(pickle.dumps(user.TRIPLE)) is user.TRIPLE
