"""Conversations that stay alive against stateless ones: K conversations of T turns against `pie serve`,
each through three paths, with the time to first token of every turn and the prompt tokens it computed.

    python bench/sessions.py [--conversations 5] [--turns 5] [--tokens 32] [--dtype float32]
                             [--compile off] [--threads N] [--quick] [--out bench/RESULTS.md]

  stateless  chat.completions (streamed) that resend the whole transcript each turn; the prefix
             cache is on, so a turn finds the pages of the turns before it (whole pages only) and
             computes the rest
  responses  the Responses API (streamed), each turn chained to the last by previous_response_id:
             the endpoint reopens the previous response's saved working set and computes only the
             turn's new tokens
  session    one inferlet per conversation over pie-client's WebSocket (pie_actors.client.Client),
             looping on session.receive(): its working set never leaves, a turn feeds only its new
             tokens and streams each token's text

The K conversations of a path run interleaved: turn t of all K is sent at once, then turn t + 1. The
paths run one after the other on the same server, stateless first (so that no path finds another's
pages in the prefix cache where it matters: the other paths' first turns, which the target leaves out).
The clients run in a process of their own. Per turn: TTFT (from sending the turn to its first text)
median over the K conversations, and the prompt tokens the engine computed for it, summed over them
(stateless and responses: usage's input tokens less its cached tokens; session: the tokens the
inferlet fed less those its working set found in the prefix cache). Each path's line of the second table gives its median TTFT from turn 2 on, over every
such turn, and the engine's own count of the rows it ran meanwhile (prompts and decode steps;
`tokens_computed`). Greedy decoding: the three paths' replies are compared, turn by turn.

Target: from turn 2 on, the median TTFT of a live path (responses, session) at most 0.5x stateless's.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from report import add_output_options, publish

MODEL = "smollm2-135m-instruct"
PATHS = ("stateless", "responses", "session")
INSTRUCTIONS = "You are a concise assistant."
TOPICS = ["France", "Japan", "Brazil", "Egypt", "Canada", "Norway", "India", "Peru"]
QUESTIONS = ["Tell me about {topic} in two sentences.", "What is its capital city?", "Name a famous dish from there.",
             "Which languages do people speak there?", "Thank you! Give me one more fun fact."]

# The session path's program: one conversation, kept alive between turns; each turn feeds what the
# working set lacks (the end of the last reply, the user turn, the cue), streams each token's text,
# then sends {"computed": the fed tokens not found in the prefix cache, "reply": text}.
SESSION = """
from inferlet import chat, model, session
from inferlet.eta import ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduce_argmax


async def main(input):
    stops, ws, pipe = set(chat.stop_tokens()), WorkingSet(), Pipeline()
    pending = chat.system(input["system"])
    while True:
        text = await session.receive()
        if not text:
            break
        feed = pending + chat.user(text) + chat.cue_without_thinking()
        fed, cached, reply, sent = len(feed), ws.cached_tokens(), [], ""
        for _ in range(input["max_tokens"]):
            fwd = ForwardPass()
            fwd.embed(feed)
            fwd.state([ws], StateGeometry.folding())
            chosen = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
            pipe.submit(fwd)
            token = await chosen
            if token in stops:
                feed = []
                break
            reply.append(token)
            shown = model.decode(reply)
            if not shown.endswith("\\ufffd"):
                session.send({"text": shown[len(sent):]})
                sent = shown
            feed = [token]
        pending = feed + chat.seal()
        session.send({"computed": fed - (ws.cached_tokens() - cached), "reply": model.decode(reply)})
    pipe.close()
    return {}
"""


@dataclass(frozen=True)
class Turn:
    ttft: float        # seconds from sending the turn to its first text
    computed: int      # prompt tokens the engine computed for it
    reply: str


def conversation(k: int, turns: int) -> list[str]:
    return [q.format(topic=TOPICS[k % len(TOPICS)]) for q in QUESTIONS[:turns]]


# ---- the paths (in the clients' process) -------------------------------------------------------------

async def _stateless(client, questions: list[str], max_tokens: int, turn: int, state: dict) -> Turn:
    messages = state.setdefault("messages", [{"role": "system", "content": INSTRUCTIONS}])
    messages.append({"role": "user", "content": questions[turn]})
    t0, first, parts, usage = time.perf_counter(), None, [], None
    stream = await client.chat.completions.create(model="default", messages=messages, max_tokens=max_tokens,
                                                  temperature=0, stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            parts.append(chunk.choices[0].delta.content)
    reply = "".join(parts)
    messages.append({"role": "assistant", "content": reply})
    return Turn(first - t0, usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens, reply)


async def _responses(client, questions: list[str], max_tokens: int, turn: int, state: dict) -> Turn:
    t0, first, final = time.perf_counter(), None, None
    stream = await client.responses.create(model="default", input=questions[turn], instructions=INSTRUCTIONS,
                                           max_output_tokens=max_tokens, temperature=0, stream=True,
                                           previous_response_id=state.get("previous"))
    async for event in stream:
        if event.type == "response.output_text.delta" and first is None:
            first = time.perf_counter()
        elif event.type in ("response.completed", "response.incomplete"):
            final = event.response
    state["previous"] = final.id
    usage = final.usage
    return Turn(first - t0, usage.input_tokens - usage.input_tokens_details.cached_tokens, final.output_text)


def _session_turn(process, text: str) -> Turn:
    import json

    from pie_actors import Send

    t0, first = time.perf_counter(), None
    process.send(text)
    for event in process.events(timeout=600):
        assert isinstance(event, Send), event
        message = json.loads(event.text)
        if "text" in message:
            first = first or time.perf_counter()
        else:
            return Turn(first - t0, message["computed"], message["reply"])
    raise RuntimeError("the session ended")


async def _session(client, questions: list[str], max_tokens: int, turn: int, state: dict) -> Turn:
    if "process" not in state:
        state["process"] = client.submit(SESSION, {"system": INSTRUCTIONS, "max_tokens": max_tokens}, timeout=3600)
    return await asyncio.to_thread(_session_turn, state["process"], questions[turn])


async def _drive(path: str, url: str, conversations: list[list[str]], max_tokens: int) -> list[list[Turn]]:
    """Every conversation through `path`, turn t of all of them at once: turns[t][k]."""
    if path == "session":
        from pie_actors.client import Client
        client = Client(url)
    else:
        import openai
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    step = {"stateless": _stateless, "responses": _responses, "session": _session}[path]
    states = [{} for _ in conversations]
    turns = []
    try:
        for t in range(len(conversations[0])):
            turns.append(await asyncio.gather(*(step(client, questions, max_tokens, t, state)
                                                for questions, state in zip(conversations, states))))
    finally:
        for state in states:
            if "process" in state:
                state["process"].send("")
                state["process"].result(60)
        await client.close() if path != "session" else client.close()
    return turns


def drive(path: str, url: str, conversations: list[list[str]], max_tokens: int) -> list[list[Turn]]:
    return asyncio.run(_drive(path, url, conversations, max_tokens))


# ---- the report ----------------------------------------------------------------------------------

def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}"


def turns_table(results: dict[str, list[list[Turn]]]) -> str:
    paths = list(results)
    head = ["turn", *(f"{p} TTFT ms" for p in paths), *(f"{p} prompt tokens computed" for p in paths)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in range(len(results[paths[0]])):
        ttft = [_ms(statistics.median(turn.ttft for turn in results[p][t])) for p in paths]
        computed = [str(sum(turn.computed for turn in results[p][t])) for p in paths]
        lines.append(f"| {t + 1} | " + " | ".join(ttft + computed) + " |")
    return "\n".join(lines)


def summary_table(results: dict[str, list[list[Turn]]], rows: dict[str, int]) -> str:
    later = {p: statistics.median(turn.ttft for t in turns[1:] for turn in t) for p, turns in results.items()}
    base = later["stateless"]
    lines = ["| path | median TTFT ms, turns 2+ | vs stateless | target (<= 0.5x) | prompt tokens computed, "
             "turns 2+ | engine rows (prompts and decode) |", "|---|---|---|---|---|---|"]
    for path, turns in results.items():
        computed = sum(turn.computed for t in turns[1:] for turn in t)
        ratio = later[path] / base
        verdict = "" if path == "stateless" else ("met" if ratio <= 0.5 else "not met")
        lines.append(f"| {path} | {_ms(later[path])} | {ratio:.2f}x | {verdict} | {computed} | {rows[path]} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=5, help="K: conversations a path, interleaved")
    ap.add_argument("--turns", type=int, default=5, choices=range(2, len(QUESTIONS) + 1), metavar="T",
                    help=f"T: turns a conversation (2-{len(QUESTIONS)})")
    ap.add_argument("--tokens", type=int, default=32, help="the most tokens of a reply")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--compile", default="off", choices=("auto", "on", "off"),
                    help="the engine's compiled decode (default off: TTFT is the prompt's pass, which is eager "
                         "either way, and an eager engine starts in seconds)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the engine's CPU threads")
    ap.add_argument("--quick", action="store_true", help="3 conversations of 3 turns, 16 tokens a reply")
    add_output_options(ap, "Live sessions against stateless turns")
    args = ap.parse_args()
    if args.quick:
        args.conversations, args.turns, args.tokens = 3, 3, 16

    from pie_actors.serve import Server

    conversations = [conversation(k, args.turns) for k in range(args.conversations)]
    results: dict[str, list[list[Turn]]] = {}
    rows: dict[str, int] = {}
    clients = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    with Server(MODEL, port=0, dtype=args.dtype, compile=args.compile, num_threads=args.threads) as server:
        clients.submit(drive, "stateless", server.url, [conversation(len(TOPICS) - 1, 2)], 4).result()   # warm-up
        load_before = os.getloadavg()[0]
        for path in PATHS:
            before = server.runtime.stats()["tokens_computed"]
            results[path] = clients.submit(drive, path, server.url, conversations, args.tokens).result()
            rows[path] = server.runtime.stats()["tokens_computed"] - before
            print(f"{path}: done", file=sys.stderr, flush=True)
        for saved in server.runtime.saved(None):           # the responses' working sets
            server.runtime.delete_saved(saved["name"])
        dtype = str(server.runtime.engine.worker.dtype).removeprefix("torch.")
    clients.shutdown()

    replies = {p: [turn.reply for t in turns for turn in t] for p, turns in results.items()}
    same = {p: sum(a == b for a, b in zip(replies["stateless"], replies[p])) for p in PATHS[1:]}
    total = args.conversations * args.turns
    env = (f"SmolLM2-135M-Instruct, {dtype}, {'compiled' if args.compile != 'off' else 'eager'} engine, "
           f"{args.threads} thread{'s' if args.threads > 1 else ''}; {args.conversations} conversations x "
           f"{args.turns} turns a path, interleaved; at most {args.tokens} tokens a reply, greedy; replies equal "
           f"to stateless's: {', '.join(f'{p} {n}/{total}' for p, n in same.items())}; 1-min load average "
           f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    publish(env, f"{turns_table(results)}\n\n{summary_table(results, rows)}\n", args.out, args.title)


if __name__ == "__main__":
    main()
