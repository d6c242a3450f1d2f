"""Tensor parallelism on the CPU: ranks 1.. are Ray actors, the all-reduces go through gloo."""
from __future__ import annotations

import pytest
import ray
import torch

from pie_actors.gpu.engine import Engine, Lane, PassRequest
from tests.engine_helpers import save_tiny_model
from tests.test_engine import PROMPTS


@pytest.fixture(scope="module")
def ray_local():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _prefill_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    seq = engine.create_sequence()
    fut = engine.submit(PassRequest([Lane(seq, prompt, readout=list(range(len(prompt))))]))
    engine.run_until_idle()
    engine.free(seq)
    return fut.result()


def _check_same_as_tp1(model_dir, tp: int, prompts: list[list[int]], device: str = "cpu") -> None:
    kw = dict(device=device, dtype="float32", kv_memory_mb=64)
    tp1 = Engine.from_model(str(model_dir), tp=1, **kw)
    want = tp1.generate(prompts, 12, ignore_eos=True)
    want_logits = _prefill_logits(tp1, prompts[0])
    sharded = Engine.from_model(str(model_dir), tp=tp, num_threads=1, **kw)
    try:
        assert sharded.worker.comm.world_size == tp
        full = tp1.worker.model.layers[0].mlp.down_proj.weight.shape[1]
        assert sharded.worker.model.layers[0].mlp.down_proj.weight.shape[1] == full // tp   # really sharded
        assert sharded.generate(prompts, 12, ignore_eos=True) == want
        torch.testing.assert_close(_prefill_logits(sharded, prompts[0]), want_logits, atol=1e-3, rtol=1e-3)
        sharded.kv.check()
    finally:
        sharded.close()


def test_tp2_matches_tp1_on_a_qwen3_shaped_model(ray_local, tmp_path):
    folder = save_tiny_model("qwen3", tmp_path / "qwen3")   # 4 heads, 2 KV heads: splits over 2
    g = torch.Generator().manual_seed(3)
    _check_same_as_tp1(folder, 2, [torch.randint(0, 512, (n,), generator=g).tolist() for n in (7, 30)])


def test_tp3_matches_tp1_on_the_default_model(ray_local, default_model_dir):
    # SmolLM2-135M has 9 heads and 3 KV heads: 3 is the tensor-parallel size it splits over.
    from pie_actors.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(default_model_dir)
    _check_same_as_tp1(default_model_dir, 3, [tok.encode(p) for p in PROMPTS[:3]])


def test_tp_that_does_not_divide_the_heads_is_refused(ray_local, default_model_dir):
    with pytest.raises(ValueError, match="does not divide the model's attention heads"):
        Engine.from_model(str(default_model_dir), device="cpu", dtype="float32", tp=2, kv_memory_mb=64)
