"""pie serve's OpenAI API through the official openai SDK and raw HTTP: every answer is compared with
the engine's own greedy decode or log-softmax of the same prompt."""
from __future__ import annotations

import asyncio
import json
import secrets
from collections import Counter

import httpx
import jsonschema
import openai
import pytest
import torch

from pie_actors.inferlet.chat_ops import chat_tokens
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent

from pie_actors.config import ConfigError, load
from serve_helpers import (ASK, KEY, QUESTION, WEATHER, batches_since, chat_prompt, checked, checked_stream,
                           greedy_text, greedy_tokens, idle, log_softmax_rows, reference_engine, sse_data, start, valid)

PAGE = 16
DEFAULT_MAX_TOKENS = 40          # the server's bound for a request without max_tokens


@pytest.fixture(scope="module")
def server(default_model_dir):
    with start(default_model_dir, api_keys=(KEY,), default_max_tokens=DEFAULT_MAX_TOKENS) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def chat(client, messages=ASK, **kw):
    """A chat completion (its chunks, streamed), each checked by the SDK's own model."""
    reply = client.chat.completions.create(**{"model": "default", "messages": messages, "temperature": 0, **kw})
    return checked_stream(reply) if kw.get("stream") else checked(reply)


def streamed_text(chunks) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


# ---- answers -----------------------------------------------------------------------------------

def test_paris_streamed_and_not_are_the_engines_greedy_text(server, client):
    prompt = chat_prompt(server, ASK)
    expected = greedy_tokens(server, prompt, 32)
    text = reference_engine(server).tokenizer.decode(expected)
    assert "Paris" in text

    full = chat(client, max_tokens=32)
    assert full.choices[0].message.content == text
    assert full.choices[0].finish_reason == "stop"
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(prompt), len(expected))

    chunks = list(chat(client, max_tokens=32, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert streamed_text(chunks) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected)
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == len(prompt) // PAGE * PAGE   # the same prompt again


def test_content_as_text_parts_is_their_lines_and_a_system_message_reaches_the_template(server, client):
    """Text parts join with newlines, as vLLM joins them."""
    system, lines = "You are a geography teacher.", ["Answer in one sentence.", QUESTION]
    as_strings = [{"role": "system", "content": system}, {"role": "user", "content": "\n".join(lines)}]
    as_parts = [{"role": "system", "content": [{"type": "text", "text": system}]},
                {"role": "user", "content": [{"type": "text", "text": line} for line in lines]}]
    expected = greedy_text(server, chat_prompt(server, as_strings), 24)
    reply = chat(client, as_parts, max_tokens=24)
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == len(chat_prompt(server, as_strings)) != len(chat_prompt(server, ASK))


def test_stop_cuts_the_text(server, client):
    text = greedy_text(server, chat_prompt(server, ASK), 32)
    cut = text[:text.index(" Paris")]
    full = chat(client, max_tokens=32, stop=[" Paris", "never appears"])
    assert (full.choices[0].message.content, full.choices[0].finish_reason) == (cut, "stop")
    assert streamed_text(chat(client, max_tokens=32, stop=" Paris", stream=True)) == cut


def test_max_tokens_within_the_context_is_capped_beyond_it_refused(server, client):
    """As OpenAI's API refuses a max_tokens past the model's limit; one the context holds but the
    prompt leaves no room for is capped at the context's end (users ask for that, elsewhere)."""
    reply = chat(client, max_tokens=8000)
    assert reply.choices[0].finish_reason == "stop" and "Paris" in reply.choices[0].message.content
    cut = chat(client, max_completion_tokens=3)
    assert (cut.choices[0].finish_reason, cut.usage.completion_tokens) == ("length", 3)
    for field in ("max_tokens", "max_completion_tokens"):        # the refusal names the field the user wrote
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as refused:
                chat(client, stream=stream, **{field: 10**6})
            assert refused.value.param == field and refused.value.body["message"].startswith(field), refused.value.body
            assert "8192" in refused.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="default", prompt="Hello", max_tokens=10**9)


def test_a_request_without_max_tokens_gets_the_servers_default(client):
    for stream in (False, True):
        kw = {"extra_body": {"ignore_eos": True}, "stream": stream}
        if stream:
            kw["stream_options"] = {"include_usage": True}
            reply = list(chat(client, **kw))[-1]
        else:
            reply = chat(client, **kw)
        assert reply.usage.completion_tokens == DEFAULT_MAX_TOKENS
    # not stored: a stored response's saved working set would hold pages after the test (spilled to
    # host memory only when the pool runs short)
    response = checked(client.responses.create(model="default", input="Count from 1 to 200, separated by commas.",
                                               temperature=0, store=False))
    assert (response.usage.output_tokens, response.status) == (DEFAULT_MAX_TOKENS, "incomplete")
    completion = checked(client.completions.create(model="default", prompt="Once upon a time",
                                                   extra_body={"ignore_eos": True}))
    assert completion.usage.completion_tokens == 16            # OpenAI's default for text completions
    for bad in (0, -5, "many"):
        with pytest.raises(ConfigError, match="default_max_tokens"):
            load(default_max_tokens=bad)


def test_ignore_eos_replies_run_to_max_tokens(server, client):
    """Benchmarks (bench/serve.py) rely on it: a reply's stop token does not end it."""
    n = len(greedy_tokens(server, chat_prompt(server, ASK), 64)) + 8        # past the greedy reply's end
    reply = chat(client, max_tokens=n, extra_body={"ignore_eos": True})
    assert (reply.choices[0].finish_reason, reply.usage.completion_tokens) == ("length", n)
    chunks = list(chat(client, max_tokens=n, extra_body={"ignore_eos": True}, stream=True,
                       stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == n


def test_tools_required_streamed_in_openais_delta_shape(client):
    chunks = list(chat(client, [{"role": "user", "content": "What is the weather in Paris?"}], max_tokens=64,
                       tools=[{"type": "function", "function": WEATHER}], tool_choice="required", stream=True))
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    first, rest = deltas[0], deltas[1:]
    assert first.id and first.type == "function" and first.function.name == "get_weather"
    assert rest and all(d.id is None and d.function.name is None and d.index == first.index for d in rest)
    arguments = json.loads(first.function.arguments + "".join(d.function.arguments for d in rest))
    jsonschema.validate(arguments, WEATHER["parameters"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_parallel_tool_calls_lets_a_reply_call_again_and_off_ends_it_at_its_first(client):
    ask = [{"role": "user", "content": "What is the weather in Paris, in Rome and in Madrid?"}]
    kw = dict(max_tokens=160, tools=[{"type": "function", "function": WEATHER}], tool_choice="required")
    several = chat(client, ask, parallel_tool_calls=True, **kw).choices[0]
    one = chat(client, ask, parallel_tool_calls=False, **kw).choices[0]
    assert several.finish_reason == one.finish_reason == "tool_calls"
    assert len(several.message.tool_calls) > 1 and len(one.message.tool_calls) == 1
    for call in several.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["parameters"])
    assert len({call.id for call in several.message.tool_calls}) == len(several.message.tool_calls)
    # greedy: the same first call, then the reply either ends or calls again
    assert one.message.tool_calls[0].function == several.message.tool_calls[0].function


def test_named_tool_choice_and_a_tool_result_round_trip(server, client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools = [{"type": "function", "function": WEATHER},
             {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    called = chat(client, ask, max_tokens=64, tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = called.choices[0].message.tool_calls[0]
    assert (call.function.name, called.choices[0].finish_reason) == ("get_weather", "tool_calls")
    history = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    tokens = httpx.post(server.url + "/tokenize", json={"messages": history}, headers={"x-api-key": KEY}).json()["tokens"]
    prompt = reference_engine(server).tokenizer.decode(tokens)
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in prompt and '"name": "get_weather"' in prompt
    answer = chat(client, history, max_tokens=24, tools=tools, tool_choice="none")
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content


def test_json_schema_and_json_object_are_enforced(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
              "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}}}
    ask = [{"role": "user", "content": "Where is the Eiffel Tower?"}]
    reply = chat(client, ask, max_tokens=48, response_format={"type": "json_schema",
                                                             "json_schema": {"name": "place", "schema": schema}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    assert reply.choices[0].finish_reason == "stop"
    # JSON mode is a JSON object (OpenAI's json_object), even where the prompt asks for another value
    for question in ("Describe Paris as a JSON object with keys city and country.",
                     'Answer with the JSON string "Paris" and nothing else.', "List three colors as a JSON array."):
        reply = chat(client, [{"role": "user", "content": question}], max_tokens=48,
                     response_format={"type": "json_object"})
        text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
        assert text.startswith("{"), text                   # an object, whole or cut by max_tokens
        assert finish == "length" or isinstance(json.loads(text), dict), (text, finish)


def test_n_forks_one_prompt_computation_and_a_seed_repeats(server, client):
    ask = [{"role": "user", "content": f"Tell me a story about the number {secrets.token_hex(16)}. " * 4}]
    prompt, known = chat_prompt(server, ask), chat_prompt(server, ASK)
    shared = next(i for i, (a, b) in enumerate(zip(prompt, known)) if a != b)   # the template's opening
    chat(client, max_tokens=1)                                                  # computed before
    before = idle(server)
    reply = chat(client, ask, n=3, temperature=1.0, seed=11, max_tokens=6)
    after = idle(server)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.prompt_tokens_details.cached_tokens == shared // PAGE * PAGE
    # one pass of one lane held more than one row: the prompt; the three replies only decoded
    prefill = batches_since(before, after) - batches_since(before, after, "decode_batch_sizes")
    assert prefill == {1: 1}
    again = chat(client, ask, n=3, temperature=1.0, seed=11, max_tokens=6)
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]
    assert again.usage.prompt_tokens_details.cached_tokens == len(prompt) // PAGE * PAGE
    assert 3 <= reply.usage.completion_tokens <= 3 * 6


def test_logprobs_are_the_engines_log_softmax(server, client):
    prompt = chat_prompt(server, ASK)
    generated = greedy_tokens(server, prompt, 5)
    reference = log_softmax_rows(server, prompt + generated[:-1], list(range(len(prompt) - 1, len(prompt) + 4)))
    decode = reference_engine(server).tokenizer.decode
    reply = chat(client, max_tokens=5, logprobs=True, top_logprobs=3)
    entries = reply.choices[0].logprobs.content
    assert [e.token for e in entries] == [decode([t]) for t in generated]
    for k, entry in enumerate(entries):
        assert entry.logprob == pytest.approx(reference[k, generated[k]].item(), abs=1e-3)
        top = reference[k].topk(3)
        assert [t.token for t in entry.top_logprobs] == [decode([int(i)]) for i in top.indices]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-3)
    streamed = [e for c in chat(client, max_tokens=5, logprobs=True, top_logprobs=3, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 3)) for e in streamed] == [(e.token, round(e.logprob, 3)) for e in entries]


def test_stop_token_ids_end_a_reply_before_the_token(server, client):
    tokens = greedy_tokens(server, chat_prompt(server, ASK), 12)
    reply = chat(client, max_tokens=12, extra_body={"stop_token_ids": [tokens[3]]}).choices[0]
    cut = tokens[:tokens.index(tokens[3])]
    assert reply.message.content == reference_engine(server).tokenizer.decode(cut) and reply.finish_reason == "stop"


def test_bad_values_are_refused_before_any_pass(server, client):
    before = idle(server)
    for bad, param in (({"logit_bias": {"-5": 1}}, "logit_bias"), ({"logit_bias": {"12": 500}}, "logit_bias.12"),
                       ({"extra_body": {"stop_token_ids": [49152]}}, "stop_token_ids"),
                       ({"extra_body": {"stop_token_ids": [-1]}}, "stop_token_ids"),
                       ({"n": 129}, "n"), ({"top_logprobs": 21, "logprobs": True}, "top_logprobs")):
        with pytest.raises(openai.BadRequestError) as refused:
            chat(client, max_tokens=4, **bad)
        assert refused.value.param == param, (bad, refused.value.body)
    after = idle(server)
    assert after["batch_sizes"] == before["batch_sizes"]          # no pass ran for any of them


def test_unknown_fields_are_refused_by_name_and_known_extras_taken(server, client):
    """As OpenAI answers a field it does not have (a misspelling, another server's extension): 400
    naming it, not a reply that silently ignored it. vLLM's sampling extras and OpenAI's labels of a
    request are taken."""
    before = idle(server)
    unknown = [("temprature", {"temprature": 0.5}), ("grammar", {"grammar": 'root ::= "yes"'}),
               ("json_schema", {"json_schema": {"type": "object"}}),
               ("continue_final_message", {"continue_final_message": True, "add_generation_prompt": True}),
               ("response_format.schema", {"response_format": {"type": "json_object", "schema": {"type": "object"}}})]
    for name, extra in unknown:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as refused:
                chat(client, max_tokens=4, stream=stream, extra_body=extra)
            assert refused.value.param == name, refused.value.body
            assert refused.value.body["message"] == f"Unrecognized request argument supplied: {name}"
            assert refused.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="default", prompt="Hi", max_tokens=4, extra_body={"temprature": 0.5})
    assert refused.value.param == "temprature"
    assert idle(server)["batch_sizes"] == before["batch_sizes"]            # no pass ran for any of them
    taken = {"top_k": 1, "min_p": 0.5, "ignore_eos": True}
    reply = chat(client, max_tokens=4, user="someone", metadata={"team": "a"}, store=False,
                 service_tier="auto", extra_body=taken)
    assert reply.usage.completion_tokens == 4
    assert client.completions.create(model="default", prompt="Hi", max_tokens=2, user="someone",
                                     extra_body=taken).usage.completion_tokens == 2


def test_the_real_apis_fields_are_taken_or_refused_as_not_implemented(server, client):
    """Every field of the openai SDK's own create params is either read by pie serve's request shape
    or listed as not implemented, which answers 400 "Unsupported parameter" naming it (as OpenAI
    answers a parameter a model lacks) rather than "Unrecognized"."""
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params
    from openai.types.responses import response_create_params

    from pie_actors.serve.openai_api import ChatRequest, CompletionRequest
    from pie_actors.serve.responses_api import ResponseRequest

    for params, shape in ((chat_create_params.CompletionCreateParamsBase, ChatRequest),
                          (completion_create_params.CompletionCreateParamsBase, CompletionRequest),
                          (response_create_params.ResponseCreateParamsBase, ResponseRequest)):
        assert set(params.__annotations__) - set(shape.model_fields) <= shape.not_implemented, shape
        assert not shape.not_implemented & set(shape.model_fields), shape
    before = idle(server)
    for call, name in ((lambda: chat(client, max_tokens=4, extra_body={"verbosity": "low"}), "verbosity"),
                       (lambda: client.completions.create(model="default", prompt="Hi", max_tokens=4, suffix="!"),
                        "suffix"),
                       (lambda: client.responses.create(model="default", input="Hi", max_output_tokens=4,
                                                        reasoning={"effort": "low"}), "reasoning")):
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        assert refused.value.param == name, refused.value.body
        assert refused.value.body["message"] == f"Unsupported parameter: '{name}' is not supported by this server"
    assert idle(server)["batch_sizes"] == before["batch_sizes"]            # no pass ran for any of them


def test_system_fingerprint_is_on_every_object_and_chunk_and_stable(client):
    reply = chat(client, max_tokens=4)
    assert reply.system_fingerprint and reply.system_fingerprint.startswith("fp_")
    chunks = list(chat(client, max_tokens=4, stream=True, stream_options={"include_usage": True}))
    assert {c.system_fingerprint for c in chunks} == {reply.system_fingerprint}
    completion = checked(client.completions.create(model="default", prompt="Hi", max_tokens=2))
    assert completion.system_fingerprint == reply.system_fingerprint == chat(client, max_tokens=2).system_fingerprint


def test_a_request_the_kv_pool_cannot_hold_is_a_429_and_every_page_returns(server, client):
    # 3,900 prompt tokens fit the context (8,192) and the pool (256 pages of 16), but not with two
    # replies of 1,000 tokens each: the engine runs out of pages some 90 tokens into the decode
    before = idle(server)
    with pytest.raises(openai.RateLimitError) as busy:
        chat(client, [{"role": "user", "content": "hello " * 3900}], n=2, max_tokens=1000,
             extra_body={"ignore_eos": True})
    assert "KV cache has no room" in busy.value.message
    after = idle(server)
    assert after["kv"]["referenced"] == before["kv"]["referenced"], (before, after)
    assert "Paris" in chat(client, max_tokens=16).choices[0].message.content      # still serving


def test_logit_bias_bans_a_token(server, client):
    plain = chat(client, max_tokens=12).choices[0].message.content
    paris = reference_engine(server).tokenizer.encode(" Paris")
    biased = chat(client, max_tokens=12, logit_bias={str(paris[0]): -100}).choices[0].message.content
    assert " Paris" in plain and " Paris" not in biased


def test_presence_and_frequency_penalties_are_the_engines_greedy_decode_with_them(server, client):
    """Each step's argmax of the log-softmax minus presence x (seen) minus frequency x (times seen),
    over the reply's own tokens, from direct passes."""
    ask = [{"role": "user", "content": "Count from 1 to 30, separated by commas."}]
    prompt, tok = chat_prompt(server, ask), reference_engine(server).tokenizer
    stops = set(chat_tokens(tok).stop_tokens())
    presence, frequency, reply = 0.5, 1.5, []
    counts = torch.zeros(tok.vocab_size)
    for _ in range(24):
        logprobs = log_softmax_rows(server, prompt + reply, [len(prompt) + len(reply) - 1])[0]
        token = int((logprobs[:len(counts)] - (counts > 0).float() * presence - counts * frequency).argmax())
        if token in stops:
            break
        reply.append(token)
        counts[token] += 1
    penalized = chat(client, ask, max_tokens=24, presence_penalty=presence, frequency_penalty=frequency)
    assert penalized.choices[0].message.content == tok.decode(reply)
    assert tok.decode(reply) != greedy_text(server, prompt, 24)        # the penalties changed the reply


def test_top_k_1_min_p_1_and_a_tiny_top_p_sample_the_greedy_text(server, client):
    """Sampling at temperature 1 keeps only the likeliest token under top_k 1 or min_p 1 (extras, as
    in vLLM) or a top_p below its probability; without them the same seed gives another text."""
    ask = [{"role": "user", "content": "Write a short poem about the sea."}]
    greedy = greedy_text(server, chat_prompt(server, ask), 24)
    sampled = {name: chat(client, ask, max_tokens=24, temperature=1.0, seed=5, **kw).choices[0].message.content
               for name, kw in (("top_k", {"extra_body": {"top_k": 1}}), ("min_p", {"extra_body": {"min_p": 1.0}}),
                                ("top_p", {"top_p": 1e-6}), ("plain", {}))}
    assert sampled["top_k"] == sampled["min_p"] == sampled["top_p"] == greedy != sampled["plain"]


def test_completions_one_prompt_a_list_echo_and_logprobs(server, client):
    tok = reference_engine(server).tokenizer
    prompts = ["The capital of France is", "Water boils at"]
    expected = [greedy_text(server, tok.encode(p), 6) for p in prompts]
    one = client.completions.create(model="default", prompt=prompts[0], max_tokens=6, temperature=0)
    assert one.choices[0].text == expected[0]
    both = client.completions.create(model="default", prompt=prompts, max_tokens=6, temperature=0, echo=True,
                                     logprobs=2)
    assert [c.text for c in both.choices] == [p + e for p, e in zip(prompts, expected)]
    assert [len(c.logprobs.tokens) for c in both.choices] == [len(tok.encode(e)) for e in expected]
    assert all(len(top) == 2 for c in both.choices for top in c.logprobs.top_logprobs)
    chunks = list(client.completions.create(model="default", prompt=prompts[1], max_tokens=6, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected[1]


def test_16_concurrent_streams_get_their_alone_text_in_shared_batches(server):
    questions = [f"What is {a} plus {b}?" for a, b in zip(range(2, 18), range(7, 23))]
    asks = [[{"role": "user", "content": q}] for q in questions]
    expected = [greedy_text(server, chat_prompt(server, ask), 8) for ask in asks]
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)

    async def one(ask) -> str:
        stream = await client.chat.completions.create(model="default", messages=ask, temperature=0, max_tokens=8,
                                                      stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def all_of_them() -> list[str]:
        return await asyncio.gather(*map(one, asks))

    before = idle(server)
    assert asyncio.run(all_of_them()) == expected
    decode_batches = batches_since(before, idle(server), "decode_batch_sizes")
    assert max(decode_batches) > 1, decode_batches


# ---- the disconnect ----------------------------------------------------------------------------

LONG = {"model": "default", "messages": ASK, "max_tokens": 4000, "ignore_eos": True, "temperature": 0}


def test_a_client_that_leaves_a_stream_ends_its_inferlet_and_its_pages_return(server):
    before = idle(server)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**LONG, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert [next(lines) for _ in range(6)]                # some text has come
    after = idle(server)
    assert after["kv"]["referenced"] == before["kv"]["referenced"]
    assert after["kv"]["free"] + after["kv"]["cached"] == before["kv"]["free"] + before["kv"]["cached"]
    assert sum(batches_since(before, after).values()) < 1000       # it stopped long before its 4000 tokens


def test_a_client_that_gives_up_on_a_reply_ends_its_inferlet(server):
    before = idle(server)
    route = "/v1/chat/completions"
    statuses = dict(server.serving.metrics.requests)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + route, json=LONG, headers={"Authorization": f"Bearer {KEY}"}, timeout=2)
    after = idle(server)
    # recorded as the client's leaving (499), not as a failure of the server
    assert server.serving.metrics.requests - Counter(statuses) == Counter({(route, 499): 1})
    assert after["kv"]["referenced"] == before["kv"]["referenced"]
    assert sum(batches_since(before, after).values()) < 1000


# ---- errors ------------------------------------------------------------------------------------

def test_errors_are_the_sdks_exception_types(server, client):
    with pytest.raises(openai.NotFoundError):
        chat(client, model="gpt-4o")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError) as bad:
        chat(client, temperature=5)
    assert bad.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as long:
        chat(client, [{"role": "user", "content": "hello " * 9000}], stream=True)
    assert long.value.code == "context_length_exceeded"
    for refused in ({"logit_bias": {"999999": 1}},
                    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
                    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
                    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}):
        with pytest.raises(openai.BadRequestError):
            chat(client, **{"messages": ASK, **refused})
    with pytest.raises(openai.BadRequestError) as empty:
        client.completions.create(model="default", prompt=["Hello", ""], max_tokens=2)
    assert empty.value.param == "prompt"
    assert "Paris" in chat(client, max_tokens=16).choices[0].message.content      # still serving


def test_error_bodies_in_openais_shape(server):
    url, auth = server.url, {"Authorization": f"Bearer {KEY}"}
    cases = [(httpx.post(url + "/v1/chat/completions", content=b"{not json", headers=auth), 400, None),
             (httpx.post(url + "/v1/chat/completions", json={"model": "default"}, headers=auth), 400, None),
             (httpx.post(url + "/v1/chat/completions", json={"model": "default", "messages": ASK}), 401, "invalid_api_key"),
             (httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"}), 401, "invalid_api_key"),
             (httpx.get(url + "/v1/models/nope", headers=auth), 404, "model_not_found"),
             (httpx.post(url + "/v1/chat/completions", headers=auth,
                         json={"model": "default", "messages": [{"role": "user", "content": "hi " * 9000}]}),
              400, "context_length_exceeded")]
    for response, status, code in cases:
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["code"] == code
    assert httpx.post(url + "/v1/chat/completions", json={"model": "default"}, headers=auth).json()["error"]["param"] == "messages"
    assert httpx.get(url + "/health").status_code == 200                  # needs no key
    assert httpx.get(url + "/metrics").status_code == 401


# ---- the other routes --------------------------------------------------------------------------

def test_models_tokenize_detokenize(server, client):
    names = [m.id for m in client.models.list()]
    assert names[:2] == ["default", "smollm2-135m-instruct"]
    assert client.models.retrieve("smollm2-135m-instruct").id == "smollm2-135m-instruct"
    auth = {"x-api-key": KEY}
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": QUESTION}, headers=auth).json()
    assert tokens["tokens"] == reference_engine(server).tokenizer.encode(QUESTION) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == 8192
    chat_tokens = httpx.post(server.url + "/tokenize", json={"messages": ASK}, headers=auth).json()["tokens"]
    assert chat_tokens == chat_prompt(server, ASK)
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}, headers=auth).json()
    assert text == {"prompt": QUESTION}
    refused = httpx.post(server.url + "/detokenize", json={"tokens": [10**7]}, headers=auth)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens"


def test_health_metrics_and_openapi(server, client):
    chat(client, max_tokens=4, stream=True).close()
    list(chat(client, max_tokens=4, stream=True))
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    text = httpx.get(server.url + "/metrics", headers=auth).text
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert int(samples['pie_requests_total{route="/v1/chat/completions",status="200"}']) >= 1
    assert int(samples["pie_time_to_first_token_seconds_count"]) >= 1
    assert int(samples['pie_kv_pages{state="total"}']) == 256
    assert int(samples['pie_tokens_total{kind="completion"}']) > 0
    assert any(key.startswith("pie_engine_batches_total") for key in samples)
    assert "pie_running_inferlets" in samples
    spec = httpx.get(server.url + "/openapi.json", headers=auth).json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1beta/models/{model}:generateContent",
            "/tokenize", "/health"} <= set(spec["paths"])


# ---- what the official SDKs' models and OpenAI's API require -----------------------------------

def test_responses_bodies_and_events_are_the_sdks_models(server, client):
    """openai-python builds a Response without checking it; its own model requires, e.g.,
    usage.input_tokens_details.cache_write_tokens."""
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "default", "input": QUESTION, "max_output_tokens": 8, "temperature": 0}
    created = valid(Response, httpx.post(server.url + "/v1/responses", json=body, headers=auth, timeout=120).json())
    assert created.usage.input_tokens_details.cache_write_tokens == 0
    kept = httpx.get(f"{server.url}/v1/responses/{created.id}", headers=auth).json()
    assert valid(Response, kept).id == created.id
    streamed = httpx.post(server.url + "/v1/responses", json={**body, "stream": True}, headers=auth, timeout=120).text
    events = [valid(ResponseStreamEvent, e) for e in sse_data(streamed)]
    assert events[-1].type == f"response.{created.status}" and events[-1].response.output_text == created.output_text
    chat_body = {"model": "default", "messages": ASK, "max_tokens": 4, "temperature": 0}
    valid(ChatCompletion, httpx.post(server.url + "/v1/chat/completions", json=chat_body, headers=auth,
                                     timeout=120).json())
    chunks = sse_data(httpx.post(server.url + "/v1/chat/completions", json={**chat_body, "stream": True},
                                 headers=auth, timeout=120).text)
    assert [valid(ChatCompletionChunk, c) for c in chunks]


def test_strict_booleans_and_errors_that_name_the_users_field(server):
    auth = {"Authorization": f"Bearer {KEY}"}

    def refused(route: str, **body) -> dict:
        response = httpx.post(server.url + route, json={"model": "default", **body}, headers=auth, timeout=120)
        assert response.status_code == 400, response.text
        return response.json()["error"]

    assert refused("/v1/chat/completions", messages=ASK, stream="yes")["param"] == "stream"
    assert refused("/v1/completions", prompt="Hi", echo=1)["param"] == "echo"
    stops = refused("/v1/chat/completions", messages=ASK, stop=["a", "b", "c", "d", "e"])
    assert stops["param"] == "stop" and "at most 4 items" in stops["message"]
    content = refused("/v1/chat/completions", messages=[{"role": "user", "content": 5}])
    assert content["param"] == "messages.0.content" and "valid string" in content["message"]
    prompt = refused("/v1/completions", prompt=5)
    assert prompt["param"] == "prompt" and ".str" not in prompt["message"] and "valid list" in prompt["message"]


def test_completions_take_token_id_prompts(server, client):
    tok = reference_engine(server).tokenizer
    texts = ["The capital of France is", "Water boils at"]
    ids = [tok.encode(t) for t in texts]
    expected = [greedy_text(server, p, 6) for p in ids]
    one = checked(client.completions.create(model="default", prompt=ids[0], max_tokens=6, temperature=0))
    assert one.choices[0].text == expected[0] and one.usage.prompt_tokens == len(ids[0])
    both = checked(client.completions.create(model="default", prompt=ids, max_tokens=6, temperature=0, echo=True))
    assert [c.text for c in both.choices] == [t + e for t, e in zip(texts, expected)]
    with pytest.raises(openai.BadRequestError) as outside:
        client.completions.create(model="default", prompt=[1, 2, tok.vocab_size + 5], max_tokens=2)
    assert outside.value.param == "prompt" and "vocabulary" in outside.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="default", prompt=[[1, 2], []], max_tokens=2)


def test_a_forced_call_cut_by_max_tokens_keeps_its_arguments_so_far(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = {"tools": [{"type": "function", "function": WEATHER}], "tool_choice": "required"}
    whole = chat(client, ask, max_tokens=64, **kw).choices[0].message.tool_calls[0]
    cut = chat(client, ask, max_tokens=20, **kw).choices[0]
    assert cut.finish_reason == "length" and cut.message.content is None
    call = cut.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id
    partial = call.function.arguments
    assert partial and json.loads(whole.function.arguments) != partial
    with pytest.raises(ValueError):
        json.loads(partial)                                    # incomplete, as the length left it
    chunks = list(chat(client, ask, max_tokens=20, stream=True, **kw))
    deltas = [d for c in chunks if c.choices and c.choices[0].delta.tool_calls for d in c.choices[0].delta.tool_calls]
    assert deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == partial
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_unknown_paths_and_methods_in_openais_shape(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    for response, status in ((httpx.get(server.url + "/v1/nothing", headers=auth), 404),
                             (httpx.get(server.url + "/v1/chat/completions", headers=auth), 405)):
        assert response.status_code == status
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
