"""Beam search over forked working sets.

Each step is one pass with a lane per live beam (each feeds its newest token into its own
working set) and an epilogue that returns every lane's `width` most likely next tokens and their
log-probabilities: a loop unrolled at trace time (argmax, then mask it out and repeat), so only
2 x width x beams numbers leave the device. The host keeps the `width` best extensions. A beam
extended once continues in its own working set; one extended several times is forked
(`ws.fork(pipe)`), and the children share its frozen pages -- the prompt's included -- instead of
copying them. A beam ending in a stop token is finished; the result is the best finished or
live beam by total log-probability (the search ends once a finished beam beats every live
one). Each step streams the best beam so far.

input: {"prompt", "width", "max_tokens"}  ->  {"text", "tokens", "score", "beams", "forks"}
("beams": the best `width` hypotheses and their log-probabilities; a finished one ends with its
stop token, whose log-probability its score includes.)
"""
from itertools import accumulate

from inferlet import chat, model, session
from inferlet.eta import (ForwardPass, Pipeline, StateGeometry, WorkingSet, dtype, eq, gather, intrinsics,
                          iota, log_softmax, reduce_argmax, select)


def top(lane: int, width: int, vocab: int) -> list:
    """The lane's `width` most likely next tokens, then their log-probabilities."""
    logprobs = log_softmax(intrinsics.output(lane, "logits"))
    tokens, values = [], []
    for _ in range(width):
        best = reduce_argmax(logprobs)
        tokens.append(best)
        values.append(gather(logprobs, best))
        logprobs = select(eq(iota(vocab, dtype.i64), best), float("-inf"), logprobs)
    return tokens + values


async def main(input: dict) -> dict:
    prompt = chat.user(input.get("prompt", "Name a famous painting.")) + chat.cue_without_thinking()
    width, max_tokens = int(input.get("width", 4)), int(input.get("max_tokens", 12))
    vocab, stop = model.output_vocab_size(), set(chat.stop_tokens())
    pipe = Pipeline()

    def without_stop(tokens: list[int]) -> list[int]:
        return tokens[:-1] if tokens and tokens[-1] in stop else tokens

    live = [(0.0, [], WorkingSet(), prompt)]        # (log-prob, tokens, working set, tokens to feed)
    finished, forks = [], 0
    for _ in range(max_tokens):
        fwd = ForwardPass()
        feeds = [feed for _, _, _, feed in live]
        fwd.embed([t for feed in feeds for t in feed], [0, *accumulate(map(len, feeds))])   # a lane per beam
        fwd.state([ws for _, _, ws, _ in live], StateGeometry.folding())
        lanes = len(live)
        result = fwd.epilogue(lambda lanes=lanes: [x for lane in range(lanes) for x in top(lane, width, vocab)])
        pipe.submit(fwd)
        result = await result

        candidates = []
        for lane, (score, tokens, ws, _) in enumerate(live):
            mine = result[2 * width * lane:2 * width * (lane + 1)]
            candidates += [(score + lp, tokens + [t], lane) for t, lp in zip(mine[:width], mine[width:])]
        candidates.sort(key=lambda c: -c[0])
        extended, beams = set(), []
        for score, tokens, lane in candidates[:width]:
            if tokens[-1] in stop:
                finished.append((score, tokens))
                continue
            ws = live[lane][2]
            if lane in extended:                    # a second extension of this beam: fork it
                ws, forks = ws.fork(pipe), forks + 1
            extended.add(lane)
            beams.append((score, tokens, ws, [tokens[-1]]))
        live = beams
        best = max(finished + [(s, t) for s, t, _, _ in live])
        session.send(model.decode(without_stop(best[1])))
        if not live or best[0] > live[0][0]:         # log-probs only fall: no live beam can win
            break
    pipe.close()

    ranked = sorted(finished + [(s, t) for s, t, _, _ in live], reverse=True)
    best = without_stop(ranked[0][1])
    return {"text": model.decode(best), "tokens": best, "score": ranked[0][0],
            "beams": [{"tokens": t, "score": s} for s, t in ranked[:width]], "forks": forks}
