"""The eta compiler's torch backend: every op against an independent reference, the RNG,
validation errors, and the program cache."""
from __future__ import annotations

import json
import math
import operator
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from pie_actors.gpu.eta import OPS, EtaError, ProgramCache, TensorEnv, compile_program

CPU = torch.device("cpu")


def apply(op: str, *args, env_outputs=None):
    """Run `op` once: tensor arguments are fed through channels, the rest are IR literals."""
    ops, channels, ir_args = [], {}, []
    for a in args:
        if isinstance(a, torch.Tensor):
            channels[len(channels)] = [a]
            ops.append(["take", [len(channels) - 1]])
            ir_args.append({"t": len(ops) - 1})
        else:
            ir_args.append(a)
    ops.append([op, ir_args])
    program = compile_program({"ops": ops, "outputs": [len(ops) - 1]}, device=CPU, backend="torch")
    return program.run(TensorEnv(env_outputs or {}, channels))[0]


def rand(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * 3


def close(got: torch.Tensor, want, **kw) -> None:
    """Equal values, shape and dtype (NaN equals NaN)."""
    torch.testing.assert_close(got, torch.as_tensor(want), equal_nan=True, **kw)


SHAPES = [(7,), (3, 11), (2, 3, 5)]
SEEDS = [0, 1, 2]
COVERED: set[str] = set()


def covers(*names: str):
    COVERED.update(names)
    return lambda f: f


# ---------------------------------------------------------------------------------------------
# the RNG, re-implemented with numpy's wrapping uint32 arithmetic

def _np_mix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x21F0AAAD)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x735A2D97)
    return x ^ (x >> np.uint32(15))


def ref_gumbel(n: int, seed: int) -> np.ndarray:
    s = seed % 2 ** 64
    lo, hi = np.uint32(s & 0xFFFFFFFF), np.uint32(s >> 32)
    key = _np_mix(np.array([lo ^ _np_mix(np.array([hi ^ np.uint32(0x9E3779B9)]))[0]], np.uint32))[0]
    h = _np_mix(_np_mix(np.arange(n, dtype=np.uint32) + key) ^ key)
    u = ((h >> np.uint32(8)) | np.uint32(1)).astype(np.float64) * 2.0 ** -24
    return -np.log(-np.log(u))


@covers("gumbel")
@pytest.mark.parametrize("seed", [0, 1, 12345, -7, 2 ** 40 + 3])
@pytest.mark.parametrize("shape", SHAPES)
def test_gumbel_is_the_documented_hash(shape, seed):
    got = apply("gumbel", list(shape), seed)
    close(got, torch.from_numpy(ref_gumbel(math.prod(shape), seed)).reshape(shape).float(),
          rtol=1e-5, atol=1e-5)


def test_gumbel_noise_statistics():
    g = apply("gumbel", [200_000], 3).double()
    assert abs(g.mean().item() - 0.5772) < 0.01            # Euler-Mascheroni
    assert abs(g.var().item() - math.pi ** 2 / 6) < 0.03


def test_seed_tensor_equals_seed_literal():
    x = rand(torch.Generator().manual_seed(0), 3, 50)
    for dtype in (torch.int32, torch.int64, torch.uint32):
        for seed in (5, 123456):
            assert torch.equal(apply("gumbel_max", x, torch.tensor([seed], dtype=dtype)),
                               apply("gumbel_max", x, seed))


def test_gumbel_max_samples_the_softmax():
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5])
    counts = torch.zeros(5)
    for seed in range(3000):
        counts[apply("gumbel_max", logits, seed)] += 1
    torch.testing.assert_close(counts / 3000, torch.softmax(logits, -1), atol=0.03, rtol=0)


def test_rows_get_their_own_noise():
    same_rows = torch.zeros(8, 1000)
    tokens = apply("gumbel_max", same_rows, 9)
    assert len(set(tokens.tolist())) > 4
    assert torch.equal(apply("gumbel_max", same_rows, 9), tokens)     # and the same seed repeats


# ---------------------------------------------------------------------------------------------
# elementwise ops

BINARY = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv,
          "max_elem": np.maximum, "min_elem": np.minimum, "eq": operator.eq, "ne": operator.ne,
          "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
          "and": np.logical_and}


def _np(v):
    return v.numpy() if isinstance(v, torch.Tensor) else v


def _binary_operands(g: torch.Generator):
    a = rand(g, 3, 11).round()          # rounded so that eq/ne see equal values
    yield a, rand(g, 3, 11).round()
    yield a, rand(g, 11).round()        # broadcast
    yield a, 0.5
    yield 2.0, a
    yield a.to(torch.int32), 3          # an i32 tensor and an int stays i32
    yield a.to(torch.int32), 2.5        # ... and a float makes it f32


@covers(*BINARY)
@pytest.mark.parametrize("op", BINARY)
@pytest.mark.parametrize("seed", SEEDS)
def test_binary(op, seed):
    for a, b in _binary_operands(torch.Generator().manual_seed(seed)):
        with np.errstate(all="ignore"):                 # rounded operands divide by zero
            want = torch.as_tensor(np.asarray(BINARY[op](_np(a), _np(b))))
        want_dtype = torch.result_type(torch.as_tensor(a) if not isinstance(a, torch.Tensor) else a, b)
        if op in ("eq", "ne", "lt", "le", "gt", "ge", "and"):
            want_dtype = torch.bool
        elif op == "div" and not want_dtype.is_floating_point:
            want_dtype = torch.float32
        got = apply(op, a, b)
        assert got.dtype == want_dtype, (a, b, got.dtype)
        close(got, want.to(want_dtype), rtol=1e-6, atol=1e-6)


UNARY = {"neg": np.negative, "abs": np.abs, "exp": np.exp, "log": np.log, "cos": np.cos}


@covers(*UNARY)
@pytest.mark.parametrize("op", UNARY)
@pytest.mark.parametrize("shape", SHAPES)
def test_unary(op, shape):
    x = rand(torch.Generator().manual_seed(len(shape)), *shape)
    if op == "log":
        x = x.abs() + 0.1
    close(apply(op, x), torch.from_numpy(UNARY[op](x.numpy())), rtol=1e-5, atol=1e-6)
    close(apply(op, torch.tensor([1, 2], dtype=torch.int32)).float(),
          torch.from_numpy(UNARY[op](np.array([1.0, 2.0]))).float(), rtol=1e-6, atol=1e-6)


@covers("select", "mask_apply")
@pytest.mark.parametrize("shape", SHAPES)
def test_select_and_mask_apply(shape):
    g = torch.Generator().manual_seed(1)
    x, y, cond = rand(g, *shape), rand(g, *shape), rand(g, *shape) > 0
    close(apply("select", cond, x, y), torch.from_numpy(np.where(cond.numpy(), x.numpy(), y.numpy())))
    close(apply("select", cond, x, -1.5), torch.from_numpy(np.where(cond.numpy(), x.numpy(), np.float32(-1.5))))
    close(apply("mask_apply", x, cond), torch.from_numpy(np.where(cond.numpy(), x.numpy(), -np.inf).astype(np.float32)))


@covers("matmul", "l2norm")
def test_matmul_and_l2norm():
    g = torch.Generator().manual_seed(2)
    a, b, v = rand(g, 3, 4), rand(g, 4, 5), rand(g, 4)
    close(apply("matmul", a, b), torch.from_numpy(a.numpy() @ b.numpy()), rtol=1e-5, atol=1e-5)
    close(apply("matmul", v, b), torch.from_numpy(v.numpy() @ b.numpy()), rtol=1e-5, atol=1e-5)
    for shape in SHAPES:
        x = rand(g, *shape)
        close(apply("l2norm", x), torch.as_tensor(np.sqrt((x.numpy() ** 2).sum(-1))), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# shapes and constants

@covers("reshape", "broadcast", "cast", "constant", "iota", "causal_mask")
def test_shape_ops_and_constants():
    x = torch.arange(12.0)
    close(apply("reshape", x, [3, -1]), x.numpy().reshape(3, 4))
    close(apply("broadcast", x[:4], [2, 4]), np.broadcast_to(x[:4].numpy(), (2, 4)).copy())
    close(apply("broadcast", float("-inf"), [3]), torch.full((3,), -math.inf))
    close(apply("broadcast", 2, [2]), torch.tensor([2, 2]))
    close(apply("cast", torch.tensor([-1.7, 0.0, 2.9]), "i32"), torch.tensor([-1, 0, 2], dtype=torch.int32))
    close(apply("cast", torch.tensor([-1.7, 0.0, 2.9]), "bool"), torch.tensor([True, False, True]))
    assert apply("cast", x, "bf16").dtype == torch.bfloat16
    close(apply("constant", [[1, 2], [3, 4]], "i64"), torch.tensor([[1, 2], [3, 4]]))
    close(apply("constant", float("-inf")), torch.tensor(-math.inf))
    close(apply("iota", 5), torch.arange(5, dtype=torch.int32))
    close(apply("iota", 3, "i64"), torch.arange(3))
    close(apply("causal_mask", 4), torch.from_numpy(np.tril(np.ones((4, 4), bool))))


@covers("output", "indptr")
def test_output_and_indptr():
    l0, l1 = torch.randn(10).bfloat16(), torch.randn(3, 10)
    outputs = {(0, "logits"): l0, (1, "logits"): l1}
    got = apply("output", 0, "logits", env_outputs=outputs)
    assert got.dtype == torch.float32 and torch.equal(got, l0.float())
    assert torch.equal(apply("output", 1, "logits", env_outputs=outputs), l1)
    close(apply("indptr", env_outputs=outputs), torch.tensor([0, 1, 4], dtype=torch.int32))


@covers("take", "put")
def test_channels_keep_order():
    ir = {"ops": [["take", [0]], ["take", [0]], ["add", [{"t": 0}, {"t": 1}]], ["put", [1, {"t": 2}]],
                  ["put", [1, {"t": 0}]]], "outputs": [2]}
    env = TensorEnv({}, {0: [torch.tensor(1), torch.tensor(10), torch.tensor(100)], 1: []})
    (out,) = compile_program(ir, device=CPU).run(env)
    assert out.item() == 11
    assert [t.item() for t in env.channels[1]] == [11, 1]
    assert [t.item() for t in env.channels[0]] == [100]


@covers("arg")
def test_adapter_arguments_are_the_projection_rows():
    """A LoRA-style adapter f(x, y) = y + (x @ A) @ B, as fwd.adapter traces it."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(5, 8, generator=g), torch.randn(5, 6, generator=g)
    a, b = torch.randn(8, 2, generator=g), torch.randn(2, 6, generator=g)
    ir = {"ops": [["arg", [0]], ["arg", [1]], ["constant", [a.tolist(), "f32"]], ["constant", [b.tolist(), "f32"]],
                  ["matmul", [{"t": 0}, {"t": 2}]], ["matmul", [{"t": 4}, {"t": 3}]],
                  ["add", [{"t": 1}, {"t": 5}]]], "outputs": [6]}
    (out,) = compile_program(ir, device=CPU).run(TensorEnv({}, args=(x, y)))
    close(out, y + x @ a @ b)
    with pytest.raises(EtaError, match="argument 1 does not exist"):
        compile_program(ir, device=CPU).run(TensorEnv({}, args=(x,)))


# ---------------------------------------------------------------------------------------------
# reductions and distributions

def _rows(x: torch.Tensor) -> np.ndarray:
    return x.reshape(-1, x.shape[-1]).double().numpy()


def _per_row(x: torch.Tensor, fn) -> torch.Tensor:
    return torch.tensor(np.array([fn(r) for r in _rows(x)])).reshape(*x.shape[:-1], -1).squeeze(-1)


def ref_softmax(r: np.ndarray) -> np.ndarray:
    e = np.exp(r - r.max())
    return e / e.sum()


def ref_entropy(r: np.ndarray) -> float:
    p = ref_softmax(r)
    return float(-sum(pi * math.log(pi) for pi in p if pi > 0))


def ref_nucleus(probs: np.ndarray, p: float) -> np.ndarray:
    keep, mass = np.zeros(len(probs), bool), 0.0
    for i in sorted(range(len(probs)), key=lambda i: (-probs[i], i)):
        keep[i] = mass < p
        mass += probs[i]
    return keep


REDUCTIONS = {"reduce_max": np.max, "reduce_sum": np.sum, "reduce_argmax": np.argmax,
              "softmax": ref_softmax, "log_softmax": lambda r: r - r.max() - np.log(np.exp(r - r.max()).sum()),
              "entropy": ref_entropy, "entropy_from_logprobs": lambda r: ref_entropy(r),
              "cumsum": np.cumsum, "cumprod": np.cumprod}


@covers(*REDUCTIONS)
@pytest.mark.parametrize("op", REDUCTIONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_reductions(op, shape):
    x = rand(torch.Generator().manual_seed(3), *shape)
    if op == "cumprod":
        x = x / 3
    if op in ("entropy", "softmax", "log_softmax"):
        x[..., 0] = -math.inf                 # a banned token: p = 0 must not make NaN
    arg = torch.log_softmax(x, -1) if op == "entropy_from_logprobs" else x
    want = _per_row(x, REDUCTIONS[op])
    got = apply(op, arg)
    if op == "reduce_argmax":
        assert got.dtype == torch.int64
    close(got.double(), want.double(), rtol=1e-4, atol=1e-5)


def test_argmax_takes_the_first_of_equal_maxima():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    close(apply("reduce_argmax", x), torch.tensor([1, 0]))
    close(apply("masked_argmax", x, torch.tensor([[True, False, True, True]] * 2)), torch.tensor([2, 0]))


def test_reductions_of_ints_and_bools():
    close(apply("reduce_sum", torch.tensor([[True, False, True]])), torch.tensor([2]))
    close(apply("reduce_max", torch.tensor([3, 9, 1], dtype=torch.int32)), torch.tensor(9, dtype=torch.int32))


@covers("cummass_le")
@pytest.mark.parametrize("p", [0.0, 0.3, 0.9, 1.5])
@pytest.mark.parametrize("shape", SHAPES)
def test_cummass_le(shape, p):
    probs = torch.softmax(rand(torch.Generator().manual_seed(4), *shape), -1)
    probs[..., 1] = probs[..., 2]              # a tie: the lower index comes first
    got = apply("cummass_le", probs, p)
    assert got.dtype == torch.bool
    close(got, _per_row(probs, lambda r: ref_nucleus(r, p)).bool())


@covers("top_k")
@pytest.mark.parametrize("k", [1, 3, 100])
@pytest.mark.parametrize("shape", SHAPES)
def test_top_k(shape, k):
    x = rand(torch.Generator().manual_seed(5), *shape).round()     # rounded: ties at the k-th value

    def ref(r):
        kth = sorted(r, reverse=True)[min(k, len(r)) - 1]
        return np.where(r >= kth, r, -np.inf)
    close(apply("top_k", x, k), _per_row(x, ref).float())


@covers("gumbel_max", "nucleus_sample", "masked_argmax")
@pytest.mark.parametrize("seed", [0, 77])
@pytest.mark.parametrize("shape", SHAPES)
def test_sampling(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x, mask = rand(g, *shape), rand(g, *shape) > 0.5
    noise = ref_gumbel(x.numel(), seed).reshape(-1, shape[-1])
    rows = _rows(x)
    want = [int(np.argmax(r + n)) for r, n in zip(rows, noise)]
    close(apply("gumbel_max", x, seed), torch.tensor(want).reshape(shape[:-1]))

    want = [int(np.argmax(np.where(ref_nucleus(ref_softmax(r), 0.8), r, -np.inf) + n)) for r, n in zip(rows, noise)]
    close(apply("nucleus_sample", x, 0.8, seed), torch.tensor(want).reshape(shape[:-1]))

    want = [max((i for i in range(len(r)) if m[i]), key=lambda i: (r[i], -i), default=0)
            for r, m in zip(rows, mask.reshape(-1, shape[-1]).numpy())]
    close(apply("masked_argmax", x, mask), torch.tensor(want).reshape(shape[:-1]))


def test_masked_argmax_with_nothing_allowed_is_zero():
    close(apply("masked_argmax", torch.randn(2, 5), torch.zeros(2, 5, dtype=torch.bool)), torch.tensor([0, 0]))


@covers("gather", "gather_row")
def test_gather():
    x = torch.arange(15.0).reshape(3, 5)
    close(apply("gather", x, torch.tensor([[0, 4], [1, 1], [3, 2]])), torch.tensor([[0.0, 4], [6, 6], [13, 12]]))
    close(apply("gather", x, torch.tensor([4, 0, 2])), torch.tensor([4.0, 5, 12]))
    close(apply("gather", x, 1), torch.tensor([1.0, 6, 11]))
    close(apply("gather", x[0], torch.tensor([7, -1])), torch.tensor([4.0, 0]))      # clamped
    close(apply("gather_row", x, 2), x[2])
    close(apply("gather_row", x, torch.tensor([1])), x[1])
    close(apply("gather_row", x, torch.tensor(9)), x[2])                             # clamped


def test_every_op_is_covered():
    assert set(OPS) == COVERED


# ---------------------------------------------------------------------------------------------
# programs: shapes of results, bad programs, the cache

def _argmax_ir(name="logits"):
    return {"ops": [["output", [0, name]], ["reduce_argmax", [{"t": 0}]]], "outputs": [1]}


def test_result_shapes_follow_the_read_out_rows():
    program = compile_program(_argmax_ir(), device=CPU)
    assert program.backend == "torch" and program.reads == [(0, "logits")]
    one = program.run(TensorEnv({(0, "logits"): torch.randn(9)}))[0]
    many = program.run(TensorEnv({(0, "logits"): torch.randn(3, 9)}))[0]
    assert one.shape == () and one.dtype == torch.int64
    assert many.shape == (3,) and many.dtype == torch.int64


def test_top_a_sampler_from_the_docs():
    vocab, a = 20, 0.2
    ops = [["output", [0, "logits"]], ["softmax", [{"t": 0}]], ["reduce_max", [{"t": 1}]],
           ["mul", [a, {"t": 2}]], ["mul", [{"t": 3}, {"t": 2}]], ["broadcast", [{"t": 4}, [vocab]]],
           ["ge", [{"t": 1}, {"t": 5}]], ["broadcast", [-math.inf, [vocab]]],
           ["select", [{"t": 6}, {"t": 0}, {"t": 7}]], ["take", [0]], ["gumbel_max", [{"t": 8}, {"t": 9}]]]
    program = compile_program(json.dumps({"ops": ops, "outputs": [10]}), device=CPU)  # -Infinity in JSON
    logits = torch.randn(vocab) * 2
    probs = torch.softmax(logits, -1)
    allowed = probs >= a * probs.max() ** 2
    for seed in range(20):
        token = program.run(TensorEnv({(0, "logits"): logits}, {0: [torch.tensor([seed])]}))[0]
        assert allowed[token]


BAD_PROGRAMS = [
    ({"ops": [["softmaxx", [{"t": 0}]]], "outputs": []}, "op 0 (softmaxx): unknown op"),
    ({"ops": [["output", [0, "logits"]], ["add", [{"t": 0}]]], "outputs": [1]}, "op 1 (add): takes 2 arguments, got 1"),
    ({"ops": [["output", [0, "logits"]], ["top_k", [{"t": 0}, 0]]], "outputs": [1]}, "op 1 (top_k): argument 1 must be a positive integer"),
    ({"ops": [["output", [0, "logits"]], ["cast", [{"t": 0}, "f8"]]], "outputs": [1]}, "op 1 (cast): argument 1 must be a dtype name"),
    ({"ops": [["output", [0, "logits"]], ["softmax", [2.0]]], "outputs": [1]}, "op 1 (softmax): argument 0 must be a tensor"),
    ({"ops": [["neg", [{"t": 1}]], ["output", [0, "logits"]]], "outputs": [0]}, "op 0 (neg): argument 0 refers to op 1, which does not come before it"),
    ({"ops": [["output", [0, "logits"]], ["put", [0, {"t": 0}]], ["neg", [{"t": 1}]]], "outputs": []}, "op 2 (neg): argument 0 refers to op 1 (put), which produces no value"),
    ({"ops": [["output", [0, "logits"]], ["put", [0, {"t": 0}]]], "outputs": [1]}, "output 0 refers to op 1 (put)"),
    ({"ops": [["output", [0, "logits"]]], "outputs": [3]}, "output 0 refers to op 3, but the program has 1 ops"),
    (_argmax_ir("hidden"), "op 0 (output): unknown model output 'hidden'"),
    ({"ops": [["output", [-1, "logits"]]], "outputs": [0]}, "op 0 (output): argument 0 must be a non-negative integer"),
    ({"ops": [["broadcast", [0.0, [1 << 20, 1 << 20]]]], "outputs": [0]}, "op 0 (broadcast): argument 1 must be a list"),
    ({"ops": [["causal_mask", [-5]]], "outputs": [0]}, "op 0 (causal_mask): argument 0 must be an integer from 0 to 8192"),
    ({"ops": [["constant", [[1, 2, 3, 4, 5]]], ["constant", [[1] * 7]], ["add", [{"t": 0}, {"t": 1}]]], "outputs": [2]},
     "op 2 (add) on shapes [5], [7]: The size of tensor a (5) must match"),
    ({"ops": [["add", 1]], "outputs": []}, "op 0: must be [name, [args...]]"),
    ({"ops": []}, 'a program is {"ops": [...], "outputs": [...]}'),
    ("{not json", "the program is not valid JSON"),
    ('{"ops": [["constant", [' + "[" * 5000 + "]" * 5000 + ']]], "outputs": [0]}', "the program is nested too deeply"),
]


@pytest.mark.parametrize("ir, message", BAD_PROGRAMS)
def test_bad_programs_are_refused_statically(ir, message):
    with pytest.raises(EtaError) as e:
        compile_program(ir, device=CPU)
    assert message in str(e.value)


def _run_error(ir, env: TensorEnv) -> str:
    program = compile_program(ir, device=CPU)
    with pytest.raises(EtaError) as e:
        program.run(env)
    return str(e.value)


def test_run_time_errors_name_the_op():
    logits = {(0, "logits"): torch.randn(5)}
    add = {"ops": [["output", [0, "logits"]], ["take", [0]], ["add", [{"t": 0}, {"t": 1}]]], "outputs": [2]}
    assert _run_error(add, TensorEnv(logits, {0: [torch.zeros(7)]})).startswith(
        "op 2 (add) on shapes [5], [7]: The size of tensor a (5) must match the size of tensor b (7)")
    assert _run_error(add, TensorEnv(logits, {0: []})) == "op 1 (take): channel 0 is empty"
    assert _run_error(add, TensorEnv(logits)) == "op 1 (take): channel 0 does not exist"
    assert _run_error(_argmax_ir(), TensorEnv({(1, "logits"): torch.randn(5)})) == \
        "op 0 (output): no model output 'logits' for lane 0 (this pass has: lane 1 'logits')"
    seeded = {"ops": [["output", [0, "logits"]], ["take", [0]], ["gumbel_max", [{"t": 0}, {"t": 1}]]], "outputs": [2]}
    assert "a seed must be one integer, got a [2] int64 tensor" in \
        _run_error(seeded, TensorEnv(logits, {0: [torch.tensor([1, 2])]}))


def test_cache_compiles_each_program_once():
    cache = ProgramCache()
    ir = _argmax_ir()
    first = cache.get(json.dumps(ir), CPU)
    assert cache.get(json.dumps(ir, indent=2), "cpu") is first        # same canonical IR
    assert cache.get(ir, CPU) is first
    other = cache.get(json.dumps({"ops": ir["ops"][:1], "outputs": [0]}), CPU)
    assert other is not first and other.hash != first.hash
    assert (cache.hits, cache.misses) == (2, 2)
    assert len(first.hash) == 32 and first.hash == compile_program(ir, device=CPU).hash


def test_the_torch_backend_needs_no_triton():
    check = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None            # any import of triton fails
        import torch
        from pie_actors.gpu.eta import TensorEnv, compile_program
        ir = {"ops": [["output", [0, "logits"]], ["gumbel_max", [{"t": 0}, 3]]], "outputs": [1]}
        for backend in ("torch", "auto"):
            program = compile_program(ir, device=torch.device("cpu"), backend=backend)
            assert program.backend == "torch"
            program.run(TensorEnv({(0, "logits"): torch.randn(4, 10)}))
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", check], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
