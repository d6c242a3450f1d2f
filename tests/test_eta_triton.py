"""The eta Triton backend equals the torch backend, checked with Triton's interpreter.

TRITON_INTERPRET must be set before Triton is imported, so the checks run in a fresh interpreter.
CHECK takes a device argument: "cuda" runs the compiled kernels (tests/test_cuda.py).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from pie_actors.gpu.eta import EtaError, compile_program

CHECK = textwrap.dedent("""
    import math
    import sys
    import torch
    from pie_actors.gpu.eta import EtaError, TensorEnv, compile_program

    DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cpu"

    class Trace:
        def __init__(self):
            self.ops = []

        def __call__(self, op, *args):
            self.ops.append([op, list(args)])
            return {"t": len(self.ops) - 1}

    def argmax(t, V, rows):
        return [t("reduce_argmax", t("output", 0, "logits"))]

    def temperature(t, V, rows):
        x = t("div", t("output", 0, "logits"), 0.7)
        return [t("gumbel_max", x, 1234), t("gumbel_max", x, t("take", 0)), t("gumbel_max", x, 3_000_000_007)]

    def top_a(t, V, rows):                       # the sampler of the docs (one row per lane)
        logits = t("output", 0, "logits")
        probs = t("softmax", logits)
        p_max = t("reduce_max", probs)
        keep = t("ge", probs, t("broadcast", t("mul", t("mul", 0.2, p_max), p_max), [V]))
        token = t("gumbel_max", t("select", keep, logits, t("broadcast", -math.inf, [V])), t("take", 0))
        t("put", 1, t("reshape", token, [1]))
        return [token]

    def masked(t, V, rows):
        x = t("output", 0, "logits")
        grammar = t("take", 2)                   # a [V] bool mask shared by the rows
        return [t("masked_argmax", x, grammar), t("masked_argmax", x, t("gt", x, 1.0)),
                t("reduce_argmax", t("mask_apply", x, grammar))]

    def distributions(t, V, rows):
        x = t("output", 0, "logits")
        probs = t("softmax", x)
        return [probs, t("log_softmax", x), t("entropy", x), t("entropy_from_logprobs", t("log_softmax", x)),
                t("reduce_sum", t("ge", probs, 0.01)), t("l2norm", x), t("reduce_max", x), t("reduce_sum", x)]

    def elementwise(t, V, rows):
        x = t("output", 0, "logits")
        scale = t("take", 3)                     # a one-element f32 tensor
        return [t("select", t("lt", x, 0), t("neg", x), t("mul", x, 2)), t("exp", t("min_elem", x, 1.0)),
                t("max_elem", x, scale), t("cos", x), t("log", t("add", t("abs", x), 1)),
                t("cast", t("cast", t("mul", x, 3), "i32"), "f32"), t("and", t("gt", x, 0), t("lt", x, 1)),
                t("sub", 1, t("div", x, scale)), t("eq", t("cast", x, "i32"), 0), t("ne", x, x),
                t("le", x, t("iota", V, "f32")), t("broadcast", scale, [V])]

    def noise(t, V, rows):
        seed = t("take", 0)
        return [t("gumbel", [V], seed), t("gumbel", [rows, V] if rows else [V], seed),
                t("reduce_argmax", t("add", t("output", 0, "logits"), t("gumbel", [V], seed)))]

    PROGRAMS = [argmax, temperature, top_a, masked, distributions, elementwise, noise]

    def env(V, shape, g):
        return TensorEnv({(0, "logits"): (torch.randn(*shape, V, generator=g) * 2).to(DEVICE)},
                         {0: [torch.tensor([7], dtype=torch.int64, device=DEVICE)], 1: [],
                          2: [(torch.rand(V, generator=g) > 0.5).to(DEVICE)], 3: [torch.tensor([0.25], device=DEVICE)]})

    def check(build, V, shape):
        t = Trace()
        outputs = build(t, V, shape[0] if shape else None)
        ir = {"ops": t.ops, "outputs": [o["t"] for o in outputs]}
        ref = compile_program(ir, device=DEVICE, backend="torch")
        fused = compile_program(ir, device=DEVICE, backend="triton")
        assert fused.backend == "triton"
        for seed in (0, 1):
            want_env, got_env = env(V, shape, torch.Generator().manual_seed(seed)), env(V, shape, torch.Generator().manual_seed(seed))
            try:
                want = ref.run(want_env)
            except EtaError as e:                # the torch semantics refuse the shapes: so must Triton
                try:
                    fused.run(got_env)
                except EtaError as f:
                    assert str(e) == str(f), (e, f)
                    return "refused"
                raise AssertionError(f"{build.__name__}: Triton ran what torch refuses: {e}")
            got = fused.run(got_env)
            for w, g in zip(want + [c for q in want_env.channels.values() for c in q],
                            got + [c for q in got_env.channels.values() for c in q]):
                assert w.shape == g.shape and w.dtype == g.dtype, (build.__name__, w.shape, g.shape, w.dtype, g.dtype)
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, equal_nan=True, msg=build.__name__)
        return "fallback" if fused.fallbacks else "fused"

    results = {}
    for V in (100, 37):
        for shape in ((), (1,), (3,)):
            for build in PROGRAMS:
                results[build.__name__, V, shape] = check(build, V, shape)
    # top_a broadcasts a per-row scalar to [vocab], which torch refuses for several rows
    odd = {(name, shape): r for (name, V, shape), r in results.items() if r != "fused"}
    assert odd == {("top_a", (3,)): "refused"}, odd

    # shapes that do not fit the per-row kernel (a [rows, 1] column) run the torch interpreter
    ir = {"ops": [["output", [0, "logits"]], ["take", [0]], ["add", [{"t": 0}, {"t": 1}]]], "outputs": [2]}
    fused = compile_program(ir, device=DEVICE, backend="triton")
    x, column = torch.randn(2, 10, device=DEVICE), torch.randn(2, 1, device=DEVICE)
    (out,) = fused.run(TensorEnv({(0, "logits"): x}, {0: [column]}))
    assert fused.fallbacks == 1 and torch.equal(out, x + column)
    print("ok")
""")


def test_triton_backend_matches_torch_backend(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PIE_HOME=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", CHECK], check=False, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"


@pytest.mark.parametrize("op, args", [("top_k", [{"t": 0}, 5]), ("cumsum", [{"t": 0}]),
                                      ("gather_row", [{"t": 0}, 0])])
def test_triton_refuses_ops_it_cannot_fuse(op, args):
    ir = {"ops": [["output", [0, "logits"]], [op, args]], "outputs": [1]}
    with pytest.raises(EtaError, match=re.escape(f"op 1 ({op}): not supported by the Triton backend")):
        compile_program(ir, device="cpu", backend="triton")
    assert compile_program(ir, device="cpu", backend="auto").backend == "torch"


def test_triton_refuses_a_take_after_a_put_on_the_same_channel():
    ir = {"ops": [["output", [0, "logits"]], ["put", [4, {"t": 0}]], ["take", [4]]], "outputs": [2]}
    with pytest.raises(EtaError, match=re.escape("op 2 (take): takes from channel 4 after putting into it")):
        compile_program(ir, device="cpu", backend="triton")


def test_constant_programs_are_folded_whatever_the_backend():
    ir = {"ops": [["iota", [5]], ["causal_mask", [3]], ["output", [0, "logits"]],
                  ["reduce_argmax", [{"t": 2}]]], "outputs": [0, 1, 3]}
    with pytest.raises(ValueError, match="the Triton backend runs on CUDA devices"):
        compile_program(ir, device=torch.device("cpu"), backend="triton")     # folded ops are fine
