"""pie serve's Gemini API through the official google-genai SDK and raw HTTP: generateContent, its
stream, systemInstruction and generationConfig, function calling, responseSchema JSON, countTokens,
and errors in Gemini's shape."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pydantic
import pytest
from google import genai
from google.genai import errors, types

from serve_helpers import (ASK, KEY, QUESTION, WEATHER, chat_prompt, greedy_tokens, reference_engine, sse_data, start,
                           valid)


@pytest.fixture(scope="module")
def server(default_model_dir):
    with start(default_model_dir, api_keys=(KEY,)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> genai.Client:
    return genai.Client(api_key=KEY, http_options={"base_url": server.url, "retry_options": {"attempts": 1}})


def config(**kw) -> types.GenerateContentConfig:
    return types.GenerateContentConfig(**{"temperature": 0, "max_output_tokens": 32, **kw})


def test_generate_content_and_its_stream_are_the_engines_greedy_text(server, client):
    prompt = chat_prompt(server, ASK)
    expected = greedy_tokens(server, prompt, 32)
    text = reference_engine(server).tokenizer.decode(expected)
    response = client.models.generate_content(model="default", contents=QUESTION, config=config())
    assert "Paris" in text and response.text == text
    assert response.candidates[0].finish_reason == types.FinishReason.STOP
    assert (response.usage_metadata.prompt_token_count, response.usage_metadata.candidates_token_count) == \
        (len(prompt), len(expected))
    chunks = list(client.models.generate_content_stream(model="default", contents=QUESTION, config=config()))
    assert len(chunks) > 2 and "".join(c.text or "" for c in chunks) == text
    assert chunks[-1].candidates[0].finish_reason == types.FinishReason.STOP
    assert chunks[-1].usage_metadata.candidates_token_count == len(expected)
    cut = client.models.generate_content(model="default", contents=QUESTION, config=config(max_output_tokens=2))
    assert cut.candidates[0].finish_reason == types.FinishReason.MAX_TOKENS


def test_system_instruction_stop_sequences_and_top_k(server, client):
    system = "You are a concise assistant."
    prompt = chat_prompt(server, [{"role": "system", "content": system}] + ASK)
    text = reference_engine(server).tokenizer.decode(greedy_tokens(server, prompt, 32))
    assert "Paris" in text

    def generate(**kw):
        return client.models.generate_content(model="default", contents=QUESTION,
                                              config=config(system_instruction=system, **kw))

    plain = generate()
    assert plain.text == text and plain.usage_metadata.prompt_token_count == len(prompt)
    cut = generate(stop_sequences=["Paris"])
    assert cut.text == text[:text.index("Paris")] and cut.candidates[0].finish_reason == types.FinishReason.STOP
    assert generate(temperature=1.0, top_k=1, seed=4).text == text        # sampling among one token


def test_every_path_prefix_and_the_key_as_a_query_parameter(server):
    body = {"contents": [{"role": "user", "parts": [{"text": QUESTION}]}], "generationConfig": {"temperature": 0,
                                                                                              "maxOutputTokens": 4}}
    texts = [httpx.post(f"{server.url}{prefix}/models/default:generateContent?key={KEY}", json=body,
                        timeout=120).json()
             ["candidates"][0]["content"]["parts"][0]["text"] for prefix in ("/v1beta", "/v1", "")]
    assert texts[0] and texts == [texts[0]] * 3
    streamed = httpx.post(f"{server.url}/v1beta/models/default:streamGenerateContent?alt=sse",
                          json=body, headers={"x-goog-api-key": KEY}, timeout=120)
    assert streamed.headers["content-type"].startswith("text/event-stream")
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert "".join(p.get("text", "") for c in chunks for p in c["candidates"][0]["content"]["parts"]) == texts[0]


def test_function_calling_and_the_function_response(server, client):
    tool = types.Tool(function_declarations=[types.FunctionDeclaration(
        name="get_weather", description=WEATHER["description"],
        parameters={"type": "OBJECT", "properties": {"city": {"type": "STRING"}}, "required": ["city"]})])
    forced = types.ToolConfig(function_calling_config=types.FunctionCallingConfig(mode="ANY"))
    ask = "What is the weather in Paris?"
    response = client.models.generate_content(model="default", contents=ask,
                                              config=config(max_output_tokens=64, tools=[tool], tool_config=forced))
    call = response.function_calls[0]
    assert call.name == "get_weather"
    jsonschema.validate(call.args, {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
    history = [types.Content(role="user", parts=[types.Part(text=ask)]), response.candidates[0].content,
               types.Content(role="user", parts=[types.Part(function_response=types.FunctionResponse(
                   name="get_weather", response={"temperature": 21}))])]
    counted = client.models.count_tokens(model="default", contents=history).total_tokens
    assert counted > client.models.count_tokens(model="default", contents=ask).total_tokens
    none = types.ToolConfig(function_calling_config=types.FunctionCallingConfig(mode="NONE"))
    answer = client.models.generate_content(model="default", contents=history,
                                            config=config(tools=[tool], tool_config=none))
    assert answer.function_calls is None and answer.text


def test_response_schema_json_validates(client):
    class Place(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=20)
        country: str = pydantic.Field(max_length=20)

    response = client.models.generate_content(
        model="default", contents="Where is the Eiffel Tower?",
        config=config(max_output_tokens=48, response_mime_type="application/json", response_schema=Place))
    assert isinstance(response.parsed, Place)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
              "additionalProperties": False}
    digits = client.models.generate_content(
        model="default", contents="Pick a digit.",
        config=config(response_mime_type="application/json", response_json_schema=schema))
    jsonschema.validate(json.loads(digits.text), schema)


def test_candidate_count_and_count_tokens(server, client):
    response = client.models.generate_content(model="default", contents=QUESTION,
                                              config=config(candidate_count=2, temperature=1.0, seed=3,
                                                            max_output_tokens=6))
    assert [c.index for c in response.candidates] == [0, 1]
    assert client.models.count_tokens(model="default", contents=QUESTION).total_tokens == len(chat_prompt(server, ASK))


def test_errors_are_client_errors_in_geminis_shape(server, client):
    with pytest.raises(errors.ClientError) as missing:
        client.models.generate_content(model="gemini-2.5-flash", contents=QUESTION, config=config())
    assert (missing.value.code, missing.value.status) == (404, "NOT_FOUND")
    wrong = genai.Client(api_key="wrong", http_options={"base_url": server.url, "retry_options": {"attempts": 1}})
    with pytest.raises(errors.ClientError) as bad_key:
        wrong.models.count_tokens(model="default", contents=QUESTION)
    assert (bad_key.value.code, bad_key.value.status) == (400, "INVALID_ARGUMENT")
    with pytest.raises(errors.ClientError) as bad_field:
        client.models.generate_content(model="default", contents=QUESTION, config=config(temperature=5))
    assert bad_field.value.code == 400
    with pytest.raises(errors.ClientError) as long:
        client.models.generate_content(model="default", contents="hello " * 9000, config=config())
    assert long.value.code == 400

    url = server.url + "/v1beta/models/default:generateContent"
    no_key = httpx.post(url, json={"contents": [{"parts": [{"text": "hi"}]}]})
    not_json = httpx.post(url, content=b"{", headers={"x-goog-api-key": KEY})
    image = httpx.post(url, headers={"x-goog-api-key": KEY},
                       json={"contents": [{"parts": [{"inlineData": {"mimeType": "image/png", "data": ""}}]}]})
    for response, status, kind in ((no_key, 403, "PERMISSION_DENIED"), (not_json, 400, "INVALID_ARGUMENT"),
                                   (image, 400, "INVALID_ARGUMENT")):
        assert response.status_code == status
        error = response.json()["error"]
        assert (error["code"], error["status"]) == (status, kind) and error["message"]


# ---- what Google's API does --------------------------------------------------------------------

BODY = {"contents": [{"role": "user", "parts": [{"text": QUESTION}]}],
        "generationConfig": {"temperature": 0, "maxOutputTokens": 8}}


def test_stream_without_alt_sse_is_a_json_array_of_responses(server):
    url, auth = server.url + "/v1beta/models/default:streamGenerateContent", {"x-goog-api-key": KEY}
    array = httpx.post(url, json=BODY, headers=auth, timeout=120)
    assert array.headers["content-type"].startswith("application/json")
    items = [valid(types.GenerateContentResponse, item) for item in array.json()]
    events = [valid(types.GenerateContentResponse, e)
              for e in sse_data(httpx.post(url + "?alt=sse", json=BODY, headers=auth, timeout=120).text)]
    assert len(items) == len(events) > 1
    expected = greedy_tokens(server, chat_prompt(server, ASK), 8)     # maxOutputTokens: 8
    assert "".join(i.text or "" for i in items) == "".join(e.text or "" for e in events) == \
        reference_engine(server).tokenizer.decode(expected)
    cut = types.FinishReason.MAX_TOKENS if len(expected) == 8 else types.FinishReason.STOP
    assert items[-1].candidates[0].finish_reason == events[-1].candidates[0].finish_reason == cut
    refused = httpx.post(url, json={**BODY, "contents": [{"role": "user", "parts": [{"text": "hi " * 9000}]}]},
                         headers=auth, timeout=120)
    assert refused.status_code == 400 and refused.json()["error"]["status"] == "INVALID_ARGUMENT"


def test_empty_parts_and_a_max_output_past_the_context_are_refused(server, client):
    url, auth = server.url + "/v1beta/models/default:generateContent", {"x-goog-api-key": KEY}
    for body in ({"contents": [{"role": "user", "parts": []}]},
                 {**BODY, "generationConfig": {"maxOutputTokens": 10**6}}):
        response = httpx.post(url, json=body, headers=auth, timeout=120)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["status"] == "INVALID_ARGUMENT"
    assert response.json()["error"]["message"].startswith("generationConfig.maxOutputTokens")   # as the user wrote it
    with pytest.raises(errors.ClientError) as empty:
        client.models.generate_content(model="default", contents=[types.Content(role="user", parts=[])],
                                       config=config())
    assert empty.value.code == 400


def test_unknown_paths_in_geminis_shape(server):
    auth = {"x-goog-api-key": KEY}
    for response in (httpx.post(server.url + "/v1beta/models/default:nothing", headers=auth),
                     httpx.get(server.url + "/v1beta/models/default:generateContent", headers=auth),
                     httpx.get(server.url + "/v1beta/nothing", headers=auth)):
        assert response.status_code == 404
        error = response.json()["error"]
        assert (error["code"], error["status"]) == (404, "NOT_FOUND") and error["message"]
