"""Planner / executor: the planner writes the steps of a task as a JSON list (constrained by a
JSON schema, so it always parses), an executor process runs each step as a tool call against a
tool reached over HTTP, and the planner answers from the results.

This module is the planner. It spawns executor.py of this bundle (its own process; "executor_node"
places it), sends it the steps one message each, numbered, then a closing message, and takes
the executor's results back by `session.receive_from`, checking their numbers. The executor calls
the tool at `tool_url` with `http.fetch`; the run's allow-list (`[limits] allow_hosts`, `pie run
--allow-host`) must name its host. Finally the planner's own working set, which still holds the
task and the plan, gets the results and writes a short answer.

Input: "tool_url" (required), "task", "steps" (2), "max_tokens" of the answer (24), "executor_node".
Output: {"plan": [step texts], "results": [{"seq", "step", "call", "result"}], "answer",
"executor": what the executor returned}.
"""
import json

from inferlet import chat, grammar, model, runtime, session
from inferlet.eta import Pipeline, WorkingSet

from toolcall import reply

TASK = "Compare the populations of Paris and Rome."


def plan_schema(steps: int) -> dict:
    return {"type": "array", "minItems": steps, "maxItems": steps,
            "items": {"type": "string", "minLength": 4, "maxLength": 20}}


async def main(input: dict) -> dict:
    task, steps, max_tokens = input.get("task", TASK), int(input.get("steps", 2)), int(input.get("max_tokens", 24))
    me = runtime.name()
    executor = await runtime.spawn("executor", {"planner": me, "tool_url": input["tool_url"]},
                                   name=f"{me}/executor", node=input.get("executor_node"))
    ws, pipe = WorkingSet(), Pipeline()
    feed = (chat.system("You plan tasks as a JSON list of short steps, one city lookup per step.")
            + chat.user(task) + chat.cue_without_thinking())
    matcher = grammar.Matcher(grammar.Grammar.from_json_schema(plan_schema(steps)))
    budget = 16 * steps + 4                  # a step is at most 20 characters
    planned, unfed = await reply(ws, pipe, feed, budget, matcher)
    if not matcher.is_terminated():
        raise ValueError(f"the plan did not finish in {budget} tokens: {model.decode(planned)!r}")
    plan = json.loads(model.decode(planned))

    for seq, step in enumerate(plan):
        session.send_to(executor.name, {"seq": seq, "step": step})
    session.send_to(executor.name, {"seq": len(plan), "done": True})
    results = []
    while len(results) < len(plan):
        sender, message = await session.receive_from()
        if sender != executor.name or message.get("seq") != len(results):
            raise ValueError(f"result {len(results)} expected from {executor.name!r}, got {message!r}")
        results.append(message)
        session.send({"seq": message["seq"], "step": message["step"], "result": message["result"]})

    facts = "; ".join(json.dumps(r["result"]) for r in results)
    answer, _ = await reply(ws, pipe, unfed + chat.seal() + chat.user(f"Results: {facts}. Answer the task briefly.")
                         + chat.cue_without_thinking(), max_tokens)
    pipe.close()
    return {"plan": plan, "results": results, "answer": model.decode(answer).strip(),
            "executor": await executor.result()}
