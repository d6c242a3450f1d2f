"""Compiled decode graphs give the eager engine's tokens and logits (a tiny model, so that a bucket
compiles in about a minute)."""
from __future__ import annotations

from pathlib import Path

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


KW = dict(device="cpu", dtype="float32", num_pages=64, page_size=4)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """A tiny model, an eager engine of it, and a compiled one (buckets 1, 2 and 4) whose packages
    went into a PIE_HOME of this module's."""
    root = tmp_path_factory.mktemp("compiled")
    folder = save_tiny_model("qwen3", root / "m")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PIE_HOME", str(root / "home"))
        eager = Engine.from_model(str(folder), compile=False, **KW)
        engine = Engine.from_model(str(folder), compile=True, compile_max_batch=4, **KW)
        yield folder, root / "home", eager, engine


def test_compiled_decode_matches_eager(compiled):
    """Every bucket gives the eager engine's logits: one lane (bucket 1: decode attention as
    multiply-sums), two from a first page that is still filling (bucket 2) and three (bucket 4, a
    padding lane), both through the C++ paged attention kernel."""
    _, _, eager, engine = compiled
    assert FUSED_ATTENTION_MAX_BATCH == 1              # bucket 1 alone takes the multiply-sums form
    assert eager.worker.decode_form == engine.worker.compiled.batch_form == "kernel"
    # every bucket up to the largest compiled batch was compiled at start
    assert engine.worker.compiled.compiled_now == [b for b in BATCH_BUCKETS if b <= 4] == [1, 2, 4]
    assert set(engine.worker.compiled.graphs) == {1, 2, 4}
    assert_buckets_1_2_4_match_eager(eager, engine)


def assert_buckets_1_2_4_match_eager(eager: Engine, engine: Engine) -> None:
    """Random prompts of 1, 2 and 3 lanes decode 12 steps: `engine`'s logits are `eager`'s, and each
    prompt's 11 steps after its prefill (eager) ran one bucket's graph."""
    g = torch.Generator().manual_seed(0)
    for lengths in ((9,), (2, 1), (3, 9, 14)):
        prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]
        for w, c in zip(_decode_logits(eager, prompts, 12), _decode_logits(engine, prompts, 12)):
            torch.testing.assert_close(c, w, atol=1e-4, rtol=1e-4)
    assert engine.worker.compiled.runs == {1: 11, 2: 11, 4: 11}
    engine.kv.check()


def test_a_second_model_with_the_speed_edits_off_keeps_its_own_weights(compiled, tmp_path):
    """The CPU speed edits (huge pages, the AMX GEMM template edits) have switches; off, a compiled
    engine gives its eager engine's logits all the same. A package holds its model's frozen weights:
    this second model, of the first one's shapes, gets packages of its own, not the first one's."""
    _, _, _, first = compiled
    folder = save_tiny_model("qwen3", tmp_path / "b", seed=1)
    # one bucket: the switches change how the graph is built, not which buckets there are
    second = Engine.from_model(str(folder), compile=True, compile_max_batch=1, amx_gemm_edits=False,
                               hugepages=False, **KW)
    assert second.worker.compiled.compiled_now == [1] and not second.worker.compiled.amx_gemm_edits
    prompts = [[5, 6, 7]]                  # one lane: every step runs the compiled bucket-1 graph
    want = _decode_logits(Engine.from_model(str(folder), compile=False, **KW), prompts, 6)
    got = _decode_logits(second, prompts, 6)
    for w, c in zip(want, got):
        torch.testing.assert_close(c, w, atol=1e-4, rtol=1e-4)
    assert second.worker.compiled.runs == {1: 5}
    assert not torch.allclose(_decode_logits(first, prompts, 6)[-1], got[-1])


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
import torch
from pie_actors.gpu.engine import Engine          # first: it points inductor's caches at $PIE_HOME
from tests.test_compiled_decode import _decode_logits
kw = dict(device="cpu", dtype="float32", num_pages=32, page_size=4, compile_max_batch=4)   # another pool size
engine = Engine.from_model(sys.argv[1], compile=sys.argv[2], progress=False, **kw)
compiled = engine.worker.compiled
eager = Engine.from_model(sys.argv[1], compile="off", **kw)
prompts = [[5, 6, 7], [8, 9], [10]]                   # three lanes: bucket 4
got, want = _decode_logits(engine, prompts, 4), _decode_logits(eager, prompts, 4)
print(json.dumps({"compiled": compiled.compiled_now if compiled else None,
                  "loaded": compiled.loaded if compiled else None,
                  "runs": dict(compiled.runs) if compiled else None,
                  "matches": all(torch.allclose(g, w, atol=1e-4, rtol=1e-4) for g, w in zip(got, want))}))
"""


def test_a_second_start_loads_the_packages_and_compiles_nothing(compiled, tmp_path):
    """Compiled buckets are packages under $PIE_HOME/cache: a second start of the same model (a
    fresh process) loads them, compiles nothing, and gives the eager engine's logits. A one-shot
    CPU engine with compile "auto" stays eager until the packages are there, then uses them."""
    import json
    import os
    import subprocess
    import sys

    folder, home, _, _ = compiled
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}

    def start(compile: str, home: Path) -> dict:
        out = subprocess.run([sys.executable, "-c", START, str(folder), compile], env={**env, "PIE_HOME": str(home)},
                             capture_output=True, text=True, timeout=600, cwd=Path(__file__).parent.parent)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    assert list((home / "cache" / "compiled").glob("*/bucket-4.pt2"))
    assert start("auto", tmp_path / "empty") == {"compiled": None, "loaded": None, "runs": None, "matches": True}
    assert start("auto", home) == {"compiled": [], "loaded": [1, 2, 4], "runs": {"4": 3}, "matches": True}


def test_pie_serves_engine_answers_at_once_and_compiles_its_buckets_behind(default_model_dir, tmp_path, monkeypatch):
    """pie serve's engine (a long-lived one), compile "on" and no package compiled yet, answers at
    once, eager; its buckets compile behind it one at a time, the most used first, each running
    compiled from the step after it loaded, and the tokens stay the eager engine's throughout.
    Meanwhile /health answers 200 with the progress in its body, and /metrics shows it as gauges."""
    import shutil

    import httpx

    from pie_actors.serve import Server
    folder = save_tiny_model("qwen3", tmp_path / "m")
    shutil.copy(default_model_dir / "tokenizer.json", folder)          # the server loads one
    monkeypatch.setenv("PIE_HOME", str(tmp_path / "home"))
    eager = Engine.from_model(str(folder), compile=False, **KW)
    three, one, two = [[5, 6, 7], [8, 9], [10]], [[11, 12]], [[13], [14, 15]]     # buckets 4, 1 and 2
    want = {len(p): eager.generate(p, 8, ignore_eos=True) for p in (three, one, two)}

    def reported(ready: int, compiling: int) -> None:
        health = httpx.get(server.url + "/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert health.json()["compile"] == {"ready": ready, "total": 3, "compiling": compiling, "failed": 0}
        metrics = httpx.get(server.url + "/metrics").text
        assert 'pie_compiled_decode_buckets{state="total"} 3' in metrics
        assert f'pie_compiled_decode_buckets{{state="ready"}} {ready}' in metrics

    # the engine in this process, to wait on its compile
    with Server(str(folder), port=0, engine_process=False, compile="on", compile_max_batch=4, **KW) as server:
        engine = server.runtime.engine
        compiled = engine.worker.compiled
        assert engine.generate(three, 8, ignore_eos=True) == want[3]
        # answered with no bucket compiled: every step eager, the three buckets to come
        progress = engine.compile_progress()
        assert (progress["ready"], progress["total"], progress["failed"]) == (0, 3, 0) and not compiled.runs
        assert compiled.wanted == {4: 7}               # its 7 decode steps (the first was a prefill)
        reported(ready=0, compiling=1)
        compiled.wait(ready=1)                         # bucket 1: the first pick, before any request
        assert compiled.compiled_now == [1] and engine.compile_progress()["ready"] == 1
        assert engine.generate(one, 8, ignore_eos=True) == want[1] and compiled.runs == {1: 7}
        assert engine.generate(two, 8, ignore_eos=True) == want[2]      # bucket 2 eager still
        compiled.wait(ready=2)                         # then bucket 4: 7 steps wanted it, bucket 2 none yet
        assert compiled.compiled_now == [1, 4]
        assert engine.generate(three, 8, ignore_eos=True) == want[3] and compiled.runs == {1: 7, 4: 7}
        assert compiled.wait()                         # and bucket 2: all compiled
        assert compiled.compiled_now == [1, 4, 2]
        assert engine.compile_progress() == {"ready": 3, "total": 3, "compiling": 0, "failed": 0}
        reported(ready=3, compiling=0)
        assert "pie_compiling_decode_bucket 0" in httpx.get(server.url + "/metrics").text
        assert engine.generate(two, 8, ignore_eos=True) == want[2] and compiled.runs == {1: 7, 2: 7, 4: 7}
        assert sorted(p.name for p in compiled.packages.iterdir()) == ["bucket-1.pt2", "bucket-2.pt2", "bucket-4.pt2"]
    engine.kv.check()
