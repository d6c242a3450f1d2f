"""KV eviction: an attention sink and a sliding window, through explicit geometry.

The working set reserves a fixed `sink + ring` slots once and never grows. The first `sink`
tokens keep slots 0..sink-1 and are folded (the attention sink, StreamingLLM-style); every later
position p is written at ring slot sink + (p - sink) % ring, over the token `ring` positions
before it. Rows carry their true positions, so rotary embeddings see real distances, and each
row's mask attends the sink plus the last `window` positions, nothing evicted. The prompt goes in
chunks of at most `chunk` rows and ring = window + chunk, so no row of a pass overwrites a slot
another row of the same pass still reads.

What it shows: the KV pages a generation holds stay fixed however long it runs, and until the
window first slides (position sink + window) the tokens are exactly full-attention greedy
decoding's; after that the model sees only the sink and the window, which is enough for local
patterns (counting, lists) but forgets what scrolled out. Each token is streamed as it comes.

input: {"prompt", "max_tokens", "sink", "window", "chunk"}  ->  {"text", "tokens", "slots", "positions"}
"""
from inferlet import chat, model, session
from inferlet.eta import ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduce_argmax


def greedy():
    return reduce_argmax(intrinsics.output(0, "logits"))


async def main(input: dict) -> dict:
    prompt = chat.prefix() + model.encode(input.get("prompt", "1, 2, 3, 4, 5,"))
    max_tokens = int(input.get("max_tokens", 64))
    sink, window, chunk = int(input.get("sink", 4)), int(input.get("window", 32)), int(input.get("chunk", 32))
    ring = window + chunk
    stop = set(chat.stop_tokens())
    ws, pipe = WorkingSet(), Pipeline()
    ws.reserve(sink + ring)
    held: dict[int, int] = {}                       # slot -> position of the token it holds

    def slot_of(position: int) -> int:
        return position if position < sink else sink + (position - sink) % ring

    def attends(slot: int, row: int) -> bool:
        p = held.get(slot, row + 1)
        return p <= row and (p < sink or p > row - window)

    def submit(tokens: list[int], start: int):
        """Rows at positions start.. ; returns the awaitable greedy token after the last."""
        positions = list(range(start, start + len(tokens)))
        slots = [slot_of(p) for p in positions]
        held.update(zip(slots, positions))
        kv_len = min(start + len(tokens), sink + ring)
        fwd = ForwardPass()
        fwd.embed(tokens)
        fwd.state([ws], StateGeometry(positions=positions, slots=slots, kv_len=kv_len,
                                      fold=min(sink, start + len(tokens))))
        fwd.mask([[attends(s, row) for s in range(kv_len)] for row in positions])
        token = fwd.epilogue(greedy)
        pipe.submit(fwd)
        return token

    for start in range(0, len(prompt), chunk):
        token = submit(prompt[start:start + chunk], start)
    out = []
    while True:
        out.append(await token)
        if out[-1] in stop or len(out) == max_tokens:
            break
        session.send(model.decode(out[-1:]))
        token = submit(out[-1:], len(prompt) + len(out) - 1)
    pipe.close()
    if out[-1] in stop:
        out.pop()
    return {"text": model.decode(out), "tokens": out, "slots": sink + ring,
            "positions": len(prompt) + len(out)}
