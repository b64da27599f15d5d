"""Recipes, TE's scale updates, and the state-through-the-gradient protocol."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest
import torch
from fp8_helpers import py_delayed_update

import functe
from functe import DelayedScaling, Format, ops
from functe._fp8_state import FLT_MAX, as_cotangent

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


# ----------------------------------------------------------------------------- recipes


def test_recipe_defaults_are_te_and_hashable():
    d = DelayedScaling()
    assert (d.margin, d.fp8_format, d.amax_history_len, d.amax_compute_algo) == (0, Format.HYBRID, 1024, "max")
    c = functe.CurrentScaling()
    assert (c.fp8_format, c.power_2_scales, c.amax_epsilon) == (Format.HYBRID, False, 0.0)
    m = functe.MXFP8BlockScaling()
    assert m.fp8_format is Format.E4M3 and m.block_size == 32
    assert {d: 1, DelayedScaling(): 2}[d] == 2 and hash(d) == hash(DelayedScaling())
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.margin = 3


def test_formats_map_roles_to_dtypes():
    assert [Format.HYBRID.dtype(r) for r in ("input", "weight", "grad_output")] == [E4M3, E4M3, E5M2]
    assert [Format.E4M3.dtype(r) for r in ("input", "weight", "grad_output")] == [E4M3, E4M3, E4M3]
    assert DelayedScaling().max("grad_output") == 57344.0 and DelayedScaling().max("input") == 448.0
    assert functe.MXFP8BlockScaling(fp8_format=Format.HYBRID).dtype("grad_output") == E5M2


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: DelayedScaling(fp8_format=Format.E5M2), r"pure E5M2 training is not supported"),
        (lambda: functe.CurrentScaling(fp8_format=Format.E5M2), r"pure E5M2"),
        (lambda: functe.MXFP8BlockScaling(fp8_format=Format.E5M2), r"pure E5M2"),
        (lambda: DelayedScaling(fp8_format="HYBRID"), r"fp8_format must be a functe.Format, got 'HYBRID'"),
        (lambda: DelayedScaling(amax_history_len=0), r"amax_history_len must be an int from 1 to 2\*\*61 - 1, got 0"),
        (lambda: DelayedScaling(amax_history_len=2**61), r"amax_history_len must be .* 2\*\*61 - 1, got 2305843"),
        (lambda: DelayedScaling(amax_history_len=2.0), r"amax_history_len must be an int"),
        (lambda: DelayedScaling(margin=0.5), r"margin must be an int in \[-127, 30\] .*, got 0.5"),
        (lambda: DelayedScaling(margin=2000), r"margin must be an int in \[-127, 30\] .*, got 2000"),
        (lambda: DelayedScaling(margin=31), r"a larger margin can round a scale to 0\), got 31"),
        (lambda: DelayedScaling(amax_compute_algo=max), r"amax_compute_algo must be 'max' or 'most_recent'"),
        (lambda: functe.CurrentScaling(amax_epsilon=-1.0), r"amax_epsilon must be a number >= 0 that fp32 holds"),
        (lambda: functe.CurrentScaling(power_2_scales=1), r"power_2_scales must be a bool"),
    ],
)
def test_recipe_validation(make, message):
    with pytest.raises(functe.RecipeError, match=message):
        make()


# ----------------------------------------------------------------------------- delayed scaling update


def _update_loop(recipe, role, amaxes, history_len):
    state = functe.init_scaling_state(history_len)
    py_scale, py_hist = np.float32(1.0), [np.float32(0.0)] * history_len
    for k, a in enumerate(amaxes):
        state = functe.delayed_scaling_update(state, torch.tensor(a), recipe=recipe, role=role)
        py_scale, py_hist = py_delayed_update(
            py_scale, py_hist, a, fp8_max=recipe.max(role), margin=recipe.margin, algo=recipe.amax_compute_algo
        )
        got = state.amax_history.numpy()
        assert state.scale.dtype == torch.float32 and state.amax_history.dtype == torch.float32
        assert np.array_equal(state.scale.numpy(), py_scale, equal_nan=True), (k, state.scale, py_scale)
        assert np.array_equal(got, np.array(py_hist, dtype=np.float32), equal_nan=True), (k, got, py_hist)
    return state


@pytest.mark.parametrize("history_len", [1, 2, 16])
@pytest.mark.parametrize(("algo", "margin", "role"), [("max", 0, "input"), ("most_recent", 2, "grad_output")])
def test_200_steps_match_a_plain_python_reimplementation_exactly(history_len, algo, margin, role):
    g = np.random.default_rng(history_len)
    amaxes = list((np.exp(g.normal(size=200) * 3)).astype(np.float32))
    # Every special case of the update: zero, inf, NaN amax (keep the old scale), a tiny one
    # (infinite scale -> FLT_MAX), repeats and long decreasing runs (the window slides).
    for k, special in [(7, 0.0), (30, float("inf")), (31, 5.0), (55, float("nan")), (90, 1e-45), (120, 0.0)]:
        amaxes[k] = np.float32(special)
    amaxes[140:170] = list(np.linspace(1000, 1, 30, dtype=np.float32))
    recipe = DelayedScaling(margin=margin, amax_history_len=history_len, amax_compute_algo=algo)
    _update_loop(recipe, role, amaxes, history_len)


def test_update_special_cases_explicitly():
    recipe = DelayedScaling(amax_history_len=3)
    state = functe.init_scaling_state(3)
    upd = lambda s, a: functe.delayed_scaling_update(s, torch.tensor(a), recipe=recipe, role="input")
    state = upd(state, 0.0)
    assert state.scale.item() == 1.0 and state.amax_history.tolist() == [0.0, 0.0, 0.0]  # a fresh state keeps 1
    state = upd(state, 1e-45)
    assert state.scale.item() == FLT_MAX  # (448 / tiny) is inf -> FLT_MAX
    state = upd(state, 7.0)
    assert state.scale.item() == 64.0 and torch.equal(state.amax_history, torch.tensor([0.0, 1e-45, 7.0]))
    state = upd(state, float("nan"))
    assert state.scale.item() == 64.0  # NaN in the window keeps the old scale
    assert math.isnan(state.amax_history[-1].item())
    recent = DelayedScaling(amax_history_len=1, amax_compute_algo="most_recent")
    state = functe.delayed_scaling_update(functe.init_scaling_state(1), torch.tensor(-3.0), recipe=recent, role="input")
    assert state.scale.item() == 1.0  # a negative amax keeps the old scale (TE's amax > 0 test), not -149.3


def test_the_largest_margin_keeps_a_positive_scale_and_a_valid_state():
    # margin 127 was accepted: (448 / 1e10) / 2**127 is 0, a scale that value_and_grad's check then
    # reported as "used more than once" (and check=False turned into NaN). Margins stop at 30, where
    # even an amax of FLT_MAX leaves the smallest subnormal.
    recipe = DelayedScaling(margin=30, amax_history_len=1)
    state = functe.delayed_scaling_update(
        functe.init_scaling_state(1), torch.tensor(FLT_MAX), recipe=recipe, role="input"
    )
    assert state.scale.item() > 0
    loss = lambda w, s, x: ops.fp8_linear(x, w, None, s, recipe=recipe).sum()
    x = torch.full((2, 16), 1e30)
    _, _, new = functe.value_and_grad(loss)(torch.ones(8, 16), functe.init_linear_scaling_state(recipe), x)
    assert new.input.scale.item() > 0 and new.input.amax_history.item() == 0.0


def test_current_scale_rules():
    cs = lambda a, **kw: functe.current_scale(torch.tensor(a), recipe=functe.CurrentScaling(**kw), role="input").item()
    assert cs(3.5) == 128.0 and cs(3.0) == np.float32(448.0) / np.float32(3.0)
    assert cs(0.0) == cs(float("inf")) == cs(float("nan")) == 1.0
    assert cs(1e-45) == FLT_MAX
    assert cs(3.0, power_2_scales=True) == 128.0 and cs(0.9, power_2_scales=True) == 256.0
    assert cs(0.0, amax_epsilon=0.5) == 896.0 and cs(3.5, amax_epsilon=0.5) == 128.0


# ----------------------------------------------------------------------------- cotangent protocol


def _states(history_len=4):
    recipe = DelayedScaling(amax_history_len=history_len)
    old = functe.init_scaling_state(history_len)
    new = functe.delayed_scaling_update(old, torch.tensor(3.5), recipe=recipe, role="input")
    return recipe, old, new


def test_state_from_gradient_keeps_untouched_takes_used_rejects_doubled():
    _, old, new = _states()
    untouched = functe.ScalingState(torch.zeros(()), torch.zeros(4))  # what grad gives an unreached state
    doubled = functe.tree_map(lambda t: 2 * t, as_cotangent(new))
    got = functe.state_from_gradient(
        {"a": old, "b": old, "c": None}, {"a": untouched, "b": as_cotangent(new), "c": None}
    )
    assert torch.equal(got["a"].scale, old.scale) and torch.equal(got["a"].amax_history, old.amax_history)
    assert torch.equal(got["b"].scale, new.scale) and torch.equal(got["b"].amax_history, new.amax_history)
    assert got["c"] is None
    with pytest.raises(functe.StateError, match=r"state at state\.fc2 was used more than once.*share_state"):
        functe.state_from_gradient({"fc1": old, "fc2": old}, {"fc1": untouched, "fc2": doubled})
    poisoned = functe.state_from_gradient(old, doubled, check=False)  # no sync: NaN makes it visible later
    assert poisoned.scale.isnan() and poisoned.amax_history.isnan().all()


def test_state_from_gradient_of_many_states_equals_each_alone_and_each_owns_its_storage():
    # States of one shape are updated as one stack: every outcome (kept, taken, doubled, a cut leaf,
    # a missing half) must be the state's own update bit for bit, and no next state may be a view
    # into a shared buffer (saving one state would write them all; safetensors refuses it).
    g = torch.Generator().manual_seed(0)
    states, grads = {}, {}
    cases = ["taken", "kept", "doubled", "scale_cut", "no_history", "no_scale", "none", "nan_count"]
    for i in range(24):
        history_len, shape = (1, 4, 16)[i % 3], ((), (3,))[i % 2]
        old = functe.ScalingState(torch.rand(shape, generator=g) * 9, torch.rand(*shape, history_len, generator=g))
        if i % 5 == 0:  # (the classic route: leaves that require grad)
            old = functe.ScalingState(old.scale.requires_grad_(), old.amax_history.requires_grad_())
        history = torch.rand(*shape, history_len, generator=g)
        case = cases[i % len(cases)]
        history[..., 0] = {"kept": 0.0, "doubled": 2.0, "nan_count": float("nan")}.get(case, 1.0)
        scale = torch.zeros(shape) if case in ("scale_cut", "kept") else torch.rand(shape, generator=g) + 1
        grads[f"s{i}"] = {
            "none": None,
            "no_history": functe.ScalingState(scale, None),
            "no_scale": functe.ScalingState(None, history),
        }.get(case, functe.ScalingState(scale, history))
        states[f"s{i}"] = old
    together = functe.state_from_gradient(states, grads, check=False)
    storages = set()
    for key, old in states.items():
        alone = functe.state_from_gradient(old, grads[key], check=False)
        for name in ("scale", "amax_history"):
            got, want = getattr(together[key], name), getattr(alone, name)
            assert got.shape == want.shape and torch.equal(got.view(torch.int32), want.view(torch.int32)), key
            assert got.is_leaf and got.requires_grad == getattr(old, name).requires_grad
            if grads[key] is not None:  # (a kept state's leaves alias the old ones, as before)
                assert got.untyped_storage().nbytes() == got.numel() * 4, (key, name)
                storages.add(got.untyped_storage().data_ptr())
    assert len(storages) == 2 * sum(ct is not None for ct in grads.values())
    # (a scale of another shape than the history's batch, TE's [1] beside a 1-d history, broadcasts
    # against the count: stacked, it mixed the states; each is updated alone)
    odd = {k: functe.ScalingState(torch.full((1,), 2.0 + k), torch.rand(4, generator=g)) for k in range(3)}
    odd_grads = {k: functe.ScalingState(torch.full((1,), 5.0 + k), torch.tensor([1.0, 0.5, 0.5, 0.5])) for k in odd}
    stacked = functe.state_from_gradient(odd, odd_grads, check=False)
    for k in odd:
        alone = functe.state_from_gradient(odd[k], odd_grads[k], check=False)
        assert torch.equal(stacked[k].scale, alone.scale) and torch.equal(stacked[k].amax_history, alone.amax_history)
    bad = {"doubled", "scale_cut", "no_history", "no_scale", "nan_count"}  # (a cut leaf or a count not 0 or 1)
    named = ", ".join(f"state.{key}" for key in sorted(states) if cases[int(key[1:]) % len(cases)] in bad)
    with pytest.raises(functe.StateError, match=f"the scaling state at {re.escape(named)} was used more than once"):
        functe.state_from_gradient(states, grads)


def test_state_from_gradient_rejects_loose_tensors():
    with pytest.raises(functe.StateError, match=r"tensor f32\[\] outside a ScalingState at state\.step"):
        functe.state_from_gradient({"step": torch.zeros(())}, {"step": torch.zeros(())})


def test_value_and_grad_refuses_a_loose_state_tensor_before_running_the_loss():
    # The usual slip: a loss written fn(params, x, y) with data in the state's place. The refusal
    # came from state_from_gradient after the whole step had run, naming neither the value nor
    # value_and_grad's signature.
    calls = []

    def loss_fn(params, x, y):
        calls.append(1)
        return ((ops.linear(x, params["w"]) - y) ** 2).mean()

    params = {"w": torch.randn(16, 32)}
    with pytest.raises(
        functe.StateError,
        match=r"value_and_grad: argument 'state' .*fn\(params, state, \*args\).*f32\[4,32\] at state:",
    ):
        functe.value_and_grad(loss_fn)(params, torch.randn(4, 32), torch.randn(4, 16))
    with pytest.raises(functe.StateError, match=r"tensor f32\[\] at state\.s\[1\]"):
        functe.value_and_grad(loss_fn)(params, {"s": [None, torch.zeros(())]}, torch.randn(4, 32))
    assert not calls


def test_state_passed_through_an_op_is_rejected():
    # The chain rule scales the cotangent: the count in slot 0 is no longer 1.
    recipe = DelayedScaling(amax_history_len=4)

    def loss_fn(params, state, x):
        bent = functe.LinearScalingState(
            input=functe.ScalingState(state.input.scale * 2, state.input.amax_history * 2),
            weight=state.weight,
            grad_output=state.grad_output,
        )
        return functe.ops.fp8_linear(x, params, None, bent, recipe=recipe).sum()

    state = functe.init_linear_scaling_state(recipe)
    with pytest.raises(functe.StateError, match=r"state\.input was used more than once.*or reached its op through"):
        functe.value_and_grad(loss_fn)(torch.ones(4, 16), state, torch.ones(2, 16))


def test_gradient_accumulation_over_backward_calls_is_named_and_one_update_per_backward_works():
    # Two micro-batches with classic .backward(): the leaves' .grad summed the two cotangents (count
    # 2), and the error blamed a state used twice or passed through an op.
    recipe = DelayedScaling(amax_history_len=4)
    w = torch.nn.Parameter(torch.randn(32, 32) / 6)
    xs = [torch.randn(16, 32) for _ in range(2)]

    def leaves(state):
        return functe.tree_map(lambda t: t.detach().clone().requires_grad_(), state)

    state = leaves(functe.init_linear_scaling_state(recipe))
    for x in xs:
        ops.fp8_linear(x, w, None, state, recipe=recipe).square().mean().backward()
    grads = functe.tree_map(lambda t: t.grad, state)
    with pytest.raises(functe.StateError, match=r"accumulated over several backward calls \(gradient accumulation"):
        functe.state_from_gradient(functe.tree_map(torch.Tensor.detach, state), grads)
    # the documented route: one update per backward, the next micro-batch on the new state
    state, expected = leaves(functe.init_linear_scaling_state(recipe)), functe.init_linear_scaling_state(recipe)
    for x in xs:
        ops.fp8_linear(x, w, None, state, recipe=recipe).square().mean().backward()
        state = leaves(
            functe.state_from_gradient(
                functe.tree_map(torch.Tensor.detach, state), functe.tree_map(lambda t: t.grad, state)
            )
        )
        _, _, expected = functe.value_and_grad(
            lambda p, s, x: ops.fp8_linear(x, p, None, s, recipe=recipe).square().mean()
        )(w.detach(), expected, x)
    for got, exp in zip(functe.tree_leaves(state), functe.tree_leaves(expected)):
        assert torch.equal(got, exp)


@pytest.mark.parametrize("retain_graph", [False, True])
def test_the_classic_route_threads_the_returned_state_as_leaves(retain_graph):
    # state_from_gradient(state, grads) on leaves that require grad returned tensors chained to the
    # old leaves (torch.where): the next micro-batch's backward filled the old leaves' .grad, the new
    # state's stayed None (read as "not used": the state froze), and without retain_graph the third
    # backward ran into a freed graph. The next state is fresh leaves that require grad.
    recipe = DelayedScaling(amax_history_len=4)
    w = torch.nn.Parameter(torch.randn(32, 32) / 6)
    xs = [torch.randn(16, 32) * (i + 1) for i in range(3)]
    state = functe.tree_map(lambda t: t.requires_grad_(), functe.init_linear_scaling_state(recipe))
    expected = functe.init_linear_scaling_state(recipe)
    for x in xs:
        ops.fp8_linear(x, w, None, state, recipe=recipe).square().mean().backward(retain_graph=retain_graph)
        state = functe.state_from_gradient(state, functe.tree_map(lambda t: t.grad, state))
        assert all(t.is_leaf and t.requires_grad and t.grad is None for t in functe.tree_leaves(state))
        _, _, expected = functe.value_and_grad(
            lambda p, s, x: ops.fp8_linear(x, p, None, s, recipe=recipe).square().mean()
        )(w.detach(), expected, x)
    for got, exp in zip(functe.tree_leaves(state), functe.tree_leaves(expected)):
        assert torch.equal(got.detach(), exp)


def test_vmapped_cotangents_of_trainable_state_leaves_give_detached_leaves():
    # (requires_grad_() on a vmapped next state raised inside the transform: mark leaves outside it)
    recipe = DelayedScaling(amax_history_len=4)
    state = functe.tree_map(lambda t: t.requires_grad_(), functe.init_linear_scaling_state(recipe))
    grads = functe.tree_map(lambda t: torch.zeros(3, *t.shape), functe.init_linear_scaling_state(recipe))
    nxt = torch.vmap(functe.state_from_gradient, in_dims=(None, 0))(state, grads)
    assert all(t.shape[0] == 3 and not t.requires_grad for t in functe.tree_leaves(nxt))


def test_a_state_from_value_and_grad_over_trainable_parameters_holds_no_graph():
    # Parameters that require grad make torch.func's results carry the outer autograd graph; the next
    # state carried it too, and fed into the next step it chained every step's graph (saved FP8
    # operands included) to the last: memory grew each step.
    recipe = DelayedScaling(amax_history_len=4)
    params = {"w": torch.nn.Parameter(torch.randn(32, 32) / 6)}
    step = functe.value_and_grad(lambda p, s, x: ops.fp8_linear(x, p["w"], None, s, recipe=recipe).square().mean())
    state = functe.init_linear_scaling_state(recipe)
    for _ in range(3):
        loss, _, state = step(params, state, torch.randn(16, 32))
        assert loss.grad_fn is not None  # (torch.func's own behaviour for the loss and gradients)
        assert not any(t.requires_grad for t in functe.tree_leaves(state))


def test_a_shared_state_passed_through_an_op_is_rejected_too():
    # share_state turned a copy's count of 0.5 (the state scaled by 0.5 on its way) into 1: the
    # halved amax was recorded and the next step saturated.
    recipe = DelayedScaling(amax_history_len=4)

    def loss_fn(params, state, x):
        (copy,) = functe.share_state(state, 1, recipe=recipe)
        return functe.ops.fp8_linear(x, params, None, functe.tree_map(lambda t: t * 0.5, copy), recipe=recipe).sum()

    state = functe.init_linear_scaling_state(recipe)
    with pytest.raises(functe.StateError, match=r"was used more than once.*or reached its op through"):
        functe.value_and_grad(loss_fn)(torch.ones(4, 16), state, torch.ones(2, 16))


def test_a_state_inside_a_class_functe_cannot_flatten_is_refused():
    # an opaque leaf: its scaling states never entered the gradient and never updated, silently
    import dataclasses

    @dataclasses.dataclass
    class Holder:
        fc1: functe.LinearScalingState

    recipe = DelayedScaling(amax_history_len=4)
    loss_fn = lambda w, state, x: functe.ops.fp8_linear(x, w, None, state["a"].fc1, recipe=recipe).sum()
    state = {"a": Holder(functe.init_linear_scaling_state(recipe))}
    with pytest.raises(functe.StateError, match=r"state leaf 'a' is a Holder, which functe cannot flatten"):
        functe.value_and_grad(loss_fn)(torch.ones(4, 16), state, torch.ones(2, 16))
    with pytest.raises(functe.StateError, match=r"holds a Holder at state\.a, which functe cannot flatten"):
        functe.state_from_gradient(state, {"a": None})
    # objects that hold no tensor (a recipe, a numpy number) are plain leaves, as before
    import numpy as np

    plain = {"recipe": recipe, "step": np.float32(3.0), "fc1": functe.init_linear_scaling_state(recipe)}
    loss2 = lambda w, state, x: functe.ops.fp8_linear(x, w, None, state["fc1"], recipe=state["recipe"]).sum()
    _, _, new = functe.value_and_grad(loss2)(torch.ones(4, 16), plain, torch.ones(2, 16))
    assert new["recipe"] is recipe and new["step"] == 3.0 and new["fc1"].input.amax_history[-1] == 1.0


# ----------------------------------------------------------------------------- share_state


def _two_uses(recipe, state, x1, x2, w, *, share: bool, use_second: bool = True):
    def loss_fn(params, state, x1, x2):
        s1, s2 = functe.share_state(state, 2, recipe=recipe) if share else (state, state)
        y = functe.ops.fp8_linear(x1, params, None, s1, recipe=recipe).sum()
        if use_second:
            y = y + 3 * functe.ops.fp8_linear(x2, params, None, s2, recipe=recipe).sum()
        return y

    return functe.value_and_grad(loss_fn)(w, state, x1, x2)


def test_share_state_combines_uses_by_max():
    recipe = DelayedScaling(amax_history_len=4, margin=1)
    state = functe.init_linear_scaling_state(recipe)
    w = torch.randn(8, 16)
    x1, x2 = torch.randn(3, 16), torch.randn(5, 16) * 4  # the second use has the larger amax
    _, _, shared = _two_uses(recipe, state, x1, x2, w, share=True)
    amax_x = max(x1.abs().max(), x2.abs().max())
    expected_in = functe.delayed_scaling_update(state.input, amax_x, recipe=recipe, role="input")
    assert torch.equal(shared.input.scale, expected_in.scale)
    assert torch.equal(shared.input.amax_history, expected_in.amax_history)
    # grad_output: dy is 1 for the first use and 3 for the second -> amax 3.
    expected_go = functe.delayed_scaling_update(state.grad_output, torch.tensor(3.0), recipe=recipe, role="grad_output")
    assert torch.equal(shared.grad_output.scale, expected_go.scale)
    with pytest.raises(functe.StateError, match=r"state\.input.*used more than once"):
        _two_uses(recipe, state, x1, x2, w, share=False)
    # a next state passed as the gradient (value_and_grad returns it already): the message says so
    with pytest.raises(functe.StateError, match=r"or 'grad' is a state rather than the ops' cotangents"):
        functe.state_from_gradient(state, shared)


def test_share_state_with_an_unused_copy_is_a_single_use():
    recipe = DelayedScaling(amax_history_len=4)
    state = functe.init_linear_scaling_state(recipe)
    w, x1 = torch.randn(8, 16), torch.randn(3, 16)
    _, _, shared = _two_uses(recipe, state, x1, None, w, share=True, use_second=False)
    _, _, single = functe.value_and_grad(lambda p, s, x: functe.ops.fp8_linear(x, p, None, s, recipe=recipe).sum())(
        w, state, x1
    )
    for a, b in zip(functe.tree_leaves(shared), functe.tree_leaves(single)):
        assert torch.equal(a, b)


def test_share_state_whose_copies_ran_no_op_keeps_the_state():
    # Copies whose cotangents carry count 0 (zeros, as autograd materialises them): the combined
    # cotangent must read as "never reached" (a count of 0 beside a recomputed scale reads as a
    # cut history, a bad use).
    recipe = DelayedScaling(amax_history_len=4)
    state = functe.init_linear_scaling_state(recipe)
    _, pullback = torch.func.vjp(lambda s: functe.share_state(s, 2, recipe=recipe), state)
    zero = functe.tree_map(torch.zeros_like, state)
    (ct,) = pullback((zero, zero))
    kept = functe.state_from_gradient(state, ct)
    for a, b in zip(functe.tree_leaves(kept), functe.tree_leaves(state)):
        assert torch.equal(a, b)


def test_share_state_errors():
    recipe = DelayedScaling(amax_history_len=1)
    state = functe.init_linear_scaling_state(recipe)
    with pytest.raises(functe.StateError, match=r"needs amax_history_len >= 2"):
        functe.share_state(state, 2, recipe=recipe)
    with pytest.raises(functe.StateError, match=r"only DelayedScaling keeps state"):
        functe.share_state(state, 2, recipe=functe.CurrentScaling())
    recipe = DelayedScaling(amax_history_len=2)
    with pytest.raises(functe.StateError, match=r"n must be an int >= 1, got 0"):
        functe.share_state(functe.init_linear_scaling_state(recipe), 0, recipe=recipe)


@pytest.mark.parametrize("leaf", ["scale", "amax_history"])
def test_a_detached_state_leaf_is_a_bad_use(leaf):
    # Only amax_history carried the use count: scale.detach() gave a next scale of 0.0 silently;
    # amax_history.detach() gave a count of 0, and the state was silently never updated.
    recipe = functe.DelayedScaling(amax_history_len=4)
    x, w = torch.randn(4, 16), torch.randn(16, 16) / 4

    def loss(p, s, x):
        scale, history = s.input.scale, s.input.amax_history
        cut = (
            functe.ScalingState(scale.detach(), history)
            if leaf == "scale"
            else functe.ScalingState(scale, history.detach())
        )
        s = functe.LinearScalingState(input=cut, weight=s.weight, grad_output=s.grad_output)
        return functe.ops.fp8_linear(x, p, None, s, recipe=recipe).square().mean()

    state = functe.init_linear_scaling_state(recipe)
    with pytest.raises(functe.StateError, match=r"state\.input .* reached its op through another op"):
        functe.value_and_grad(loss)(w, state, x)
    _, _, unchecked = functe.value_and_grad(loss, check=False)(w, state, x)
    assert unchecked.input.scale.isnan() and unchecked.weight.scale.isfinite()
    # the classic route: a cut history leaf's .grad is None beside its scale's, which read as "not
    # reached" (the state froze silently); a cut scale's .grad is None beside a count of 1
    leaves = functe.tree_map(lambda t: t.detach().clone().requires_grad_(), state)
    loss(w, leaves, x).backward()
    with pytest.raises(functe.StateError, match=r"state\.input .* reached its op through another op"):
        functe.state_from_gradient(leaves, functe.tree_map(lambda t: t.grad, leaves))


def test_value_and_grad_checks_no_counts_it_cannot_read():
    # (check=True read the states' use counts back: "Cannot copy out of meta tensor; no data!" on
    # meta tensors and DataDependentOutputException under FakeTensorMode, where shapes are all there is)
    from torch._subclasses.fake_tensor import FakeTensorMode

    recipe = functe.DelayedScaling(amax_history_len=4)

    def loss(p, s, x):
        return functe.ops.fp8_linear(x, p["w"], None, s, recipe=recipe).square().mean()

    def step(device):
        state = functe.tree_map(lambda t: t.to(device), functe.init_linear_scaling_state(recipe))
        params, x = {"w": torch.randn(16, 32, device=device)}, torch.randn(8, 32, device=device)
        value, grads, state = functe.value_and_grad(loss)(params, state, x)
        return value.shape, grads["w"].shape, state.input.amax_history.shape

    expected = (torch.Size([]), torch.Size([16, 32]), torch.Size([4]))
    assert step("meta") == expected
    with FakeTensorMode():
        assert step("cpu") == expected


def test_value_and_grad_leaves_a_frozen_parameter_alone():
    # dict(model.named_parameters()) with the base frozen (LoRA): differentiated like every leaf,
    # the base got a gradient that `p.grad = g; optimizer.step()` applied; autograd gives None.
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    recipe = functe.DelayedScaling(amax_history_len=4)
    base = torch.nn.Parameter(torch.randn(16, 32), requires_grad=False)
    a, b = torch.nn.Parameter(torch.randn(4, 32)), torch.nn.Parameter(torch.zeros(16, 4) + 0.1)
    x = torch.randn(8, 32)

    def loss(p, s, x):
        return (ops.fp8_linear(x, p["base"], None, s, recipe=recipe) + ops.linear(ops.linear(x, p["a"]), p["b"])).sum()

    state = functe.init_linear_scaling_state(recipe)
    with FlopCounterMode(display=False) as frozen_flops:
        _, grads, _ = functe.value_and_grad(loss)({"base": base, "a": a, "b": b}, state, x)
    assert grads["base"] is None
    loss({"base": base, "a": a, "b": b}, state, x).backward()
    torch.testing.assert_close(grads["a"], a.grad, rtol=0, atol=0)
    torch.testing.assert_close(grads["b"], b.grad, rtol=0, atol=0)
    # the frozen weight's gradient GEMM (16x32 from 8 rows: 2*8*16*32 flops) does not run
    with FlopCounterMode(display=False) as all_flops:
        _, every, _ = functe.value_and_grad(loss)({"base": base.detach(), "a": a, "b": b}, state, x)
    assert every["base"] is not None  # (a plain tensor is always differentiated, as torch.func does)
    assert all_flops.get_total_flops() - frozen_flops.get_total_flops() == 2 * 8 * 16 * 32
