"""A tool-calling agent loop: the model calls a local calculator, the inferlet runs it and answers.

The tools are declared in the model's own format (`tools.equip`). Each reply is read by
`tools.Decoder` as it is generated: Event.Call as soon as a call's text is complete, Event.Error
for call text that does not parse (or a reply cut off inside a call). With "tool_choice":
"required" (the default, for small models that would not call on their own) the first reply is
constrained to a valid call by `tools.create_matcher(specs)`: the grammar's mask reaches the
device through a channel and the epilogue applies it (`masked_argmax`); that reply ends with its
call. The inferlet computes each call, gives the result back with `tools.answer`, and lets the
model continue (unconstrained, still watched for calls) until a reply has no call, or
`max_rounds` replies were made.

Input (all optional): "question", "tool_choice" ("required" or "auto"), "max_tokens" per reply
(default 64), "max_rounds" (default 3).
Output: {"answer": the last reply's text, "calls": [{"name", "arguments", "result"}], "errors":
[{"message", "text"}] for malformed calls, "rounds", "transcript": the whole conversation's text}.
"""
import operator

from inferlet import chat, model, tools
from inferlet.eta import (Channel, ForwardPass, Pipeline, StateGeometry, WorkingSet, dtype, intrinsics,
                          masked_argmax, reduce_argmax)
from inferlet.mask import unpack_mask

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Compute a op b for two numbers.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "op", "b"],
                   "properties": {"a": {"type": "number"}, "op": {"enum": ["+", "-", "*", "/"]},
                                  "b": {"type": "number"}}}}}

OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


def calculate(name: str, arguments: dict) -> dict:
    """The local tool: {"result": a op b}, or {"error": why}."""
    if name != "calculator":
        return {"error": f"there is no tool {name!r}"}
    try:
        a, op, b = float(arguments["a"]), OPERATORS[arguments["op"]], float(arguments["b"])
        value = op(a, b)
    except (KeyError, TypeError, ValueError) as e:
        return {"error": f"bad arguments: {e}"}
    except ZeroDivisionError:
        return {"error": "division by zero"}
    return {"result": int(value) if value.is_integer() else value}


def drain(decoder, event, events: list) -> None:
    """Collect `event` and the decoder's queued events."""
    while not isinstance(event, tools.Event.Idle):
        events.append(event)
        event = decoder.feed([])


async def reply(ws, pipe, feed, max_tokens, matcher=None):
    """One assistant reply after `feed`: (its tokens, its tool events). The stop token is not fed
    back. A constrained reply ends with its first call (the grammar would admit more calls)."""
    vocab, stops = model.output_vocab_size(), set(chat.stop_tokens())
    mask_chan = Channel([vocab], dtype.bool) if matcher is not None else None
    decoder, tokens, events = tools.Decoder(), [], []
    for _ in range(max_tokens):
        fwd = ForwardPass()
        fwd.embed(feed)
        fwd.state([ws], StateGeometry.folding())
        if matcher is None:
            chosen = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
        else:
            mask_chan.put(unpack_mask(matcher.mask(), vocab))
            chosen = fwd.epilogue(lambda: masked_argmax(intrinsics.output(0, "logits"), mask_chan.take()))
        pipe.submit(fwd)
        token = await chosen
        if matcher is not None:
            matcher.accept_tokens([token])
        if token in stops:
            break
        tokens.append(token)
        feed = [token]
        drain(decoder, decoder.feed([token]), events)
        if matcher is not None and any(isinstance(e, tools.Event.Call) for e in events):
            break
    drain(decoder, decoder.finish(), events)        # a call left open becomes an error event
    return tokens, events


async def main(input: dict) -> dict:
    specs = [CALCULATOR]
    max_tokens = int(input.get("max_tokens", 64))
    required = input.get("tool_choice", "required") == "required"
    feed = (tools.equip(specs, "You are a helpful assistant. Use the calculator for arithmetic.")
            + chat.user(input.get("question", "What is 37 times 12?")) + chat.cue_without_thinking())
    ws, pipe = WorkingSet(), Pipeline()
    calls, errors, transcript = [], [], []
    for rounds in range(1, int(input.get("max_rounds", 3)) + 1):
        matcher = tools.create_matcher(specs) if required and not calls else None
        tokens, events = await reply(ws, pipe, feed, max_tokens, matcher)
        transcript += feed + tokens
        answers = []
        for event in events:
            if isinstance(event, tools.Event.Call):
                result = calculate(event.call.name, event.call.arguments)
                calls.append({"name": event.call.name, "arguments": event.call.arguments, "result": result})
                answers += tools.answer(event.call.name, result)
            elif isinstance(event, tools.Event.Error):
                errors.append({"message": event.message, "text": event.text})
        if not answers:
            break
        feed = chat.seal() + answers + chat.cue_without_thinking()
    pipe.close()
    return {"answer": model.decode(tokens), "calls": calls, "errors": errors, "rounds": rounds,
            "transcript": model.decode(transcript)}
