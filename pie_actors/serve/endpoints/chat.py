"""The built-in generation endpoint of `pie serve`: chat and text completions for every API.

`pie serve` launches this inferlet for each chat-completions, completions, messages and
generateContent request, and for counting tokens. The HTTP layer turns the API's request into the
neutral input below, and this program's messages and result into the API's response or stream.
A program named for a route in the config's [serve.routes] runs in its place and speaks the same
protocol (examples/serve_endpoint is a small one).

Input (one of "messages" and "prompt"; everything else optional):
  messages      [{"role": "system" | "user" | "assistant" | "tool", "content": str,
                  "tool_calls": [{"id", "name", "arguments": JSON text}],     (assistant)
                  "thinking": str,      (assistant: its reasoning, fed back before its text on a thinking model)
                  "tool_call_id": str, "name": str}]                          (tool results)
                system messages, wherever they are, open the conversation together
  prompt        str, [str], [int] or [[int]]: raw completion prompts (text, or token ids as they
                are), no chat template
  tools         [{"name", "description", "parameters": JSON schema}]
  tool_choice   "auto" (default) | "none" | "required" | {"name": str}
  parallel_tool_calls  true lets a reply make several calls; otherwise it ends at its first
                (small models repeat a call again and again where the grammar allows more)
  response_format      {"type": "text" | "json"} or {"type": "json_schema", "schema": {...}}
  thinking      bool: a reasoning model thinks first (sent as "thinking" messages)
  max_tokens    int or null: at most the model's context (more is refused); a reply that reaches
                the context's end stops there
  default_max_tokens  int or null: the bound when max_tokens is null (null: the context's end)
  temperature (1; 0 is greedy), top_p (1), top_k (0: off), min_p (0), seed (null: random)
  presence_penalty, frequency_penalty (0), logit_bias {"token id": bias}
  stop          [str]: a reply ends before the first of them
  stop_token_ids  [int]: token ids that end a reply too, as the model's own stop tokens do (not
                shown; they end it also with ignore_eos)
  n             replies per prompt (1): the prompt is computed once, the replies fork it
  logprobs      bool; top_logprobs: alternatives per token (0-20)
  echo          bool: a completion's text starts with its prompt
  ignore_eos    bool: stop tokens do not end a reply (equal lengths for benchmarks)
  stream        bool (true): false sends no messages; the result holds everything
  count_only    bool: build the prompts only; the result is {"prompt_tokens", "tokens",
                "max_position"} (tokens: the ids of each prompt)
  resume        {"name": str, "tokens": [ids]}: a saved working set (ws.save) holding `tokens`.
                When they begin the prompt, the prompt continues from it and only the rest is
                computed; otherwise, or when the set is gone, the whole prompt is (prefix cache
                first). Chat messages and n = 1 only, as for save.
  save          str: keep the reply's working set under this name once it ends (ws.save)

Messages (session.send of JSON objects), in order:
  {"type": "start", "prompt_tokens", "cached_tokens"}   once, when the prompts are computed
  {"type": "text", "choice", "text", "logprobs"}        reply text; logprobs (with the logprobs
                                                        input): an entry for each new token
  {"type": "thinking", "choice", "text"}
  {"type": "tool_call", "choice", "index", "id", "name", "arguments": JSON text}
  {"type": "cut_call", "choice", "index", "id", "text", "name", "arguments"}
      a call the length cut off: its text as written and, once its name is complete, the name and
      its arguments' JSON text so far (name and arguments null before)
  {"type": "finish", "choice", "reason", "stop_sequence"}
      reason: "stop" (a stop token or the grammar's end), "stop_sequence" (one of `stop`),
      "length", "tool_calls"
  A logprobs entry: {"token", "bytes", "logprob", "top": [{"token", "bytes", "logprob"}]}, the
  log-softmax of the model's logits (before sampling settings).

Result: {"choices": [{"index", "text", "thinking", "tool_calls", "cut_call", "finish_reason",
          "stop_sequence", "logprobs"}], "usage": {"prompt_tokens", "completion_tokens",
          "cached_tokens"}}; choice i * n + j is prompt i's reply j. With save, also
        "saved": {"name", "tokens": the ids the set holds, for a later resume}.
A request refused before the start message:
        {"error": {"type": "invalid_request" | "context_length_exceeded", "message", "param"}}

How it decodes: each prompt is one pass into a working set; its epilogue draws the first token of
every reply from the last row's logits. Each reply then forks the prompt's working set and, when
nothing on the host shapes its next token, decodes with `run_ahead`: one pass repeats on the
engine, its epilogue puts each token into the next run's input channel, and the host only reads
tokens (text, stop strings and tool calls are watched on the host). A grammar (tool_choice
required or named, response_format json) needs the host's mask before every token, so those
replies submit one pass per token. Sampling, penalties, logit bias and logprobs are device code.
"""
import asyncio
import json
import random
import re

from inferlet import HostError, chat, model, reasoning, session, tools
from inferlet.eta import (Channel, ForwardPass, Pipeline, StateGeometry, WorkingSet, cast, cummass_le, dtype, eq,
                          gather, ge, gt, gumbel_max, intrinsics, iota, log_softmax, mask_apply, reduce_argmax,
                          reduce_max, reshape, select, softmax, top_k)
from inferlet.grammar import Grammar, Matcher
from inferlet.mask import unpack_mask

MAX_TOP_LOGPROBS = 20
# The call syntax that tools.equip teaches templates without tools of their own (and Hermes/Qwen
# use natively): an earlier call is written back into the conversation in it, and a reply's
# content ends where a call opens.
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# The start of a call's JSON up to its arguments (Hermes writes "arguments", Llama 3 "parameters")
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')
THINK_CLOSE = "</think>"


class Refused(Exception):
    """A request this program will not run; main returns it as {"error": ...}."""

    def __init__(self, message: str, param=None, kind: str = "invalid_request") -> None:
        super().__init__(message)
        self.param, self.kind = param, kind

    def body(self) -> dict:
        return {"error": {"type": self.kind, "message": str(self), "param": self.param}}


def number(input: dict, key: str, default, low=None, high=None, kind=float):
    value = input.get(key)
    if value is None:
        return default
    try:
        value = kind(value)
    except (TypeError, ValueError):
        raise Refused(f"{key} must be a number, got {value!r}", key) from None
    if (low is not None and value < low) or (high is not None and value > high):
        raise Refused(f"{key} must be between {low} and {high}, got {value}", key)
    return value


# ---- the prompt --------------------------------------------------------------------------------

def thinks() -> bool:
    """Whether the model has a thinking mode (its template cues thinking differently)."""
    return chat.cue_thinking(True) != chat.cue_without_thinking()


def call_text(call: dict) -> str:
    """An earlier assistant call, as the model writes one."""
    try:
        arguments = json.loads(call.get("arguments") or "{}")
    except ValueError:
        raise Refused(f"tool call {call.get('name')!r}: arguments are not JSON", "messages") from None
    body = json.dumps({"name": call.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def conversation(messages: list, specs: list | None) -> list:
    """The tokens of `messages` in the model's template (its tools declared when `specs`)."""
    system = "\n\n".join(m.get("content") or "" for m in messages if m.get("role") == "system")
    has_system = any(m.get("role") == "system" for m in messages)
    if specs:
        tokens = tools.equip(specs, system if has_system else None)
    else:
        tokens = chat.system(system) if has_system else []
    names = {}                                    # tool call id -> the tool's name
    for m in messages:
        role, text = m.get("role"), m.get("content") or ""
        if role == "user":
            tokens += chat.user(text) if tokens else chat.first_user(text)
        elif role == "assistant":
            calls = m.get("tool_calls") or []
            names.update({c.get("id"): c.get("name") for c in calls})
            text = "\n".join([text] * bool(text) + [call_text(c) for c in calls])
            if m.get("thinking") and thinks():
                # the turn as the model wrote it: the template would drop its thinking, as it does
                # the thinking of every turn before a later one
                written = f"{m['thinking']}\n{THINK_CLOSE}\n\n{text}"
                tokens += chat.cue_thinking(True) + model.encode(written) + chat.seal()
            else:
                tokens += chat.assistant(text)
        elif role == "tool":
            tokens += tools.answer(m.get("name") or names.get(m.get("tool_call_id")) or "tool", text)
        elif role != "system":
            raise Refused(f"unknown message role {role!r}", "messages")
    return tokens


def token_ids(prompt) -> bool:
    """Whether `prompt` is a prompt of token ids (a non-empty list of integers)."""
    return isinstance(prompt, list) and bool(prompt) and all(type(t) is int for t in prompt)


# ---- the request -------------------------------------------------------------------------------

class Request:
    """The input, checked: prompts, sampling settings, grammar, stops and limits."""

    def __init__(self, input: dict) -> None:
        self.vocab = model.output_vocab_size()
        self.temperature = number(input, "temperature", 1.0, 0.0)
        self.top_p = number(input, "top_p", 1.0, 0.0, 1.0)
        self.top_k = number(input, "top_k", 0, 0, kind=int)
        self.min_p = number(input, "min_p", 0.0, 0.0, 1.0)
        self.presence = number(input, "presence_penalty", 0.0)
        self.frequency = number(input, "frequency_penalty", 0.0)
        self.seed = number(input, "seed", None, kind=int)
        self.n = number(input, "n", 1, 1, kind=int)
        self.logprobs = bool(input.get("logprobs"))
        self.top_logprobs = number(input, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS, kind=int) if self.logprobs else 0
        self.bias = self._bias(input.get("logit_bias") or {})
        self.stop_ids = {self._token(t, "stop_token_ids") for t in input.get("stop_token_ids") or []}
        stop = input.get("stop") or []
        self.stops = [s for s in ([stop] if isinstance(stop, str) else stop) if s]
        self.ignore_eos = bool(input.get("ignore_eos"))
        self.stream = input.get("stream", True) is not False
        # more than the context could ever hold is a mistake, refused as the APIs refuse it
        self.max_tokens = number(input, "max_tokens", None, 1, model.max_position(), kind=int)
        if self.max_tokens is None:
            self.max_tokens = number(input, "default_max_tokens", None, 1, kind=int)
        self.specs = self._tools(input)
        self.calls_end_reply = input.get("parallel_tool_calls") is not True
        self.grammar = self._grammar(input.get("response_format") or {})
        self.prompts, self.echoes, self.thinking = self._prompts(input)
        self.resume, self.save = input.get("resume"), input.get("save")
        if (self.resume or self.save) and (self.n != 1 or input.get("messages") is None):
            raise Refused("resume and save take chat messages and one reply (n = 1)", "save")

    def _bias(self, bias: dict) -> list | None:
        if not bias:
            return None
        dense = [0.0] * self.vocab
        for key, value in bias.items():
            dense[self._token(key, "logit_bias")] = float(value)
        return dense

    def _token(self, value, what: str) -> int:
        """`value` as a token id of the vocabulary (a Refused naming `what` otherwise)."""
        try:
            token = int(value)
        except (TypeError, ValueError):
            raise Refused(f"{what} takes token ids, got {value!r}", what) from None
        if not 0 <= token < self.vocab:
            raise Refused(f"{what}: token id {token} is outside the vocabulary (0-{self.vocab - 1})", what)
        return token

    def _tools(self, input: dict) -> list | None:
        """The tool specs the prompt declares (none when tool_choice is "none"); a required or
        named choice also sets the grammar of the reply."""
        declared = input.get("tools") or []
        choice = input.get("tool_choice") or "auto"
        self.call_grammar = None
        if not declared or choice == "none":
            return None
        specs = [{"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                                   "parameters": t.get("parameters") or {"type": "object"}}}
                 for t in declared]
        if isinstance(choice, dict):
            named = [s for s in specs if s["function"]["name"] == choice.get("name")]
            if not named:
                raise Refused(f"tool_choice names {choice.get('name')!r}, which is not among the tools", "tool_choice")
        elif choice not in ("auto", "required"):
            raise Refused(f"tool_choice must be auto, none, required or a tool's name, got {choice!r}", "tool_choice")
        try:
            self.call_grammar = tools.format(named if isinstance(choice, dict) else specs)   # validates the specs
        except HostError as e:
            raise Refused(f"tools: {e}", "tools") from None
        if choice == "auto":
            self.call_grammar = None
        return specs

    def _grammar(self, fmt: dict):
        if self.call_grammar is not None:
            return self.call_grammar
        kind = fmt.get("type", "text")
        try:
            if kind == "json_schema":
                return Grammar.from_json_schema(fmt.get("schema") or {})
            if kind == "json":
                return Grammar.json()
        except HostError as e:
            raise Refused(f"response_format: the schema cannot be used: {e}", "response_format") from None
        if kind != "text":
            raise Refused(f"response_format type must be text, json or json_schema, got {kind!r}", "response_format")
        return None

    def _prompts(self, input: dict):
        """(token ids of each prompt, the text a reply's shown text starts with, whether replies think)."""
        if input.get("messages") is not None:
            thinking = bool(input.get("thinking"))
            cue = chat.cue_thinking(True) if thinking else chat.cue_without_thinking()
            thinking = thinking and cue != chat.cue_without_thinking()    # the model has a thinking mode
            return [conversation(input["messages"], self.specs) + cue], [""], thinking
        prompts = input.get("prompt")
        prompts = [prompts] if isinstance(prompts, str) or token_ids(prompts) else prompts
        if not prompts or not all(isinstance(p, str) or token_ids(p) for p in prompts):
            raise Refused("prompt must be a string, a list of token ids, or a list of either", "prompt")
        echo = bool(input.get("echo"))
        tokens = [chat.prefix() + model.encode(p) if isinstance(p, str) else [self._token(t, "prompt") for t in p]
                  for p in prompts]
        if not all(tokens):                       # a pass needs a token, and the model has no BOS to begin with
            raise Refused("prompt: an empty prompt gives the model nothing to continue", "prompt")
        shown = [p if isinstance(p, str) else model.decode(p) for p in prompts] if echo else [""] * len(prompts)
        return tokens, shown, False

    def budget(self, prompt: list) -> int:
        """The most tokens a reply to `prompt` may have: max_tokens, capped at the context's end."""
        room = model.max_position() - len(prompt)
        if room < 1:
            raise Refused(f"the prompt has {len(prompt)} tokens; the model's context holds {model.max_position()}",
                          "messages", "context_length_exceeded")
        return room if self.max_tokens is None else min(self.max_tokens, room)

    def seeds(self, count: int) -> list:
        base = random.getrandbits(62) if self.seed is None else self.seed
        return [(base * 1_000_003 + i) % (1 << 62) for i in range(count)]


# ---- device code -------------------------------------------------------------------------------

class Channels:
    """One reply's queues in engine memory: its next input token, the tokens and logprobs it
    streams to the host, and the state its device code carries from token to token."""

    def __init__(self, request: Request, seed: int) -> None:
        capacity = model.channel_capacity()
        self.feed = Channel([1], dtype.i32)                        # device -> the next pass's input
        self.out = Channel([1], dtype.i32).capacity(capacity)      # device -> host: the tokens
        self.lp = Channel([1], dtype.f32).capacity(capacity) if request.logprobs else None
        self.seed = Channel.from_([seed], dtype.i64) if request.temperature > 0 else None
        penalized = request.presence or request.frequency
        self.counts = Channel.from_([0.0] * request.vocab, dtype.f32) if penalized else None
        self.bias = Channel.from_(request.bias, dtype.f32) if request.bias else None
        self.mask = Channel([request.vocab], dtype.bool) if request.grammar is not None else None


def token_program(r: Request, c: Channels):
    """The device code that picks a reply's next token from lane 0's logits: bias, penalties and
    the grammar's mask, then greedy or temperature / top-k / top-p / min-p sampling; the token goes
    to the next pass's input and to the host, with its logprobs when asked for. The function closes
    over numbers and channels only, so it is traced once."""
    temperature, k, top_p, min_p = r.temperature, r.top_k, r.top_p, r.min_p
    presence, frequency, vocab, alternatives = r.presence, r.frequency, r.vocab, r.top_logprobs
    feed, out, lp, seed, counts, bias, mask = c.feed, c.out, c.lp, c.seed, c.counts, c.bias, c.mask

    def program():
        raw = intrinsics.output(0, "logits")
        x = raw
        if bias is not None:
            b = bias.take()
            bias.put(b)
            x = x + b
        if counts is not None:
            seen = counts.take()
            x = x - cast(gt(seen, 0), dtype.f32) * presence - seen * frequency
        if mask is not None:
            x = mask_apply(x, mask.take())
        if temperature == 0:
            token = reduce_argmax(x)
        else:
            x = x / temperature
            if k:
                x = top_k(x, k)
            if top_p < 1:
                x = mask_apply(x, cummass_le(softmax(x), top_p))
            if min_p > 0:
                probs = softmax(x)
                x = mask_apply(x, ge(probs, reduce_max(probs) * min_p))
            step = seed.take()
            seed.put(step + 1)
            token = gumbel_max(x, step)
        token = reshape(token, [1])
        feed.put(token)
        out.put(token)
        if counts is not None:
            counts.put(seen + cast(eq(iota(vocab), token), dtype.f32))
        if lp is not None:                  # the token's log-probability, then the best alternatives
            logprobs = log_softmax(raw)
            lp.put(reshape(gather(logprobs, token), [1]))
            rest = logprobs
            for _ in range(alternatives):
                best = reduce_argmax(rest)
                lp.put(reshape(gather(logprobs, best), [1]))
                lp.put(reshape(cast(best, dtype.f32), [1]))
                rest = select(eq(iota(vocab), best), float("-inf"), rest)

    return program


# ---- text --------------------------------------------------------------------------------------

class Detokenizer:
    """Text of a growing token list, a piece per token: each piece is decoded in the context of the
    token before it (so spaces and merged characters come out right), and a piece that ends inside
    a UTF-8 character waits for the token that completes it."""

    def __init__(self) -> None:
        self.tokens, self.start, self.done = [], 0, 0

    def add(self, token: int) -> str:
        self.tokens.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        piece = model.decode(self.tokens[self.start:], after=self.done - self.start)
        if piece.endswith("\ufffd") and not final:
            return ""
        self.start, self.done = self.done, len(self.tokens)
        return piece


class Gate:
    """Reply text as it may be shown: text that could still become a stop string (the reply ends
    before it) or a call's opening (the content ends there and the call is read) is held back."""

    def __init__(self, stops: list, markers: list) -> None:
        self.stops, self.markers, self.held = stops, markers, ""

    def push(self, text: str):
        """(text to show now, the stop string found or None, whether a call opened)."""
        self.held += text
        found = [(self.held.find(s), s, s in self.stops) for s in self.stops + self.markers if s in self.held]
        if found:
            at, word, is_stop = min(found)
            shown, self.held = self.held[:at], ""
            return shown, word if is_stop else None, not is_stop
        keep = max([n for s in self.stops + self.markers for n in range(1, len(s)) if self.held.endswith(s[:n])],
                   default=0)
        shown, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return shown, None, False

    def flush(self) -> str:
        shown, self.held = self.held, ""
        return shown


def token_entry(token: int, logprob: float) -> dict:
    text = model.decode([token])
    return {"token": text, "bytes": list(text.encode("utf-8")), "logprob": logprob}


# ---- one reply ---------------------------------------------------------------------------------

STOPS = set(chat.stop_tokens())
PREFILL_CHUNK = 512          # prompt tokens per pass: a long prompt does not hold up other requests' tokens


class Reply:
    """One choice: its working set, its device code, and what it has produced."""

    def __init__(self, index: int, request: Request, seed: int, budget: int, room: int, echo: str) -> None:
        self.index, self.request, self.budget, self.room = index, request, budget, room
        self.channels = Channels(request, seed)
        self.program = token_program(request, self.channels)
        self.matcher = Matcher(request.grammar) if request.grammar is not None else None
        self.calls = tools.Decoder() if request.specs else None
        self.thinker = reasoning.Decoder.for_cue(chat.cue_thinking(True)) if request.thinking else None
        self.text = Detokenizer()
        self.gate = Gate(request.stops, [CALL_OPEN] if request.specs else [])
        self.ws = None
        self.tokens, self.shown, self.thought, self.tool_calls = [], [], [], []
        self.cut_call = None
        self.entries, self.unsent = [], []        # logprobs entries: all of them, and those not sent yet
        self.content_open = True
        self.finish_reason = self.stop_sequence = None
        self.echo = echo

    def _send(self, kind: str, **fields) -> None:
        if self.request.stream:
            session.send({"type": kind, "choice": self.index, **fields})

    def mask(self) -> None:
        """The grammar's mask for the next token, into the channel the device code takes it from."""
        if self.matcher is not None:
            self.channels.mask.put(unpack_mask(self.matcher.mask(), self.request.vocab))

    async def read(self):
        """The next token from the device, and its logprob values when asked for."""
        token = await self.channels.out.take_scalar()
        lp = self.channels.lp
        values = [await lp.take_scalar() for _ in range(1 + 2 * self.request.top_logprobs)] if lp else None
        return int(token), values

    async def run(self, first) -> None:
        """Decode from the first token (drawn by the prompt's pass) to the end of the reply."""
        self._show(self.echo)
        if not self.accept(*first):
            return
        pipe = Pipeline()
        if self.matcher is None:
            async def on_token():
                return self.accept(*await self.read())
            # The loop always ends here, at a stop or the length, never by exhausting the engine's
            # budget: a run-ahead that ends on its own drops the values its last runs put that were not
            # read yet. The engine runs at most 3 windows past the reads, so that margin is enough.
            runs = min(self.budget - len(self.tokens) + 3 * model.run_ahead_window(), self.room - len(self.tokens))
            await pipe.run_ahead(self._step(), runs, on_token)
        else:
            going = True
            while going:
                self.mask()
                pipe.submit(self._step())
                going = self.accept(*await self.read())
        pipe.close()

    def _step(self) -> ForwardPass:
        fwd = ForwardPass()
        fwd.embed(self.channels.feed)
        fwd.state([self.ws], StateGeometry.folding())
        fwd.epilogue(self.program)
        return fwd

    def accept(self, token: int, values) -> bool:
        """Take the next token and stream what it adds; False once the reply is over."""
        if self.matcher is not None and not self.matcher.accept_tokens([token]):
            raise RuntimeError(f"the device chose token {token}, which the grammar does not allow")
        if (token in STOPS and not self.request.ignore_eos) or token in self.request.stop_ids:
            return self._finish("stop")
        self.tokens.append(token)
        if values is not None:
            entry = token_entry(token, values[0])
            entry["top"] = [token_entry(int(values[i + 1]), values[i]) for i in range(1, len(values), 2)]
            self.entries.append(entry)
            self.unsent.append(entry)
        stop = self._text(token)
        if stop is not None:
            return self._finish("stop_sequence", stop)
        if self.tool_calls and self.request.calls_end_reply:
            return self._finish("tool_calls")
        if self.matcher is not None and self.matcher.is_terminated():
            return self._finish("stop")
        if len(self.tokens) >= self.budget:
            return self._finish("length")
        return True

    def _text(self, token: int):
        """Route the token's text to thinking, content or a tool call; the stop string it completed."""
        if self.thinker is not None:
            self._think(self.thinker.feed([token]))
            return None
        piece = self.text.add(token)
        if self.calls is not None:
            self._calls(self.calls.feed([token]))
        if not self.content_open:
            return None
        shown, stop, opened = self.gate.push(piece)
        self.content_open = not opened
        self._show(shown)
        return stop

    def _think(self, event) -> None:
        while not isinstance(event, reasoning.Event.Idle):
            if isinstance(event, reasoning.Event.Delta):
                self.thought.append(event.text)
                self._send("thinking", text=event.text)
            elif isinstance(event, reasoning.Event.End):
                self.thinker = None                # the answer starts with the next token
                return
            event = self.thinker.feed([])

    def _calls(self, event) -> None:
        while not isinstance(event, tools.Event.Idle):
            if isinstance(event, tools.Event.Start):
                self.content_open = False
            elif isinstance(event, tools.Event.Call):
                call = {"id": "call_%016x" % random.getrandbits(64), "name": event.call.name,
                        "arguments": event.call.arguments_json}
                self.tool_calls.append(call)
                self._send("tool_call", index=len(self.tool_calls) - 1, **call)
            else:                                  # call text that does not parse: shown as it was written
                self._show(event.text)
            event = self.calls.feed([])

    def _cut(self, event) -> None:
        """A call the length cut off (an Error event of the decoder's finish) is kept, not dropped."""
        if isinstance(event, tools.Event.Error):
            head = CALL_HEAD.match(event.text)
            self.cut_call = {"index": len(self.tool_calls), "id": "call_%016x" % random.getrandbits(64),
                             "text": event.text, "name": json.loads(head[1]) if head else None,
                             "arguments": event.text[head.end():] if head else None}
            self._send("cut_call", **self.cut_call)

    def _show(self, text: str, last: bool = False) -> None:
        """Stream `text` (with the logprobs of the tokens not sent yet); the last piece goes out
        even when it is empty, to carry the remaining logprobs."""
        if text or (last and self.unsent):
            self.shown.append(text)
            self._send("text", text=text, logprobs=self.unsent if self.request.logprobs else None)
            self.unsent = []

    def _finish(self, reason: str, stop_sequence=None) -> bool:
        tail = ""
        if self.content_open and self.thinker is None and stop_sequence is None:
            tail, stop_sequence, _ = self.gate.push(self.text.flush())
            tail += self.gate.flush() if stop_sequence is None else ""
        self._show(tail, last=True)
        if stop_sequence is not None:
            reason = "stop_sequence"
        if self.tool_calls and reason != "length":
            reason = "tool_calls"
        if reason == "length" and self.calls is not None:
            self._cut(self.calls.finish())
        self.finish_reason, self.stop_sequence = reason, stop_sequence
        self._send("finish", reason=reason, stop_sequence=stop_sequence)
        return False

    def result(self) -> dict:
        return {"index": self.index, "text": "".join(self.shown), "thinking": "".join(self.thought) or None,
                "tool_calls": self.tool_calls, "cut_call": self.cut_call, "finish_reason": self.finish_reason,
                "stop_sequence": self.stop_sequence, "logprobs": self.entries if self.request.logprobs else None}


# ---- the program -------------------------------------------------------------------------------

def resumed(resume, prompt: list):
    """The working set to compute `prompt` into, and how many of its first tokens it holds: the
    saved set `resume` names when the tokens it holds begin the prompt, else a new one."""
    held = (resume or {}).get("tokens") or []
    if not held or len(held) >= len(prompt) or prompt[:len(held)] != held:
        return WorkingSet(), 0
    try:
        ws = WorkingSet.open(resume["name"])
    except HostError:                  # gone: deleted, or never kept
        return WorkingSet(), 0
    return (ws, len(held)) if ws.folded() == len(held) else (WorkingSet(), 0)


async def prefill(prompt: list, replies: list, resume=None) -> int:
    """Compute `prompt` once (what `resume` holds of it is not computed again); its last pass draws
    each reply's first token and each reply gets a working set that shares the prompt (a fork,
    when there are several). Returns how many prompt tokens were not computed for this request
    (found in pages computed earlier, by any request, or resumed), and each reply's first token."""
    (root, done), pipe = resumed(resume, prompt), Pipeline()
    for reply in replies:
        reply.mask()
    programs = [reply.program for reply in replies]

    def first_tokens():
        for program in programs:
            program()

    for start in range(done, len(prompt), PREFILL_CHUNK):
        fwd = ForwardPass()
        fwd.embed(prompt[start:start + PREFILL_CHUNK])
        fwd.state([root], StateGeometry.folding())
        if start + PREFILL_CHUNK >= len(prompt):
            fwd.epilogue(first_tokens)
        pipe.submit(fwd)
    firsts = [await reply.read() for reply in replies]
    pipe.close()
    for reply in replies:
        reply.ws = root if len(replies) == 1 else root.fork(pipe)
    # a set restored by recomputing its tokens counts only its prefix-cache hits
    return root.cached_tokens() + (done if root.restored in ("kept", "spilled") else 0), firsts


async def main(input: dict) -> dict:
    try:
        request = Request(input)
        if input.get("count_only"):
            return {"prompt_tokens": sum(map(len, request.prompts)), "tokens": request.prompts,
                    "max_position": model.max_position()}
        budgets = [request.budget(prompt) for prompt in request.prompts]
    except Refused as e:
        return e.body()
    except HostError as e:              # the model's template or tokenizer cannot take the request
        return Refused(str(e)).body()
    n = request.n
    seeds = request.seeds(n * len(request.prompts))
    rooms = [model.max_position() - len(prompt) for prompt in request.prompts]
    replies = [Reply(i, request, seeds[i], budgets[i // n], rooms[i // n], request.echoes[i // n])
               for i in range(len(seeds))]
    prefilled = await asyncio.gather(*(prefill(prompt, replies[i * n:(i + 1) * n], request.resume)
                                       for i, prompt in enumerate(request.prompts)))
    usage = {"prompt_tokens": sum(map(len, request.prompts)), "cached_tokens": sum(c for c, _ in prefilled)}
    if request.stream:
        session.send({"type": "start", **usage})
    firsts = [first for _, group in prefilled for first in group]
    await asyncio.gather(*(reply.run(first) for reply, first in zip(replies, firsts)))
    usage["completion_tokens"] = sum(len(reply.tokens) for reply in replies)
    result = {"choices": [reply.result() for reply in replies], "usage": usage}
    if request.save:          # the set holds the prompt and the reply, up to the last token it fed
        held = replies[0].ws.save(request.save)
        result["saved"] = {"name": request.save, "tokens": (request.prompts[0] + replies[0].tokens)[:held]}
    return result
