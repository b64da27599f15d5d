"""Pytree helpers and state classes: both registries, torch.func acceptance, validation."""

from __future__ import annotations

import dataclasses

import optree
import pytest
import torch
import torch.utils._pytree as torch_pytree

import functe
from functe._state import check_scaling_state


def test_none_is_a_leaf_so_optional_arguments_keep_their_position():
    leaves, spec = functe.tree_flatten((torch.ones(1), None, {"b": 2, "a": None}))
    assert [type(v).__name__ for v in leaves] == ["Tensor", "NoneType", "NoneType", "int"]
    assert functe.tree_unflatten(spec, leaves)[2] == {"b": 2, "a": None}


def test_tree_map_over_several_trees():
    out = functe.tree_map(lambda a, b: a * b, {"x": torch.tensor(2.0)}, {"x": torch.tensor(3.0)})
    assert out["x"].item() == 6.0


def test_scaling_state_is_registered_with_optree_and_torch():
    state = functe.init_scaling_state(8)
    assert len(optree.tree_leaves(state, namespace="functe")) == 2
    assert len(torch_pytree.tree_leaves(state)) == 2
    assert functe.tree_leaves(state)[0] is state.scale


def test_scaling_state_fields_are_fp32_with_documented_shapes():
    state = functe.init_scaling_state(16)
    assert state.scale.dtype == torch.float32 and state.scale.shape == ()
    assert state.amax_history.dtype == torch.float32 and state.amax_history.shape == (16,)
    assert state.scale.item() == 1.0 and not state.amax_history.any()
    assert "scale: ``f32[]``" in functe.ScalingState.__doc__
    assert "amax_history: ``f32[L]``" in functe.ScalingState.__doc__


def test_state_is_immutable():
    state = functe.init_scaling_state(2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.scale = torch.zeros(())
    new = dataclasses.replace(state, scale=torch.full((), 2.0))
    assert new.scale.item() == 2.0 and state.scale.item() == 1.0


def test_state_through_grad_vmap_and_jacrev():
    state = functe.init_scaling_state(4)
    g = torch.func.grad(lambda s: s.scale * 3 + s.amax_history.sum())(state)
    assert isinstance(g, functe.ScalingState) and g.scale.item() == 3.0
    batched = functe.ScalingState(scale=torch.arange(3.0), amax_history=torch.zeros(3, 4))
    out = torch.func.vmap(lambda s: s.scale * 2, in_dims=(functe.ScalingState(0, 0),))(batched)
    assert out.tolist() == [0.0, 2.0, 4.0]
    jac = torch.func.jacrev(lambda s: s.amax_history * 2)(state)
    assert jac.amax_history.shape == (4, 4)


def test_user_pytree_dataclass_round_trips():
    @functe.pytree_dataclass
    class Pair:
        a: torch.Tensor
        b: torch.Tensor

    g = torch.func.grad(lambda p: (p.a * p.b).sum())(Pair(torch.ones(2), torch.full((2,), 3.0)))
    assert isinstance(g, Pair) and g.a.tolist() == [3.0, 3.0] and g.b.tolist() == [1.0, 1.0]


def test_check_scaling_state_errors():
    good = functe.init_scaling_state(4)
    assert check_scaling_state("op", "state", good) is good
    with pytest.raises(
        functe.StateError,
        match=r"functe\.op: argument 'state\.scale' expected float32 \(states stay fp32\), got bf16\[\]",
    ):
        check_scaling_state("op", "state", dataclasses.replace(good, scale=good.scale.bfloat16()))
    with pytest.raises(functe.StateError, match=r"'state\.amax_history' expected f32\[L\], got f32\[2,2\]"):
        check_scaling_state("op", "state", dataclasses.replace(good, amax_history=torch.zeros(2, 2)))
    with pytest.raises(functe.StateError, match=r"expected a ScalingState, got dict"):
        check_scaling_state("op", "state", {"scale": good.scale})
    split = dataclasses.replace(good, scale=torch.ones((), device="meta"))
    with pytest.raises(functe.StateError, match=r"'state\.scale' is on meta, its amax_history on cpu"):
        check_scaling_state("op", "state", split)
    recipe = functe.DelayedScaling(amax_history_len=4)
    with pytest.raises(functe.StateError, match=r"functe\.delayed_scaling_update: argument 'state\.scale' is on meta"):
        functe.delayed_scaling_update(split, torch.tensor(1.0), recipe=recipe, role="input")
    linear_state = dataclasses.replace(functe.init_linear_scaling_state(recipe), weight=split)
    with pytest.raises(functe.StateError, match=r"functe\.share_state: argument 'state\.weight\.scale' is on meta"):
        functe.share_state(linear_state, 2, recipe=recipe)
    with pytest.raises(functe.StateError, match=r"argument 'history_len' expected an int from 1 to 2\*\*61 - 1, got 0"):
        functe.init_scaling_state(0)
