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

    python bench/sessions.py --idle N[,N...] [--per-actor 64,1] [--burst 256] [--model dummy] [--out ...]

`--idle`: what a live idle session costs on a cluster. For each N and each `[cluster]
inferlets_per_actor` P of `--per-actor` (P = 1 at `--small-n` sessions only: an actor process each),
a fresh `pie serve` on a Ray cluster of its own (the dummy model by default: the engine's cost is
negligible, the hosting's shows). One fresh session per topic first answers four turns alone (the
reference: greedy, so equal inputs give equal replies). Then N sessions of the session program above,
each on a WebSocket connection of its own from one asyncio client process, are launched `--burst`
at a time and answer their first turn; after park_after_s + 1 s idle, the host memory is taken
again: PSS (/proc/PID/smaps_rollup) summed over this process and every process of its Ray cluster,
the client's left out, against the same sum before the connections opened; the engine's KV pool is
allocated at its start (in the sum before), and the KV pages the sessions hold are taken off the
difference. Then all N answer turn 2 at once (idle past park_after_s: parked), each reply checked
against the reference, and a sample of them, one at a time, turn 3 (parked again) and at once turn 4
(live): TTFT = from sending the turn to the first message of its reply.

Targets: <= 10 MB of host memory per idle session (KV aside); 1,000 sessions, each answering its
next turn correctly; a burst of 256 launches done in <= 5 s.

    python bench/sessions.py --kv-pressure 3 [--conversations 12] [--turns 6] [--tokens 24] [--active 2]
                             [--park-after 0] [--spill-mb MB] [--out ...]

`--kv-pressure X`: live sessions whose working sets outgrow the KV pool, on pie serve on a Ray cluster
of its own. K conversations of T turns, user turns alternating with tool results (a short JSON
value), through the stateless and session paths; the turns of a round go `--active` at a time, in
order (the sets that work at once must fit in the pool: a pass finds no room otherwise). First the
session path on a pool that holds everything: the reference replies, and the size of each working
set at its final turn. Then a fresh server whose pool (`num_pages`) holds 1/X of those sets'
pages together, stateless first, then session: a session parks once it waits (`--park-after`,
[limits] park_after_s), so the turns of the others evict its set (to host memory within [engine]
spill_memory_mb, else as its tokens) and its next turn brings it back; the stateless path finds in
the prefix cache only the pages the other conversations did not push out. Per path: the turn
table and summary above, the engine's parked evictions and restores by kind, the prompt tokens sent
and found in the prefix cache, and its replies against the reference's.

Target: from turn 2 on, stateless's median TTFT >= 2x the session path's.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from report import add_output_options, publish

MODEL = "smollm2-135m-instruct"
PATHS = ("stateless", "responses", "session")
INSTRUCTIONS = "You are a concise assistant."
TOPICS = ["France", "Japan", "Brazil", "Egypt", "Canada", "Norway", "India", "Peru",
          "Italy", "Kenya", "Mexico", "Vietnam", "Chile", "Greece", "Morocco", "Iceland"]
QUESTIONS = ["Tell me about {topic} in two sentences.", "What is its capital city?", "Name a famous dish from there.",
             "Which languages do people speak there?", "Thank you! Give me one more fun fact."]
# --kv-pressure's tool turns: (tool, result), the result of a call the conversation's client made
TOOL_RESULTS = [("weather", {"temperature_c": 21, "sky": "clear"}), ("clock", {"local_time": "14:05"}),
                ("currency", {"per_euro": 1.7}), ("news", {"headline": "A new museum opens downtown"}),
                ("flights", {"cheapest_eur": 420, "stops": 1})]

# A turn's message: text (a user turn), or {"tool": name, "result": text} (a tool's result)
Message = str | dict[str, str]

# The session path's program: one conversation, kept alive between turns; each turn feeds what the
# working set lacks (the end of the last reply, the user turn or tool result, the cue), streams each
# token's text, then sends {"fed": its prompt tokens, "computed": those not found in the prefix cache,
# "held": the working set's tokens, "reply": text}.
SESSION = """
from inferlet import chat, model, session, tools
from inferlet.eta import ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduce_argmax


async def main(input):
    stops, ws, pipe = set(chat.stop_tokens()), WorkingSet(), Pipeline()
    pending = chat.system(input["system"])
    while True:
        text = await session.receive()
        if not text:
            break
        turn = chat.user(text) if isinstance(text, str) else tools.answer(text["tool"], text["result"])
        feed = pending + turn + chat.cue_without_thinking()
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
        session.send({"fed": fed, "computed": fed - (ws.cached_tokens() - cached), "held": ws.folded(),
                      "reply": model.decode(reply)})
    pipe.close()
    return {}
"""


@dataclass(frozen=True)
class Turn:
    ttft: float        # seconds from sending the turn to its first text
    computed: int      # prompt tokens the engine computed for it
    reply: str
    sent: int          # prompt tokens sent (stateless: the whole transcript; live paths: the new ones)
    held: int = 0      # session: its working set's tokens after the turn


def conversation(k: int, turns: int) -> list[str]:
    return [q.format(topic=TOPICS[k % len(TOPICS)]) for q in QUESTIONS[:turns]]


def tool_conversation(k: int, turns: int) -> list[Message]:
    """User turns of `conversation` alternating with tool results: user, tool, user, tool..."""
    questions = conversation(k, (turns + 1) // 2)
    results = [{"tool": tool, "result": json.dumps({"place": TOPICS[k % len(TOPICS)], **result})}
               for tool, result in TOOL_RESULTS]
    return [questions[t // 2] if t % 2 == 0 else results[t // 2] for t in range(turns)]


# ---- the paths (in the clients' process) -------------------------------------------------------------

async def _stateless(client, questions: list[Message], max_tokens: int, turn: int, state: dict) -> Turn:
    messages = state.setdefault("messages", [{"role": "system", "content": INSTRUCTIONS}])
    message = questions[turn]
    if isinstance(message, str):
        messages.append({"role": "user", "content": message})
    else:   # the endpoint names the tool by "name" (the reply before it called none: no call id to match)
        messages.append({"role": "tool", "name": message["tool"], "tool_call_id": f"call_{turn}",
                         "content": message["result"]})
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
    return Turn(first - t0, usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens, reply,
                usage.prompt_tokens)


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
    return Turn(first - t0, usage.input_tokens - usage.input_tokens_details.cached_tokens, final.output_text,
                usage.input_tokens)


def _session_turn(process, message: Message) -> Turn:
    from pie_actors import Send

    t0, first = time.perf_counter(), None
    process.send(message)
    for event in process.events(timeout=600):
        assert isinstance(event, Send), event
        frame = json.loads(event.text)
        if "text" in frame:
            first = first or time.perf_counter()
        else:
            return Turn(first - t0, frame["computed"], frame["reply"], frame["fed"], frame["held"])
    raise RuntimeError("the session ended")


async def _session(client, questions: list[Message], max_tokens: int, turn: int, state: dict) -> Turn:
    if "process" not in state:
        state["process"] = client.submit(SESSION, {"system": INSTRUCTIONS, "max_tokens": max_tokens}, timeout=3600)
    return await asyncio.to_thread(_session_turn, state["process"], questions[turn])


async def _drive(path: str, url: str, conversations: list[list[Message]], max_tokens: int,
                 active: int | None) -> list[list[Turn]]:
    """Every conversation through `path`, turn t of all of them at once (at most `active` at a time,
    in order, when given): turns[t][k]."""
    if path == "session":
        from pie_actors.client import Client
        client = Client(url)
    else:
        import openai
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    step = {"stateless": _stateless, "responses": _responses, "session": _session}[path]
    states = [{} for _ in conversations]
    turns = []
    gate = asyncio.Semaphore(active or len(conversations))     # FIFO: the conversations take turns in order

    async def gated(questions: list[Message], t: int, state: dict) -> Turn:
        async with gate:
            return await step(client, questions, max_tokens, t, state)

    try:
        for t in range(len(conversations[0])):
            turns.append(await asyncio.gather(*(gated(questions, t, state)
                                                for questions, state in zip(conversations, states))))
    finally:
        for state in states:
            if "process" in state:
                state["process"].send("")
                state["process"].result(60)
        await client.close() if path != "session" else client.close()
    return turns


def drive(path: str, url: str, conversations: list[list[Message]], max_tokens: int,
          active: int | None = None) -> list[list[Turn]]:
    return asyncio.run(_drive(path, url, conversations, max_tokens, active))


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


# ---- pie serve on a cluster ------------------------------------------------------------------------

@contextlib.contextmanager
def cluster_server(model: str, **settings: Any) -> Iterator[Any]:
    """pie serve on a Ray cluster of its own, as `pie serve` runs without --local: never one that
    runs on this machine already, whose other work would show in the figures. It ends with it."""
    import ray

    from pie_actors.runtime import start_ray
    from pie_actors.serve import Server

    start_ray("local")     # a cluster of its own, as `pie serve` starts it (its workers at nice 0)
    try:
        with Server(model, local=False, port=0, **settings) as server:
            yield server
    finally:
        ray.shutdown()


# ---- idle sessions on a cluster (--idle) ---------------------------------------------------------------

IDLE_TURNS = 4          # turn 1 before the memory is taken, 2 all at once, 3 parked and 4 live in the sample
STUCK_S = 120.0         # a launch or turn unanswered this long counts as failed (and its session drops out)


@dataclass
class _Conn:
    """One client's WebSocket and the one session it launched: answers to its requests (one at a
    time) and the session's events, each in a queue of its own."""
    ws: Any
    replies: asyncio.Queue
    events: asyncio.Queue
    process: str | None = ""     # None: the session failed or stopped answering
    reader: Any = None           # the task that reads the socket (held: a task nobody holds may be collected)


async def _open(url: str) -> _Conn:
    from websockets.asyncio.client import connect

    from pie_actors.client import ws_url
    from pie_actors.ws_protocol import decode

    conn = _Conn(await connect(ws_url(url), max_size=None, open_timeout=300, ping_interval=None),
                 asyncio.Queue(), asyncio.Queue())

    async def read() -> None:
        async for data in conn.ws:
            frame = decode(data)
            (conn.replies if "id" in frame else conn.events).put_nowait(frame)

    conn.reader = asyncio.create_task(read())
    return conn


async def _request(conn: _Conn, frame: dict[str, Any]) -> dict[str, Any]:
    from pie_actors.ws_protocol import RequestError, encode

    await conn.ws.send(encode({**frame, "id": 0}, True))
    reply = await asyncio.wait_for(conn.replies.get(), 600)
    if reply["type"] == "error":
        raise RequestError(reply["code"], reply["message"])
    return reply


async def _launch(conn: _Conn, program: str, max_tokens: int) -> None:
    reply = await _request(conn, {"type": "launch", "hash": program, "timeout": 3600,
                                  "input": {"system": INSTRUCTIONS, "max_tokens": max_tokens}})
    conn.process = reply["process"]


async def _idle_turn(conn: _Conn, text: str) -> tuple[float, str]:
    """(seconds to the reply's first message, the reply) of one turn."""
    t0, first = time.perf_counter(), None
    await _request(conn, {"type": "send", "process": conn.process, "message": text})
    while True:
        frame = await asyncio.wait_for(conn.events.get(), 600)
        first = first or time.perf_counter()
        if frame["type"] != "text":
            raise RuntimeError(f"session {conn.process} ended: {frame}")
        message = json.loads(frame["text"])
        if "reply" in message:
            return first - t0, message["reply"]


async def _end(conn: _Conn) -> None:
    await _request(conn, {"type": "send", "process": conn.process, "message": ""})
    while (await asyncio.wait_for(conn.events.get(), 600))["type"] == "text":
        pass
    await conn.ws.close()


def _question(session: int, turn: int) -> str:
    return conversation(session % len(TOPICS), turn + 1)[turn]


class _IdleClients:
    """The client side (in a process of its own, so that its memory stays out of the server's): N
    sessions, each on its own connection, driven by one asyncio loop."""

    def __init__(self, url: str, max_tokens: int) -> None:
        from pie_actors.program import Program
        from pie_actors.ws_protocol import program_hash

        self.url, self.max_tokens, self.sessions = url, max_tokens, []
        self.program = Program.load(SESSION)
        self.hash = program_hash(self.program)

    async def reference(self) -> list[list[str]]:
        """Every topic's IDLE_TURNS replies, each conversation alone in a fresh session, one after another."""
        from pie_actors.ws_protocol import program_payload

        replies = []
        for k in range(len(TOPICS)):
            conn = await _open(self.url)
            if k == 0:                            # the server keeps it by hash for every later launch
                await _request(conn, {"type": "upload", "program": program_payload(self.program)})
            await _launch(conn, self.hash, self.max_tokens)
            replies.append([(await _idle_turn(conn, _question(k, t)))[1] for t in range(IDLE_TURNS)])
            await _end(conn)
        return replies

    async def launch(self, n: int, burst: int) -> list[float]:
        """Open n connections, then launch a session on each, `burst` at once: each wave's seconds
        (a session whose launch failed or went unanswered for STUCK_S is left out of every turn)."""
        conns: list[_Conn] = []
        while len(conns) < n:                     # 100 handshakes at a time: the listen backlog is finite
            conns += await asyncio.gather(*(_open(self.url) for _ in range(min(100, n - len(conns)))))
        waves = []
        for start in range(0, n, burst):
            t0 = time.perf_counter()
            await asyncio.gather(*(self._bounded(c, _launch(c, self.hash, self.max_tokens))
                                   for c in conns[start:start + burst]))
            waves.append(time.perf_counter() - t0)
        self.sessions = conns
        return waves

    async def _bounded(self, conn: _Conn, step: Any) -> Any:
        """`step`'s result, or None once its session failed or went STUCK_S without an answer."""
        if conn.process is None:
            step.close()
            return None
        try:
            return await asyncio.wait_for(step, STUCK_S)
        except Exception as e:
            print(f"session {conn.process or '(launching)'}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            conn.process = None
            return None

    async def turn(self, turn: int, which: list[int] | None = None) -> list[tuple[float, str] | None]:
        """Turn `turn` of the sessions `which` (default all), sent all at once (None: no answer)."""
        which = range(len(self.sessions)) if which is None else which
        return await asyncio.gather(*(self._bounded(self.sessions[i], _idle_turn(self.sessions[i], _question(i, turn)))
                                      for i in which))

    async def pairs(self, which: list[int]) -> list[tuple[tuple[float, str] | None, tuple[float, str] | None]]:
        """One session at a time: turn 3 (after an idle spell), then at once turn 4."""
        pairs = []
        for i in which:
            conn = self.sessions[i]
            parked = await self._bounded(conn, _idle_turn(conn, _question(i, 2)))
            pairs.append((parked, await self._bounded(conn, _idle_turn(conn, _question(i, 3)))))
        return pairs

    async def close(self) -> None:
        await asyncio.gather(*(c.ws.close() for c in self.sessions), return_exceptions=True)


def _clients_main(pipe: Any, url: str, max_tokens: int) -> None:
    """Answer the parent's commands ((method, *args) of _IdleClients, then None) until it sends None."""
    import traceback

    async def serve() -> None:
        clients, loop = _IdleClients(url, max_tokens), asyncio.get_running_loop()
        while (command := await loop.run_in_executor(None, pipe.recv)) is not None:
            try:
                pipe.send(("ok", await getattr(clients, command[0])(*command[1:])))
            except Exception:
                pipe.send(("error", traceback.format_exc()))
        await clients.close()

    asyncio.run(serve())


class _ClientProcess:
    def __init__(self, url: str, max_tokens: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.pipe, theirs = context.Pipe()
        self.process = context.Process(target=_clients_main, args=(theirs, url, max_tokens), daemon=True)
        self.process.start()

    def __call__(self, *command: Any) -> Any:
        self.pipe.send(command)
        status, value = self.pipe.recv()
        if status == "error":
            raise RuntimeError(f"the clients' process failed:\n{value}")
        return value

    def close(self) -> None:
        self.pipe.send(None)
        self.process.join(60)


def _parents() -> dict[int, int]:
    """Every process's parent: pid -> ppid."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                pass                              # it ended meanwhile
    return parents


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def server_processes(session_name: str, leave_out: int) -> list[int]:
    """This process, its descendants and any process that names the Ray session (one that left the
    tree), less the process `leave_out` and its descendants."""
    parents = _parents()
    mine, changed = {os.getpid()}, True
    while changed:
        grown = mine | {p for p, parent in parents.items() if parent in mine and p != leave_out}
        changed, mine = grown != mine, grown
    return sorted(mine | {p for p in parents if p not in mine and p != leave_out and session_name in _cmdline(p)})


def pss_mb(pids: list[int]) -> float:
    """Proportional set size summed over `pids`, in MB: shared pages split among their users, so a
    sum over processes counts each page once."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += sum(int(line.split()[1]) for line in f if line.startswith("Pss:"))
        except (OSError, ValueError):
            pass
    return total / 1024


def _kv_bytes_per_token(model: str, dtype_bytes: int) -> int:
    """K and V of one token over every layer, from the model's config.json."""
    from pie_actors.model_store import resolve_model

    config = json.loads((resolve_model(model) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * kv_heads * head_dim * dtype_bytes


def _pct(values: list[float], q: float) -> str:
    """The q-quantile of `values` in ms ("-": none)."""
    values = sorted(values)
    return _ms(values[min(len(values) - 1, int(q * len(values)))]) if values else "-"


@dataclass(frozen=True)
class IdleRow:
    per_actor: int
    n: int
    host_actors: int
    ray_workers: int
    pss_before: float            # MB
    pss_after: float
    kv_mb: float                 # what the sessions' KV pages hold, taken off the difference
    waves: list[float]           # seconds each burst of launches took
    first_turn_s: float          # all N answering turn 1 at once, after their launch
    correct: int                 # of the N turn-2 replies, equal to the reference
    ttft: list[float]            # turn 2 of all N at once
    parked: list[float]          # the sample's turn 3, one at a time
    live: list[float]            # the sample's turn 4, right after turn 3
    sample_correct: int          # of the sample's turns 3 and 4
    parked_sets: int             # the engine's parked working sets while the N sat idle (-1: no such count)

    @property
    def per_session(self) -> float:
        return (self.pss_after - self.pss_before - self.kv_mb) / self.n


def idle_run(model: str, per_actor: int, n: int, burst: int, max_tokens: int, sample: int,
             settings: dict[str, Any]) -> IdleRow:
    """N idle sessions on a fresh pie serve on a Ray cluster of its own, hosting `per_actor`
    sessions an actor."""
    import ray

    from pie_actors.config import load
    from pie_actors.controller import INFERLET_PREFIX

    park_after = load(**settings).limits.park_after_s if _parking() else 0.0
    with cluster_server(model, inferlets_per_actor=per_actor, **settings) as server:
        session_name = ray._private.worker._global_node.session_name     # the PSS sum is over its processes
        clients = _ClientProcess(server.url, max_tokens)
        try:
            reference = clients("reference")
            config = server.runtime.config.engine
            kv_page = config.page_size * _kv_bytes_per_token(model, 4 if config.dtype == "float32" else 2)

            def held_pages() -> int:
                return server.runtime.stats()["kv"]["referenced"]

            time.sleep(2)
            pages, before = held_pages(), pss_mb(server_processes(session_name, clients.process.pid))
            waves = clients("launch", n, burst)
            print(f"P={per_actor} N={n}: launched in {sum(waves):.2f} s", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            first = clients("turn", 0)
            first_s = time.perf_counter() - t0
            print(f"P={per_actor} N={n}: turn 1 answered by {sum(r is not None for r in first)} in "
                  f"{first_s:.2f} s", file=sys.stderr, flush=True)
            time.sleep(max(park_after + 1, 3))
            pids = server_processes(session_name, clients.process.pid)
            after, kv = pss_mb(pids), (held_pages() - pages) * kv_page / 2**20
            stats = server.runtime.stats()
            parked_sets = stats.get("parked", {}).get("sets", -1)
            workers = sum(_cmdline(p).startswith("ray::") for p in pids)
            actors = sum(name.startswith(INFERLET_PREFIX) for name in ray.util.list_named_actors())
            second = clients("turn", 1)
            time.sleep(park_after + 1)
            chosen = list(range(min(sample, n)))
            pairs = clients("pairs", chosen)
        finally:
            clients.close()

    def right(answer: tuple[float, str] | None, session: int, turn: int) -> bool:
        return answer is not None and answer[1] == reference[session % len(TOPICS)][turn]

    correct = sum(right(answer, i, 1) for i, answer in enumerate(second))
    sample_correct = sum(right(p, i, 2) + right(lv, i, 3) for i, (p, lv) in zip(chosen, pairs))
    return IdleRow(per_actor, n, actors, workers, before, after, kv, waves, first_s, correct,
                   [a[0] for a in second if a], [p[0] for p, _ in pairs if p], [lv[0] for _, lv in pairs if lv],
                   sample_correct, parked_sets)


def _parking() -> bool:
    """Whether this version parks idle sessions (`[limits] park_after_s`)."""
    from dataclasses import fields

    from pie_actors.config import RunLimits

    return "park_after_s" in {f.name for f in fields(RunLimits)}


def idle_table(rows: list[IdleRow], burst: int) -> str:
    parking = _parking()
    head = ["inferlets per actor", "N", "host actors", "Ray workers", "PSS before / after MB", "KV held MB",
            "MB per idle session", f"first launch burst s (<= {burst} at once)", "all N launched s", "turn 1, all N s",
            "turn 2 correct", "turn 2 TTFT p50 / p90 ms, all N at once",
            "next turn TTFT p50 ms, parked / live" if parking else "next turn TTFT p50 ms, live"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        next_turn = f"{_pct(r.parked, 0.5)} / {_pct(r.live, 0.5)}" if parking else _pct(r.live, 0.5)
        lines.append(f"| {r.per_actor} | {r.n} | {r.host_actors} | {r.ray_workers} | {r.pss_before:.0f} / "
                     f"{r.pss_after:.0f} | {r.kv_mb:.1f} | {r.per_session:.1f} | {r.waves[0]:.2f} | "
                     f"{sum(r.waves):.2f} | {r.first_turn_s:.2f} | {r.correct}/{r.n} | {_pct(r.ttft, 0.5)} / "
                     f"{_pct(r.ttft, 0.9)} | {next_turn} |")
    return "\n".join(lines)


def idle_targets(rows: list[IdleRow], burst: int) -> str:
    pooled = [r for r in rows if r.per_actor > 1]
    if not pooled:
        return ""
    most = max(pooled, key=lambda r: r.n)
    bursts = [r.waves[0] for r in pooled if r.n >= burst]
    memory = max(r.per_session for r in pooled)

    def verdict(ok: bool) -> str:
        return "met" if ok else "not met"

    lines = ["| target | measured | verdict |", "|---|---|---|",
             f"| <= 10 MB of host memory per idle session, KV aside | at most {memory:.1f} MB "
             f"(inferlets_per_actor {', '.join(sorted({str(r.per_actor) for r in pooled}))}) | {verdict(memory <= 10)} |",
             f"| 1,000 sessions, each answering its next turn correctly | {most.correct}/{most.n} at N = {most.n} | "
             f"{verdict(most.n >= 1000 and most.correct == most.n)} |"]
    if bursts:
        lines.append(f"| a burst of {burst} launches in <= 5 s | {max(bursts):.2f} s | {verdict(max(bursts) <= 5)} |")
    return "\n".join(lines)


def idle_main(args: Any) -> None:
    settings = dict(device="cpu", dtype=args.dtype, compile=args.compile, num_threads=args.threads,
                    kv_memory_mb=args.kv_memory_mb)
    runs = [(p, n) for p in args.per_actor for n in (args.idle if p > 1 else [args.small_n])]
    rows = []
    for per_actor, n in runs:
        started = time.perf_counter()
        rows.append(idle_run(args.model, per_actor, n, args.burst, args.tokens, args.sample, settings))
        print(idle_table(rows[-1:], args.burst).splitlines()[-1] + f" ({time.perf_counter() - started:.0f} s)",
              file=sys.stderr, flush=True)
    sample = "; ".join(f"P={r.per_actor} N={r.n}: {r.sample_correct}/{2 * len(r.live)} sample replies correct, "
                       f"{r.parked_sets} parked working sets while idle" for r in rows)
    parking = (f"parked: idle past [limits] park_after_s ({_park_after(settings)} s) before the turn" if _parking()
               else "this version has no [limits] park_after_s: live sessions only")
    env = (f"{args.model}, {args.dtype}, {args.threads} engine thread{'s' if args.threads > 1 else ''}, "
           f"kv_memory_mb {args.kv_memory_mb}; pie serve on a Ray cluster of its own; each session on a WebSocket "
           f"connection of its own, all from one asyncio process; launches {args.burst} at once; at most "
           f"{args.tokens} tokens a reply, greedy; MB per idle session = (PSS after - before - KV held) / N, PSS "
           f"summed over the server's and its Ray cluster's processes; next-turn TTFT over {args.sample} sessions "
           f"one at a time, {parking}; {sample}; 1-min load average {os.getloadavg()[0]:.1f} at the end")
    targets = idle_targets(rows, args.burst)
    publish(env, f"{idle_table(rows, args.burst)}\n\n{targets}\n", args.out, args.title)


# ---- sessions under KV pressure (--kv-pressure) --------------------------------------------------------

MOVES = ("evicted_spilled", "evicted_tokens", "restored_spilled", "restored_recomputed")   # the engine's `parked`
REFERENCE = "session, big pool"


@dataclass
class PressureRun:
    """One path's conversations on one server, and what the engine did meanwhile."""
    turns: list[list[Turn]]
    rows: int                    # rows the engine ran (prompts, decode steps, restores' prefills)
    moves: dict[str, int]        # parked working sets evicted and restored, by kind
    pages: int                   # the KV pool
    model_s: float               # the engine's time in the model's forward passes
    batches: int


def pressure_run(server: Any, path: str, clients: ProcessPoolExecutor, conversations: list[list[Message]],
                 max_tokens: int, active: int) -> PressureRun:
    before = server.runtime.stats()
    turns = clients.submit(drive, path, server.url, conversations, max_tokens, active).result()
    after = server.runtime.stats()
    moves = {k: after["parked"][k] - before["parked"][k] for k in MOVES}
    steps = {k: after["step_seconds"].get(k, 0) - before["step_seconds"].get(k, 0) for k in ("model", "steps")}
    print(f"{path}: done, {moves}", file=sys.stderr, flush=True)
    return PressureRun(turns, after["tokens_computed"] - before["tokens_computed"], moves, after["kv"]["total"],
                       steps["model"], int(steps["steps"]))


def pressure_table(runs: dict[str, PressureRun]) -> str:
    lines = ["| path | KV pool pages | prompt tokens sent, turns 2+ | of them from the prefix cache | parked sets "
             "evicted: to host memory / as tokens | restored: written back / recomputed | engine batches | engine s in the "
             "model |", "|---|---|---|---|---|---|---|---|"]
    for path, run in runs.items():
        sent = sum(turn.sent for t in run.turns[1:] for turn in t)
        cached = sent - sum(turn.computed for t in run.turns[1:] for turn in t)
        m = run.moves
        lines.append(f"| {path} | {run.pages} | {sent} | {cached} ({cached / sent:.0%}) | {m['evicted_spilled']} / "
                     f"{m['evicted_tokens']} | {m['restored_spilled']} / {m['restored_recomputed']} | {run.batches} | "
                     f"{run.model_s:.1f} |")
    return "\n".join(lines)


def pressure_main(args: Any) -> None:
    """The session path on a pool that holds every working set (the reference: its replies, and the
    sets' sizes at their final turn), then the stateless and session paths on a pool `args.kv_pressure`
    times smaller than those sets together."""
    from pie_actors.config import load

    settings = dict(device="cpu", dtype=args.dtype, compile=args.compile, num_threads=args.threads,
                    park_after_s=args.park_after)
    if args.spill_mb is not None:
        settings["spill_memory_mb"] = args.spill_mb
    conversations = [tool_conversation(k, args.turns) for k in range(args.conversations)]
    warm_up = [["Hello!"]]
    runs: dict[str, PressureRun] = {}
    clients = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    started = time.perf_counter()
    with cluster_server(MODEL, **settings) as server:
        clients.submit(drive, "session", server.url, warm_up, 4).result()     # the host actors' first runs
        runs[REFERENCE] = pressure_run(server, "session", clients, conversations, args.tokens, args.active)
        page_size = server.runtime.config.engine.page_size
    sets = [math.ceil(turn.held / page_size) for turn in runs[REFERENCE].turns[-1]]
    num_pages = math.ceil(sum(sets) / args.kv_pressure)
    if args.active * max(sets) > num_pages:
        raise SystemExit(f"{args.active} working sets of up to {max(sets)} pages at once do not fit in {num_pages} "
                         "pages: fewer --active, more --conversations or less --kv-pressure")
    print(f"working sets at their final turn: {sum(sets)} pages; the pool: {num_pages}", file=sys.stderr, flush=True)
    with cluster_server(MODEL, num_pages=num_pages, **settings) as server:
        for path in ("stateless", "session"):
            clients.submit(drive, path, server.url, warm_up, 4).result()
        load_before = os.getloadavg()[0]
        for path in ("stateless", "session"):
            runs[path] = pressure_run(server, path, clients, conversations, args.tokens, args.active)
    clients.shutdown()

    runs = {p: runs[p] for p in ("stateless", "session", REFERENCE)}
    results = {p: run.turns for p, run in runs.items()}
    replies = {p: [turn.reply for t in turns for turn in t] for p, turns in results.items()}
    same = {p: sum(a == b for a, b in zip(replies[REFERENCE], replies[p])) for p in ("session", "stateless")}
    later = {p: statistics.median(turn.ttft for t in turns[1:] for turn in t) for p, turns in results.items()}
    ratio = later["stateless"] / later["session"]
    total = args.conversations * args.turns
    env = (f"SmolLM2-135M-Instruct, {args.dtype}, {'compiled' if args.compile != 'off' else 'eager'} engine, "
           f"{args.threads} thread{'s' if args.threads > 1 else ''}; pie serve on a Ray cluster of its own; "
           f"{args.conversations} conversations x {args.turns} turns a path (user turns alternating with tool "
           f"results), at most {args.active} turns at once, in order; at most {args.tokens} tokens a reply, greedy; "
           f"the sessions' working sets at their final turn: {sum(sets)} pages of {page_size} tokens "
           f"(measured on the big pool), so the pool of {num_pages} pages holds 1/{args.kv_pressure:g} of them; "
           f"park_after_s {args.park_after:g}, spill_memory_mb {load(**settings).engine.spill_memory_mb}; "
           f"replies equal to the big pool's session replies: session {same['session']}/{total}, stateless "
           f"{same['stateless']}/{total}; 1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} "
           f"after; {time.perf_counter() - started:.0f} s in all")
    verdict = "met" if ratio >= 2 else "not met"
    report = (f"{turns_table(results)}\n\n{summary_table(results, {p: r.rows for p, r in runs.items()})}\n\n"
              f"{pressure_table(runs)}\n\nstateless / session median TTFT, turns 2+: {ratio:.2f}x "
              f"(target >= 2x: {verdict})\n")
    publish(env, report, args.out, args.title)


def _park_after(settings: dict[str, Any]) -> float:
    from pie_actors.config import load

    return load(**settings).limits.park_after_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, help="K: conversations a path, interleaved (default 5; "
                                                        "--kv-pressure: 12)")
    ap.add_argument("--turns", type=int, metavar="T", help=f"T: turns a conversation (2-{len(QUESTIONS)}, default "
                                                          f"5; --kv-pressure: 2-{2 * len(QUESTIONS)}, default 6)")
    ap.add_argument("--tokens", type=int, help="the most tokens of a reply (default 32; --idle: 8; --kv-pressure: 24)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--compile", default="off", choices=("auto", "on", "off"),
                    help="the engine's compiled decode (default off: TTFT is the prompt's pass, which is eager "
                         "either way, and an eager engine starts in seconds)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the engine's CPU threads")
    ap.add_argument("--quick", action="store_true", help="3 conversations of 3 turns, 16 tokens a reply")
    ap.add_argument("--idle", type=lambda v: [int(n) for n in v.split(",")], metavar="N[,N...]",
                    help="measure N live idle sessions on a cluster instead (see above)")
    ap.add_argument("--per-actor", type=lambda v: [int(n) for n in v.split(",")], default=[64], metavar="P[,P...]",
                    help="--idle: [cluster] inferlets_per_actor of each run (default 64; 1: an actor process a "
                         "session, at --small-n sessions)")
    ap.add_argument("--small-n", type=int, default=32, help="--idle: N of the runs with inferlets_per_actor 1")
    ap.add_argument("--burst", type=int, default=256, help="--idle: launches sent at once")
    ap.add_argument("--sample", type=int, default=16, help="--idle: sessions whose parked and live turns are timed")
    ap.add_argument("--model", default=None, help=f"--idle: the model (default dummy, whose cost is "
                                                  f"negligible; e.g. {MODEL})")
    ap.add_argument("--kv-memory-mb", type=int, default=1024, help="--idle: the engine's KV pool")
    ap.add_argument("--kv-pressure", type=float, metavar="X",
                    help="the stateless and session paths on a Ray cluster whose KV pool holds 1/X of the "
                         "sessions' working sets at their final turn, user turns alternating with tool results")
    ap.add_argument("--active", type=int, default=2, help="--kv-pressure: turns in flight at once (default 2)")
    ap.add_argument("--park-after", type=float, default=0.0,
                    help="--kv-pressure: [limits] park_after_s (default 0: a session parks once it waits)")
    ap.add_argument("--spill-mb", type=int, help="--kv-pressure: [engine] spill_memory_mb (default: the config's)")
    add_output_options(ap, "Live sessions against stateless turns")
    args = ap.parse_args()
    if args.kv_pressure:
        if args.title == "Live sessions against stateless turns":
            args.title = "Sessions under KV pressure"
        args.conversations, args.turns = args.conversations or 12, args.turns or 6
        args.tokens = args.tokens or 24
        if not 2 <= args.turns <= 2 * len(QUESTIONS):
            ap.error(f"--turns: 2-{2 * len(QUESTIONS)} with --kv-pressure")
        return pressure_main(args)
    args.conversations, args.turns = args.conversations or 5, args.turns or 5
    if not 2 <= args.turns <= len(QUESTIONS):
        ap.error(f"--turns: 2-{len(QUESTIONS)}")
    if args.idle:
        if args.title == "Live sessions against stateless turns":
            args.title = "Idle sessions on the cluster"
        args.model = args.model or "dummy"
        args.tokens = args.tokens or 8
        return idle_main(args)
    args.tokens = args.tokens or 32
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
    env = (f"SmolLM2-135M-Instruct, {args.dtype}, {'compiled' if args.compile != 'off' else 'eager'} engine, "
           f"{args.threads} thread{'s' if args.threads > 1 else ''}; {args.conversations} conversations x "
           f"{args.turns} turns a path, interleaved; at most {args.tokens} tokens a reply, greedy; replies equal "
           f"to stateless's: {', '.join(f'{p} {n}/{total}' for p, n in same.items())}; 1-min load average "
           f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    publish(env, f"{turns_table(results)}\n\n{summary_table(results, rows)}\n", args.out, args.title)


if __name__ == "__main__":
    main()
