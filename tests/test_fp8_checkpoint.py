"""Checkpoints (exact save/load, bit-for-bit resume: TE's checkpointing test), the quantize API, the FP8 demo."""

from __future__ import annotations

import pytest
import torch
from fp8_helpers import FP8, MAX

import functe
from functe import demo


def _same_tree(a, b):
    la, lb = functe.tree_leaves(a), functe.tree_leaves(b)
    return len(la) == len(lb) and all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(la, lb))


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_resumed_run_reproduces_the_uninterrupted_run_bit_for_bit(tmp_path, suffix):
    params = demo.init_params(0)
    start = (params, demo.adam_init(params), demo.init_fp8_state())
    *straight, straight_losses = demo.fp8_steps(*start, 0, 4)
    *half, first_losses = demo.fp8_steps(*start, 0, 2)
    path = tmp_path / f"ckpt{suffix}"
    functe.save_tree(path, tuple(half))
    loaded = functe.load_tree(path, tuple(half))
    assert _same_tree(loaded, tuple(half))
    *resumed, rest_losses = demo.fp8_steps(*loaded, 2, 4)
    assert first_losses + rest_losses == straight_losses
    assert _same_tree(tuple(resumed), tuple(straight))  # params, Adam moments and every FP8 state
    assert not torch.equal(straight[2]["fc1"].input.scale, start[2]["fc1"].input.scale)  # the states moved


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_classic_route_resume_keeps_leaves_marked(tmp_path, suffix):
    # A checkpoint holds values only: loaded unmarked, the FP8 state's .grad stayed None after the
    # resume ("not reached": its scale froze at the loaded value) and a restored adapter trained no
    # more, both silently. Two classic steps, save, load, two more equal four straight steps.
    recipe = functe.DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    xs = [torch.randn(8, 32) * (1 + 4 * i) for i in range(4)]  # growing inputs: the scale must move
    start = {
        "w": torch.randn(16, 32).requires_grad_(),
        "frozen": torch.randn(16, 32),
        "state": functe.tree_map(lambda t: t.requires_grad_(), functe.init_linear_scaling_state(recipe)),
    }

    def steps(tree, batches):
        w, state = tree["w"], tree["state"]
        for x in batches:
            loss = functe.ops.fp8_linear(x, w + tree["frozen"], None, state, recipe=recipe).square().mean()
            loss.backward()
            state = functe.state_from_gradient(state, functe.tree_map(lambda t: t.grad, state))
            with torch.no_grad():
                w = (w - 1e-3 * w.grad).requires_grad_()
        return {"w": w, "frozen": tree["frozen"], "state": state}

    def fresh(tree):  # (each run its own leaves: .grad accumulates into the ones it is given)
        return functe.tree_map(lambda t: t.detach().clone().requires_grad_(t.requires_grad), tree)

    straight = steps(fresh(start), xs)
    half = steps(fresh(start), xs[:2])
    functe.save_tree(tmp_path / f"c{suffix}", half)
    loaded = functe.load_tree(tmp_path / f"c{suffix}", half)
    assert [t.requires_grad for t in functe.tree_leaves(loaded)] == [t.requires_grad for t in functe.tree_leaves(half)]
    assert all(t.is_leaf for t in functe.tree_leaves(loaded))
    assert _same_tree(steps(loaded, xs[2:]), straight)
    assert not torch.equal(straight["state"].input.scale, half["state"].input.scale)  # the scale moved after it


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_parameters_load_as_parameters_so_frozen_ones_stay_frozen(tmp_path, suffix):
    # A template's nn.Parameter loaded as a plain tensor: a frozen one (value_and_grad's mark for a
    # None gradient) came back differentiated, so a LoRA base trained again after a resume.
    base = torch.nn.Linear(4, 3)
    base.weight.requires_grad_(False)
    params = dict(base.named_parameters())
    functe.save_tree(tmp_path / f"m{suffix}", params)
    loaded = functe.load_tree(tmp_path / f"m{suffix}", params)
    assert {k: (type(v), v.requires_grad, v.is_leaf) for k, v in loaded.items()} == {
        "weight": (torch.nn.Parameter, False, True),
        "bias": (torch.nn.Parameter, True, True),
    }
    assert all(torch.equal(loaded[k], params[k]) for k in params)

    def loss(p, state, x):
        return functe.ops.linear(x, p["weight"], p["bias"]).square().sum()

    x = torch.randn(2, 4)
    grads, loaded_grads = (functe.value_and_grad(loss)(tree, None, x)[1] for tree in (params, loaded))
    assert grads["weight"] is None and loaded_grads["weight"] is None
    assert torch.equal(loaded_grads["bias"], grads["bias"])


def test_a_tree_rebuilt_from_computed_tensors_keeps_their_graph():
    # (MAML-style: parameters computed from trainable ones, put back under the model's own names; a
    # Parameter template must not wrap them, which would cut the graph)
    template = dict(torch.nn.Linear(3, 2).named_parameters())
    theta = {k: v.detach().clone().requires_grad_() for k, v in template.items()}
    rebuilt = functe.tree_from_dict(template, {k: 2.0 * v for k, v in theta.items()})
    assert not isinstance(rebuilt["weight"], torch.nn.Parameter)
    assert torch.equal(torch.autograd.grad(rebuilt["weight"].sum(), theta["weight"])[0], torch.full((2, 3), 2.0))


@pytest.mark.parametrize(
    ("flat", "shown"),
    [
        (torch.zeros(3, 4), r"f32\[3,4\]"),
        (None, "None"),
        ({"a": torch.zeros(2), 3: torch.zeros(1)}, r"a dict with the key 3 \(int\)"),
    ],
)
def test_a_checkpoint_that_is_no_dict_of_named_tensors_is_refused(flat, shown):
    # (a .pt file holding a bare tensor reached the key check as torch's "Boolean value of Tensor with
    # more than one value is ambiguous"; a non-str key broke the message's sort with a TypeError)
    with pytest.raises(functe.StateError, match=rf"'flat' expected a dict of tensors by dotted key .*, got {shown}"):
        functe.tree_from_dict({"a": torch.zeros(2)}, flat)


def test_a_checkpoint_read_under_inference_mode_restores_unmarked():
    # (a serving process: torch refuses requires_grad_() on an inference tensor outside inference_mode)
    template = dict(torch.nn.Linear(4, 2).named_parameters())
    with torch.inference_mode():
        flat = {k: v.detach().clone() for k, v in template.items()}
    restored = functe.tree_from_dict(template, flat)
    assert all(torch.equal(restored[k], template[k]) and not restored[k].requires_grad for k in template)


def test_a_pt_checkpoint_loads_onto_the_templates_device_and_stores_views_compactly(tmp_path, monkeypatch):
    # torch.load without map_location deserialised onto the saved device (a GPU checkpoint failed on a
    # CPU-only machine); a saved view wrote its whole storage (one row of a 1000x1000 tensor: 4 MB)
    big = torch.arange(1000 * 1000, dtype=torch.float32).reshape(1000, 1000)
    path = tmp_path / "row.pt"
    functe.save_tree(path, {"row": big[3]})
    assert path.stat().st_size < 16_000
    seen = {}
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: seen.update(k) or real_load(*a, **k))
    back = functe.load_tree(path, {"row": torch.zeros(1000)})
    assert seen.get("map_location") == "cpu" and torch.equal(back["row"], big[3])


def test_tree_dict_keys_and_errors():
    state = {"fc1": functe.init_linear_scaling_state(functe.DelayedScaling(amax_history_len=2)), "none": None}
    flat = functe.tree_to_dict(state)
    assert sorted(flat) == sorted(
        f"fc1.{role}.{field}" for role in ("input", "weight", "grad_output") for field in ("scale", "amax_history")
    )
    with pytest.raises(functe.StateError, match=r"missing \['fc1.input.scale'\]"):
        functe.tree_from_dict(state, {k: v for k, v in flat.items() if k != "fc1.input.scale"})
    with pytest.raises(functe.StateError, match=r"'fc1.weight.amax_history' expected f32\[2\] \(as in the template\)"):
        functe.tree_from_dict(state, {**flat, "fc1.weight.amax_history": torch.zeros(3)})
    with pytest.raises(functe.StateError, match=r"unexpected \['extra'\]"):
        functe.tree_from_dict(state, {**flat, "extra": torch.zeros(1)})
    with pytest.raises(functe.StateError, match=r"'fc1.input.scale' expected f32\[\], got float"):
        functe.tree_from_dict(state, {**flat, "fc1.input.scale": 1.0})
    with pytest.raises(functe.StateError, match=r"template leaf 'step' is int, not a tensor"):
        functe.tree_from_dict({"step": 3}, {"step": torch.zeros(())})
    # (next to tensors, and the dict from tree_to_dict, which cannot hold 'step': it said "missing")
    with pytest.raises(functe.StateError, match=r"template leaf 'step' is int, not a tensor"):
        functe.tree_from_dict({"w": torch.ones(2), "step": 3}, {"w": torch.zeros(2)})


def test_a_renamed_leaf_shows_both_names_and_long_lists_are_cut():
    # (only the missing name was shown, never what the checkpoint held instead)
    with pytest.raises(functe.StateError, match=r"missing \['layers.1.weight'\]; unexpected \['layers.1.w'\]"):
        functe.tree_from_dict({"layers": [None, {"weight": torch.ones(2)}]}, {"layers.1.w": torch.ones(2)})
    many = {f"w{i:02d}": torch.ones(1) for i in range(25)}
    with pytest.raises(functe.StateError, match=r"missing \['w00', .*'w09'\] and 15 more$"):
        functe.tree_from_dict(many, {})


def test_a_meta_template_takes_the_checkpoint_values():
    # (a model described on the meta device loaded "successfully" into meta tensors: the data was gone)
    flat = {"w": torch.arange(6.0).view(2, 3)}
    back = functe.tree_from_dict({"w": torch.empty(2, 3, device="meta")}, flat)
    assert back["w"].device.type == "cpu" and torch.equal(back["w"], flat["w"])


@pytest.mark.parametrize("tree", [{"a.b": 0, "a": {"b": 1}}, {1: 0, "1": 1}], ids=["dotted", "int-and-str"])
def test_two_paths_with_one_key_are_refused(tree, tmp_path):
    # A flat dict keeps one of them: the other leaf was silently lost, and loading wrote it back twice.
    tree = functe.tree_map(lambda i: torch.full((2,), float(i)), tree)
    with pytest.raises(functe.StateError, match=r"both flatten to the key '(a\.b|1)'"):
        functe.tree_to_dict(tree)
    with pytest.raises(functe.StateError, match=r"both flatten to the key"):
        functe.save_tree(tmp_path / "t.pt", tree)
    with pytest.raises(functe.StateError, match=r"both flatten to the key"):
        functe.tree_from_dict(tree, {"a.b": torch.zeros(2), "1": torch.zeros(2)})


@pytest.mark.parametrize("recipe", [functe.CurrentScaling(), functe.MXFP8BlockScaling()], ids=["current", "mxfp8"])
@pytest.mark.parametrize("role", ["input", "grad_output"])
def test_quantize_round_trip_error_is_half_an_fp8_step(recipe, role, backend):
    recipe = type(recipe)(fp8_format=functe.Format.HYBRID)
    x = torch.randn(37, 64) * torch.logspace(-2, 2, 64)
    q, nxt = functe.quantize(x, recipe, role=role)
    assert nxt is None and q.data.dtype == recipe.dtype(role) and q.data.shape == x.shape
    back = functe.dequantize(q, torch.float64)
    mant = 3 if q.data.dtype == torch.float8_e4m3fn else 2
    if q.block_scales is None:
        step = q.scale_inv.double() * 2.0 ** (-9 if mant == 3 else -16)  # the subnormal spacing
        assert q.scale_inv.item() * MAX[q.data.dtype] == pytest.approx(x.abs().max().item(), rel=1e-6)
    else:
        scale_inv = functe._quantize.mx_dequantize(torch.ones_like(x), q.block_scales).double()
        step = scale_inv * 2.0 ** (-9 if mant == 3 else -16)
    bound = (2.0 ** -(mant + 1) + 1e-6) * x.double().abs() + step / 2  # + fp32 rounding of x * scale
    assert ((back - x.double()).abs() <= bound).all()
    again, _ = functe.quantize(back.float(), recipe, role=role)  # quantizing dequantized values is lossless
    if q.block_scales is None:
        assert torch.equal(again.data.view(torch.uint8), q.data.view(torch.uint8))
    else:
        assert torch.equal(functe.dequantize(again, torch.float64), back)


def test_quantize_delayed_uses_the_state_and_returns_the_next_one():
    recipe = functe.DelayedScaling(amax_history_len=3)
    state = functe.ScalingState(torch.tensor(2.0), torch.zeros(3))
    x = torch.tensor([1.0, -300.0, 0.01])
    q, nxt = functe.quantize(x, recipe, state=state)
    assert q.scale_inv.item() == 0.5 and functe.dequantize(q).tolist()[:2] == [1.0, -224.0]  # -600 saturates to -448
    expected = functe.delayed_scaling_update(state, torch.tensor(300.0), recipe=recipe, role="input")
    assert torch.equal(nxt.scale, expected.scale) and torch.equal(nxt.amax_history, expected.amax_history)


def test_quantize_errors():
    with pytest.raises(functe.StateError, match=r"'state' expected a ScalingState, got NoneType"):
        functe.quantize(torch.ones(2), functe.DelayedScaling(amax_history_len=2))
    with pytest.raises(
        functe.StateError,
        match=r"'state\.amax_history' expected f32\[2\] \(the recipe's amax_history_len\), got f32\[3\]",
    ):
        functe.quantize(torch.ones(2), functe.DelayedScaling(amax_history_len=2), state=functe.init_scaling_state(3))
    with pytest.raises(functe.StateError, match=r"'state' expected None \(CurrentScaling is stateless\)"):
        functe.quantize(torch.ones(2), functe.CurrentScaling(), state=functe.init_scaling_state(3))
    with pytest.raises(functe.DTypeError, match=r"'x' expected dtype f32\|f16\|bf16, got f64\[2\]"):
        functe.quantize(torch.ones(2, dtype=torch.float64), functe.CurrentScaling())
    with pytest.raises(functe.FuncteError, match=r"'role' expected one of"):
        functe.quantize(torch.ones(2), functe.CurrentScaling(), role="output")
    with pytest.raises(functe.ShapeError, match=r"rank >= 1 for MXFP8"):
        functe.quantize(torch.tensor(1.0), functe.MXFP8BlockScaling())
    assert set(FP8) == {torch.float8_e4m3fn, torch.float8_e5m2}


def test_fp8_demo_trains_and_scales_move(capsys):
    losses = demo.train_fp8(steps=150, log_every=50)
    out = capsys.readouterr().out
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10])
    assert "step  150" in out and "fc2.grad_output" in out


def test_fp8_design_note_example_runs():
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "fp8.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    namespace: dict = {}
    exec(compile(block, "docs/fp8.md", "exec"), namespace)
    state = namespace["state"]
    assert state["fc1"].input.amax_history[-1].item() == namespace["x"].abs().max().item()
    assert state["fc2"].grad_output.scale.item() != 1.0
