"""pie serve on a hybrid model: a small random Qwen3.5 folder (with the default model's tokenizer
and chat template) answers the OpenAI and Anthropic APIs with the engine's greedy text, `n` forks of
the prompt's working set (the recurrent state copied) included, and a repeated prompt reuses its
cached prefix, recurrent state and all."""
from __future__ import annotations

import pytest

from tests.engine_helpers import save_tiny_hybrid
from tests.serve_helpers import ASK, KEY, chat_prompt, greedy_tokens, reference_engine, start


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_dir):
    folder = save_tiny_hybrid(tmp_path_factory.mktemp("hybrid") / "tiny-qwen3_5", default_model_dir)
    with start(folder, api_keys=(KEY,)) as s:
        yield s


def test_openai_n_forks_and_anthropic_give_the_greedy_text(server):
    import anthropic
    import openai
    prompt = chat_prompt(server, ASK)
    text = reference_engine(server).tokenizer.decode(greedy_tokens(server, prompt, 16))
    assert text

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    reply = client.chat.completions.create(model="default", messages=ASK, temperature=0, max_tokens=16, n=2)
    assert [c.message.content for c in reply.choices] == [text, text]
    again = client.chat.completions.create(model="default", messages=ASK, temperature=0, max_tokens=16)
    assert again.choices[0].message.content == text
    assert again.usage.prompt_tokens_details.cached_tokens > 0        # prefix reuse, state snapshot included

    claude = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    message = claude.messages.create(model="default", max_tokens=16, messages=ASK, extra_body={"temperature": 0})
    assert message.content[0].text == text

    response = client.responses.create(model="default", input=ASK[0]["content"], temperature=0, max_output_tokens=16)
    assert response.output_text == text

    import httpx
    metrics = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    states = {line.split('"')[1]: int(line.split()[-1]) for line in metrics.splitlines()
              if line.startswith("pie_recurrent_states{")}
    # the stored response keeps its working set's state; the prefix snapshots stay for reuse
    assert states["held"] == 1 and states["snapshots"] > 0, metrics
    assert states["free"] + states["held"] + states["snapshots"] == states["total"]


def test_gemini_and_the_models_architecture_on_a_hybrid_model(server):
    from google import genai
    from google.genai import types

    from pie_actors.program import Program
    prompt = chat_prompt(server, ASK)
    text = reference_engine(server).tokenizer.decode(greedy_tokens(server, prompt, 16))
    gemini = genai.Client(api_key=KEY, http_options={"base_url": server.url, "retry_options": {"attempts": 1}})
    reply = gemini.models.generate_content(model="default", contents=ASK[0]["content"],
                                           config=types.GenerateContentConfig(temperature=0, max_output_tokens=16))
    assert reply.text == text
    architecture = server.runtime.launch(Program(source="from inferlet import model\n\nasync def main(input):\n"
                                                        "    return model.architecture()\n"), {}).result(60)
    assert architecture == reference_engine(server).model_config.architecture and "3_5" in architecture.lower()


def test_a_grammar_holds_on_a_hybrid_model(server):
    import json

    import openai
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    reply = client.chat.completions.create(
        model="default", messages=ASK, temperature=0, max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert reply.choices[0].finish_reason == "stop"
    assert json.loads(reply.choices[0].message.content)["city"] in ("Paris", "Rome")
