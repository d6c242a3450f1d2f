"""The Responses API through the official openai SDK: a conversation chained by
previous_response_id continues from the saved working set of the response before it (the engine
computes only each turn's new tokens, usage reports the rest as cached), its replies equal fresh
greedy runs over the whole transcript, streamed or not, and equal again when the saved set is gone;
stored responses are per key, store=false ones are not kept, deleting works, and every page returns."""
from __future__ import annotations

import json
import time

import openai
import pytest
from openai import OpenAI

from serve_helpers import KEY, WEATHER, batches_since, chat_prompt, checked, checked_stream, greedy_text, idle, start

OTHER = "other-key"
INSTRUCTIONS = "You are a concise assistant."
TURNS = ["What is the capital of France?", "And of Italy?", "Which of the two is bigger?"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(default_model_dir):
    # the engine in this process: the tests check its KV pool's own invariants (kv.check)
    with start(default_model_dir, api_keys=(KEY, OTHER), stored_responses=8, engine_process=False) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def _create(client: OpenAI, stream: bool, **fields):
    """A response, and for a stream the types of its events in order; each checked by the SDK's own
    model."""
    if not stream:
        return checked(client.responses.create(**fields)), None
    events = list(checked_stream(client.responses.create(stream=True, **fields)))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text
    return final, kinds


def _references(server, replies: list[str]) -> list[str]:
    """Greedy decoding of each turn's whole transcript, rendered by the chat template."""
    messages, out = [{"role": "system", "content": INSTRUCTIONS}], []
    for text, reply in zip(TURNS, replies):
        messages.append({"role": "user", "content": text})
        out.append(greedy_text(server, chat_prompt(server, messages), MAX_TOKENS))
        messages.append({"role": "assistant", "content": reply})
    return out


def _prefilled(before: dict, after: dict) -> int:
    """Prompt rows the engine computed between two stats: every row but those of decode steps
    (batches of one row a lane; one request at a time here, so no batch mixes the two)."""
    decoded = batches_since(before, after, "decode_batch_sizes")
    return after["tokens_computed"] - before["tokens_computed"] - sum(k * v for k, v in decoded.items())


def _conversation(server, client, stream: bool) -> tuple[list, list[int], list]:
    """The three turns chained by previous_response_id: the responses, the prompt tokens the
    engine computed for each, and the event types of each stream."""
    responses, computed, kinds, previous = [], [], [], None
    for text in TURNS:
        before = server.runtime.stats()
        response, events = _create(client, stream, model="default", input=text, instructions=INSTRUCTIONS,
                                   max_output_tokens=MAX_TOKENS, temperature=0, previous_response_id=previous)
        computed.append(_prefilled(before, idle(server)))
        responses.append(response)
        kinds.append(events)
        previous = response.id
    return responses, computed, kinds


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_chained_conversation_computes_only_new_tokens_and_matches_greedy_runs(server, client, stream):
    start_pages = idle(server)["kv"]["referenced"]
    responses, computed, kinds = _conversation(server, client, stream)
    replies = [r.output_text for r in responses]
    assert replies == _references(server, replies)
    for number, response in enumerate(responses):
        usage, cached = response.usage, response.usage.input_tokens_details.cached_tokens
        assert response.id.startswith("resp_") and response.object == "response"
        assert response.status in ("completed", "incomplete")
        assert usage.total_tokens == usage.input_tokens + usage.output_tokens
        assert computed[number] == usage.input_tokens - cached
        if number > 0:       # every earlier token came from the previous response's saved working set
            previous = responses[number - 1].usage
            assert cached >= previous.input_tokens + previous.output_tokens - 1 > 0
    if stream:
        message = ["response.output_item.added", "response.content_part.added"]
        closing = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
        for events, response in zip(kinds, responses):
            deltas = events.count("response.output_text.delta")
            assert deltas >= 1
            assert events == (["response.created", "response.in_progress", *message]
                              + ["response.output_text.delta"] * deltas + closing + [f"response.{response.status}"])
    assert checked(client.responses.retrieve(responses[-1].id)).output_text == replies[-1]
    assert idle(server)["kv"]["referenced"] > start_pages          # the saved sets hold their pages


def test_a_gone_saved_set_is_recomputed_from_the_stored_conversation_with_the_same_output(server, client):
    kept, _, _ = _conversation(server, client, stream=False)
    first, second = kept[0], kept[1]
    saved = {s["name"] for s in server.runtime.saved(_owner(KEY))}
    assert {first.id, second.id} <= saved
    server.runtime.delete_saved(second.id, _owner(KEY))
    before = server.runtime.stats()
    again = checked(client.responses.create(model="default", input=TURNS[2], instructions=INSTRUCTIONS, temperature=0,
                                            max_output_tokens=MAX_TOKENS, previous_response_id=second.id))
    after = idle(server)
    assert again.output_text == kept[2].output_text
    # no saved set was opened: the stored conversation was computed whole, through the prefix cache
    # (whole pages only: the tail of the last turn is computed again)
    assert after["saved"]["opened_kept"] == before["saved"]["opened_kept"]
    cached = again.usage.input_tokens_details.cached_tokens
    assert _prefilled(before, after) == again.usage.input_tokens - cached
    assert cached % server.runtime.engine.kv.page_size == 0


def test_stored_responses_are_per_key_and_store_false_ones_are_not_kept(server, client):
    other = OpenAI(base_url=server.url + "/v1", api_key=OTHER, max_retries=0)
    mine = checked(client.responses.create(model="default", input=TURNS[0], max_output_tokens=4, temperature=0))
    with pytest.raises(openai.NotFoundError) as info:
        other.responses.retrieve(mine.id)
    assert info.value.body["message"] == f"Response with id {mine.id!r} not found."
    with pytest.raises(openai.BadRequestError) as info:
        other.responses.create(model="default", input="Go on.", previous_response_id=mine.id)
    assert info.value.code == "previous_response_not_found" and info.value.param == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(mine.id)
    assert server.runtime.saved(_owner(OTHER)) == []

    names = {s["name"] for s in server.runtime.saved(_owner(KEY))}
    unkept = checked(client.responses.create(model="default", input=TURNS[0], max_output_tokens=4, temperature=0,
                                             store=False))
    assert unkept.output_text == mine.output_text and unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="default", input="Go on.", previous_response_id=unkept.id)
    assert info.value.code == "previous_response_not_found"
    assert {s["name"] for s in server.runtime.saved(_owner(KEY))} == names     # no set was kept for it

    client.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(mine.id)
    assert mine.id not in {s["name"] for s in server.runtime.saved(_owner(KEY))}


def test_function_tools_and_json_schema(server, client):
    called = checked(client.responses.create(model="default", input="What is the weather in Paris?", temperature=0,
                                             tools=[{"type": "function", **WEATHER}], tool_choice="required"))
    call = called.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert "city" in json.loads(call.arguments)
    answered = checked(client.responses.create(model="default", previous_response_id=called.id, temperature=0,
                                               max_output_tokens=16, tools=[{"type": "function", **WEATHER}],
                                               input=[{"type": "function_call_output", "call_id": call.call_id,
                                                       "output": '{"celsius": 21}'}]))
    assert answered.output[0].type == "message" and answered.usage.input_tokens > called.usage.input_tokens
    streamed, kinds = _create(client, True, model="default", input="What is the weather in Paris?", temperature=0,
                              tools=[{"type": "function", **WEATHER}], tool_choice="required", store=False)
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert streamed.output[-1].arguments == call.arguments

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    shaped = checked(client.responses.create(
        model="default", input="Name the capital of France as JSON.", temperature=0,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema}}))
    assert set(json.loads(shaped.output_text)) == {"city"}


def test_json_object_is_an_object_and_unknown_fields_and_a_max_output_past_the_context_are_refused(server, client):
    """OpenAI's JSON mode is a JSON object, even where the prompt asks for another value; a field the
    API does not have is refused by name, and so is a max_output_tokens past the context, under the
    name the user wrote."""
    before = idle(server)
    for extra, param in (({"temprature": 0.5}, "temprature"),
                         ({"text": {"format": {"type": "json_object", "schema": {}}}}, "text.format.schema")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model="default", input="Hi", max_output_tokens=4, extra_body=extra)
        assert refused.value.param == param, refused.value.body
        assert refused.value.body["message"] == f"Unrecognized request argument supplied: {param}"
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model="default", input="Hi", max_output_tokens=10**6, stream=stream)
        assert refused.value.param == "max_output_tokens"
        assert refused.value.body["message"].startswith("max_output_tokens")
    assert idle(server)["batch_sizes"] == before["batch_sizes"]            # no pass ran for any of them
    shaped = checked(client.responses.create(model="default", input='Answer with the JSON string "Paris" only.',
                                             temperature=0, max_output_tokens=32, store=False,
                                             text={"format": {"type": "json_object"}}))
    assert shaped.output_text.startswith("{"), shaped.output_text  # an object, whole or cut by max_output_tokens
    assert shaped.status == "incomplete" or isinstance(json.loads(shaped.output_text), dict), shaped.output_text


def test_a_client_that_leaves_mid_stream_leaves_no_stored_response_and_no_saved_set(server, client):
    names = {s["name"] for s in server.runtime.saved(_owner(KEY))}
    long = {"type": "object", "properties": {"story": {"type": "string", "minLength": 400}}, "required": ["story"]}
    with client.responses.create(model="default", input="Tell me a story.", temperature=0, stream=True,
                                 text={"format": {"type": "json_schema", "name": "story", "schema": long}}) as stream:
        for event in stream:
            if event.type == "response.created":
                response_id = event.response.id
            if event.type == "response.output_text.delta":
                break                                  # and the connection closes
    idle(server)                                           # nothing saves once its run has ended
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response_id)
    # the server deletes sets in the background (this one, and the oldest ones the bound drops)
    end = time.monotonic() + 60
    while {s["name"] for s in server.runtime.saved(_owner(KEY))} - names:
        assert time.monotonic() < end, "the left response's saved set stayed"
        time.sleep(0.05)


def test_bad_requests_get_openai_errors_and_the_store_stays_bounded(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="default", input="Hi", previous_response_id="resp_missing")
    assert info.value.code == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="no-such-model", input="Hi")
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="default", input=[{"type": "image", "url": "x"}])
    assert info.value.param == "input.0"
    made = [client.responses.create(model="default", input=f"Say {i}.", max_output_tokens=2, temperature=0).id
            for i in range(9)]
    assert len(server.serving.responses) == 8              # the bound: the oldest went
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made[0])
    checked(client.responses.retrieve(made[-1]))
    for response_id in made[1:]:
        client.responses.delete(response_id)
    saved = server.runtime.saved(_owner(KEY))
    assert not {s["name"] for s in saved} & set(made)      # the dropped and deleted ones' sets went too
    for s in saved:
        server.runtime.delete_saved(s["name"], _owner(KEY))
    assert idle(server)["kv"]["referenced"] == 0
    server.runtime.engine.kv.check()


def _owner(key: str) -> str:
    from pie_actors.serve.auth import owner_of
    return owner_of(key)
