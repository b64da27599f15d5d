"""Every Triton kernel compiles for a GPU (sm_90), in the specialisations functe launches.

Triton's interpreter accepts code its compiler rejects (Python globals read inside a kernel,
some dtype mixes, blocks smaller than ``tl.dot`` allows), so interpreter tests alone do not prove
that a kernel builds on the first GPU it meets. Here a small workload of public ops and kernel
launchers runs through the interpreter with :func:`functe.kernels._triton.record_launches` on;
every distinct launch (kernel, argument types, constexpr values, warps) is then compiled to a
cubin for sm_90 with the ptxas Triton ships, no device needed. The GEMM is also compiled in the
largest Hopper configurations of its autotuning lists and must fit an H100's shared memory.
A kernel that the workload never launches fails :func:`test_the_workload_launches_every_kernel`,
so a new kernel cannot skip this check. Numerics on a GPU are not tested here.
"""

from __future__ import annotations

import importlib
import itertools
import pkgutil
import re

import pytest
import torch
from codegen_helpers import HAVE_PTXAS, ASTSource, GPUTarget, triton

import functe
from functe import ops
from functe._block_quantize import cast_act_block_keep
from functe.kernels import _gemm_configs, _triton, gemm, gemm_fp8, norm, norm_block_quantize, norm_quantize

pytestmark = [pytest.mark.skipif(not HAVE_PTXAS, reason="Triton's NVIDIA backend (ptxas) is not installed")]

BF16 = torch.bfloat16
H100_SHARED_MEMORY = 232448  # bytes of shared memory one block may use on sm_90 (227 KiB)

_POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.float64: "*fp64",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.float8_e4m3fn: "*fp8e4nv",
    torch.float8_e5m2: "*fp8e5",
    torch.uint8: "*u8",
    torch.int8: "*i8",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.bool: "*i1",
}


def launchable_kernels() -> dict:
    """``{kernel: "module.name"}`` for every top-level (``*_kernel``) Triton kernel of functe."""
    import functe.kernels as package

    found = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"functe.kernels.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, _triton._SwitchableJIT) and name.endswith("_kernel"):
                found[value] = f"{info.name}.{name}"
    return found


def _value_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return _POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def _frozen(d: dict) -> tuple:
    return tuple(sorted(d.items()))


def specialisation(kernel, args, kwargs) -> tuple:
    """A hashable ``(kernel, signature, constexprs, options, attrs)`` from one recorded launch.

    As a GPU launch does, integer arguments equal to 1 become constants and pointers and integers
    divisible by 16 carry ``tt.divisibility`` (without them Triton cannot prove a unit stride or
    alignment, and neither vectorises nor software-pipelines the loads).
    """
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    values = dict(zip((p.name for p in kernel.params), args))
    values.update({k: v for k, v in kwargs.items() if k not in options})
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        value = values[param.name]
        specialise = not param.do_not_specialize
        if param.is_constexpr or value is None:
            signature[param.name], constexprs[param.name] = "constexpr", value
        elif specialise and type(value) is int and value == 1:
            signature[param.name], constexprs[param.name] = "constexpr", 1
        else:
            signature[param.name] = _value_type(value)
            aligned = (
                value.data_ptr() % 16 == 0
                if isinstance(value, torch.Tensor)
                else type(value) is int and value % 16 == 0
            )
            if specialise and aligned:
                attrs[(index,)] = (("tt.divisibility", 16),)
    return kernel, _frozen(signature), _frozen(constexprs), _frozen(options), _frozen(attrs)


def compile_for_sm90(spec):
    kernel, signature, constexprs, options, attrs = spec
    attrs = {key: [list(a) for a in value] for key, value in attrs}
    source = ASTSource(fn=kernel, signature=dict(signature), constexprs=dict(constexprs), attrs=attrs)
    return triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={**_triton.COMPILE_OPTIONS, **dict(options)}
    )


SMALLEST_SHARED_MEMORY = 101376  # bytes of shared memory one block may use on sm_86/89 (99 KiB)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("columns", [1024, 8192])
@pytest.mark.parametrize("variant", ["layer_norm_bwd", "rms_norm_bwd_add"])
def test_the_pipelined_norm_backward_fits_every_gpus_shared_memory(variant, columns, dtype):
    # The backward's loop pipelines its loads through shared memory once a program loops over more
    # than one row tile (the workload's small norms never do): fp32 and fp64 tiles needed 128-384
    # KiB, more than an sm_80/86/89 block may have, and Triton refuses such a launch.
    rows = 2 * min(4, 8192 // columns) * norm._bwd_partials(columns)  # (two row tiles a program)
    x = torch.randn(rows, columns, dtype=torch.float64).to(dtype)
    dy, w = torch.randn_like(x), torch.randn(columns, dtype=torch.float64).to(dtype)
    stats = x.to(torch.float64 if dtype == torch.float64 else torch.float32)
    mean, rstd = stats.mean(-1), stats.var(-1, correction=0).add(1e-5).rsqrt()
    with functe.use_backend("interpret"), _triton.record_launches() as log:
        if variant == "layer_norm_bwd":
            norm.layer_norm_bwd(dy, x, mean, rstd, w, False)
        else:
            norm.rms_norm_bwd_add(dy, x, w, dy, 1e-5, False)
    ((kernel, args, kwargs, _),) = [entry for entry in log if entry[0] is norm._norm_bwd_kernel]
    assert args[13] > 1  # tiles_per_program: the loop runs more than once, so it is pipelined
    compiled = compile_for_sm90(specialisation(kernel, args, kwargs))
    assert compiled.metadata.shared <= SMALLEST_SHARED_MEMORY, (kwargs["STAGES"], compiled.metadata.shared)


# ----------------------------------------------------------------------------- the workload


def _grads(fn, *args):
    out = fn(*args)
    outs = out if isinstance(out, tuple) else (out,)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs])


def workload():
    """bf16 forward+backward of every op family, the quantized linears, the fused block, the GEMMs."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape, dtype=BF16):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_()

    for name in ops.ACTIVATION_NAMES:
        gated = name not in ("gelu", "qgelu", "relu", "srelu", "silu")
        x = rand(4, 64 if gated else 32)
        if name.startswith("scaled_"):
            _grads(lambda x, s, name=name: ops.activation(x, name, s), x, rand(4))
        else:
            _grads(lambda x, name=name: ops.activation(x, name), x)
    x, w, b = rand(4, 32), rand(32), rand(32)
    _grads(lambda x, w, b: ops.layer_norm(x, w, b), x, w, b)
    _grads(lambda x, w: ops.rms_norm(x, w, zero_centered_gamma=True), x, w)
    _grads(ops.l2_normalize, x)
    # per-example gradients of an ensemble of γ: the norm backward's members kernel, γ per member
    ensemble_grad = torch.vmap(torch.func.grad(lambda w, x: ops.rms_norm(x, w).pow(2).sum()))
    ensemble_grad(rand(2, 32).detach(), rand(2, 4, 32).detach())
    _grads(lambda x: ops.dropout(x, 0.1, seed=3), x)
    _grads(ops.bias, x, b)
    _grads(lambda x: ops.constant_scale(x, 2.0), x)
    _grads(ops.add_extra_input, x, rand(4, 32))

    recipes = [
        functe.DelayedScaling(amax_history_len=4),
        functe.CurrentScaling(),
        functe.MXFP8BlockScaling(),
        functe.Float8BlockScaling(),
        functe.NVFP4BlockScaling(),
    ]
    for recipe in recipes:
        x, w, b = rand(32, 128), rand(128, 128), rand(128)
        state = functe.init_linear_scaling_state(recipe)
        seed = torch.tensor(5) if isinstance(recipe, functe.NVFP4BlockScaling) else None
        _grads(lambda x, w, b, st=state, r=recipe, sd=seed: ops.fp8_linear(x, w, b, st, recipe=r, seed=sd), x, w, b)
        q, _ = functe.quantize(x.detach(), recipe, state=None if state is None else state.input, seed=seed)
        functe.dequantize(q, BF16)

    # The fused block (norm q-in, GEMM epilogues, dact+dbias) with and without FP8.
    from functe.demo import init_block_params, mlp_block

    params = {k: v.to(BF16).requires_grad_() for k, v in init_block_params(0).items() if k != "head.weight"}
    x = rand(16, params["ln.weight"].shape[0])
    _grads(lambda x, *ps: mlp_block(dict(zip(params, ps)), x), x, *params.values())

    # The norm + FP8 cast kernel (the q-in of norm -> FP8 linear), both norms.
    x, w, b, scale = rand(4, 32).detach(), rand(32).detach(), rand(32).detach(), torch.ones(())
    for kind, beta in (("layer", b), ("rms", None)):
        norm_quantize.norm_cast_amax(x, w, beta, scale, 1e-5, kind, False, torch.float8_e4m3fn, torch.uint8, True)
    # ... and its block-scaled siblings (FP8 1x128, NVFP4 1x16) on a 128-wide row.
    x, w, b = rand(4, 128).detach(), rand(128).detach(), rand(128).detach()
    norm_block_quantize.norm_fp8_block_cast(x, w, b, 1e-5, "layer", False, torch.float8_e4m3fn, torch.uint8, True, 0.0)
    norm_block_quantize.norm_nvfp4_cast(x, w, None, torch.tensor(4.0), 1e-5, "rms", True, BF16)
    # The activation + block cast that writes the activation too (forward_activation_block_linear):
    # FP8 block's one kernel with KEEP, NVFP4's amax pass that stores h; elementwise and gated.
    for recipe, act in itertools.product((functe.Float8BlockScaling(), functe.NVFP4BlockScaling()), ("gelu", "swiglu")):
        cast_act_block_keep(rand(4, 256 if act == "swiglu" else 128).detach(), act, recipe, "input", None, BF16)

    # The GEMM launchers (16-bit and FP8 operands, every epilogue and backward variant).
    a, wt, bias, res = rand(32, 64).detach(), rand(48, 64).detach(), rand(48).detach(), rand(32, 48).detach()
    gemm.gemm(a, wt, bias, res, 0.5, "gelu")
    z = gemm.gemm_preact(a, wt, bias, None, 1.0, "silu")[1]
    dy = rand(32, 48).detach()
    gemm.gemm_dgrad(dy, wt, a)
    gemm.gemm_dgrad_dact(dy, z, wt, None, 1.0, "silu")
    gemm.gemm_wgrad(dy, a)
    gemm.gemm_wgrad_dbias(dy, a)
    one = torch.ones((), dtype=torch.float32)
    a8, w8 = a.to(torch.float8_e4m3fn), wt.to(torch.float8_e4m3fn)
    gemm.gemm(a8, w8, bias, None, 1.0, None, one, one, BF16)
    gemm.gemm_dgrad(dy.to(torch.float8_e5m2), w8, None, 1.0, one, one, BF16)
    gemm_fp8.gemm_amax(a, wt, bias, None, 1.0, "relu")
    gemm_fp8.gemm_quantize(a, wt, one, torch.float8_e4m3fn, bias, None, 1.0, "gelu")
    gemm_fp8.cast_fp8(dy, one, torch.float8_e5m2)


@pytest.fixture(scope="module")
def recorded():
    with functe.use_backend("interpret"), _triton.record_launches() as log:
        workload()
    return log


# Constexprs that only the interpreter sets (numpy has no bf16 dot or fp8 casts); a GPU launch has them off.
INTERPRETER_ONLY = {"UPCAST": False, "EMULATE_FP8": False, "EMULATE": False}


def _gemm_configs_for(spec):
    operands = dict(spec[1])["A"]
    return _gemm_configs.HOPPER_FP8 if operands.startswith("*fp8") else _gemm_configs.HOPPER_16BIT


def as_on_gpu(spec, config=None) -> tuple:
    """The specialisation a GPU launch would compile: interpreter-only flags off, and for the GEMM a
    Hopper configuration (default: the smallest tile of its list) instead of the interpreter's 16x16x16."""
    kernel, signature, constexprs, options, attrs = spec
    constexprs = {**dict(constexprs), **{k: v for k, v in INTERPRETER_ONLY.items() if k in dict(constexprs)}}
    if kernel is gemm._gemm_kernel:
        if config is None:
            config = min(_gemm_configs_for(spec), key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])
        constexprs.update(config.kwargs)
        options = (("num_stages", config.num_stages), ("num_warps", config.num_warps))
    return kernel, signature, tuple(sorted(constexprs.items())), options, attrs


def _specs(recorded) -> list:
    return list(dict.fromkeys(as_on_gpu(specialisation(*launch[:3])) for launch in recorded))


def test_the_workload_launches_every_kernel(recorded):
    launched = {kernel for kernel, *_ in recorded}
    missing = sorted(name for kernel, name in launchable_kernels().items() if kernel not in launched)
    assert not missing, f"kernels the codegen workload never launches: {missing}"


def test_every_launched_specialisation_compiles_for_sm90(recorded, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # fresh compiles, isolated from other processes
    failures = []
    specs = _specs(recorded)
    for spec in specs:
        try:
            compiled = compile_for_sm90(spec)
            assert compiled.asm["cubin"]
        except Exception as e:  # collect all: one failing kernel should not hide the others
            failures.append(f"{spec[0].__name__} {dict(spec[2])}: {type(e).__name__}: {str(e)[:300]}")
    assert len(specs) >= len(launchable_kernels())
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("operands", ["bf16", "fp8"])
@pytest.mark.parametrize("largest", ["tiled", "persistent"])
def test_gemm_compiles_in_its_largest_hopper_configs(recorded, operands, largest, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    want = "*fp8e4nv" if operands == "fp8" else "*bf16"
    # The forward GEMM with the richest epilogue recorded for these operands.
    candidates = [s for s in _specs(recorded) if s[0] is gemm._gemm_kernel and dict(s[1])["A"] == want]
    assert candidates, f"no {operands} GEMM launch recorded"
    spec = max(candidates, key=lambda s: sum(v is not None and v is not False for _, v in s[2]))
    persistent = largest == "persistent"
    config = max(
        (c for c in _gemm_configs_for(spec) if c.kwargs["PERSISTENT"] == persistent),
        key=lambda c: (c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"], c.num_stages),
    )
    compiled = compile_for_sm90(as_on_gpu(spec, config))
    assert compiled.asm["cubin"]
    shared = compiled.metadata.shared
    assert shared <= H100_SHARED_MEMORY, (config, shared)
    # Software pipelining multi-buffers the operand tiles: more shared memory than one stage's tiles
    # (a change that defeats it, e.g. an unprovable unit stride, shows up here, not only on a GPU).
    one_stage = (
        (config.kwargs["BLOCK_M"] + config.kwargs["BLOCK_N"])
        * config.kwargs["BLOCK_K"]
        * (1 if operands == "fp8" else 2)
    )
    assert shared >= (config.num_stages - 1) * one_stage, (config, shared, one_stage)


def test_every_launch_uses_a_one_dimensional_grid(recorded):
    # CUDA takes 2^31 - 1 programs on grid axis 0 but 65,535 on axes 1 and 2: column blocks on axis 1
    # failed for a row past ~8.4M elements (a flattened 4096x4096 weight). 2-D tilings launch a 1-D
    # grid and split the program id (functe.kernels._triton.tile_ids).
    grids = {kernel.fn.__name__: grid for kernel, _, _, grid in recorded}
    assert grids and all(isinstance(g, tuple) and len(g) == 1 for g in grids.values()), grids


def test_tiled_grid_refuses_a_launch_past_cudas_limit():
    assert _triton.tiled_grid(3, 5) == (15,)
    with pytest.raises(ValueError, match="exceeds CUDA"):
        _triton.tiled_grid(2**16, 2**15)


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2,
    reason="fake cuda:1 tensors need a second device where CUDA is real (FakeTensorMode initialises it)",
)
def test_compiled_launches_make_their_tensors_device_current(monkeypatch):
    # Triton launches on the current CUDA device and rejects another device's pointers; nothing set
    # the device, so an op on cuda:1 failed while cuda:0 was current.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        on_1, on_0 = torch.empty(2, device="cuda:1"), torch.empty(2, device="cuda:0")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert _triton.launch_device((3, on_1, on_0)) == torch.device("cuda:1")
    assert _triton.launch_device((on_0, on_1)) is None
    assert _triton.launch_device((torch.empty(2), on_1)) is None  # (a CPU launch: the interpreter's)


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2,
    reason="fake cuda:1 tensors need a second device where CUDA is real (FakeTensorMode initialises it)",
)
def test_the_gemm_launch_and_its_autotuning_run_on_their_tensors_device(monkeypatch):
    # The autotuner times configurations with events on the *current* device's stream: a GEMM on
    # cuda:1 tensors while cuda:0 was current chose its configuration from the wrong device's timings.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        on_1, on_0 = torch.empty(2, device="cuda:1"), torch.empty(2, device="cuda:0")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    context = _triton.on_device_of(on_1)
    assert isinstance(context, torch.cuda.device) and context.idx == 1
    assert not isinstance(_triton.on_device_of(on_0), torch.cuda.device)
    assert not isinstance(_triton.on_device_of(torch.empty(2)), torch.cuda.device)
    entered = []
    monkeypatch.setattr(gemm, "on_device_of", lambda t: entered.append(t) or _triton.on_device_of(t))
    a = torch.randn(4, 8)
    with functe.use_backend("interpret"):
        gemm.gemm(a, torch.randn(6, 8))
    assert len(entered) == 1 and entered[0] is a


# Kernels whose program id may stay int32: it only indexes something bounded far below 2^31
# (a GEMM's output tile, a vmapped dropout member's seed, a norm cast's per-program amax slot).
_SMALL_PROGRAM_INDEX = {
    "_gemm_kernel",
    "_dropout_kernel",
    "_norm_cast_kernel",
}


def test_kernels_index_memory_from_an_int64_program_id(recorded, tmp_path, monkeypatch):
    # tile_ids split the program id in int32: on a row of 2^31 elements or more (a flattened 4 GiB
    # buffer quantized block-wise, a 1-D activation) column program x block wrapped negative, passed
    # the column mask after widening, and the kernels read and wrote ~2^31 elements before their
    # buffers. Every use of the program id must be its widening to i64, but where it indexes
    # something small (_SMALL_PROGRAM_INDEX).
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    one = {}
    for spec in _specs(recorded):
        one.setdefault(spec[0], spec)  # (one specialisation per kernel: the index types do not depend on it)
    checked = {kernel.__name__ for kernel in one} - _SMALL_PROGRAM_INDEX
    assert {"_act_kernel", "_mxfp8_kernel", "_fp8_block_kernel", "_nvfp4_kernel"} <= checked
    narrow = {}
    for kernel in one:
        if kernel.__name__ in checked:
            ttir = compile_for_sm90(one[kernel]).asm["ttir"]
            for pid in re.findall(r"(%\w+) = tt\.get_program_id \w : i32", ttir):
                uses = [line.strip() for line in ttir.splitlines() if re.search(re.escape(pid) + r"\b(?! =)", line)]
                widened = r"%\w+ = arith\.extsi " + re.escape(pid) + " : i32 to i64"
                narrow[kernel.__name__] = [u[:100] for u in uses if not re.match(widened, u)]
    assert not any(narrow.values()), {k: v for k, v in narrow.items() if v}


def test_norm_statistics_use_ieee_sqrt_and_division_on_the_gpu(recorded, tmp_path, monkeypatch):
    # tl.sqrt compiled to sqrt.approx.ftz: a subnormal variance (eps = 0) flushed to 0 and rstd = inf
    # on a GPU, where the interpreter and the twins stay finite.
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    kernels = (norm._norm_fwd_kernel, norm_quantize._norm_cast_kernel, norm_block_quantize._norm_block_cast_kernel)
    specs = [s for s in _specs(recorded) if s[0] in kernels and dict(s[1])["X"] != "*fp64"]  # (fp32 math)
    assert {s[0] for s in specs} == set(kernels)
    for spec in specs:
        ptx = compile_for_sm90(spec).asm["ptx"]
        assert "sqrt.rn.f32" in ptx and "sqrt.approx" not in ptx, spec[0].__name__


def test_fp64_norm_statistics_are_not_computed_from_fp32_scalars(tmp_path, monkeypatch):
    # A Python float argument is fp32 in a compiled kernel (the interpreter keeps the double): 1/N
    # passed as a float left fp64 LayerNorm and RMSNorm statistics fp32-accurate on a GPU (~1e-7).
    # Only eps may still be widened (its rounding moves var + eps by ~eps * 3e-8).
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    x, w, b = (torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in ((3, 40), (40,), (40,)))
    with functe.use_backend("interpret"), _triton.record_launches() as log:
        _grads(lambda x, w, b: ops.layer_norm(x, w, b), x, w, b)
        _grads(lambda x, w: ops.rms_norm(x, w), x, w)
        _grads(ops.l2_normalize, x)
    specs = list(dict.fromkeys(as_on_gpu(specialisation(*launch[:3])) for launch in log))
    assert {s[0] for s in specs} == {norm._norm_fwd_kernel, norm._norm_bwd_kernel}, specs
    for spec in specs:
        ttir = compile_for_sm90(spec).asm["ttir"]
        widened = [line.strip() for line in ttir.splitlines() if "arith.extf" in line and "f32 to f64" in line]
        assert all("%eps" in line for line in widened), (spec[0].__name__, widened)
