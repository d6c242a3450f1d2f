// Constrained decoding (grammar, Matcher), tool calls (tools) and thinking blocks (reasoning):
// all kept on the host, the program holding their handles, as in the Python SDK.

import { call, ints } from './host.js';

/** A grammar compiled on the host for the model's vocabulary. Make one with a static method. */
export class Grammar {
  constructor(handle) { this._handle = handle; }

  static _compile(kind, source) { return new Grammar(call('grammar.compile', [kind, source])); }
  /** JSON that validates against `schema` (an object, or its JSON text). */
  static fromJsonSchema(schema) { return Grammar._compile('json_schema', schema); }
  /** Text matching `pattern` as a whole (Rust regex syntax). */
  static fromRegex(pattern) { return Grammar._compile('regex', String(pattern)); }
  /** A context-free grammar (Lark syntax as llguidance reads it, or GBNF). */
  static fromEbnf(grammar) { return Grammar._compile('ebnf', String(grammar)); }
  /** Any JSON value. */
  static json() { return Grammar._compile('json', null); }
}

/** The state of one generation under a grammar. */
export class Matcher {
  constructor(grammar, handle = null) {
    this._handle = handle ?? call('grammar.matcher', grammar._handle);
  }

  /** The tokens allowed next, packed: bit i % 32 of word i / 32 is token i (unpackMask). */
  mask() { return call('grammar.mask', this._handle); }
  /** Advance by `tokens` if the grammar allows all of them; else change nothing, return false. */
  acceptTokens(tokens) { return call('grammar.accept', [this._handle, ints(tokens)]); }
  isTerminated() { return call('grammar.is_terminated', this._handle); }
  fork() { return new Matcher(null, call('grammar.fork', this._handle)); }
  rollback(n) { call('grammar.rollback', [this._handle, Math.trunc(n)]); }
  reset() { call('grammar.reset', this._handle); }
}

/** A decoder's events, one class each (`event instanceof tools.Event.Call`). */
function events(kinds) {
  return Object.fromEntries(Object.entries(kinds).map(([name, fields]) => [name, class {
    constructor(...values) { fields.forEach((field, i) => { this[field] = values[i]; }); }
    get [Symbol.toStringTag]() { return name; }
  }]));
}

/** Hands out a decoder's events one per feed, keeping the rest for the next feeds. */
class EventQueue {
  constructor(idle) {
    this.items = [];
    this.idle = idle;
  }

  next() { return this.items.length ? this.items.shift() : new this.idle(); }
}

export class ToolCall {
  constructor(name, argumentsJson) {
    this.name = name;
    this.argumentsJson = argumentsJson;
  }

  get arguments() { return JSON.parse(this.argumentsJson); }
}

const ToolEvent = events({ Idle: [], Start: [], Call: ['call'], Error: ['message', 'text'] });

function toolEvent(e) {
  if (e.type === 'start') return new ToolEvent.Start();
  if (e.type === 'call') return new ToolEvent.Call(new ToolCall(e.name, e.arguments_json));
  return new ToolEvent.Error(e.message, e.text);
}

/** Finds tool calls in one reply as its tokens are fed. */
class ToolDecoder {
  constructor() {
    this._handle = call('tools.decoder');
    this._queue = new EventQueue(ToolEvent.Idle);
  }

  _next(found) {
    this._queue.items.push(...found.map(toolEvent));
    return this._queue.next();
  }

  /** Generated tokens -> Event.Start, Event.Call (its .call), Event.Error or Event.Idle. */
  feed(tokens) {
    const ids = ints(tokens);
    return this._next(ids.length ? call('tools.feed', [this._handle, ids]) : []);
  }

  /** The reply is over: a call left open becomes Event.Error. */
  finish() { return this._next(call('tools.finish', this._handle)); }
}

export const tools = {
  /** The opening turn that declares the tools `specs` (with system message `system`). */
  equip: (specs, system = null) => call('tools.equip', { specs, system }),
  /** A turn that gives tool `name`'s result `value` (text as is, anything else as JSON). */
  answer: (name, value) => call('tools.answer', [String(name), value]),
  /** The grammar of valid calls to `specs` in the model's call syntax. */
  format: (specs) => new Grammar(call('tools.grammar', specs)),
  createMatcher: (specs) => new Matcher(tools.format(specs)),
  Decoder: ToolDecoder,
  Event: ToolEvent,
  ToolCall,
};

const ReasoningEvent = events({ Idle: [], Start: [], Delta: ['text'], End: ['text'] });

function reasoningEvent(e) {
  if (e.type === 'start') return new ReasoningEvent.Start();
  if (e.type === 'delta') return new ReasoningEvent.Delta(e.text);
  return new ReasoningEvent.End(e.text);
}

/** One reply's thinking block; consecutive deltas are joined. */
class ReasoningDecoder {
  constructor(cue = []) {
    this._handle = call('reasoning.decoder', ints(cue));
    this._queue = new EventQueue(ReasoningEvent.Idle);
  }

  /** A decoder for the reply that follows the tokens `cue` (the start of the turn). */
  static forCue(cue) { return new ReasoningDecoder(cue); }

  /** Generated tokens -> Event.Start, Event.Delta (text), Event.End (text) or Event.Idle. */
  feed(tokens) {
    const ids = ints(tokens);
    const found = ids.length ? call('reasoning.feed', [this._handle, ids]) : [];
    const items = this._queue.items;
    for (const e of found.map(reasoningEvent)) {
      const last = items[items.length - 1];
      if (e instanceof ReasoningEvent.Delta && last instanceof ReasoningEvent.Delta) {
        items[items.length - 1] = new ReasoningEvent.Delta(last.text + e.text);
      } else {
        items.push(e);
      }
    }
    return this._queue.next();
  }
}

export const reasoning = { Decoder: ReasoningDecoder, Event: ReasoningEvent };
