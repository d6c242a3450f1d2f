"""Shared by the pie serve tests: the references their answers are compared with (an in-process
engine's greedy decoding of the same prompt, and its log-softmax from a direct pass), and waiting for the
engine to be idle; and the SDKs' own response models, which every body and stream event the tests
receive must satisfy."""
from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any, Iterable, Iterator, TypeVar

import pydantic
import torch

from pie_actors import Runtime
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


_references: dict[Any, Runtime] = {}     # engine settings -> an in-process runtime for the references


def reference_engine(server: Server):
    """The engine the references come from: the server's own when it runs in this process, else
    one loaded here with the same settings (a server's engine runs in a child process by default,
    as `pie serve --local` runs it), kept for the session."""
    if not server.engine_process:
        return server.runtime.engine
    key = server.config.engine
    if key not in _references:
        _references[key] = Runtime.local(**server.settings)
    return _references[key].engine


def chat_prompt(server: Server, messages: list[dict], **template) -> list[int]:
    """The token ids of `messages` rendered by the model's template, with the generation prompt."""
    tok = reference_engine(server).tokenizer
    return tok.encode(tok.chat_template.render(messages, add_generation_prompt=True, **template))


def greedy_tokens(server: Server, prompt: list[int], max_tokens: int) -> list[int]:
    """The engine's greedy decode of `prompt` alone, up to a stop token (not included)."""
    engine = reference_engine(server)
    stops = set(chat_tokens(engine.tokenizer).stop_tokens())
    out = engine.generate([prompt], max_tokens, stop=stops)[0]
    return out[:-1] if out and out[-1] in stops else out


def greedy_text(server: Server, prompt: list[int], max_tokens: int) -> str:
    return reference_engine(server).tokenizer.decode(greedy_tokens(server, prompt, max_tokens))


def log_softmax_rows(server: Server, tokens: list[int], rows: list[int]) -> torch.Tensor:
    """The model's log-softmax at `rows` of one direct pass over `tokens` [len(rows), vocab]."""
    engine = reference_engine(server)
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


# ---- the SDKs' response models -----------------------------------------------------------------

T = TypeVar("T")


def checked(obj: T) -> T:
    """`obj`, an object the openai or anthropic SDK returned, validated by its own model: those SDKs
    build objects without checking them, so a field the API requires that the body lacks (or a
    wrong type) would pass unseen; here it fails."""
    type(obj).model_validate(obj.model_dump(mode="json", by_alias=True, exclude_unset=True, warnings=False))
    return obj


def checked_stream(stream: Iterable[T]) -> Iterator[T]:
    """The events of an SDK stream, each `checked`; closing the iterator closes the stream."""
    with stream:
        for event in stream:
            yield checked(event)


def valid(model: Any, body: Any) -> Any:
    """`body` (JSON) as `model` (an SDK's pydantic model or a union of them), which must accept it."""
    return pydantic.TypeAdapter(model).validate_python(body)


def sse_data(text: str) -> list[Any]:
    """The JSON of each server-sent event in `text` (a [DONE] left out)."""
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
