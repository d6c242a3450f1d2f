"""A reasoning-aware chat turn: the reply's thinking block is kept apart from its answer.

`chat.cue_thinking(True)` starts the reply the way the model's template lets it think (templates
like Qwen3's 2507 thinking models pre-fill `<think>`), and `reasoning.Decoder.for_cue(cue)` reads
the generated tokens: Event.Start when thinking begins, Event.Delta for more of it (streamed to
the client as {"thinking": text}), Event.End with all of it. The rest of the reply is the answer.
Thinking is capped by a budget: past `think_budget` tokens (or where the model would end its reply
inside the block) the inferlet writes the closing `</think>` itself and the model goes on to the
answer. On a model without thinking (no `<think>` in its template, as SmolLM2) the decoder stays
idle and the whole reply is the answer.

Input (all optional): "question", "system", "think_budget" in reply tokens (default 48),
"max_tokens" for the answer (default 64).
Output: {"thinking": text or null, "answer", "forced_close": whether the budget closed the
block, "events": the kinds of the decoder's events in order, consecutive repeats dropped}.
"""
from inferlet import chat, model, reasoning, session
from inferlet.eta import ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduce_argmax

CLOSE = "</think>"


async def main(input: dict) -> dict:
    think_budget = int(input.get("think_budget", 48))
    max_tokens = int(input.get("max_tokens", 64))
    cue = chat.cue_thinking(True)
    prompt = (chat.system(input.get("system", "You are a helpful assistant."))
              + chat.user(input.get("question", "Is 91 a prime number?")) + cue)
    decoder = reasoning.Decoder.for_cue(cue)
    stops = set(chat.stop_tokens())
    ws, pipe = WorkingSet(), Pipeline()

    reply, feed, kinds = [], prompt, []
    thinking, started, forced, answer_tokens = None, False, False, 0
    for _ in range(think_budget + max_tokens + 1):
        if answer_tokens >= max_tokens:
            break
        fwd = ForwardPass()
        fwd.embed(feed)
        fwd.state([ws], StateGeometry.folding())
        chosen = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
        pipe.submit(fwd)
        token = await chosen
        thinking_open = started and thinking is None
        if token in stops and not thinking_open:
            break
        feed = [token]
        if thinking_open and (token in stops or len(reply) >= think_budget):
            # out of budget, or the model would end its reply inside the block: close it here
            feed, forced = model.encode(f"\n{CLOSE}\n\n"), True
        reply += feed
        event = decoder.feed(feed)
        while not isinstance(event, reasoning.Event.Idle):
            if not kinds or kinds[-1] != type(event).__name__:
                kinds.append(type(event).__name__)
            if isinstance(event, reasoning.Event.Start):
                started = True
            elif isinstance(event, reasoning.Event.Delta):
                session.send({"thinking": event.text})
            elif isinstance(event, reasoning.Event.End):
                thinking = event.text
            event = decoder.feed([])
        if thinking is not None or not started:
            answer_tokens += 1
    pipe.close()

    text = model.decode(reply)
    answer = text[text.find(CLOSE) + len(CLOSE):] if thinking is not None else text
    return {"thinking": None if thinking is None else thinking.strip(), "answer": answer.strip(),
            "forced_close": forced, "events": kinds}
