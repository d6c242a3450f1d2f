"""pie serve's Anthropic API through the official anthropic SDK and raw HTTP: the Messages stream's
event order, a tool_use -> tool_result -> answer loop, count_tokens, thinking blocks, and errors in
Anthropic's shape."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from anthropic.types import Message, RawMessageStreamEvent
from starlette.testclient import TestClient

from pie_actors.serve.app import build_app
from pie_actors.serve.metrics import Metrics
from pie_actors.serve.routes import Serving
from pie_actors.serve.sessions import Sessions
from serve_helpers import (ASK, KEY, WEATHER, chat_prompt, checked, checked_stream, greedy_text, greedy_tokens,
                           reference_engine, sse_data, start, valid)
from tests.chat_families import thinking_model_dir

TOOLS = [{"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(default_model_dir):
    with start(default_model_dir, api_keys=(KEY,)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


GREEDY = {"temperature": 0}        # the SDK has no temperature argument; the server takes it as older clients send it


def create(client, messages=ASK, **kw):
    """A message (its events, streamed), each checked by the SDK's own model."""
    reply = client.messages.create(**{"model": "default", "max_tokens": 32, "messages": messages, "extra_body": GREEDY,
                                      **kw})
    return checked_stream(reply) if kw.get("stream") else checked(reply)


def test_paris_streamed_and_not_with_the_full_event_order(server, client):
    prompt = chat_prompt(server, ASK)
    expected = greedy_tokens(server, prompt, 32)
    text = reference_engine(server).tokenizer.decode(expected)
    message = create(client)
    assert "Paris" in text and [b.type for b in message.content] == ["text"] and message.content[0].text == text
    assert (message.stop_reason, message.usage.output_tokens) == ("end_turn", len(expected))
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(prompt)

    raw = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                     json={"model": "default", "max_tokens": 32, "messages": ASK, "stream": True, **GREEDY},
                     timeout=120).text
    kinds = [line[7:] for line in raw.splitlines() if line.startswith("event: ")]
    deltas = kinds.count("content_block_delta")
    assert kinds == ["message_start", "content_block_start", "ping", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"] and deltas > 1

    events = list(create(client, stream=True))         # the SDK's events (it leaves out the ping)
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == text
    assert events[-2].delta.stop_reason == "end_turn" and events[-2].usage.output_tokens == len(expected)
    start_usage = events[0].message.usage
    assert start_usage.input_tokens + start_usage.cache_read_input_tokens == len(prompt)
    assert start_usage.cache_read_input_tokens > 0                           # this prompt ran before

    with client.messages.stream(model="default", max_tokens=32, messages=ASK, extra_body=GREEDY) as stream:
        assert "".join(stream.text_stream) == text
        assert stream.get_final_message().stop_reason == "end_turn"


def test_system_as_a_string_or_blocks_stop_sequences_and_top_k(server, client):
    system = "You are a geography teacher."
    expected = greedy_text(server, chat_prompt(server, [{"role": "system", "content": system}, *ASK]), 32)
    assert create(client, system=system).content[0].text == expected
    assert create(client, system=[{"type": "text", "text": system}]).content[0].text == expected
    word = expected[len(expected) // 2:][:4]
    stopped = create(client, system=system, stop_sequences=[word])
    assert stopped.content[0].text == expected[:expected.index(word)]
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", word)
    assert create(client, max_tokens=2).stop_reason == "max_tokens"
    one = create(client, system=system, extra_body={"temperature": 1.0, "top_k": 1})        # sampling among one
    assert one.content[0].text == expected


def test_tool_use_then_tool_result_then_the_answer(server, client):
    called = create(client, WEATHER_ASK, max_tokens=64, tools=TOOLS, tool_choice={"type": "any"})
    assert called.stop_reason == "tool_use"
    use = next(b for b in called.content if b.type == "tool_use")
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER["parameters"])

    result = "It is 21 degrees and sunny."
    history = [*WEATHER_ASK, {"role": "assistant", "content": [b.model_dump() for b in called.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]}]
    counted = client.messages.count_tokens(model="default", messages=history, tools=TOOLS)
    alone = client.messages.count_tokens(model="default", messages=WEATHER_ASK, tools=TOOLS)
    assert counted.input_tokens > alone.input_tokens + len(reference_engine(server).tokenizer.encode(result))
    answer = create(client, history, max_tokens=32, tools=TOOLS, tool_choice={"type": "none"})
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text

    events = list(create(client, WEATHER_ASK, max_tokens=64, tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"},
                         stream=True))
    start = next(e for e in events if e.type == "content_block_start" and e.content_block.type == "tool_use")
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                      and e.delta.type == "input_json_delta")
    assert start.content_block.name == "get_weather"
    jsonschema.validate(json.loads(partial), WEATHER["parameters"])
    assert next(e for e in events if e.type == "message_delta").delta.stop_reason == "tool_use"


def test_output_config_json_schema_is_enforced(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["city"],
              "properties": {"city": {"type": "string", "maxLength": 20}}}
    message = create(client, [{"role": "user", "content": "Where is the Eiffel Tower?"}],
                     output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(message.content[0].text), schema)


def test_count_tokens_is_the_prompts_length(server, client):
    assert client.messages.count_tokens(model="default", messages=ASK).input_tokens == len(chat_prompt(server, ASK))


def test_errors_are_the_sdks_exception_types_and_anthropics_bodies(server, client):
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.count_tokens(
            model="default", messages=ASK)
    with pytest.raises(anthropic.NotFoundError):
        create(client, model="claude-sonnet-4")
    with pytest.raises(anthropic.BadRequestError):
        create(client, extra_body={"temperature": 1.5})
    with pytest.raises(anthropic.BadRequestError) as long:
        create(client, [{"role": "user", "content": "hello " * 9000}], stream=True)
    assert "context" in str(long.value)

    url = server.url + "/v1/messages"
    bearer = {"Authorization": f"Bearer {KEY}", "anthropic-version": "2023-06-01"}
    no_max = httpx.post(url, json={"model": "default", "messages": ASK}, headers=bearer)
    wrong_key = httpx.post(url, json={"model": "default", "max_tokens": 4, "messages": ASK}, headers={"x-api-key": "no"})
    image = httpx.post(url, headers=bearer, json={"model": "default", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]})
    for response, status, kind in ((no_max, 400, "invalid_request_error"), (wrong_key, 401, "authentication_error"),
                                   (image, 400, "invalid_request_error")):
        assert response.status_code == status
        body = response.json()
        assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"]
    ok = httpx.post(url, json={"model": "default", "max_tokens": 4, "messages": ASK, "temperature": 0}, headers=bearer,
                    timeout=120)
    assert ok.status_code == 200 and ok.json()["type"] == "message"                 # Bearer works too


@pytest.fixture(scope="module")
def thinking_server(default_model_dir, tmp_path_factory):
    """A server on `thinking_model_dir`: its replies open with thinking."""
    with start(thinking_model_dir(default_model_dir, tmp_path_factory.mktemp("qwen3_thinking")), api_keys=(KEY,)) as s:
        yield s


def test_thinking_blocks_and_thinking_deltas_on_a_reasoning_template(thinking_server):
    """The thinking before `</think>` is a thinking block (thinking_delta events when streamed), the
    rest (if any) a text block: the split of the engine's own greedy reply."""
    client = anthropic.Anthropic(base_url=thinking_server.url, api_key=KEY, max_retries=0)
    kw = {"max_tokens": 48, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    reply = greedy_text(thinking_server, chat_prompt(thinking_server, ASK), 48)
    assert reference_engine(thinking_server).tokenizer.decode(chat_prompt(thinking_server, ASK)).endswith("<think>\n")
    message = create(client, **kw)
    assert message.content[0].type == "thinking" and message.content[0].thinking
    assert message.content[0].thinking.strip() == reply.split("</think>")[0].strip()
    assert all("<think>" not in b.thinking for b in message.content if b.type == "thinking")

    events = list(create(client, stream=True, **kw))
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert starts[0] == "thinking" and {d.type for d in deltas} <= {"thinking_delta", "text_delta"}
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == message.content[0].thinking
    texts = [b.text for b in message.content if b.type == "text"]
    assert "".join(d.text for d in deltas if d.type == "text_delta") == "".join(texts)
    assert events[-2].delta.stop_reason == message.stop_reason


# ---- what Anthropic's API requires -------------------------------------------------------------

HEADERS = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}


def test_raw_bodies_and_events_are_the_sdks_models(server):
    body = {"model": "default", "max_tokens": 8, "messages": ASK, **GREEDY}
    valid(Message, httpx.post(server.url + "/v1/messages", json=body, headers=HEADERS, timeout=120).json())
    events = sse_data(httpx.post(server.url + "/v1/messages", json={**body, "stream": True}, headers=HEADERS,
                                 timeout=120).text)
    assert [valid(RawMessageStreamEvent, e).type for e in events if e["type"] != "ping"][-1] == "message_stop"


def test_empty_content_and_a_max_tokens_past_the_context_are_refused(client):
    for empty in ("", []):
        with pytest.raises(anthropic.BadRequestError) as refused:
            create(client, [{"role": "user", "content": empty}])
        assert "messages.0.content" in refused.value.message
    # the SDK refuses a long request without a stream or a timeout of its own before sending it
    for long in ({"timeout": 120}, {"stream": True}):
        with pytest.raises(anthropic.BadRequestError) as huge:
            create(client, max_tokens=10**9, **long)
        assert huge.value.body["error"]["message"].startswith("max_tokens must be")
    prefill = [*ASK, {"role": "assistant", "content": ""}]         # an empty final assistant turn is fine
    assert create(client, prefill, max_tokens=4).content


def test_a_forced_call_cut_by_max_tokens_is_its_text(client):
    """A tool_use block needs a valid input; a call cut off is returned as the text generated."""
    whole = create(client, WEATHER_ASK, max_tokens=64, tools=TOOLS, tool_choice={"type": "any"})
    use = next(b for b in whole.content if b.type == "tool_use")
    cut = create(client, WEATHER_ASK, max_tokens=20, tools=TOOLS, tool_choice={"type": "any"})
    assert cut.stop_reason == "max_tokens" and [b.type for b in cut.content] == ["text"]
    assert '"get_weather"' in cut.content[0].text and use.name == "get_weather"
    events = list(create(client, WEATHER_ASK, max_tokens=20, tools=TOOLS, tool_choice={"type": "any"}, stream=True))
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert text == cut.content[0].text
    assert next(e for e in events if e.type == "message_delta").delta.stop_reason == "max_tokens"


def test_unknown_paths_wrong_methods_and_loading_in_anthropics_shape(server, default_model_dir):
    for response, status, kind in ((httpx.post(server.url + "/v1/messages/nope", headers=HEADERS), 404,
                                    "not_found_error"),
                                   (httpx.get(server.url + "/v1/messages", headers=HEADERS), 405,
                                    "invalid_request_error")):
        assert response.status_code == status
        assert response.json()["type"] == "error" and response.json()["error"]["type"] == kind
    # an engine still loading: Anthropic's 529 overloaded_error, which its SDK retries
    loading = Serving("smollm2", ("default",), Metrics(), Sessions(600, 16))
    with TestClient(build_app(loading, ())) as app:
        response = app.post("/v1/messages", json={"model": "default", "max_tokens": 4, "messages": ASK})
    assert response.status_code == 529 and response.json()["error"]["type"] == "overloaded_error"
    # the document lists the answers these routes give: 405 and 529, and not the 503 they never give
    document = httpx.get(server.url + "/openapi.json", headers=HEADERS).json()
    messages = document["paths"]["/v1/messages"]["post"]["responses"]
    assert {"405", "529"} <= set(messages) and "503" not in messages


def test_thinking_of_the_turn_in_progress_is_fed_back_and_earlier_thinking_is_not(thinking_server):
    client = anthropic.Anthropic(base_url=thinking_server.url, api_key=KEY, max_retries=0)
    thought = "The user wants the weather in Paris, so I call get_weather with the city Paris."
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 degrees"}

    def count(thinking: bool, then: list) -> int:
        turn = [{"type": "thinking", "thinking": thought, "signature": "s"}] * thinking + [use]
        messages = [*WEATHER_ASK, {"role": "assistant", "content": turn}, *then]
        return client.messages.count_tokens(model="default", messages=messages, tools=TOOLS).input_tokens

    in_progress = [{"role": "user", "content": [result]}]
    words = len(reference_engine(thinking_server).tokenizer.encode(thought))
    assert count(True, in_progress) >= count(False, in_progress) + words
    completed = [{"role": "user", "content": [result]}, {"role": "assistant", "content": "It is 21 degrees."},
                 {"role": "user", "content": "And in Rome?"}]
    assert count(True, completed) == count(False, completed)
