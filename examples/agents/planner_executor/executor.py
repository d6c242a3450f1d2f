"""The executor (spawned by main.py, the planner): takes the plan's steps by message, runs each
as a constrained call of the lookup tool (`tools.create_matcher`: the reply can only be a valid
call), makes the call over `http.fetch`, and sends each result back to the planner. Its working
set holds the whole exchange: each step feeds only the tool's answer and the next step."""
from inferlet import chat, session, tools
from inferlet.eta import Pipeline, WorkingSet

from toolcall import LOOKUP, call_lookup, lookup


async def main(input: dict) -> dict:
    planner = input["planner"]
    ws, pipe = WorkingSet(), Pipeline()
    feed = tools.equip([LOOKUP], "You carry out one step at a time with the lookup tool.")
    expected, calls = 0, []
    while True:
        sender, message = await session.receive_from()
        if sender != planner or message.get("seq") != expected:
            raise ValueError(f"step {expected} from {planner!r} expected, got {message!r} from {sender!r}")
        expected += 1
        if message.get("done"):
            break
        feed += chat.user(f"Step: {message['step']}") + chat.cue_without_thinking()
        arguments, unfed = await call_lookup(ws, pipe, feed)
        result = await lookup(input["tool_url"], arguments)
        session.send_to(planner, {"seq": message["seq"], "step": message["step"], "call": arguments,
                                  "result": result})
        calls.append(arguments)
        feed = unfed + chat.seal() + tools.answer("lookup", result)
    pipe.close()
    return {"calls": calls, "messages": expected, "folded": ws.folded()}
