"""Tensor, sequence and data parallelism: collectives, parallel linears, FP8 states, fusion rules.

Single-process tests check arguments, the one-rank identity, tracing and the fusion rules (a
traced program records the parallel configuration without communicating, so a fake two-rank
``functe.Group`` suffices). The ``distributed`` tests run on two gloo processes from one shared
worker pool (tests/dist_helpers.py); the checks themselves are in tests/dist_checks.py.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import dist_checks as checks
import pytest
import torch
from dist_helpers import shared_pool
from helpers import make

import functe
from functe import ops
from functe.testing import assert_close

FAKE = functe.Group("fake", 2)  # traced programs record it; they never communicate
ROOT = pathlib.Path(__file__).resolve().parents[1]
# what a valid rank raises when rank 1 fails a local argument check before a collective
RAISED = "rank(s) 1 of Group('0', size=2) raised an argument error instead of joining this collective"


# ----------------------------------------------------------------------------- one process


def test_one_rank_is_the_identity():
    x, w, b = make((5, 8)), make((6, 8)), make((6,))
    for y in (ops.all_gather(x), ops.reduce_scatter(x), ops.all_reduce(x)):
        # (a view, not x itself: see test_purity's donation test)
        assert y is not x and y.data_ptr() == x.data_ptr() and torch.equal(y, x)
    for mode in ("column", "row"):
        y = ops.linear(x, w, b, tensor_parallel_mode=mode)
        assert torch.equal(y, ops.linear(x, w, b))
    program = functe.trace(lambda x, w: ops.linear(x, w, tensor_parallel_mode="row"))(x, w)
    assert "parallel" not in str(program)  # as TE: a group of one rank is no parallelism
    assert functe.all_reduce_gradients({"w": x}) == {"w": x}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"tensor_parallel_mode": "columns"}, ValueError, "expected None, 'column' or 'row', got 'columns'"),
        ({"sequence_parallel": True}, ValueError, "set tensor_parallel_mode='column' or 'row'"),
        ({"tensor_parallel_mode": "row", "sequence_parallel": 1}, TypeError, "'sequence_parallel' expected a bool"),
        ({"tensor_parallel_mode": "row", "group": "world"}, TypeError, "expected a torch.distributed.ProcessGroup"),
        ({"tensor_parallel_mode": "row", "group": FAKE, "sequence_parallel": True}, functe.ShapeError, "divisible"),
    ],
)
def test_bad_parallel_arguments_name_the_argument(kwargs, error, match):
    x, w = make((3, 4)), make((6, 4))
    with pytest.raises(error, match=match):
        ops.linear(x, w, **kwargs)
    with pytest.raises(error, match=match):
        ops.fp8_linear(x, w, None, None, recipe=functe.CurrentScaling(), **kwargs)


def test_states_are_refused_by_the_gradient_reduction():
    # Averaged over ranks, FP8 state cotangents made a state no rank measured (a mean amax, a mean
    # of scales) that the use count of 1 let through: each rank's larger tensors saturated.
    recipe = functe.DelayedScaling(amax_history_len=4)
    grads = {"w": torch.ones(2), "state": functe.init_linear_scaling_state(recipe)}
    with pytest.raises(functe.ArgumentError, match=r"all_reduce_gradients: the tree holds a ScalingState"):
        functe.all_reduce_gradients(grads)
    assert functe.all_reduce_gradients({"w": grads["w"], "b": None})["w"] is grads["w"]


def test_bad_collective_arguments():
    with pytest.raises(functe.ShapeError, match=r"all_gather: argument 'x' expected a tensor with a dimension 2"):
        ops.all_gather(make((3, 4)), dim=2, group=FAKE)
    with pytest.raises(functe.ShapeError, match="dimension 0"):
        ops.all_gather(torch.tensor(1.0))
    with pytest.raises(functe.DTypeError, match=r"functe\.all_reduce: argument 'x' expected dtype"):
        ops.all_reduce(torch.ones(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="'reduce_in_backward' expected a bool"):
        ops.all_reduce(make((3,)), reduce_in_backward=None)
    with pytest.raises(functe.ShapeError, match="sequence parallelism"):
        ops.linear(make((4,)), make((2, 4)), tensor_parallel_mode="column", sequence_parallel=True, group=FAKE)


def test_collective_checks_switch():
    from functe import _collectives

    assert _collectives._checks
    with functe.collective_checks(False):
        assert not _collectives._checks
    assert _collectives._checks
    functe.set_collective_checks(False)
    functe.set_collective_checks(True)
    assert _collectives._checks


def _block(x, w1, w2, w3, b2, *, sp=False):
    """column (+ residual) -> fork -> row (+ residual) -> column, scaled (+ the fork's other branch)."""
    col = {"tensor_parallel_mode": "column", "sequence_parallel": sp, "group": FAKE}
    row = {"tensor_parallel_mode": "row", "sequence_parallel": sp, "group": FAKE}
    h = ops.linear(x, w1, **col) + (ops.all_gather(x, group=FAKE) if sp else x)
    a, skip = ops.make_extra_output(h)
    y = ops.linear(a, w2, b2, **row) + x
    return ops.constant_scale(ops.linear(y, w3, **col), 0.5) + skip


def _sp_block(x, w1, w2, w3, b2):
    return _block(x, w1, w2, w3, b2, sp=True)


def _weights():
    return make((4, 4)), make((4, 4)), make((4, 4)), make((4,))  # local shards of [8,4], [4,8], [8,4]; bias


def test_traced_parallel_linears_record_their_mode():
    x, w = make((4, 8)), make((6, 8))
    program = functe.trace(
        lambda x, w: ops.linear(x, w, tensor_parallel_mode="row", sequence_parallel=True, group=FAKE)
    )(x, w)
    eqn = program.eqns[0]
    assert eqn.params["parallel"] == functe.LinearParallelism("row", True, FAKE)
    assert "linear[parallel=row+sp@fake/2] a b None" in str(program)
    assert program.outputs[0].shape == (2, 6)  # reduce-scattered along dim 0
    gathered = functe.trace(lambda x, w: ops.all_gather(x, group=FAKE, dim=1))(x, w)
    assert gathered.outputs[0].shape == (4, 16)
    recipe = functe.DelayedScaling(amax_history_len=4)
    quantized = functe.trace(
        lambda x, w, s: ops.fp8_linear(
            x, w, None, s, recipe=recipe, tensor_parallel_mode="column", sequence_parallel=True, group=FAKE
        )
    )(x, w, functe.init_linear_scaling_state(recipe))
    assert "fp8_linear[parallel=column+sp@fake/2 amax@fake/2 recipe=" in str(quantized)
    assert quantized.outputs[0].shape == (8, 6)  # all-gathered along dim 0


def test_fusion_rules_decline_parallel_linears_with_te_reasons():
    """TE: no forward (epilogue) fusion of a row-parallel linear, no backward one of a column-parallel linear."""
    x = make((4, 4))
    plan = functe.fuse(_block).plan(x, *_weights())
    forward, backward = plan.stats["forward"], plan.stats["backward"]
    assert forward.fired == {"forward_linear_bias_add": 1, "forward_linear_scale_add": 1}  # the column linears
    assert backward.fired == {"backward_linear_add": 1}  # the row linear
    # (which keeps its mode: the fused op runs the row linear's own backward; it printed none)
    assert "= backward_linear_add[parallel=row@fake/2]" in str(plan.backward)
    [(rule, _, reason)] = forward.declined
    assert rule == "forward_linear_bias_add" and reason.startswith("row tensor-parallel linear: its GEMM output")
    [(rule, _, reason)] = backward.declined
    assert rule == "backward_linear_scale" and reason.startswith("column tensor-parallel linear: dx is a partial sum")


def test_fusion_rules_decline_sequence_parallel_communication(capsys):
    x = make((2, 4))  # this rank's half of the sequence
    plan = functe.fuse(_sp_block).plan(x, *_weights())
    assert not plan.stats["forward"].fired and not plan.stats["backward"].fired
    reasons = {(r, reason.split(":")[0]) for r, _, reason in plan.stats["forward"].declined}
    reasons |= {(r, reason.split(":")[0]) for r, _, reason in plan.stats["backward"].declined}
    assert reasons == {
        ("forward_linear_bias_add", "column tensor-parallel linear with sequence parallelism"),
        ("forward_linear_bias_add", "row tensor-parallel linear"),
        ("forward_linear_scale_add", "column tensor-parallel linear with sequence parallelism"),
        ("backward_linear_add", "row tensor-parallel linear with sequence parallelism"),
        ("backward_linear_scale", "column tensor-parallel linear"),
    }
    functe.explain(_sp_block, x, *_weights())
    out = capsys.readouterr().out
    assert "row tensor-parallel linear: its GEMM output is a partial sum that is reduce-scattered" in out
    assert "linear[parallel=column+sp@fake/2]" in out


def test_phase2_rules_decline_parallel_linears():
    """The activation epilogue, activation backward and FP8 q-in / dact rules keep parallel linears unfused."""
    row = {"tensor_parallel_mode": "row", "group": FAKE}
    col = {"tensor_parallel_mode": "column", "group": FAKE}

    def mlp(x, w1, b1, w2, b2):
        return ops.linear(ops.gelu(ops.linear(x, w1, b1, **row)), w2, b2, **col)

    x, w1, b1, w2, b2 = (make(s, torch.bfloat16) for s in [(4, 8), (8, 8), (8,), (8, 8), (8,)])
    plan = functe.fuse(mlp).plan(x, w1, b1, w2, b2)
    assert plan.stats["forward"].declined[0][2].startswith("row tensor-parallel linear")
    assert not plan.stats["forward"].fired
    recipe = functe.DelayedScaling(amax_history_len=4)

    def fp8_mlp(x, g, w1, w2, s1, s2):
        h = ops.fp8_linear(ops.rms_norm(x, g), w1, None, s1, recipe=recipe, **col)
        return ops.fp8_linear(ops.gelu(h), w2, None, s2, recipe=recipe, **row)

    states = [functe.init_linear_scaling_state(recipe) for _ in range(2)]
    plan = functe.fuse(fp8_mlp).plan(make((4, 16)), make((16,)), make((16, 16)), make((16, 16)), *states)
    assert not plan.stats["forward"].fired and not plan.stats["backward"].fired
    reasons = {r: reason for r, _, reason in plan.stats["forward"].declined + plan.stats["backward"].declined}
    assert reasons["forward_norm_quantize"].startswith("column tensor-parallel fp8_linear: the fused FP8 op")
    assert reasons["forward_activation_quantize"].startswith("row tensor-parallel fp8_linear")
    assert reasons["backward_fp8_linear_activation"].startswith("column tensor-parallel fp8_linear")


# ----------------------------------------------------------------------------- two processes


@pytest.fixture
def pool():
    return shared_pool()


@pytest.mark.distributed
@pytest.mark.parametrize(("dtype", "backend"), [("float32", "torch"), ("bfloat16", "interpret")])
def test_collectives_values_and_backward(pool, dtype, backend):
    pool.run(checks.collectives, dtype, backend)


@pytest.mark.distributed
def test_collectives_under_torch_func_transforms(pool):
    pool.run(checks.collective_transforms)


@pytest.mark.distributed
@pytest.mark.parametrize(("dtype", "backend"), [("float32", "torch"), ("bfloat16", "interpret"), ("float16", "torch")])
def test_parallel_linear_equals_one_process(pool, dtype, backend):
    pool.run(checks.parallel_linear, dtype, backend)


@pytest.mark.distributed
def test_parallel_linear_second_derivatives_equal_one_process(pool):
    pool.run(checks.parallel_linear_second_derivatives)


@pytest.mark.distributed
def test_plain_forward_over_reverse_through_parallel_linears(pool):
    pool.run(checks.parallel_forward_over_reverse)


@pytest.mark.distributed
def test_fused_row_parallel_backward_equals_unfused_to_second_order(pool):
    for fired in pool.run(checks.fused_row_parallel_backward):
        assert fired == ["backward_linear_scale", "backward_linear_bias_activation"]


@pytest.mark.distributed
def test_parallel_linear_under_vmap(pool):
    pool.run(checks.parallel_linear_vmap)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("recipe", "dtype"),
    [("delayed", "float32"), ("delayed", "bfloat16"), ("current", "float32"), ("mxfp8", "bfloat16")],
)
def test_parallel_fp8_linear_equals_one_process(pool, recipe, dtype):
    pool.run(checks.parallel_fp8_linear, recipe, dtype)


@pytest.mark.distributed
def test_parallel_fp8_ensemble_under_vmap(pool):
    pool.run(checks.parallel_fp8_ensemble)


@pytest.mark.distributed
def test_amax_reduction_keeps_nan_and_inf(pool):
    pool.run(checks.amax_reduction_keeps_nan_and_inf)


@pytest.mark.distributed
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_delayed_scaling_states_agree_across_ranks(pool, sequence_parallel):
    curves = pool.run(checks.delayed_states_agree, 6, sequence_parallel)
    assert curves[0] == curves[1]


@pytest.mark.distributed
@pytest.mark.parametrize(("sequence_parallel", "tp"), [(False, 2), (True, 2), (False, 1)], ids=["tp", "tp+sp", "dp"])
def test_mlp_loss_curve_matches_one_process(pool, sequence_parallel, tp):
    for curve, reference in pool.run(checks.tp_mlp_loss_curve, 8, sequence_parallel, tp):
        assert_close(torch.tensor(curve), torch.tensor(reference))
        assert curve[-1] < curve[0]


@pytest.mark.distributed
def test_data_parallel_step_averages_gradients(pool):
    pool.run(checks.data_parallel_step)


@pytest.mark.distributed
def test_data_parallel_fp8_states_match_one_process(pool):
    pool.run(checks.data_parallel_fp8_states, timeout=120)


@pytest.mark.distributed
def test_gradient_averages_of_awkward_trees(pool):
    # fp16 gradients whose mean fits but whose sum does not came back inf; a defaultdict with a lambda
    # factory (its repr holds an address) was refused as a layout mismatch; fullgraph compile failed
    # building the layout text that the compiled reduction never checks.
    pool.run(checks.awkward_gradient_trees, timeout=120)


@pytest.mark.distributed
def test_mismatched_shapes_raise_the_same_error_on_every_rank(pool):
    messages = pool.run(checks.mismatched_shapes)
    assert messages[0][:-2] == messages[1][:-2]  # the last two name each rank's own op
    assert messages[0][-2].split(": the ranks")[1] == messages[1][-2].split(": the ranks")[1]
    assert messages[0][0] == (
        "ShapeError: functe.all_gather: every rank of Group('0', size=2) must pass the same shape and dtype: "
        "rank 0 calls all_gather(f32[2,3], dim=0), rank 1 calls all_gather(f32[3,3], dim=0)"
    )
    rest = messages[0][1:]
    assert "functe.linear: all-gather of the input (column+sp)" in rest[0]
    assert "reduce_scatter(f32[4,2,4], dim=0, sum), rank 1 calls reduce_scatter(f32[6,2,4], dim=0, sum)" in rest[1]
    assert rest[-2].startswith("DistributedError: functe.all_gather: the ranks of Group('0', size=2) run different")
    purposes = (
        "the ranks of Group('0', size=2) run different collectives at this point: rank 0 calls all_reduce(f32[3,8], "
        "sum), rank 1 calls all_reduce(f32[3,8], sum), not all for this one's purpose"
    )
    assert messages[0][-1] == f"DistributedError: functe.linear: all-reduce of dx (column, backward): {purposes}" + (
        " (a forward's and a backward's collective, say); every rank must run the same ops in the same order"
    )
    assert messages[1][-1].startswith(f"DistributedError: functe.linear: all-reduce of the output (row): {purposes}")


@pytest.mark.distributed
def test_layouts_that_one_flat_size_hides_are_refused(pool):
    # The same total size summed unrelated elements silently (a transposed leaf, swapped sizes,
    # another key), and shapes differing only after the 12th dim passed the signature check.
    for messages in pool.run(checks.layouts_hidden_by_one_size, timeout=60):
        for m in (*messages[:3], messages[4]):
            assert m.startswith("ShapeError: functe.all_reduce_gradients: every rank of Group('0', size=2) must pass")
            assert "the same tree structure, shapes and dtypes" in m
        assert "f32[1,1,1,1,1,1,1,1,1,1,1,1,...(checksum" in messages[3]


@pytest.mark.distributed
def test_a_local_argument_error_on_one_rank_raises_on_every_rank(pool):
    # Rank 1 failed its check at once while rank 0 waited in the collective until the group timed out.
    ok, failing = pool.run(checks.argument_error_on_one_rank, timeout=60)
    assert failing[0].startswith("ShapeError: functe.linear: argument 'x' expected dim 0 divisible by the")
    assert failing[1].startswith("ShapeError: functe.linear: argument 'x' expected rank >= 2 with sequence")
    assert failing[2].startswith("ShapeError: functe.fp8_linear: argument 'x' expected dim 0 divisible by")
    assert failing[3].startswith("ShapeError: functe.fp8_linear: argument 'x' expected rank >= 2 with sequence")
    assert failing[4].startswith("ShapeError: functe.all_gather: argument 'x' expected a tensor with a dimension 1")
    assert failing[5].startswith("ShapeError: functe.reduce_scatter: argument 'x' expected a tensor with a dimension 2")
    assert failing[6].startswith("DTypeError: functe.all_reduce: argument 'x' expected dtype f32|f16|bf16")
    # (the valid rank learns that rank 1 raised; under current scaling it said the ranks ran different
    # collectives, reading rank 1's stand-in all-gather against its own amax all-reduce)
    assert all(m.startswith("DistributedError: functe.") and RAISED in m for m in ok), ok
    assert "amax reduction" in ok[3]
    assert [m.split(":")[1] for m in ok[4:]] == [" functe.all_gather", " functe.reduce_scatter", " functe.all_reduce"]


@pytest.mark.distributed
def test_a_block_recipe_with_tensor_parallelism_is_refused_on_every_rank(pool):
    for error, after in pool.run(checks.block_recipe_refusal_on_every_rank, timeout=60):
        assert error.startswith("ArgumentError: functe.fp8_linear: tensor parallelism is not implemented for Float8Bl")
        assert after == [2.0, 2.0, 2.0]


@pytest.mark.distributed
def test_an_amax_group_must_contain_the_tensor_parallel_group(pool):
    for r, (error, after) in enumerate(pool.run(checks.amax_group_outside_the_tensor_parallel_group, timeout=60)):
        assert error.startswith(
            "ArgumentError: functe.fp8_linear: argument 'amax_group' must contain the tensor-parallel group's "
            f"ranks [0, 1], got a group of ranks [{r}]"
        )
        assert after == [2.0, 2.0, 2.0]


@pytest.mark.distributed
def test_gradient_reduction_meets_a_raising_rank_or_another_collective(pool):
    first, second = pool.run(checks.gradient_reduction_meets_other_ranks, timeout=60)
    stops = "(their error says which argument), so this rank stops too"
    assert first[0] == f"DistributedError: functe.all_reduce_gradients: {RAISED} {stops}"
    assert second[0].startswith("ShapeError: functe.linear: argument 'x' expected dim 0 divisible by the")
    different = (
        "run different collectives at this point: rank 0 calls all_reduce_gradients' layout check, "
        "rank 1 calls all_reduce(f32[2,3], sum)"
    )
    assert first[1].startswith("DistributedError: functe.all_reduce_gradients: the ranks of") and different in first[1]
    assert second[1].startswith("DistributedError: functe.all_reduce: the ranks of") and different in second[1]
    assert RAISED in first[2] and first[2].startswith("DistributedError: functe.all_reduce_gradients:")
    assert second[2] == (
        "DTypeError: functe.all_reduce_gradients: every leaf must be a floating-point tensor or None, got i32[2,3]"
    )


@pytest.mark.distributed
def test_a_non_member_group_a_destroyed_group_and_dtypes_outside_the_old_table_are_named(pool):
    first, second = pool.run(checks.group_and_dtype_errors, timeout=60)
    # int8 on rank 0 and bool on rank 1 both had code -1: gloo reinterpreted the bytes silently
    assert all(
        "rank 0 calls all_gather(i8[3], dim=0), rank 1 calls all_gather(bool[3], dim=0)" in m
        for m in (first[0], second[0])
    )
    assert first[1].startswith("ArgumentError: functe.all_gather: argument 'group': this rank (0) is not a member")
    for errors in (first, second):
        assert errors[-1].startswith("ArgumentError: functe.all_reduce: argument 'group' is Group(")
        assert "pass a live ProcessGroup itself (one torch.distributed.destroy_process_group destroyed" in errors[-1]


@pytest.mark.distributed
def test_a_rank_that_raises_does_not_hang_the_others(pool):
    timeout = 2.0
    (ok0, err0), (ok1, err1) = pool.run_raw(checks.rank_raises, timeout, timeout=60)
    assert not ok1 and err1.startswith("ValueError: rank 1 fails before the collective")
    assert not ok0 and err0.startswith("RuntimeError: after ")
    elapsed = float(err0.split("after ")[1].split(" s")[0])
    assert timeout * 0.9 <= elapsed < timeout + 10, err0
    pool.run(checks.data_parallel_step)  # the pool's own group is unaffected


@pytest.mark.distributed
def test_fused_parallel_block_equals_unfused(pool):
    stats = pool.run(checks.fused_parallel_block)
    assert stats[0] == stats[1]
    assert stats[0]["forward"]["fired"] == {"forward_linear_bias_add": 1, "forward_linear_scale_add": 1}
    assert stats[0]["backward"]["fired"] == {"backward_linear_add": 1}


@pytest.mark.distributed
def test_compiled_parallel_linears(pool):
    pool.run(checks.compiled_parallel_linear, timeout=240)


@pytest.mark.distributed
def test_example_runs_under_torchrun():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "examples/tp_mlp.py"]
    args = ["--steps", "4", "--sequence-parallel", "--fp8", "--check"]
    run = subprocess.run(cmd + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    gap = float(run.stdout.split("largest relative gap ")[1].split()[0])
    assert gap < 1e-5, run.stdout
