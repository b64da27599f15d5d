"""Tracing to an op list: op calls, arithmetic translations, opaque functions, constants and errors."""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import re
import weakref

import pytest
import torch
import torch.nn.functional as F
from fuse_helpers import oplist_text
from helpers import check_transforms, make

import functe
from functe import _vjp, ops
from functe.testing import assert_close


def test_arithmetic_is_recorded_as_functe_ops():
    def fn(x, y, b, w):
        h = 2.0 * x + y  # constant_scale, add_extra_input
        h = h * 0.5 - x / 4  # constant_scale, constant_scale, constant_scale(-1), add_extra_input
        h = -h + b  # constant_scale(-1), bias (b is per-feature)
        h = F.linear(h, w).reshape(2, -1).view(-1)
        return h

    x, y = torch.zeros(2, 3), torch.zeros(2, 3)
    assert oplist_text(fn, x, y, torch.zeros(3), torch.zeros(4, 3)) == (
        "{ lambda a:f32[2,3] b:f32[2,3] c:f32[3] d:f32[4,3]. let\n"
        "    e:f32[2,3] = constant_scale[scale=2.0] a\n"
        "    f:f32[2,3] = add_extra_input e b\n"
        "    g:f32[2,3] = constant_scale[scale=0.5] f\n"
        "    h:f32[2,3] = constant_scale[scale=0.25] a\n"
        "    i:f32[2,3] = constant_scale[scale=-1.0] h\n"
        "    j:f32[2,3] = add_extra_input g i\n"
        "    k:f32[2,3] = constant_scale[scale=-1.0] j\n"
        "    l:f32[2,3] = bias k c\n"
        "    m:f32[2,4] = linear l d None\n"
        "    n:f32[2,4] = reshape[shape=(2, -1)] m\n"
        "    o:f32[8] = reshape[shape=(-1,)] n\n"
        "  in (o,) }"
    )


def test_reflected_operands_keep_source_order():
    text = oplist_text(lambda x, y: (y + x, 3 * x, torch.add(x, y, alpha=2)), torch.zeros(3), torch.zeros(3))
    assert "c:f32[3] = add_extra_input b a" in text
    assert "d:f32[3] = constant_scale[scale=3.0] a" in text
    assert "e:f32[3] = constant_scale[scale=2.0] b\n    f:f32[3] = add_extra_input a e" in text


def test_static_params_outputs_structure_and_passthrough():
    def fn(x, scales, *, flip):
        y = ops.constant_scale(x, scales[0] * (-1 if flip else 1))
        return {"y": y, "x": x, "none": None}

    oplist = functe.trace(fn)(torch.zeros(3), (2.5, 1.0), flip=True)
    assert "constant_scale[scale=-2.5] a" in str(oplist)
    assert str(oplist).endswith("in (None, a, b) }")  # dict keys sorted: none, x, y
    assert sorted(oplist.static.values(), key=repr) == [1.0, 2.5, True]


def test_captured_constants_become_literals_and_eager_values_fold():
    const = torch.arange(3.0)

    def fn(x):
        folded = ops.constant_scale(const, 2.0)  # no traced input: computed now, a constant
        return ops.add_extra_input(x, folded)

    oplist = functe.trace(fn)(torch.zeros(3))
    assert str(oplist).splitlines()[1] == "    b:f32[3] = add_extra_input a const:f32[3]"
    assert torch.equal(oplist.eqns[0].inputs[1].value, 2.0 * const)


def test_tracing_computes_nothing_and_leaves_no_hook_behind():
    calls = []

    def fwd(x):
        calls.append(x.device.type)
        return x * 2, None

    op = functe.custom_vjp("probe", fwd, lambda _, g: (g * 2,))
    functe.trace(lambda x: op(x))(torch.zeros(2))
    assert calls == ["meta"]  # shape inference only
    assert _vjp._recorder is None and not functe._trace.tracing()
    assert op(torch.ones(2)).tolist() == [2.0, 2.0] and calls[-1] == "cpu"


def test_trace_errors_name_the_call():
    x = torch.zeros(2, 3)
    with pytest.raises(functe.TraceError, match=r"torch\.tanh\(f32\[2,3\]\) on a traced value cannot be recorded"):
        functe.trace(torch.tanh)(x)
    with pytest.raises(functe.TraceError, match=r"Tensor\.sum\(f32\[2,3\]\).*functe\.opaque"):
        functe.trace(lambda x: x.sum())(x)
    with pytest.raises(functe.TraceError, match=r"f32\[2,3\] \+ float has no functe op"):
        functe.trace(lambda x: x + 1.0)(x)
    with pytest.raises(functe.TraceError, match=r"f32\[2,3\] \* f32\[2,3\] has no functe op"):
        functe.trace(lambda x: x * x)(x)
    with pytest.raises(functe.TraceError, match=r"Tensor\.__bool__"):
        functe.trace(lambda x: bool(x))(x)
    with pytest.raises(functe.TraceError, match=r"Tensor\.__getitem__"):
        functe.trace(lambda x: x[0])(x)
    # (keywords are named with their values: this said only "Tensor.to(f32[2,3])")
    with pytest.raises(functe.TraceError, match=r"Tensor\.to\(f32\[2,3\], dtype=torch\.int32\)"):
        functe.trace(lambda x: x.to(dtype=torch.int32))(x)
    assert "constant_scale" in str(functe.trace(lambda x: x.to("cpu:0") * 2.0)(x))  # (a no-op: recorded)
    # (an int device is an accelerator, not a no-op; copy=True given positionally copies; a device
    # string is shown as the device)
    with pytest.raises(functe.TraceError, match=r"Tensor\.to\(f32\[2,3\], int\)"):
        functe.trace(lambda x: x.to(0))(x)
    with pytest.raises(functe.TraceError, match=r"Tensor\.to\(f32\[2,3\], torch\.float32, bool, bool\) .*\(copy=True"):
        functe.trace(lambda x: x.to(torch.float32, False, True))(x)
    with pytest.raises(functe.TraceError, match=r"Tensor\.to\(f32\[2,3\], meta\)"):
        functe.trace(lambda x: x.to("meta"))(x)


@pytest.mark.parametrize(
    ("dtype", "c"), [(torch.float32, 1e-40), (torch.float32, 3e38), (torch.float32, 3e-39), (torch.float64, 1e-310)]
)
def test_division_by_a_constant_whose_inverse_is_not_normal_is_refused(dtype, c):
    # x / c is recorded as x * (1/c): for a subnormal c, 1/c overflowed (fused x / 1e-40 gave inf where
    # torch gives 1e5), for a huge c it is subnormal and lost bits
    message = rf"/ {re.escape(repr(c))}: .* or 1/{re.escape(repr(c))} is not a normal {str(dtype)[6:]} .*functe\.opaque"
    with pytest.raises(functe.TraceError, match=message):
        functe.trace(lambda x: x / c)(torch.ones(3, dtype=dtype))
    x = torch.tensor([1e-35, -2e-35, 3e38], dtype=dtype)
    fused = functe.fuse(lambda x: functe.opaque(lambda x: x / c)(x) * 2.0)
    assert torch.equal(fused(x), x / c * 2.0)
    assert torch.equal(functe.fuse(lambda x: x / 1e-30)(x), x * (1.0 / 1e-30))  # (normal: recorded)


@pytest.mark.parametrize("flag", [True, False])
def test_a_bool_scalar_scales_as_torch_promotes_it(flag):
    # torch computes x * True as x * 1.0 (and x / False as x / 0.0); the trace refused a bool scalar
    x = torch.tensor([1.5, -2.0, 0.0, float("inf"), float("nan")], requires_grad=True)
    programs = [lambda x, s: x * s, lambda x, s: s * x, lambda x, s: x / s, lambda x, s: torch.mul(x, s) - x]
    for fn in programs:
        fused, eager = functe.fuse(fn)(x, flag), fn(x, flag)
        assert torch.equal(fused.nan_to_num(7.0), eager.nan_to_num(7.0))
        grads = [torch.autograd.grad(y.sum(), x)[0].nan_to_num(7.0) for y in (fused, eager)]
        assert torch.equal(*grads)
    assert f"constant_scale[scale={float(flag)}] a" in str(functe.trace(programs[0])(x, flag))


def test_metadata_queries_answer_while_tracing():
    # is_cpu, itemsize, nbytes, is_signed() and torch.numel were refused as unrecordable calls, while
    # is_cuda, element_size() and numel() answered
    x = torch.ones(2, 3)
    queries = [
        lambda x: x.is_cpu,
        lambda x: x.itemsize,
        lambda x: x.nbytes,
        lambda x: x.is_signed(),
        lambda x: torch.numel(x),
        lambda x: x.is_xpu or x.is_mps or x.is_sparse_csr or x.is_nested or x.is_mkldnn,
        lambda x: x.ndimension() * x.nelement(),
        lambda x: x.is_conj() or x.is_neg(),
        lambda x: torch.is_floating_point(x) + torch.is_complex(x),
    ]
    for query in queries:
        fn = lambda x, query=query: x * float(query(x))
        assert torch.equal(functe.fuse(fn)(x), fn(x))


def test_keyword_operands_of_arithmetic_are_recorded():
    # torch's keyword names for the operands were refused, with the message naming a translation
    # helper ("_torch_add() got an unexpected keyword argument 'other'")
    x, y = make((2, 3)), make((2, 3))
    programs = [
        lambda x, y: x.add(other=y),
        lambda x, y: torch.add(input=x, other=y, alpha=2.0),
        lambda x, y: x.sub(other=y, alpha=3),
        lambda x, y: x.mul(other=2.0) + torch.mul(input=y, other=0.5),
        lambda x, y: x.div(other=4.0) + torch.div(y, 2, rounding_mode=None),
        lambda x, y: x.float(memory_format=torch.preserve_format) + y.contiguous(memory_format=torch.contiguous_format),
    ]
    for fn in programs:
        assert_close(functe.fuse(fn)(x, y), fn(x, y))
    assert "add_extra_input a b" in str(functe.trace(programs[0])(x, y))


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (lambda x: x.add(2.0, alpha=2), r"f32\[2,3\] \+ float has no functe op"),  # (was "float * int")
        (lambda x: torch.sub(x, x, alpha=True), r"alpha=True: a boolean alpha is only supported for boolean"),
        (lambda x: torch.div(x, 2, rounding_mode="floor"), r"torch\.div\(f32.*'floor'.*only true division"),
        (lambda x: F.dropout(x, 1.5, training=False), r"F\.dropout: dropout probability .* but got 1\.5"),
        (lambda x: F.dropout(x, -0.1, False), r"between 0 and 1, but got -0\.1"),
        (
            lambda x: x.contiguous(memory_format=torch.channels_last),
            r"memory_format=torch\.channels_last\) .*contiguous",
        ),
        (lambda x: x.half(memory_format=torch.channels_last), r"Tensor\.to\(f32\[2,3\], torch\.float16, memory_format"),
        (lambda x: torch.add(x, x, out=x), r"\(got an unexpected keyword argument 'out'\)"),
    ],
)
def test_arithmetic_arguments_torch_refuses_or_functe_cannot_record_are_named(fn, message):
    # the first four were accepted (torch raises for the invalid ones) or reported in other words
    with pytest.raises(functe.TraceError, match=message):
        functe.fuse(fn)(torch.ones(2, 3))


def test_public_op_validation_still_applies_while_tracing():
    with pytest.raises(functe.ShapeError, match=r"'weight' expected f32\[\?,3\], got f32\[4,5\]"):
        functe.trace(lambda x, w: ops.linear(x, w))(torch.zeros(2, 3), torch.zeros(4, 5))


def test_captured_tensor_requiring_grad_is_refused():
    w = torch.zeros(4, 3, requires_grad=True)
    with pytest.raises(functe.TraceError, match=r"captured from the enclosing scope requires gradients"):
        functe.trace(lambda x: ops.linear(x, w))(torch.zeros(2, 3))


@pytest.mark.parametrize(
    "gradients_off",
    [torch.no_grad, lambda: torch.set_grad_enabled(False), torch.inference_mode],
    ids=["no_grad", "set_grad_enabled", "inference_mode"],
)
def test_an_op_on_a_traced_value_with_gradients_off_is_refused(gradients_off):
    # Unfused, the block's output carries no gradient (a stop-gradient); the op list recorded it like
    # any op and the fused program differentiated it: dL/dw came out twice the unfused value.
    def fn(x, w):
        with gradients_off():
            target = ops.linear(x, w)
        return ops.linear(x, w) + target

    x, w = make((4, 8)), make((8, 8))
    with pytest.raises(functe.TraceError, match=r"functe\.linear: called on a traced value with gradients off"):
        functe.fuse(fn)(x, w)
    # a constant computed under no_grad (no traced value reaches the op) stays fine
    g, x = functe.fuse(lambda x: ops.bias(x, _no_grad_linear(w))), make((3, 8))
    assert_close(g(x), ops.bias(x, _no_grad_linear(w)))


def _no_grad_linear(w):
    with torch.no_grad():
        return ops.linear(torch.ones(1, 8), w).reshape(8)


def test_constants_made_under_torch_func_grad_are_literals():
    # First traced under torch.func.grad: the int seed becomes a tensor inside the transform, a
    # grad-tracking wrapper of a constant. It was refused as a "captured tensor requiring gradients";
    # it must be kept unwrapped (the cached plan is reused outside the transform).
    total = functe.opaque(torch.sum)

    def f(x, seed):
        return total(ops.bias(ops.dropout(x, 0.5, seed=seed), torch.ones(8)))

    x = make((4, 8))
    fused = functe.fuse(f)
    assert_close(torch.func.grad(fused)(x, 7), torch.func.grad(f)(x, 7))
    assert fused(x, 7) == f(x, 7) and fused.trace_count == 1
    w = make((3, 8))
    with pytest.raises(functe.TraceError, match=r"captured from the enclosing scope requires gradients"):
        torch.func.grad(lambda w: functe.fuse(lambda x: ops.linear(x, w).sum())(x))(w)
    # (a vmapped capture needs no gradient to be refused: the message said "requires gradients")
    vmapped = r"f32\[3,8\] captured from the enclosing scope is batched by an enclosing torch.func.vmap"
    with pytest.raises(functe.TraceError, match=vmapped):
        torch.func.vmap(lambda w: functe.fuse(lambda x: ops.linear(x, w))(x))(make((2, 3, 8)))


def test_escaped_tracer_is_refused():
    kept = []
    functe.trace(lambda x: kept.append(x) or x)(torch.zeros(2))
    with pytest.raises(functe.TraceError, match="escaped its trace"):
        ops.constant_scale(kept[0], 2.0)
    with pytest.raises(functe.TraceError, match="from another"):
        functe.trace(lambda y: ops.add_extra_input(y, kept[0]))(torch.zeros(2))


def test_data_dependent_forward_rule_is_reported():
    op = functe.custom_vjp("peek", lambda x: (x * float(x.sum()), None), lambda _, g: (g,))
    with pytest.raises(functe.TraceError, match=r"cannot infer the output shapes of peek.*data-dependent"):
        functe.trace(op)(torch.zeros(2))


def _ln(x, g, b):
    return F.layer_norm(x, (x.shape[-1],), g, b)


def test_opaque_functions_are_one_equation_with_static_keywords():
    gelu = functe.opaque(F.gelu)
    assert functe.opaque(F.gelu) is gelu
    text = oplist_text(lambda x: gelu(x, approximate="tanh") * 2.0, torch.zeros(3))
    assert "b:f32[3] = opaque_gelu[approximate='tanh'] a" in text
    ln = functe.opaque(_ln, name="layer_norm")
    text = oplist_text(ln, torch.zeros(2, 5), torch.ones(5), torch.zeros(5))
    assert "d:f32[2,5] = layer_norm a b c" in text


def test_opaque_ops_of_fresh_lambdas_are_freed_and_wrapped_functions_get_their_own():
    from functe import _opaque

    before, refs = len(_opaque._OPAQUE), []
    for k in range(4):  # a new lambda every step, as eager code may make one
        f = lambda x, k=k: x * k
        op = functe.opaque(f)
        assert functe.opaque(f) is op and op(torch.ones(2)).tolist() == [k, k]
        refs.append(weakref.ref(op))
    del f, op
    gc.collect()
    assert len(_opaque._OPAQUE) == before and all(r() is None for r in refs)

    def inner(x):
        return x + 1

    inner_op = functe.opaque(inner)

    @functools.wraps(inner)  # copies inner.__dict__, where the ops live
    def outer(x):
        return inner(x) * 2

    assert functe.opaque(outer) is not inner_op
    assert functe.opaque(outer)(torch.ones(1)).tolist() == [4.0]
    assert functe.opaque(inner) is inner_op


def test_opaque_ops_of_modules_and_bound_methods_are_freed_with_them():
    # A global table keyed by the module (or by the bound method, which holds its object) kept every
    # model of a sweep alive with its parameters; the ops now live on the object.
    from functe import _opaque

    before, refs = len(_opaque._OPAQUE), []
    for _ in range(3):
        model = torch.nn.Linear(4, 4).requires_grad_(False)
        op, method_op = functe.opaque(model), functe.opaque(model.forward)
        assert functe.opaque(model) is op and functe.opaque(model.forward) is method_op
        assert_close(op(torch.ones(2, 4)), model(torch.ones(2, 4)))
        refs += [weakref.ref(model), weakref.ref(op), weakref.ref(method_op)]
    copied = copy.deepcopy(model)  # (a copy makes ops of its own; the table is not copied)
    assert functe.opaque(copied) is not op and functe.opaque(model) is op
    del model, op, method_op, copied
    gc.collect()
    assert len(_opaque._OPAQUE) == before and all(r() is None for r in refs)

    class Scale:  # (a callable object: its ops are not written into its __dict__, which vars() shows)
        def __call__(self, x):
            return x * 2.0

    scale = Scale()
    assert torch.equal(functe.opaque(scale)(torch.ones(2)), torch.full((2,), 2.0)) and vars(scale) == {}

    @dataclasses.dataclass
    class Times:  # (unhashable, as a dataclass with eq: keyed by identity, where hash() raised a TypeError)
        factor: float

        def __call__(self, x):
            return x * self.factor

    times, equal = Times(3.0), Times(3.0)
    op = functe.opaque(times)
    assert functe.opaque(times) is op and functe.opaque(equal) is not op
    assert torch.equal(op(torch.ones(2)), torch.full((2,), 3.0))
    x = torch.ones(3, requires_grad=True)
    assert torch.equal(torch.autograd.grad(op(x).sum(), x)[0], torch.full((3,), 3.0))


def test_opaque_gradients_match_torch_under_every_transform():
    ln = functe.opaque(_ln, name="layer_norm")
    args = [make((3, 5), torch.float64), make((5,), torch.float64), make((5,), torch.float64)]
    check_transforms(ln, _ln, args)
    xs = [a.clone().requires_grad_() for a in args]
    assert torch.autograd.gradcheck(ln, xs) and torch.autograd.gradgradcheck(ln, xs)


def test_opaque_first_order_eager_backward_matches():
    gelu = functe.opaque(F.gelu)
    x = make((4, 6), torch.float32).requires_grad_()
    (g,) = torch.autograd.grad(gelu(x, approximate="tanh").sum(), x)
    (r,) = torch.autograd.grad(F.gelu(x, approximate="tanh").sum(), x)
    assert_close(g, r)


def test_tracers_look_like_tensors_to_validation_code():
    seen = {}

    def fn(x):
        seen.update(
            shape=x.shape, dtype=x.dtype, device=x.device, dim=x.dim(), numel=x.numel(), contiguous=x.is_contiguous()
        )
        return x.contiguous().to(torch.float32)

    oplist = functe.trace(fn)(torch.zeros(2, 3))
    assert seen == dict(shape=(2, 3), dtype=torch.float32, device=torch.device("cpu"), dim=2, numel=6, contiguous=True)
    assert oplist.outputs == oplist.inputs  # contiguous() and a no-op to() record nothing
    assert "cast[dtype=f16]" in str(functe.trace(lambda x: x.to(torch.float16))(torch.zeros(2)))
    with pytest.raises(functe.TraceError, match=r"Tensor\.to"):  # (a device change has no op)
        functe.trace(lambda x: x.to("meta"))(torch.zeros(2))


def test_trace_on_a_device_that_is_not_present_records_it():
    # Tracers carry the device as metadata only: a CUDA signature traces on a CPU-only machine.
    x = torch.empty(2, 3, device="meta")
    oplist = functe.trace(lambda x: x * 2.0)(functe._trace.shape_only(x.shape, x.dtype, torch.device("cuda", 0)))
    assert oplist.eqns[0].outputs[0].device == torch.device("cuda", 0)


def test_an_opaque_random_function_is_differentiated_at_the_draw_it_made():
    # The backward recomputed fn with the generator already advanced: dropout's gradient used another
    # mask than its forward (eager, fused and torch.func alike).
    drop = functe.opaque(torch.nn.functional.dropout)
    torch.manual_seed(0)
    x = torch.ones(1000, requires_grad=True)
    y = drop(x, p=0.5)
    after_forward = torch.get_rng_state()
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(g, y.detach())  # 2 where kept, 0 where dropped
    assert torch.equal(torch.get_rng_state(), after_forward)  # the backward leaves the generator alone
    fused = functe.fuse(lambda x, w: ops.linear(drop(x, p=0.5), w))
    x2 = torch.ones(6, 64, requires_grad=True)
    y2 = fused(x2, torch.eye(64))  # the dropped x itself (identity weight), and so is its gradient
    assert torch.equal(torch.autograd.grad(y2.sum(), x2)[0], y2.detach())
    y3, pull = torch.func.vjp(lambda x: drop(x, p=0.5), torch.ones(1000))
    assert torch.equal(pull(torch.ones(1000))[0], y3)


@pytest.mark.parametrize("expr", ["seed + 1", "seed * 2", "seed - 1", "seed + seed"])
def test_seed_arithmetic_in_a_trace_names_the_way_out(expr):
    f = eval(f"lambda x, seed: functe.ops.dropout(x, 0.3, seed={expr})")
    with pytest.raises(functe.TraceError, match=r"i64\[\] . .*integer tensor \(a seed\).*functe\.opaque"):
        functe.fuse(f)(torch.randn(4, 8), torch.tensor(7))


def test_a_seed_derived_by_an_opaque_op_matches_unfused():
    next_seed = functe.opaque(lambda seed, k: seed + k)

    def f(x, seed):
        return functe.ops.dropout(functe.ops.dropout(x, 0.3, seed=seed), 0.3, seed=next_seed(seed, 1))

    x = torch.randn(4, 8)
    assert torch.equal(functe.fuse(f)(x, torch.tensor(7)), f(x, torch.tensor(7)))


def test_formatting_a_traced_value_logs_like_str_and_refusals_show_keywords():
    # f"{y}" went through Tensor.__format__ to __torch_function__ and was refused, where str(y) and
    # logging's %s printed the tracer; a refused call lost its keywords (x.sum(dim=-1) read as a full sum).
    shown = []

    def block(x, w):
        y = ops.linear(x, w)
        shown.append(f"{y} {y!r:>20}")
        return y

    functe.fuse(block)(make((4, 8)), make((6, 8)))
    assert shown == ["Tracer(f32[4,6])     Tracer(f32[4,6])"]
    with pytest.raises(functe.TraceError, match=r"Tensor\.__format__\(f32\[4,8\], str\) on a traced value"):
        functe.trace(lambda x: f"{x:.4f}")(make((4, 8)))  # (a format spec reads the value)
    with pytest.raises(functe.TraceError, match=r"Tensor\.sum\(f32\[4,8\], dim=-1, keepdim=True\)"):
        functe.trace(lambda x: x.sum(dim=-1, keepdim=True))(make((4, 8)))


def test_out_writes_into_captured_tensors_are_refused_and_reshape_takes_its_keyword():
    step = torch.zeros(())
    with pytest.raises(functe.TraceError, match=r"torch\.add writes into f32\[\] captured from the enclosing scope"):
        functe.fuse(lambda x: (torch.add(step, 1, out=step), ops.constant_scale(x, 2.0))[1])(make((3,)))
    assert step.item() == 0.0
    x = make((4, 8))
    assert torch.equal(functe.fuse(lambda x: ops.gelu(x).reshape(shape=(32,)))(x), ops.gelu(x).reshape(32))


def test_an_opaque_function_differentiates_complex_inputs_and_outputs():
    # Its eager backward took floating-point leaves only: a complex output's cotangent was dropped
    # (its part of the gradient silently missing), a complex input failed in torch.autograd.grad.
    spectrum = functe.opaque(lambda x: torch.fft.fft(x))
    magnitude = functe.opaque(lambda z: z.abs())
    x = make((5,), torch.float64).requires_grad_()
    z = torch.randn(5, dtype=torch.complex128, requires_grad=True)
    for f, g, arg in ((spectrum, lambda x: torch.fft.fft(x), x), (magnitude, lambda z: z.abs(), z)):
        got = torch.autograd.grad((f(arg).abs() if arg is x else f(arg)).sum() + arg.real.sum(), arg)[0]
        expected = torch.autograd.grad((g(arg).abs() if arg is x else g(arg)).sum() + arg.real.sum(), arg)[0]
        torch.testing.assert_close(got, expected)  # (complex for z: the tolerance table is for real dtypes)
    assert_close(
        torch.func.grad(lambda x: spectrum(x).abs().sum())(x.detach()),
        torch.func.grad(lambda x: torch.fft.fft(x).abs().sum())(x.detach()),
    )


_OWN_GENERATOR = torch.Generator().manual_seed(0)


def _own_dropout(x):  # (dropout drawing from a dedicated generator the function reaches by name)
    return x * (torch.rand(x.shape, generator=_OWN_GENERATOR) > 0.5).to(x.dtype) * 2.0


def test_an_opaque_function_replays_the_draws_of_a_generator_it_reaches():
    # Only torch's default generators were restored for the backward's recomputation: it drew a new
    # mask from the advanced generator (a wrong gradient) and advanced it a second time.
    op = functe.opaque(_own_dropout)
    for run in (op, functe.fuse(lambda x: op(x))):
        _OWN_GENERATOR.manual_seed(0)
        x = torch.ones(4, 6, requires_grad=True)
        y = run(x)
        (dx,) = torch.autograd.grad(y.sum(), x)
        assert torch.equal(dx, y.detach())  # (y = mask * 2, dy/dx the same mask * 2)
        _OWN_GENERATOR.manual_seed(0)
        _own_dropout(torch.ones(4, 6))
        after_plain = _OWN_GENERATOR.get_state()
        _OWN_GENERATOR.manual_seed(0)
        run(torch.ones(4, 6, requires_grad=True)).sum().backward()
        assert torch.equal(_OWN_GENERATOR.get_state(), after_plain)  # (advanced once, as unfused)
    _OWN_GENERATOR.manual_seed(0)
    dx = torch.func.grad(lambda x: op(x).sum())(torch.ones(4, 6))
    _OWN_GENERATOR.manual_seed(0)
    assert torch.equal(dx, _own_dropout(torch.ones(4, 6)))


def _upcast_on_cpu(x):
    return torch.tanh(x.float()) if x.device.type == "cpu" else torch.tanh(x)


def test_an_opaque_function_is_traced_on_its_inputs_device():
    # Its output types were inferred on meta tensors: a function branching on the device recorded
    # the other branch's dtype (bf16 where it returns f32), and a fused op after it failed in torch.
    act, x = functe.opaque(_upcast_on_cpu), make((4, 8), torch.bfloat16)
    assert "f32[4,8] = opaque__upcast_on_cpu" in str(functe.trace(act)(x))
    assert functe.fuse(act)(x).dtype == torch.float32
    with pytest.raises(functe.DTypeError, match=r"functe\.linear: argument 'weight' expected dtype f32"):
        functe.fuse(lambda x, w: ops.linear(act(x), w))(x, make((6, 8), torch.bfloat16))


def test_dropout_that_is_off_traces_as_the_identity():
    # nn.Dropout in eval mode (F.dropout(training=False)) or p = 0 was refused on a traced value, so
    # an ordinary transformer module could not be fused for evaluation; dropping is still refused.
    model, x = torch.nn.Sequential(torch.nn.Dropout(0.5)), make((4, 8))
    fused = functe.fuse(lambda x: ops.gelu(model(x)))
    model.eval()
    assert torch.equal(fused(x), ops.gelu(x))
    assert torch.equal(functe.fuse(lambda x: F.dropout(ops.gelu(x), p=0.0))(x), ops.gelu(x))
    model.train()
    with pytest.raises(functe.TraceError, match=r"dropout draws random numbers inside a traced function"):
        fused(x)


def test_draw_checks_spare_ops_that_do_not_draw_shape_runs_and_rebound_generators():
    # The draw watch refused every op tagged nondeterministic_seeded: attention with dropout_p = 0 on
    # captured constants, and an opaque op's fake shape run of torch.randn under a fake mode.
    q = make((1, 2, 4, 8))
    fn = lambda x: ops.add_extra_input(x, F.scaled_dot_product_attention(q, q, q, dropout_p=0.0).reshape(8, 8))
    x = make((8, 8))
    assert torch.equal(functe.fuse(fn)(x), fn(x))
    from torch._subclasses.fake_tensor import FakeTensorMode

    noisy = functe.opaque(lambda x: x + torch.randn(x.shape))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        assert functe.fuse(lambda x: noisy(x))(mode.from_tensor(x)).shape == (8, 8)
    # an opaque function whose generator name is rebound (a fresh generator per epoch): the first
    # generator found was replayed, and the backward differentiated another mask
    global _OWN_GENERATOR
    op, saved = functe.opaque(_own_dropout), _OWN_GENERATOR
    try:
        for seed in range(3):
            _OWN_GENERATOR = torch.Generator().manual_seed(seed)
            x = torch.ones(4, 6, requires_grad=True)
            y = op(x)
            assert torch.equal(torch.autograd.grad(y.sum(), x)[0], y.detach())
    finally:
        _OWN_GENERATOR = saved


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpoint_inside_a_traced_function_is_refused_and_one_around_a_fused_function_works(reentrant):
    # A checkpoint inside a fused function was dropped silently (the plan saved every residual, no
    # memory saved); its reentrant form blamed a no_grad the user never wrote.
    from torch.utils.checkpoint import checkpoint

    w = make((8, 8)).requires_grad_()
    body = lambda x, w: ops.gelu(ops.linear(ops.layer_norm(x, torch.ones(8), torch.zeros(8)), w))
    inside = functe.fuse(lambda x, w: checkpoint(body, x, w, use_reentrant=reentrant))
    x = make((4, 8)).requires_grad_()
    why = "with use_reentrant=True" if reentrant else "under saved-tensor hooks pushed inside the traced function"
    with pytest.raises(functe.TraceError, match=rf"functe\.layer_norm: called on a traced value .*{why}"):
        inside(x, w)
    fused = functe.fuse(body)
    expected = torch.autograd.grad(body(x, w).square().sum(), (x, w))
    checkpoint(fused, x, w, use_reentrant=reentrant).square().sum().backward()  # (reentrant: no .grad())
    assert torch.equal(x.grad, expected[0]) and torch.equal(w.grad, expected[1])
    with torch.autograd.graph.save_on_cpu():  # (hooks in force before the trace: they save the plan's residuals)
        got = torch.autograd.grad(functe.fuse(body)(x, w).square().sum(), (x, w))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_reentrant_checkpoint_inside_an_opaque_function_names_the_op():
    # The backward failed with torch's "incompatible with .grad()", which the caller never called.
    from torch.utils.checkpoint import checkpoint

    for reentrant in (False, True):
        op = functe.opaque(lambda x, r=reentrant: checkpoint(torch.sin, x, use_reentrant=r), name=f"ck_sin_{reentrant}")
        x = make((3,)).requires_grad_()
        y = op(x)
        if reentrant:
            with pytest.raises(functe.TraceError, match=r"functe\.ck_sin_True: the function runs torch\.utils\.ch"):
                y.sum().backward()
        else:
            y.sum().backward()
            assert torch.equal(x.grad, torch.cos(x.detach()))
