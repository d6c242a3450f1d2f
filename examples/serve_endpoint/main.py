"""A replacement chat endpoint for `pie serve`: every API's chat route answers through this program.

    # $PIE_HOME/config.toml
    [serve.routes]
    "/v1/chat/completions" = "examples/serve_endpoint/main.py"

It receives the neutral input of the built-in endpoint (pie_actors/serve/endpoints/chat.py, whose
docstring is the whole protocol) and speaks the same messages, using only what it needs: the
conversation's last user message, answered greedily in the voice of a ship's captain, streamed
as text, with the usage the APIs report. The HTTP layer does the rest (OpenAI chunks, Anthropic
events, Gemini responses).

input: {"messages", "max_tokens", ...}  ->  {"choices": [{"index", "text", "finish_reason"}], "usage"}
"""
from inferlet import chat, model, session
from inferlet.eta import Pipeline, WorkingSet, generate

SYSTEM = "You are the captain of a sailing ship. Answer in one sentence."
STOP = set(chat.stop_tokens())


async def main(input: dict) -> dict:
    question = next(m["content"] for m in reversed(input["messages"]) if m["role"] == "user")
    prompt = chat.system(SYSTEM) + chat.user(question) + chat.cue_without_thinking()
    max_tokens = min(input.get("max_tokens") or 256, model.max_position() - len(prompt))
    streaming = input.get("stream", True)
    ws, pipe = WorkingSet(), Pipeline()
    if streaming:
        session.send({"type": "start", "prompt_tokens": len(prompt), "cached_tokens": 0})

    reply, sent = [], ""
    async for token in generate(ws, pipe, prompt, max_tokens, STOP):
        reply.append(token)
        text = model.decode(reply)
        if streaming and not text.endswith("\ufffd"):          # a whole character at least
            session.send({"type": "text", "choice": 0, "text": text[len(sent):]})
            sent = text
    pipe.close()
    text, reason = model.decode(reply), "length" if len(reply) >= max_tokens else "stop"
    if streaming:
        session.send({"type": "text", "choice": 0, "text": text[len(sent):]})
        session.send({"type": "finish", "choice": 0, "reason": reason})
    return {"choices": [{"index": 0, "text": text, "finish_reason": reason}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(reply), "cached_tokens": 0}}
