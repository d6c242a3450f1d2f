"""Speculative decoding with an n-gram drafter; the output is exactly greedy decoding's.

Each round guesses up to `k` next tokens by finding the latest earlier occurrence of the last
`n` tokens in the prompt and output so far, and copying what followed it (no draft model:
repetitive text drafts itself). One pass verifies the guesses: the last accepted token and the
drafts are written at explicit slots (`StateGeometry(positions=, slots=, kv_len=, fold=)`), every
row is read out, and the epilogue returns the greedy token after each row. The drafts that equal
those tokens are accepted, plus the model's token after the last of them (its correction, or a
bonus token when all drafts matched): 1 to k + 1 tokens per pass.

Rejected drafts are rolled back by never folding their slots: each pass freezes only up to its
first row (a token known to be right), so the next round writes its rows over the rejected ones,
and rows attend causally by slot, never to anything past themselves.

input: {"prompt", "max_tokens", "n", "k"}  ->  {"text", "tokens", "passes", "drafted", "accepted"}
"""
from inferlet import chat, model
from inferlet.eta import ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduce_argmax


def draft(history: list[int], n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of history's last n tokens."""
    tail = history[-n:]
    for start in range(len(history) - n - 1, -1, -1):
        if history[start:start + n] == tail:
            return history[start + n:start + n + k]
    return []


def greedy():
    return reduce_argmax(intrinsics.output(0, "logits"))


async def main(input: dict) -> dict:
    prompt = chat.prefix() + model.encode(input.get("prompt", "one, two, three, one, two, three, one,"))
    max_tokens = int(input.get("max_tokens", 32))
    n, k = int(input.get("n", 2)), int(input.get("k", 4))
    stop = set(chat.stop_tokens())
    ws, pipe = WorkingSet(), Pipeline()

    fwd = ForwardPass()
    fwd.embed(prompt)
    fwd.state([ws], StateGeometry.folding())
    first = fwd.epilogue(greedy)
    pipe.submit(fwd)
    out = [await first]
    ws.reserve(len(prompt) + max_tokens + k)        # writable slots for every round's rows
    passes, drafted, accepted = 1, 0, 0

    while len(out) < max_tokens and out[-1] not in stop:
        slot = len(prompt) + len(out) - 1           # where the last accepted token goes
        guesses = draft(prompt + out, n, k)
        rows = [out[-1]] + guesses
        slots = list(range(slot, slot + len(rows)))
        fwd = ForwardPass()
        fwd.embed(rows)
        fwd.state([ws], StateGeometry(positions=slots, slots=slots, kv_len=slot + len(rows), fold=slot + 1))
        fwd.readout(range(len(rows)))
        verdict = fwd.epilogue(greedy)
        pipe.submit(fwd)
        verdict = await verdict
        verdict = verdict if isinstance(verdict, list) else [verdict]
        good = 0
        while good < len(guesses) and guesses[good] == verdict[good]:
            good += 1
        out += verdict[:good + 1]                   # the accepted drafts and the model's next token
        passes, drafted, accepted = passes + 1, drafted + len(guesses), accepted + good

    out = out[:max_tokens]
    out = out[:next((i for i, t in enumerate(out) if t in stop), len(out))]
    pipe.close()
    return {"text": model.decode(out), "tokens": out, "passes": passes, "drafted": drafted,
            "accepted": accepted}
