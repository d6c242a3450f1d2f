"""JSON-schema-constrained generation, with the grammar mask applied on the device.

Each step the host-side matcher says which tokens may come next (`matcher.mask()`, packed bits);
the inferlet unpacks it into a channel of one bool per vocabulary entry, and the pass's epilogue
takes it from the channel and picks the best allowed token (`masked_argmax`) next to the logits,
which never leave the engine. The matcher then accepts the chosen token. Generation ends when the
schema's JSON is complete (the matcher then admits only a stop token) or after `max_tokens`.

Input (all optional): "schema" (a JSON schema, default: a small person record), "prompt" (the
request; default asks for the JSON), "system", "max_tokens" (default 128).
Output: {"text", "value" (the parsed JSON, or null if it did not complete), "complete", "tokens"},
or {"error"} saying why the schema is invalid.
"""
import json

from inferlet import HostError, chat, model
from inferlet.eta import (Channel, ForwardPass, Pipeline, StateGeometry, WorkingSet, dtype, intrinsics,
                          masked_argmax)
from inferlet.grammar import Grammar, Matcher
from inferlet.mask import unpack_mask

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 20}}}


async def main(input: dict) -> dict:
    schema = input.get("schema", PERSON)
    max_tokens = int(input.get("max_tokens", 128))
    request = input.get("prompt", "Describe a fictional person.")
    prompt = (chat.system(input.get("system", "You reply with JSON only."))
              + chat.user(f"{request}\nReply with JSON matching this schema: {json.dumps(schema)}")
              + chat.cue_without_thinking())

    try:
        matcher = Matcher(Grammar.from_json_schema(schema))
    except HostError as e:                                    # an invalid schema: say why
        return {"error": str(e)}
    vocab = model.output_vocab_size()
    stops = set(chat.stop_tokens())
    mask_chan = Channel([vocab], dtype.bool)                  # host -> device, one mask per pass
    ws, pipe = WorkingSet(), Pipeline()

    tokens, feed = [], prompt
    for _ in range(max_tokens):
        mask_chan.put(unpack_mask(matcher.mask(), vocab))
        fwd = ForwardPass()
        fwd.embed(feed)
        fwd.state([ws], StateGeometry.folding())
        chosen = fwd.epilogue(lambda: masked_argmax(intrinsics.output(0, "logits"), mask_chan.take()))
        pipe.submit(fwd)
        token = await chosen
        if not matcher.accept_tokens([token]):
            raise RuntimeError(f"the device chose token {token}, which the grammar does not allow")
        if token in stops:
            break
        tokens.append(token)
        feed = [token]
        if matcher.is_terminated():
            break
    pipe.close()

    text = model.decode(tokens)
    complete = matcher.is_terminated()
    return {"text": text, "value": json.loads(text) if complete else None, "complete": complete,
            "tokens": len(tokens)}
