"""Per-token cost of grammar-constrained greedy decoding vs unconstrained, as a ratio, same run.

    python bench/grammar.py [--dtype bfloat16] [--batches 1,8] [--repeats 3] [--out bench/RESULTS.md]

Constrained: every step each sequence's logits come back from the engine, its matcher computes the
mask (llguidance), the mask is applied (masked_fill), argmax, and the matcher accepts the token.
Unconstrained: the same passes with the argmax taken in the engine, for the same number of tokens
per sequence (the constrained run decides how many: until its JSON schema completes). Tokens/s
counts generated tokens over the decode loop (prompts prefilled first, untimed). The breakdown
columns are host milliseconds per token for mask / apply / accept.

The second table is the cost an inferlet pays for the same matcher work through host
operations (JSON over the sandbox boundary): Matcher.mask() + accept_tokens() per token, and
mask.unpack_mask in the guest.

The third table is constrained decoding written as an inferlet, the mask reaching the device
through a channel and applied in the epilogue (batch 1, one pass per token), in milliseconds per
token by phase, against the same inferlet decoding as many tokens unconstrained:
- "bool channel": the documented way, `Channel([vocab], dtype.bool).put(unpack_mask(m.mask(),
  vocab))`, epilogue `masked_argmax(logits, chan.take())`;
- "packed 16-bit": the same mask as 16-bit halves of the packed words in an i32 channel
  ([vocab / 16] values instead of [vocab] bools), unpacked in the epilogue with eta ops (exact in
  f32: a / 2^k, truncate, test the low bit): what packing before the boundary saves, with no
  engine change.
Both must choose the same tokens. The inferlets of the second and third tables are launched with
`Runtime.local` (sandbox, data plane and engine in this process). `--parts` picks the tables to run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from report import add_output_options, publish

from pie_actors import Runtime
from pie_actors.gpu.engine import Lane, PassRequest
from pie_actors.inferlet.chat_ops import ChatTokens
from pie_actors.inferlet.grammar import GrammarCompiler, Matcher

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "home"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
                         "home": {"type": "object", "required": ["city", "country"], "additionalProperties": False,
                                  "properties": {"city": {"type": "string", "maxLength": 16},
                                                 "country": {"enum": ["France", "Japan", "Peru", "Kenya"]}}}}}
PEOPLE = ["a French chef", "a Japanese pilot", "a Peruvian poet", "a Kenyan runner", "a retired teacher",
          "a young painter", "a ship captain", "a chess player"]
MAX_TOKENS = 80

GUEST_LOOP = """
import time
from inferlet import model
from inferlet.grammar import Grammar, Matcher
from inferlet.mask import unpack_mask

async def main(input):
    tokens, vocab = input["tokens"], model.output_vocab_size()
    m = Matcher(Grammar.from_json_schema(input["schema"]))
    t_mask = t_accept = t_unpack = 0.0
    for token in tokens:
        t0 = time.perf_counter()
        words = m.mask()
        t1 = time.perf_counter()
        unpack_mask(words, vocab)
        t2 = time.perf_counter()
        assert m.accept_tokens([token])
        t3 = time.perf_counter()
        t_mask, t_unpack, t_accept = t_mask + t1 - t0, t_unpack + t2 - t1, t_accept + t3 - t2
    return {"mask": t_mask, "unpack": t_unpack, "accept": t_accept}
"""

# Constrained decoding as an inferlet with the mask applied on the device (see the docstring).
DEVICE_LOOP = """
import struct, time
from inferlet import chat, model
from inferlet.eta import (Channel, ForwardPass, Pipeline, StateGeometry, WorkingSet, cast, constant, dtype,
                          intrinsics, masked_argmax, ne, reduce_argmax, reshape)
from inferlet.grammar import Grammar, Matcher
from inferlet.mask import unpack_mask

POWERS = [float(1 << k) for k in range(16)]

def unpack16(halves, n):
    # bit k of 16-bit value j is token 16 j + k: floor(v / 2^k) is odd
    shifted = cast(reshape(cast(halves, "f32"), [n, 1]) / reshape(constant(POWERS, "f32"), [1, 16]), "i32")
    return reshape(ne(cast(shifted / 2, "i32") * 2, shifted), [n * 16])

async def main(input):
    mode, vocab = input["mode"], model.output_vocab_size()
    words = (vocab + 31) // 32
    assert words * 32 == vocab, "the 16-bit path here needs a vocabulary of whole words"
    m = Matcher(Grammar.from_json_schema(input["schema"])) if mode != "none" else None
    chan = Channel([vocab], dtype.bool) if mode == "bool" else Channel([2 * words], dtype.i32)
    stops = set(chat.stop_tokens())
    ws, pipe, out, feed = WorkingSet(), Pipeline(), [], input["prompt"]
    t = dict.fromkeys(["mask", "unpack", "put", "pass", "accept"], 0.0)
    start = None
    for i in range(input["max"]):
        if i == 1:
            start = time.perf_counter()    # the prompt's pass is not timed
        t0 = time.perf_counter()
        if mode != "none":
            packed = m.mask()
        t1 = time.perf_counter()
        if mode == "bool":
            value = unpack_mask(packed, vocab)
        elif mode == "packed16":
            value = list(struct.unpack(f"<{2 * words}H", struct.pack(f"<{words}i", *packed)))
        t2 = time.perf_counter()
        if mode != "none":
            chan.put(value)
        t3 = time.perf_counter()
        fwd = ForwardPass()
        fwd.embed(feed)
        fwd.state([ws], StateGeometry.folding())
        if mode == "bool":
            nxt = fwd.epilogue(lambda: masked_argmax(intrinsics.output(0, "logits"), chan.take()))
        elif mode == "packed16":
            nxt = fwd.epilogue(lambda: masked_argmax(intrinsics.output(0, "logits"),
                                                     unpack16(chan.take(), 2 * words)))
        else:
            nxt = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
        pipe.submit(fwd)
        token = await nxt
        t4 = time.perf_counter()
        if mode != "none":
            assert m.accept_tokens([token]), token
        t5 = time.perf_counter()
        if i >= 1:
            for key, a, b in zip(t, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5)):
                t[key] += b - a
        out.append(token)
        feed = [token]
        if mode != "none" and (token in stops or m.is_terminated()):
            break
    return {"tokens": out, "seconds": time.perf_counter() - start, "timed": len(out) - 1, **t}
"""


def device_path(runtime: Runtime, prompt: list[int], repeats: int) -> list[tuple]:
    """Rows (path, tokens, ms/token by phase..., total ms/token, ratio to unconstrained) of the
    third table; the median run of `repeats` for each path."""
    def median_run(mode: str, n: int) -> dict:
        input = {"mode": mode, "schema": SCHEMA, "prompt": prompt, "max": n}
        runs = [runtime.launch(DEVICE_LOOP, input).result() for _ in range(repeats + 1)][1:]   # 1st: warm-up
        return sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]

    paths = {"bool channel": median_run("bool", MAX_TOKENS), "packed 16-bit": median_run("packed16", MAX_TOKENS)}
    tokens = paths["bool channel"]["tokens"]
    assert paths["packed 16-bit"]["tokens"] == tokens, "the two mask paths chose different tokens"
    plain = median_run("none", len(tokens))
    rows = []
    for name, r in [*paths.items(), ("unconstrained", plain)]:
        n = r["timed"]
        rows.append((name, n, *(1000 * r[k] / n for k in ("mask", "unpack", "put", "pass", "accept")),
                     1000 * r["seconds"] / n, r["seconds"] / n / (plain["seconds"] / plain["timed"])))
    return rows


def step(engine, seqs: list[int], inputs: list[list[int]], epilogue=None) -> list:
    """One pass per sequence, batched by the engine's loop; their results (logits by default)."""
    futures = [engine.submit(PassRequest([Lane(seq, tokens)], epilogue)) for seq, tokens in zip(seqs, inputs)]
    return [f.result() for f in futures]


def prefill(engine, prompts: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """New sequences holding all prompt tokens but the last; returns them and the last tokens."""
    seqs = [engine.create_sequence() for _ in prompts]
    step(engine, seqs, [p[:-1] for p in prompts], lambda logits: None)
    return seqs, [[p[-1]] for p in prompts]


def constrained(engine, compiler: GrammarCompiler, prompts, stops: set[int]) -> dict:
    vocab = engine.model_config.vocab_size
    shifts = torch.arange(32, dtype=torch.int32)
    seqs, inputs = prefill(engine, prompts)
    matchers = [Matcher(compiler.json_schema(SCHEMA)) for _ in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    t = {"mask": 0.0, "apply": 0.0, "accept": 0.0}
    start = time.perf_counter()
    for _ in range(MAX_TOKENS):
        logits = step(engine, [seqs[i] for i in live], [inputs[i] for i in live])
        for i, rows in zip(list(live), logits):
            t0 = time.perf_counter()
            words = torch.from_numpy(matchers[i].mask_array())
            t1 = time.perf_counter()
            ok = ((words[:, None] >> shifts) & 1).flatten()[:vocab].bool()
            token = int(rows[-1].float().masked_fill(~ok, float("-inf")).argmax())
            t2 = time.perf_counter()
            assert matchers[i].accept_tokens([token])
            t["mask"], t["apply"], t["accept"] = (t["mask"] + t1 - t0, t["apply"] + t2 - t1,
                                                  t["accept"] + time.perf_counter() - t2)
            inputs[i] = [token]
            if token in stops or matchers[i].is_terminated():
                live.remove(i)
            if token not in stops:
                outputs[i].append(token)
        if not live:
            break
    elapsed = time.perf_counter() - start
    for seq in seqs:
        engine.free(seq)
    return {"seconds": elapsed, "outputs": outputs, **t}


def _argmax(logits: torch.Tensor) -> int:
    return int(logits[-1].argmax())


def unconstrained(engine, prompts, lengths: list[int]) -> float:
    """Seconds for greedy decoding of lengths[i] tokens per prompt, argmax in the engine."""
    seqs, inputs = prefill(engine, prompts)
    live = [i for i in range(len(prompts)) if lengths[i]]
    done = [0] * len(prompts)
    start = time.perf_counter()
    while live:
        for i, token in zip(live, step(engine, [seqs[i] for i in live], [inputs[i] for i in live], _argmax)):
            inputs[i] = [token]
            done[i] += 1
        live = [i for i in live if done[i] < lengths[i]]
    elapsed = time.perf_counter() - start
    for seq in seqs:
        engine.free(seq)
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parts", default="host,guest,device",
                    help="tables to run: host (engine loop), guest (matcher host operations), device (mask "
                         "through a channel, applied in the epilogue)")
    add_output_options(ap, "Grammar-constrained decoding vs unconstrained")
    args = ap.parse_args()
    parts = set(args.parts.split(","))

    load_before = os.getloadavg()[0]
    runtime = Runtime.local(dtype=args.dtype, compile=False)
    engine = runtime.engine
    rows, guest, device = [], None, []
    try:
        tok = engine.tokenizer
        chat = ChatTokens(tok)
        stops = set(chat.stop_tokens())
        compiler = GrammarCompiler(tok, engine.model_config.vocab_size, chat.stop_tokens())
        schema = json.dumps(SCHEMA)
        prompts = [chat.system("You reply with JSON only.")
                   + chat.user(f"Describe {PEOPLE[i % len(PEOPLE)]} as JSON for this schema: {schema}")
                   + chat.cue() for i in range(max(int(b) for b in args.batches.split(",")))]
        for batch in [int(b) for b in args.batches.split(",")] if "host" in parts else []:
            batch_prompts = prompts[:batch]
            lengths = [len(o) for o in constrained(engine, compiler, batch_prompts, stops)["outputs"]]   # warm-up
            unconstrained(engine, batch_prompts, lengths)
            runs = [constrained(engine, compiler, batch_prompts, stops) for _ in range(args.repeats)]
            run = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
            plain = statistics.median(unconstrained(engine, batch_prompts, lengths) for _ in range(args.repeats))
            n = sum(lengths)
            rows.append((batch, n, n / plain, n / run["seconds"], run["seconds"] / plain,
                         *(1000 * run[k] / n for k in ("mask", "apply", "accept"))))
        if "guest" in parts:
            # the guest's cost for the same matcher work, over a fixed token path (the first output)
            path = constrained(engine, compiler, prompts[:1], stops)["outputs"][0]
            runtime.launch(GUEST_LOOP, {"tokens": path, "schema": SCHEMA}).result()            # warm-up
            guest = runtime.launch(GUEST_LOOP, {"tokens": path, "schema": SCHEMA}).result(), len(path)
        if "device" in parts:
            device = device_path(runtime, prompts[0], args.repeats)
    finally:
        runtime.close()

    tables = []
    if rows:
        tables.append("\n".join(
            ["| batch | tokens | unconstrained tok/s | constrained tok/s | time ratio (constrained ÷ unconstrained) "
             "| mask ms/tok | apply ms/tok | accept ms/tok |", "|---|---|---|---|---|---|---|---|"]
            + [f"| {b} | {n} | {u:.1f} | {c:.1f} | {r:.2f}× | {m:.3f} | {a:.3f} | {acc:.3f} |"
               for b, n, u, c, r, m, a, acc in rows]))
    if guest is not None:
        times, n = guest
        tables.append("| inferlet (sandbox, host operations) | ms/token |\n|---|---|\n"
                      + "\n".join(f"| {name} | {1000 * times[key] / n:.3f} |" for name, key in
                                  [("Matcher.mask()", "mask"), ("mask.unpack_mask(...)", "unpack"),
                                   ("Matcher.accept_tokens([t])", "accept")]))
    if device:
        tables.append("\n".join(
            ["| inferlet, mask on the device (batch 1) | tokens | Matcher.mask() | unpack | Channel.put | "
             "pass (submit → token) | accept | total ms/token | time ratio (÷ unconstrained) |",
             "|---|---|---|---|---|---|---|---|---|"]
            + [f"| {name} | {n} | " + " | ".join(f"{v:.3f}" for v in phases) + f" | {total:.2f} | {ratio:.2f}× |"
               for name, n, *phases, total, ratio in device]))
    env = (f"{args.dtype}, default model, eager engine, in process; JSON schema with nested object, array, enum; "
           f"≤{MAX_TOKENS} tokens per sequence; median of {args.repeats}; "
           f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    publish(env, "\n\n".join(tables) + "\n", args.out, args.title)


if __name__ == "__main__":
    main()
