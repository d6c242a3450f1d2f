"""Map-reduce summarisation: a coordinator spawns one worker per chunk of a document, each
summarises its chunk, and the coordinator reduces their summaries into one.

This module is the coordinator. It splits the document (input) into `workers` chunks of whole
sentences and spawns worker.py of this bundle once per chunk, each its own process; with "nodes"
(Ray node ids) the workers go round-robin onto those nodes, else wherever the cluster places
them. Workers stream their summaries back token by token over `session.send_to`, each message
numbered; the coordinator reads them with `session.receive_from`, checks that every worker's
numbers arrive as 0, 1, 2, ... with none missing, and rebuilds each summary from its tokens
(checked against the worker's closing message). The reduce step then summarises the summaries.

Input (all optional): "document", "workers" (3), "max_tokens" per summary (16), "nodes".
Output: {"chunks", "summaries" (by chunk), "summary" (the reduced one), "received" ({worker name:
message count}), "workers_done" (what each worker returned: its prompt and tokens)}.
"""
import asyncio

from inferlet import model, runtime, session

from summarise import greedy, prompt

DOCUMENT = ("The river town grew around a wooden bridge. Traders crossed it every market day. "
            "A flood in the spring of 1820 carried the bridge away. The town built a stone bridge "
            "the next year. Its three arches still stand. Railways reached the town in 1870. "
            "Factories rose along the river bank. Today the old mills are flats and a museum.")


def chunks(document: str, n: int) -> list[str]:
    """`document` in `n` runs of whole sentences of about equal length."""
    sentences = [s.strip() + "." for s in document.split(".") if s.strip()]
    n = max(1, min(n, len(sentences)))
    size, extra = divmod(len(sentences), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (i < extra)
        out.append(" ".join(sentences[start:end]))
        start = end
    return out


async def main(input: dict) -> dict:
    parts = chunks(input.get("document", DOCUMENT), int(input.get("workers", 3)))
    max_tokens, nodes, me = int(input.get("max_tokens", 16)), input.get("nodes") or [None], runtime.name()
    workers = [await runtime.spawn("worker", {"coordinator": me, "index": i, "chunk": chunk,
                                              "max_tokens": max_tokens},
                                   name=f"{me}/w{i}", node=nodes[i % len(nodes)])
               for i, chunk in enumerate(parts)]
    index_of = {w.name: i for i, w in enumerate(workers)}

    tokens, summaries = [[] for _ in workers], [None] * len(workers)
    received = {w.name: 0 for w in workers}
    while any(s is None for s in summaries):
        sender, message = await session.receive_from()
        if sender not in index_of or message.get("seq") != received[sender]:
            raise ValueError(f"message {received.get(sender)} of {sender!r} expected, got {message!r}")
        received[sender] += 1
        i = index_of[sender]
        if message.get("done"):
            if model.decode(tokens[i]).strip() != message["summary"]:
                raise ValueError(f"{sender}: the streamed tokens do not make its summary")
            summaries[i] = message["summary"]
        else:
            tokens[i].append(message["token"])
    done = await asyncio.gather(*(w.result() for w in workers))

    listed = "\n".join(f"- {s}" for s in summaries)
    reduced = await greedy(prompt("Combine these summaries into one sentence:", listed), max_tokens)
    return {"chunks": parts, "summaries": summaries, "summary": model.decode(reduced).strip(),
            "received": received, "workers_done": done}
