"""One FP8 state's uses in separate backward passes: pipelined (1F1B) micro-batches.

A late write into a replaced state is reported; per-micro-batch copies combined with
``combine_state_gradients`` give ``share_state``'s update (one backward over every use).
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch

import functe

RECIPE = functe.DelayedScaling(amax_history_len=4)
ROLES = ("input", "weight", "grad_output")


def _copy(state):
    """A classic-route copy: fresh leaves that require grad (their .grad carries the update)."""
    return functe.tree_map(lambda t: t.detach().clone().requires_grad_(), state)


def _grads(state):
    return functe.tree_map(lambda t: t.grad, state)


def _loss(w, x, state):
    return functe.ops.fp8_linear(x, w, None, state, recipe=RECIPE).square().mean()


def _micro_batches(n=3):
    torch.manual_seed(0)
    # (different magnitudes: the largest amax is not always the last use's)
    return torch.randn(16, 32), [torch.randn(8, 32) * s for s in (3.0, 20.0, 0.5)[:n]]


def _shared_reference(w, xs, state):
    """share_state's update: every use in one backward pass, combined by max."""

    def loss(s):
        return sum(_loss(w, x, share) for x, share in zip(xs, functe.share_state(s, len(xs), recipe=RECIPE)))

    return functe.state_from_gradient(state, torch.func.grad(loss)(state))


def _assert_same_state(got, want):
    for role in ROLES:
        g, r = getattr(got, role), getattr(want, role)
        torch.testing.assert_close(g.amax_history, r.amax_history, rtol=0, atol=0, msg=role)
        torch.testing.assert_close(g.scale, r.scale, rtol=0, atol=0, msg=role)


def _warm_up(w, x1, x2):
    """1F1B warm-up over one state s0: both forwards, then micro-batch 1's backward and update."""
    s0 = _copy(functe.init_linear_scaling_state(RECIPE))
    l1, l2 = _loss(w, x1, s0), _loss(w, x2, s0)
    l1.backward()
    return functe.state_from_gradient(s0, _grads(s0)), l2


def test_interleaved_forwards_over_one_state_are_reported():
    # Micro-batch 2's backward wrote into s0's leaves after state_from_gradient had replaced them:
    # s1's .grad stayed None ("not reached") and micro-batch 2's amax (20x larger) was lost.
    w, (x1, x2, _) = _micro_batches()
    s1, l2 = _warm_up(w, x1, x2)
    l2.backward()
    with pytest.raises(functe.StateError, match=r"old leaves of state\.input .* 1F1B.*combine_state_gradients"):
        functe.state_from_gradient(s1, _grads(s1))
    # check=False is the caller's word that nothing needs checking
    assert functe.state_from_gradient(s1, _grads(s1), check=False).input.amax_history[-1] < x2.abs().max()


def test_a_late_write_two_updates_back_is_reported():
    # A deeper pipeline: micro-batch 2's backward lands in s0 after s1 *and* s2 replaced it.
    w, (x1, x2, x3) = _micro_batches()
    s1, l2 = _warm_up(w, x1, x2)
    _loss(w, x3, s1).backward()
    s2 = functe.state_from_gradient(s1, _grads(s1))
    l2.backward()
    with pytest.raises(functe.StateError, match=r"old leaves of state\.input"):
        functe.state_from_gradient(s2, _grads(s2))


def test_sequential_micro_batches_and_a_discarded_update_are_not_reported():
    w, xs = _micro_batches()
    state = _copy(functe.init_linear_scaling_state(RECIPE))
    for x in xs:  # the documented accumulation: one update per backward, the next forward uses it
        _loss(w, x, state).backward()
        state = functe.state_from_gradient(state, _grads(state))
    assert state.input.amax_history[-3:].tolist() == pytest.approx([x.abs().max().item() for x in xs])
    # a step skipped after its update was computed: the update is dropped, the old state runs again
    discarded = functe.state_from_gradient(state, _grads(state))
    functe.tree_map(lambda t: setattr(t, "grad", None), state)
    _loss(w, xs[0], state).backward()
    again = functe.state_from_gradient(state, _grads(state))
    assert again.input.amax_history[-1].item() == pytest.approx(xs[0].abs().max().item())
    del discarded
    # ... and the step after the retry: the retry's backward wrote into `state` before `again` was
    # made (one shared flag per leaf read it as a late write into `again`'s predecessor)
    _loss(w, xs[1], again).backward()
    functe.state_from_gradient(again, _grads(again))


def test_replaced_states_are_not_kept_alive():
    # (the late-write watch is diagnostic: it holds neither the old nor the next state)
    w, (x1, *_) = _micro_batches()
    state = _copy(functe.init_linear_scaling_state(RECIPE))
    _loss(w, x1, state).backward()
    old = state.input.scale
    ref = weakref.ref(old)
    state = functe.state_from_gradient(state, _grads(state))
    del old
    gc.collect()
    assert ref() is None


def test_pipelined_copies_combine_to_share_states_update():
    w, xs = _micro_batches()
    state = functe.init_linear_scaling_state(RECIPE)
    copies = [_copy(state) for _ in xs]
    losses = [_loss(w, x, c) for x, c in zip(xs, copies)]  # every forward before any backward
    for loss in losses:
        loss.backward()
    combined = functe.combine_state_gradients([_grads(c) for c in copies])
    _assert_same_state(functe.state_from_gradient(state, combined), _shared_reference(w, xs, state))


def test_combine_over_torch_func_gradients_of_a_state_pytree():
    # {"fc1": used by every micro-batch, "fc2": by the first only}
    w, xs = _micro_batches()
    state = {"fc1": functe.init_linear_scaling_state(RECIPE), "fc2": functe.init_linear_scaling_state(RECIPE)}

    def loss(s, x, first):
        out = _loss(w, x, s["fc1"])
        return out + _loss(w, x, s["fc2"]) if first else out

    grads = [torch.func.grad(loss)(state, x, i == 0) for i, x in enumerate(xs)]
    nxt = functe.state_from_gradient(state, functe.combine_state_gradients(grads))
    _assert_same_state(nxt["fc1"], _shared_reference(w, xs, state["fc1"]))
    _assert_same_state(nxt["fc2"], _shared_reference(w, xs[:1], state["fc2"]))


def test_combine_ignores_uses_that_never_ran_and_keeps_an_unreached_state():
    w, (x1, *_) = _micro_batches()
    state = functe.init_linear_scaling_state(RECIPE)
    used, idle = _copy(state), _copy(state)
    _loss(w, x1, used).backward()
    one = functe.state_from_gradient(state, _grads(used))
    both = functe.state_from_gradient(state, functe.combine_state_gradients([_grads(idle), _grads(used)]))
    _assert_same_state(both, one)
    kept = functe.state_from_gradient(state, functe.combine_state_gradients([_grads(idle), _grads(idle)]))
    _assert_same_state(kept, state)


def test_combine_passes_a_bad_use_on_to_the_check():
    w, (x1, x2, _) = _micro_batches()
    state = functe.init_linear_scaling_state(RECIPE)
    twice, once = _copy(state), _copy(state)
    (_loss(w, x1, twice) + _loss(w, x2, twice)).backward()  # count 2: a copy used twice
    _loss(w, x1, once).backward()
    combined = functe.combine_state_gradients([_grads(once), _grads(twice)])
    with pytest.raises(
        functe.StateError, match=r"state\.input, state\.weight, state\.grad_output was used more than once"
    ):
        functe.state_from_gradient(state, combined)
    # a cut leaf (count 1 beside a zero scale cotangent) in one use spoils the combination too
    cut = _grads(once)
    cut = dataclasses.replace(cut, input=functe.ScalingState(torch.zeros(()), cut.input.amax_history))
    with pytest.raises(functe.StateError, match=r"state\.input .* leaf cut off"):
        functe.state_from_gradient(state, functe.combine_state_gradients([cut, _grads(once)]))


def test_combine_picks_a_nan_amax_as_the_max_would():
    w, (x1, *_) = _micro_batches()
    state = functe.init_linear_scaling_state(RECIPE)
    a, b = _copy(state), _copy(state)
    _loss(w, x1, a).backward()
    bad = x1.clone()
    bad[0, 0] = float("nan")
    _loss(w, bad, b).backward()
    nxt = functe.state_from_gradient(state, functe.combine_state_gradients([_grads(a), _grads(b)]))
    assert nxt.input.amax_history[-1].isnan()


def test_combine_over_an_ensemble_picks_per_member():
    # vmapped states: each member takes its own largest use
    torch.manual_seed(1)
    w = torch.randn(16, 32)
    stacked = functe.tree_map(lambda t: torch.stack([t, t]), functe.init_linear_scaling_state(RECIPE))
    xs = [torch.randn(2, 4, 32) * torch.tensor([1.0, 9.0])[:, None, None], torch.randn(2, 4, 32) * 3]

    def member_grad(s, x):
        return torch.func.grad(lambda s: _loss(w, x, s))(s)

    grads = [torch.vmap(member_grad)(stacked, x) for x in xs]
    nxt = functe.state_from_gradient(stacked, functe.combine_state_gradients(grads))
    for m in range(2):
        member, got = (functe.tree_map(lambda t, m=m: t[m], s) for s in (stacked, nxt))
        _assert_same_state(got, _shared_reference(w, [x[m] for x in xs], member))


def test_combine_refuses_what_it_cannot_combine():
    w, (x1, *_) = _micro_batches()
    state = functe.init_linear_scaling_state(RECIPE)
    g = torch.func.grad(lambda s: _loss(w, x1, s))(state)
    with pytest.raises(functe.StateError, match=r"grads expected a non-empty list of gradients, got"):
        functe.combine_state_gradients(g)
    with pytest.raises(functe.StateError, match=r"grads\[1\]'s structure .* does not match"):
        functe.combine_state_gradients([{"a": g}, {"b": g}])
    short = functe.ScalingState(torch.ones(()), torch.ones(3))
    long = functe.ScalingState(torch.ones(()), torch.ones(4))
    with pytest.raises(functe.StateError, match=r"grads\[1\] at state\.amax_history expected f32\[3\], got f32\[4\]"):
        functe.combine_state_gradients([short, long])
    half = functe.ScalingState(torch.ones(()), torch.ones(3, dtype=torch.float16))
    with pytest.raises(functe.StateError, match=r"grads\[0\] at state\.amax_history expected a float32 tensor, got"):
        functe.combine_state_gradients([half, short])
    one = functe.ScalingState(torch.ones(()), torch.ones(1))
    with pytest.raises(functe.StateError, match=r"needs amax_history_len >= 2 .* f32\[1\]"):
        functe.combine_state_gradients([one, one])
    with pytest.raises(functe.StateError, match=r"grads\[1\] at state expected a ScalingState, got"):
        functe.combine_state_gradients([short, torch.ones(())])
