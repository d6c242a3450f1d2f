"""Greedy replies into a working set that lives on, optionally under a grammar, and constrained
calls of the lookup tool over HTTP (what the planner, the executor and the ReAct example share)."""
from urllib.parse import quote

from inferlet import chat, http, model, tools
from inferlet.eta import (Channel, ForwardPass, StateGeometry, dtype, intrinsics, masked_argmax,
                          reduce_argmax)
from inferlet.mask import unpack_mask

LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look up facts about a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "minLength": 2, "maxLength": 12}}}}}
CALL_TOKENS = 48       # a call's text is bounded by the schema: the tool's name and a short city


async def reply(ws, pipe, feed: list[int], max_tokens: int, matcher=None, done=None):
    """(the reply's tokens after `feed`, the tokens not yet fed: the last one unless a stop token
    ended the reply; the next turn's feed starts with them). Under `matcher` only tokens it
    allows are chosen (its mask reaches the epilogue through a channel). Ends at a stop token
    (left out), once the matcher is complete, or when `done(token)` is true for the last token."""
    vocab, stops = model.output_vocab_size(), set(chat.stop_tokens())
    masks = Channel([vocab], dtype.bool) if matcher is not None else None
    tokens = []
    for _ in range(max_tokens):
        fwd = ForwardPass()
        fwd.embed(feed)
        fwd.state([ws], StateGeometry.folding())
        if matcher is None:
            chosen = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
        else:
            masks.put(unpack_mask(matcher.mask(), vocab))
            chosen = fwd.epilogue(lambda: masked_argmax(intrinsics.output(0, "logits"), masks.take()))
        pipe.submit(fwd)
        token = await chosen
        if token in stops:
            return tokens, []
        tokens.append(token)
        feed = [token]
        if matcher is not None:
            matcher.accept_tokens([token])
        if (matcher is not None and matcher.is_terminated()) or (done is not None and done(token)):
            break
    return tokens, feed


async def call_lookup(ws, pipe, feed: list[int]):
    """(the call's arguments, the tokens not yet fed) of a reply that can only be a valid call of
    the lookup tool; it ends as soon as the call is complete."""
    decoder, found = tools.Decoder(), []

    def called(token: int) -> bool:
        event = decoder.feed([token])
        if isinstance(event, tools.Event.Call):
            found.append(event.call)
        return bool(found)

    _, unfed = await reply(ws, pipe, feed, CALL_TOKENS, tools.create_matcher([LOOKUP]), called)
    if not found:
        raise ValueError(f"the reply made no complete call in {CALL_TOKENS} tokens")
    return found[0].arguments, unfed


async def lookup(url: str, arguments: dict, delay_ms: int = 0):
    """The lookup tool's result (JSON) from the tool service at `url`; it answers after `delay_ms`."""
    response = await http.fetch(f"{url}/lookup?city={quote(str(arguments['city']))}&delay_ms={delay_ms}",
                                timeout=10 + delay_ms / 1000)
    if not response.ok:
        raise ValueError(f"the lookup tool answered {response.status}: {response.text[:200]}")
    return response.json()
