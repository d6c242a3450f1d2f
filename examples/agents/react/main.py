"""A ReAct agent whose tool takes time: it reasons to a tool call, waits for the tool (an HTTP
service that answers after `delay_ms`), reads the result and calls again, `calls` times, then
answers. Its working set lives across the calls: after each call only the tool's answer turn
(and the few tokens that close and reopen a turn) is prefilled, never the history before it.

Each call is constrained (`tools.create_matcher`: the reply can only be a valid call), runs over
`http.fetch` (the run's allow-list must name the tool's host), and is streamed to the client as
it completes, numbered. toolcall.py is the planner/executor example's (the same file).

Input: "tool_url" (required), "question", "calls" (2), "delay_ms" (50), "max_tokens" of the answer (24).
Output: {"steps": [{"seq", "call", "result"}], "answer", "fed": [tokens the first pass of each
turn prefilled], "answer_tokens": [tokens of each tool answer turn], "folded", "cached_tokens"}.
"""
from inferlet import chat, model, session, tools
from inferlet.eta import Pipeline, WorkingSet

from toolcall import LOOKUP, call_lookup, lookup, reply


async def main(input: dict) -> dict:
    url, calls, delay = input["tool_url"], int(input.get("calls", 2)), int(input.get("delay_ms", 50))
    max_tokens = int(input.get("max_tokens", 24))
    ws, pipe = WorkingSet(), Pipeline()
    feed = (tools.equip([LOOKUP], "You answer questions about cities. Look facts up, one call at a time.")
            + chat.user(input.get("question", "Which of Paris, Rome and Oslo is the largest?"))
            + chat.cue_without_thinking())
    steps, fed, answer_tokens = [], [], []
    for seq in range(calls):
        fed.append(len(feed))
        arguments, unfed = await call_lookup(ws, pipe, feed)
        step = {"seq": seq, "call": arguments, "result": await lookup(url, arguments, delay)}
        steps.append(step)
        session.send(step)
        answer = tools.answer("lookup", step["result"])
        answer_tokens.append(len(answer))
        feed = unfed + chat.seal() + answer + chat.cue_without_thinking()
    fed.append(len(feed))
    text, _ = await reply(ws, pipe, feed, max_tokens)
    pipe.close()
    return {"steps": steps, "answer": model.decode(text).strip(), "fed": fed, "answer_tokens": answer_tokens,
            "folded": ws.folded(), "cached_tokens": ws.cached_tokens()}
