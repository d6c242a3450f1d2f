"""The engine on CUDA, against the references its CPU tests use: the default model against
transformers (float32, and bf16 as shipped: dtype "auto", eager and compiled), the Triton decode
attention kernel and fused eta programs against the torch forms (compiled kernels here, not Triton's
interpreter), compiled decode against the eager engine, and tp = 2 over cupy's NCCL against tp = 1.

Without a CUDA device the module skips; bench/gpu_check.sh runs it on a GPU machine.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pie_actors.gpu.engine import Engine
from tests import test_eta_triton, test_triton_attention
from tests.engine_helpers import save_tiny_model
from tests.test_compiled_decode import KW, assert_buckets_1_2_4_match_eager
from tests.test_shipped_config import TOKENS, check_against_reference, reference, shipped_engine  # noqa: F401
from tests.test_tp import _check_same_as_tp1, ray_local  # noqa: F401  (ray_local: a fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


@pytest.mark.parametrize("dtype, bounds", [("float32", dict(atol=2e-3, rtol=1e-3)),   # test_model_reference's
                                           ("bfloat16", {})],                          # test_shipped_config's
                         ids=["float32", "bfloat16"])
def test_default_model_matches_transformers(default_model_dir, reference, dtype, bounds):
    engine = Engine.from_model(str(default_model_dir), device="cuda", dtype=dtype, compile="off", num_pages=64)
    check_against_reference(engine, reference, **bounds)


def test_shipped_config_compiled_matches_transformers(default_model_dir, reference, tmp_path, monkeypatch):
    """dtype "auto" (bf16 on CUDA) and a compiled decode graph: what `pie serve` runs on a GPU."""
    monkeypatch.setenv("PIE_HOME", str(tmp_path))
    engine = shipped_engine(default_model_dir, "cuda", compile="on")
    assert engine.worker.dtype == torch.bfloat16 and engine.worker.compiled.compiled_now == [1]
    check_against_reference(engine, reference)
    assert engine.worker.compiled.runs[1] == len(reference) * (TOKENS - 1)


def run_check(check: str, tmp_path: Path) -> None:
    """A CPU test's CHECK script on CUDA: Triton compiles its kernels (no TRITON_INTERPRET)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PIE_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", check, "cuda"], capture_output=True, text=True, env=env, timeout=600,
                         cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"


def test_triton_paged_decode_matches_the_torch_forms(tmp_path):
    run_check(test_triton_attention.CHECK, tmp_path)


def test_fused_eta_programs_match_the_torch_backend(tmp_path):
    run_check(test_eta_triton.CHECK, tmp_path)


def test_compiled_decode_matches_eager(tmp_path, monkeypatch):
    """Buckets 1, 2 and 4 of a tiny model (test_compiled_decode's lanes) give the eager engine's logits."""
    monkeypatch.setenv("PIE_HOME", str(tmp_path / "home"))
    folder = save_tiny_model("qwen3", tmp_path / "m")
    kw = {**KW, "device": "cuda"}
    eager = Engine.from_model(str(folder), compile="off", **kw)
    engine = Engine.from_model(str(folder), compile="on", compile_max_batch=4, progress=False, **kw)
    assert_buckets_1_2_4_match_eager(eager, engine)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tp = 2 needs two CUDA devices")
def test_tp2_over_cupy_nccl_matches_tp1(ray_local, tmp_path):
    """CUDA ranks all-reduce and gather through cupy's NCCL (join_group); tokens and logits stay tp = 1's."""
    folder = save_tiny_model("qwen3", tmp_path / "qwen3")     # 4 heads, 2 KV heads: splits over 2
    g = torch.Generator().manual_seed(3)
    _check_same_as_tp1(folder, 2, [torch.randint(0, 512, (n,), generator=g).tolist() for n in (7, 30)], "cuda")
