// inferlet: the JavaScript SDK, importable by an inferlet as "inferlet" or "@pie-project/inferlet".
//
// The same surface as the Python SDK (pie_actors/inferlet/sdk/inferlet), its names in camelCase:
// every function calls the same host operation with the same JSON arguments (ops.py lists them),
// and an epilogue traced here is the same IR text as the Python one, so the engine compiles one
// program for both. What Python awaits is a Promise here; the runner (runner.js) resolves them
// from the host's completions.

import { call as wasmCall, poll as wasmPoll, waitAny as wasmWaitAny, send as wasmSend }
  from 'pie:inferlet/host@0.1.0';

// ---------------------------------------------------------------------------------------------
// the host boundary (wit/inferlet.wit): synchronous calls, and futures completed later

const NO_TIMEOUT_MS = 0xFFFFFFFF;

/** A host operation or a host future failed; the message is the host's. */
export class HostError extends Error {
  constructor(message) {
    super(message);
    this.name = 'HostError';
  }
}

const pending = new Map();     // host future id -> {resolve, reject} of the Promise awaiting it

function call(op, args = null) {
  let out;
  try {
    out = wasmCall(op, JSON.stringify(args));
  } catch (e) {
    // the host's `err` arrives as an Error whose payload is the host's message
    if (e && e.payload !== undefined) throw new HostError(`${op}: ${e.payload}`);
    throw e;
  }
  return JSON.parse(out);
}

function deferred() {
  const d = {};
  d.promise = new Promise((resolve, reject) => { d.resolve = resolve; d.reject = reject; });
  return d;
}

/** Settle `d` (a deferred) when the host completes future `fid`. */
function attach(fid, d) {
  if (pending.has(fid)) throw new Error(`host future ${fid} is already awaited`);
  pending.set(fid, d);
  return d.promise;
}

function callAsync(op, args = null) {
  return attach(call(op, args), deferred());
}

function settle(completions) {
  if (completions === '{}') return;
  for (const [key, outcome] of Object.entries(JSON.parse(completions))) {
    const d = pending.get(Number(key));
    if (d === undefined) continue;
    pending.delete(Number(key));
    if ('ok' in outcome) d.resolve(outcome.ok);
    else d.reject(new HostError(outcome.err ?? 'host future failed'));
  }
}

/** What the runner's event loop needs: whether host futures are awaited, and a blocking wait. */
export const _host = {
  pending: () => pending.size,
  poll: () => settle(wasmPoll(JSON.stringify([...pending.keys()]))),
  wait: () => settle(wasmWaitAny(JSON.stringify([...pending.keys()]), NO_TIMEOUT_MS)),
};

// ---------------------------------------------------------------------------------------------
// model

let info = null;     // model.info, asked for once per run (each run is a fresh instance)

function modelInfo(key) {
  if (info === null) info = call('model.info');
  return info[key];
}

const ints = (values) => Array.from(values, (v) => Math.trunc(Number(v)));

export const model = {
  /** Token ids of `text` (no BOS/EOS added: see chat.prefix()). */
  encode: (text) => call('model.encode', String(text)),
  /** Text of token ids; with `after`, the text that follows the first `after` ids' own text. */
  decode: (tokens, after = 0) => {
    const ids = ints(tokens);
    return call('model.decode', after ? { tokens: ids, after: Math.trunc(after) } : ids);
  },
  name: () => modelInfo('name'),
  architecture: () => modelInfo('architecture'),
  outputVocabSize: () => modelInfo('output_vocab_size'),
  kvPageSize: () => modelInfo('kv_page_size'),
  frameSize: () => modelInfo('frame_size'),
  channelCapacity: () => modelInfo('channel_capacity'),
  runAheadWindow: () => modelInfo('run_ahead_window'),
  maxPosition: () => modelInfo('max_position'),
};

// ---------------------------------------------------------------------------------------------
// chat: each piece of a conversation as token ids, from the model's chat template

const fixedPieces = new Map();   // per-run cache of the pieces that take no text

function piece(kind, args = null) {
  const key = args === null ? kind : `${kind}:${args}`;
  if (!fixedPieces.has(key)) fixedPieces.set(key, call(`chat.${kind}`, args));
  return [...fixedPieces.get(key)];
}

export const chat = {
  prefix: () => piece('prefix'),
  system: (text) => call('chat.system', String(text)),
  user: (text) => call('chat.user', String(text)),
  assistant: (text) => call('chat.assistant', String(text)),
  systemUser: (system, user) => call('chat.system_user', [String(system), String(user)]),
  firstUser: (text) => call('chat.first_user', String(text)),
  systemThinking: (text, effort) => call('chat.system_thinking', [String(text), String(effort)]),
  cue: () => piece('cue'),
  cueWithoutThinking: () => piece('cue_without_thinking'),
  cueThinking: (thinking) => piece('cue_thinking', Boolean(thinking)),
  seal: () => piece('seal'),
  stopTokens: () => piece('stop_tokens'),
};

// ---------------------------------------------------------------------------------------------
// session: whoever started the inferlet, and the owner's other processes

export const session = {
  /** Stream `message` to the client now: text as is, anything else as JSON. */
  send: (message) => wasmSend(typeof message === 'string' ? message : JSON.stringify(message)),
  /** The next message for this process, from its client or another process's sendTo. */
  receive: () => callAsync('session.receive'),
  /** receive(), with who sent it: [sender, message], sender null for the client. */
  receiveFrom: () => callAsync('session.receive_from'),
  /** Deliver `message` to the named process of the same owner. */
  sendTo: (process, message) => call('session.send_to', [String(process?.name ?? process), message]),
};

// ---------------------------------------------------------------------------------------------
// working sets

const dropped = [];   // handles of working sets the program no longer references
const workingSets = typeof FinalizationRegistry === 'function'
  ? new FinalizationRegistry((handle) => dropped.push(handle)) : null;

/** Tell the host about dropped working sets (a finalizer must not call the host itself). */
function freeDropped() {
  if (dropped.length) call('ws.free', dropped.splice(0));
}

/** One sequence's state inside the model (its KV cache); made on the host at first use. */
export class WorkingSet {
  constructor() {
    this._handle = null;
    this.restored = null;     // how WorkingSet.open brought it back; null: made here
  }

  _h() {
    if (this._handle === null) {
      freeDropped();
      this._own(call('ws.create'));
    }
    return this._handle;
  }

  _own(handle) {
    this._handle = handle;
    workingSets?.register(this, handle);
  }

  folded() { return call('ws.state', this._h()).folded; }
  cachedTokens() { return call('ws.state', this._h()).cached_tokens; }

  fork() {
    const child = new WorkingSet();
    child._own(call('ws.fork', this._h()));
    return child;
  }

  reserve(end) { call('ws.reserve', [this._h(), Math.trunc(end)]); }
  save(name) { return call('ws.save', [this._h(), String(name)]); }

  static open(name) {
    freeDropped();
    const opened = call('ws.open', String(name));
    const ws = new WorkingSet();
    ws._own(opened.ws);
    ws.restored = opened.restored;
    return ws;
  }

  static saved() { return call('ws.saved'); }
  static deleteSaved(name) { call('ws.delete_saved', String(name)); }
}

/** How a pass's rows are placed in its working sets: folding() appends them causally and
 * freezes them; explicit positions/slots/kvLen/fold place them yourself. */
export class StateGeometry {
  constructor({ positions = null, slots = null, kvLen = null, fold = true } = {}) {
    this.positions = positions === null ? null : ints(positions);
    this.slots = slots === null ? null : ints(slots);
    this.kvLen = kvLen === null ? null : Math.trunc(kvLen);
    this.fold = typeof fold === 'boolean' ? fold : Math.trunc(fold);
  }

  static folding() { return FOLDING; }

  _fields() {
    const out = {};
    if (this.positions !== null) out.positions = this.positions;
    if (this.slots !== null) out.slots = this.slots;
    if (this.kvLen !== null) out.kv_len = this.kvLen;
    if (this.fold !== true) out.fold = this.fold;
    return out;
  }
}

const FOLDING = new StateGeometry();

// ---------------------------------------------------------------------------------------------
// tracing: an epilogue's eta operations recorded into the IR {"ops": [[op, args]...], "outputs"}

/** A placeholder for a device tensor while an epilogue is traced. */
export class Tensor {
  constructor(ref) { this._ref = ref; }
  toString() { return `Tensor(%${this._ref})`; }
  add(o) { return record('add', this, o); }
  sub(o) { return record('sub', this, o); }
  mul(o) { return record('mul', this, o); }
  div(o) { return record('div', this, o); }
  neg() { return record('neg', this); }
}

let tracing = null;     // the op list of the trace in progress

function irArg(value) {
  if (value instanceof Tensor) return { t: value._ref };
  if (Array.isArray(value)) return value.map(irArg);
  if (value === null || ['boolean', 'number', 'string'].includes(typeof value)) return value;
  throw new TypeError(`an eta operation cannot take ${typeof value} values`);
}

function record(op, ...args) {
  if (tracing === null) {
    throw new Error(`eta operation '${op}' used outside an epilogue or prologue ` +
                    '(they run on the device, traced by fwd.epilogue(f))');
  }
  tracing.push([op, args.map(irArg)]);
  return new Tensor(tracing.length - 1);
}

/** Trace `f(...args)` into the IR; its `nargs` arguments are placeholders. */
export function trace(f, nargs = 0) {
  if (tracing !== null) throw new Error('epilogues cannot be traced inside another trace');
  tracing = [];
  let out, ops;
  try {
    out = f(...Array.from({ length: nargs }, (_, i) => record('arg', i)));
    ops = tracing;
  } finally {
    tracing = null;
  }
  const outs = out === undefined || out === null ? [] : Array.isArray(out) ? out : [out];
  for (const o of outs) {
    if (!(o instanceof Tensor)) throw new TypeError(`an epilogue must return eta tensors, got ${typeof o}`);
  }
  return { ops, outputs: outs.map((o) => o._ref) };
}

/** JSON text as Python's json.dumps(sort_keys=True, separators=(",", ":")) writes it: the IR's
 * bytes are the program's identity in the engine's cache, the same from either SDK. */
export function canonicalJson(value) {
  if (Array.isArray(value)) return `[${value.map(canonicalJson).join(',')}]`;
  if (value !== null && typeof value === 'object') {
    const keys = Object.keys(value).sort();
    return `{${keys.map((k) => `${JSON.stringify(k)}:${canonicalJson(value[k])}`).join(',')}}`;
  }
  return JSON.stringify(value);
}

export const intrinsics = {
  /** The named model output (e.g. "logits") of `lane`'s read-out rows. */
  output: (lane, name) => record('output', Math.trunc(lane), String(name)),
};

export const dtype = { f32: 'f32', f16: 'f16', bf16: 'bf16', i32: 'i32', i64: 'i64', u32: 'u32', bool: 'bool' };

// The eta operations (Python's names; each recorded under its name without a trailing "_"),
// exported in camelCase: reduce_argmax -> reduceArgmax.
const ETA_OPS = ['add', 'sub', 'mul', 'div', 'neg', 'abs', 'exp', 'log', 'cos', 'l2norm', 'matmul',
  'max_elem', 'min_elem', 'eq', 'ne', 'lt', 'le', 'gt', 'ge', 'and_', 'select', 'mask_apply',
  'reshape', 'broadcast', 'cast', 'constant', 'iota', 'indptr', 'reduce_max', 'reduce_sum',
  'reduce_argmax', 'cumsum', 'cumprod', 'cummass_le', 'softmax', 'log_softmax', 'entropy',
  'entropy_from_logprobs', 'top_k', 'nucleus_sample', 'gumbel', 'gumbel_max', 'masked_argmax',
  'gather', 'gather_row', 'causal_mask'];

const camel = (name) => name.replace(/_$/, '').replace(/_([a-z0-9])/g, (_, c) => c.toUpperCase());

export const eta = Object.fromEntries(ETA_OPS.map((name) => {
  const op = name.replace(/_$/, '');
  return [camel(name), (...args) => record(op, ...args)];
}));

export const {
  add, sub, mul, div, neg, abs, exp, log, cos, l2norm, matmul, maxElem, minElem, eq, ne, lt, le, gt, ge, and, select,
  maskApply, reshape, broadcast, cast, constant, iota, indptr, reduceMax, reduceSum, reduceArgmax,
  cumsum, cumprod, cummassLe, softmax, logSoftmax, entropy, entropyFromLogprobs, topK,
  nucleusSample, gumbel, gumbelMax, maskedArgmax, gather, gatherRow, causalMask,
} = eta;

// ---------------------------------------------------------------------------------------------
// forward passes and pipelines

const programs = new Map();     // IR text -> the engine's program id (per run)

/** The engine's program id for the traced function `f`. JavaScript cannot look inside a
 * closure, so `f` is traced at every use; the host is asked once per distinct IR. */
function program(f, nargs = 0) {
  const ir = canonicalJson(trace(f, nargs));
  if (!programs.has(ir)) programs.set(ir, call('eta.program', ir));
  return programs.get(ir);
}

/** One run of the model over some input rows. */
export class ForwardPass {
  constructor() {
    this._tokens = null;
    this._ws = null;
    this._geometry = FOLDING;
    this._readout = null;
    this._epilogue = null;
    this._prologue = null;
    this._result = null;
    this._submitted = false;
  }

  /** Input token ids. */
  embed(tokens) {
    this._tokens = ints(tokens);
    return this;
  }

  /** The working set the pass extends, and how rows are placed (default: folding). */
  state(workingSets, geometry = null) {
    this._ws = workingSets instanceof WorkingSet ? [workingSets] : [...workingSets];
    this._geometry = geometry ?? FOLDING;
    return this;
  }

  /** Input rows whose outputs reach the epilogue; default: the last row. */
  readout(indices) {
    this._readout = ints(indices);
    return this;
  }

  /** Device code run before the model pass (traced like an epilogue). */
  prologue(f) {
    this._prologue = program(f);
    return this;
  }

  /** Attach device code run after the pass; returns a Promise of its result. */
  epilogue(f) {
    this._epilogue = program(f);
    this._result = deferred();
    return this._result.promise;
  }

  _spec() {
    if (this._tokens === null) throw new Error('a forward pass needs input: call fwd.embed(tokens) first');
    if (!this._ws || this._ws.length !== 1) {
      throw new Error('a forward pass needs one working set: call fwd.state([ws], geometry) first');
    }
    const lane = { ws: this._ws[0]._h(), ...this._geometry._fields(), tokens: this._tokens };
    if (this._readout !== null) lane.readout = this._readout;
    return { lanes: [lane], epilogue: this._epilogue, prologue: this._prologue, adapters: [] };
  }
}

/** Passes submitted to a pipeline run in submission order; submit never blocks. */
export class Pipeline {
  constructor() { this._closed = false; }

  /** Queue one forward pass. */
  submit(fwd) {
    if (this._closed) throw new Error('submit on a closed pipeline');
    if (fwd._submitted) throw new Error('this forward pass was already submitted');
    freeDropped();
    const fid = call('eta.submit', fwd._spec());
    fwd._submitted = true;
    attach(fid, fwd._result ?? deferred());
  }

  /** No more passes; those already submitted still run. */
  close() { this._closed = true; }
}
