"""Tensor parallelism on the CPU: rank 1 is a Ray actor, the all-reduces go through gloo."""
from __future__ import annotations

import pytest
import ray
import torch

from pie_actors.gpu.engine import Engine, Lane, PassRequest
from tests.test_engine import PROMPTS


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _prefill_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    seq = engine.create_sequence()
    fut = engine.submit(PassRequest([Lane(seq, prompt, readout=list(range(len(prompt))))]))
    engine.run_until_idle()
    engine.free(seq)
    return fut.result()


def test_tp2_matches_tp1(ray_local, default_model_dir):
    tp1 = Engine.from_model(str(default_model_dir), device="cpu", dtype="float32", tp=1, kv_memory_mb=64)
    prompts = [tp1.tokenizer.encode(p) for p in PROMPTS[:3]]
    want = tp1.generate(prompts, 12, ignore_eos=True)
    want_logits = _prefill_logits(tp1, prompts[0])
    tp2 = Engine.from_model(str(default_model_dir), device="cpu", dtype="float32", tp=2, kv_memory_mb=64,
                            num_threads=1)
    try:
        assert tp2.worker.comm.world_size == 2
        assert tp2.worker.model.layers[0].mlp.down_proj.weight.shape[1] == 1536 // 2   # really sharded
        assert tp2.generate(prompts, 12, ignore_eos=True) == want
        torch.testing.assert_close(_prefill_logits(tp2, prompts[0]), want_logits, atol=1e-3, rtol=1e-3)
        tp2.kv.check()
    finally:
        tp2.close()
