"""Shared by the pie serve tests: the references their answers are compared with (the engine's own
greedy decoding of the same prompt, and its log-softmax from a direct pass), and waiting for the
engine to be idle."""
from __future__ import annotations

import time
from collections import Counter

import torch

from pie_actors.gpu.engine import Lane, PassRequest
from pie_actors.inferlet.chat_ops import chat_tokens
from pie_actors.serve import Server

KEY = "test-key"
QUESTION = "What is the capital of France?"
ASK = [{"role": "user", "content": QUESTION}]
WEATHER = {"name": "get_weather", "description": "The current weather of a city.",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"type": "string", "maxLength": 30},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}}}}


def start(model_dir, **settings) -> Server:
    """A Server on the default model in float32 (the references' dtype), eager (its compiled decode
    is tested in test_compiled_decode), not yet entered."""
    return Server(str(model_dir), port=0, **{"dtype": "float32", "num_pages": 256, "timeout_s": 120, "compile": "off",
                                             **settings})


def chat_prompt(server: Server, messages: list[dict], **template) -> list[int]:
    """The token ids of `messages` rendered by the model's template, with the generation prompt."""
    tok = server.runtime.engine.tokenizer
    return tok.encode(tok.chat_template.render(messages, add_generation_prompt=True, **template))


def greedy_tokens(server: Server, prompt: list[int], max_tokens: int) -> list[int]:
    """The engine's greedy decode of `prompt` alone, up to a stop token (not included)."""
    engine = server.runtime.engine
    stops = set(chat_tokens(engine.tokenizer).stop_tokens())
    out = engine.generate([prompt], max_tokens, stop=stops)[0]
    return out[:-1] if out and out[-1] in stops else out


def greedy_text(server: Server, prompt: list[int], max_tokens: int) -> str:
    return server.runtime.engine.tokenizer.decode(greedy_tokens(server, prompt, max_tokens))


def log_softmax_rows(server: Server, tokens: list[int], rows: list[int]) -> torch.Tensor:
    """The model's log-softmax at `rows` of one direct pass over `tokens` [len(rows), vocab]."""
    engine = server.runtime.engine
    seq = engine.create_sequence()
    try:
        future = engine.submit(PassRequest([Lane(seq, tokens, readout=rows)],
                                           epilogue=lambda logits: torch.log_softmax(logits.float(), -1).cpu()))
        return future.result(timeout=120)
    finally:
        engine.free(seq)


def idle(server: Server, timeout: float = 120.0) -> dict:
    """The engine's stats once no program runs and no connection is open."""
    end = time.monotonic() + timeout
    while True:
        stats = server.runtime.stats()
        if stats["processes"] == 0 and stats["connections"] == 0:
            return stats
        assert time.monotonic() < end, f"the engine did not go idle: {stats}"
        time.sleep(0.05)


def batches_since(before: dict, after: dict, key: str = "batch_sizes") -> Counter:
    """Batches executed between two stats, by lanes."""
    return Counter({int(k): v for k, v in after[key].items()}) - Counter({int(k): v for k, v in before[key].items()})
