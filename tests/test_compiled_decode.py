"""Compiled decode graphs give the eager engine's tokens and logits (tiny model: compiles in seconds)."""
from __future__ import annotations


import pytest
import torch

from pie_actors.gpu.kernels import amx_gemm
from pie_actors.gpu.kernels.compiled_decode import BATCH_BUCKETS, FUSED_ATTENTION_MAX_BATCH
from pie_actors.gpu.engine import Engine, Lane, PassRequest
from tests.engine_helpers import save_tiny_model


def _decode_logits(engine: Engine, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    seqs = [engine.create_sequence() for _ in prompts]
    feeds, out = [list(p) for p in prompts], []
    for _ in range(steps):
        futs = [engine.submit(PassRequest([Lane(s, f)])) for s, f in zip(seqs, feeds)]
        engine.run_until_idle()
        rows = torch.cat([f.result() for f in futs])
        out.append(rows)
        feeds = [[int(t)] for t in rows.argmax(-1)]
    for s in seqs:
        engine.free(s)
    return out


def test_compiled_decode_matches_eager(tmp_path):
    """Every bucket gives the eager engine's logits: one lane (bucket 1: decode attention as
    multiply-sums), two from a first page that is still filling (bucket 2) and three (bucket 4),
    both through the C++ paged attention kernel."""
    assert FUSED_ATTENTION_MAX_BATCH == 1              # bucket 1 alone takes the multiply-sums form
    folder = save_tiny_model("qwen3", tmp_path / "m")
    kw = dict(device="cpu", dtype="float32", num_pages=64, page_size=4)
    eager = Engine.from_model(str(folder), compile=False, **kw)
    compiled = Engine.from_model(str(folder), compile=True, compile_max_batch=4, **kw)
    assert eager.worker.decode_form == compiled.worker.compiled.batch_form == "kernel"
    # every bucket up to the largest compiled batch was compiled at start
    assert compiled.worker.compiled.batch_sizes == {b for b in BATCH_BUCKETS if b <= 4} == {1, 2, 4}
    g = torch.Generator().manual_seed(0)
    torch._dynamo.utils.counters.clear()
    for lengths in ((9,), (2, 1), (3, 9, 14)):
        prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]
        for w, c in zip(_decode_logits(eager, prompts, 12), _decode_logits(compiled, prompts, 12)):
            torch.testing.assert_close(c, w, atol=1e-4, rtol=1e-4)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0    # no compile while serving
    compiled.kv.check()


def test_compiled_decode_with_the_speed_edits_off_matches_eager(tmp_path):
    """The CPU speed edits (huge pages, the AMX GEMM template edits) have switches; off, the
    compiled engine gives the eager engine's logits all the same."""
    folder = save_tiny_model("qwen3", tmp_path / "m")
    kw = dict(device="cpu", dtype="float32", num_pages=64, page_size=4, hugepages=False)
    eager = Engine.from_model(str(folder), **kw)
    # one bucket: the switches change how the graph is built, not which buckets there are
    compiled = Engine.from_model(str(folder), compile=True, compile_max_batch=1, amx_gemm_edits=False, **kw)
    assert not compiled.worker.compiled.hugepages and not compiled.worker.compiled.amx_gemm_edits
    prompts = [[5, 6, 7]]
    for w, c in zip(_decode_logits(eager, prompts, 6), _decode_logits(compiled, prompts, 6)):
        torch.testing.assert_close(c, w, atol=1e-4, rtol=1e-4)


def test_two_compiled_engines_in_one_process_keep_their_own_weights(tmp_path):
    """Compiled graphs hold frozen weights and skip module guards: a second engine of the same
    shapes must not run the first one's graphs."""
    first, second = save_tiny_model("qwen3", tmp_path / "a", seed=0), save_tiny_model("qwen3", tmp_path / "b", seed=1)
    kw = dict(device="cpu", dtype="float32", num_pages=64, page_size=4, compile_max_batch=1)
    prompts = [[5, 6, 7]]                  # one lane: every step runs the compiled bucket-1 graph
    results = {}
    for name, folder in (("a", first), ("b", second)):
        compiled = Engine.from_model(str(folder), compile=True, **kw)
        results[name] = _decode_logits(compiled, prompts, 4)
    want_b = _decode_logits(Engine.from_model(str(second), compile=False, **kw), prompts, 4)
    for w, c in zip(want_b, results["b"]):
        torch.testing.assert_close(c, w, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(results["a"][-1], results["b"][-1])


def test_amx_gemm_edits_fits_this_torch():
    assert amx_gemm.applies(), "inductor's AMX micro-GEMM template changed: update amx_gemm.py"


@pytest.mark.skipif(not amx_gemm.in_use(), reason="inductor compiles no AMX GEMMs on this CPU (no AMX, "
                    "or ATEN_CPU_CAPABILITY below avx512): the edits do not apply")
def test_amx_gemm_edits_compiles_into_amx_gemms_and_keeps_results():
    from torch._inductor.utils import run_and_get_code
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 512, bias=False).to(torch.bfloat16).eval()
    x = torch.randn(32, 256, dtype=torch.bfloat16)
    options = {"max_autotune": True, "max_autotune_gemm_backends": "CPP",
               "post_grad_custom_post_pass": amx_gemm.CacheKey()}
    compiled = torch.compile(linear, options=options)
    with torch.inference_mode(), torch._inductor.config.patch(freezing=True), amx_gemm.patched():
        out, code = run_and_get_code(compiled, x)
        expected = linear(x)
    code = "".join(code)
    assert "_mm_prefetch" in code and "_tile_dpbf16ps" in code
    torch.testing.assert_close(out, expected)
    assert amx_gemm._original is None        # the template is restored on leaving


START = """
import json, sys
from pie_actors.gpu.engine import Engine          # first: it points inductor's caches at $PIE_HOME
from torch._dynamo.utils import counters
engine = Engine.from_model(sys.argv[1], device="cpu", dtype="float32", num_pages=32, page_size=4,
                           compile=sys.argv[2], compile_max_batch=1, progress=False)
print(json.dumps({"compiled": engine.worker.compiled is not None,
                  "autotuned": counters["inductor"]["select_algorithm_autotune"]}))
"""


def test_a_compiled_engines_second_start_reuses_the_caches(tmp_path):
    """Caches live under $PIE_HOME/cache: the second start of the same model skips the GEMM
    autotuning (counted by inductor). A one-shot CPU engine with compile "auto" stays eager (its
    graphs would be compiled again at every start)."""
    import json
    import os
    import subprocess
    import sys

    folder = save_tiny_model("qwen3", tmp_path / "m")
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env["PIE_HOME"] = str(tmp_path / "home")

    def start(compile: str) -> dict:
        out = subprocess.run([sys.executable, "-c", START, str(folder), compile], env=env, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    assert start("auto") == {"compiled": False, "autotuned": 0}     # one-shot, nothing cached: eager
    cold = start("on")
    assert cold["compiled"] and cold["autotuned"] > 0 and (tmp_path / "home" / "cache" / "inductor").is_dir()
    assert start("on") == {"compiled": True, "autotuned": 0}           # the autotuning is cached
