"""An interactive chat that keeps its working set across turns.

The inferlet stays alive between turns: it waits for the next user message with
`session.receive()`, and each turn feeds only the new tokens (the end of its last reply, the user
turn and the cue) into the same working set, so the earlier turns are never computed again. Each
reply is sent to the client as {"turn", "reply", "folded_before", "fed", ...} when it is done:
folded_before is the state the turn found (every earlier token), fed what the turn added to it.

A message is the user's text (or {"content": text}); an empty message, null or "/bye" ends the
chat. "history" starts the chat after earlier turns ([{"role": "user" | "assistant", "content"}],
rendered in one go: a fresh request with the whole conversation).

Input (all optional): "system", "history", "max_tokens" per reply (default 48), "turns" (stop
after this many replies; default: until the client ends the chat).
Output: {"turns": [{"user", "reply", "folded_before", "fed", "folded_after", "cached_tokens"}]}
(cached_tokens: how many of the working set's tokens were found in the engine's prefix cache).
"""
from inferlet import chat, model, session
from inferlet.eta import Pipeline, WorkingSet, generate


async def main(input: dict) -> dict:
    max_tokens = int(input.get("max_tokens", 48))
    limit = input.get("turns")
    stops = set(chat.stop_tokens())
    ws, pipe = WorkingSet(), Pipeline()
    pending = chat.system(input.get("system", "You are a helpful assistant."))   # not yet in ws
    for message in input.get("history", []):
        role, content = message["role"], message["content"]
        pending += chat.user(content) if role == "user" else chat.assistant(content)

    turns = []
    while limit is None or len(turns) < int(limit):
        message = await session.receive()
        text = message.get("content") if isinstance(message, dict) else message
        if not text or text == "/bye":
            break
        feed = pending + chat.user(text) + chat.cue_without_thinking()
        folded_before, fed = ws.folded(), len(feed)
        reply = [token async for token in generate(ws, pipe, feed, max_tokens, stops)]
        # a reply that ended at its stop is all in ws; one cut at max_tokens lacks its last token
        pending = (reply[-1:] if len(reply) == max_tokens else []) + chat.seal()
        turn = {"user": text, "reply": model.decode(reply), "folded_before": folded_before, "fed": fed,
                "folded_after": ws.folded(), "cached_tokens": ws.cached_tokens()}
        session.send({"turn": len(turns) + 1, **turn})
        turns.append(turn)
    pipe.close()
    return {"turns": turns}
