// Working sets, channels, forward passes and pipelines: the eta API's host side, as the Python
// SDK's eta.py (same host operations, same arguments).

import { attach, call, deferred, ints } from './host.js';
import { canonicalJson, isTracing, record, trace } from './trace.js';
import { model } from './model.js';

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

  /** A child sharing this one's frozen prefix, as it is once the passes submitted so far ran. */
  fork(pipe = null) {
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
// masks and channels

/** An array of booleans (one per token id) that keeps its packed words: a channel sends the
 * words (one int per 32 tokens), not one JSON boolean per token. */
export class Mask extends Array {}

/** One boolean per token id from packed int32 words (bit i % 32 of word i / 32 is token i). */
export function unpackMask(packed, vocab) {
  const n = packed.length;
  if (n * 32 < vocab) throw new RangeError(`${n} mask words hold ${n * 32} tokens, fewer than vocab ${vocab}`);
  const mask = new Mask(vocab);
  for (let i = 0; i < vocab; i++) mask[i] = ((packed[i >>> 5] >>> (i & 31)) & 1) === 1;
  mask.words = Array.from(packed.slice(0, (vocab + 31) >>> 5), (w) => w | 0);
  return mask;
}

const shapeOf = (values) => {
  const shape = [];
  for (let v = values; Array.isArray(v); v = v.length ? v[0] : null) shape.push(v.length);
  return shape;
};

const ready = new Map();     // channel handle -> values the host handed over, not taken yet
const waiting = new Map();   // channel handle -> the Promise of the host's next values

function scalar(value) {
  while (Array.isArray(value)) {
    if (value.length !== 1) throw new RangeError(`takeScalar read a value of ${value.length} elements; use take()`);
    [value] = value;
  }
  return value;
}

/** A typed queue in the engine's memory, of values of one `shape` and `dtype`. put/take inside
 * a traced epilogue or prologue run on the device; outside, they are host operations. */
export class Channel {
  constructor(shape, dtype = 'i32') {
    this._shape = ints(shape);
    this._dtype = String(dtype);
    this._capacity = 1;
    this._values = null;
    this._handle = null;
  }

  /** A channel holding `values` (its shape is theirs) as its first element (Python's from_). */
  static from(values, dtype = 'i32') {
    const chan = new Channel(shapeOf(values), dtype);
    chan._values = values;
    return chan;
  }

  /** How many values the channel can buffer; set it before the channel is used. */
  capacity(n) {
    if (this._handle !== null) throw new Error("set a channel's capacity before its first use");
    this._capacity = Math.trunc(n);
    return this;
  }

  _h() {
    if (this._handle === null) {
      this._handle = call('chan.create', { shape: this._shape, dtype: this._dtype,
                                           capacity: this._capacity, values: this._values });
    }
    return this._handle;
  }

  /** Enqueue a value (on the device inside a traced function, from the host otherwise). */
  put(value) {
    if (isTracing()) record('put', this._h(), value);
    else if (value instanceof Mask) call('chan.put_bits', [this._h(), value.words, value.length]);
    else call('chan.put', [this._h(), value]);
  }

  /** Dequeue a value: a tensor inside a traced function, a (nested) array on the host. */
  take() {
    if (isTracing()) return record('take', this._h());
    const queue = ready.get(this._h());
    if (queue?.length) return queue.shift();
    return call('chan.take', this._h());
  }

  /** The next value, as a number, once the device has put it. Readers waiting together share
   * one wait for the host's next values, and each gets the next. */
  async takeScalar() {
    const handle = this._h();
    for (;;) {
      const queue = ready.get(handle);
      if (queue?.length) {
        const value = scalar(queue[0]);     // a value that is not a scalar stays, for take()
        queue.shift();
        return value;
      }
      let next = waiting.get(handle);
      if (next === undefined) {
        const got = call('chan.take_scalar', handle);
        if ('values' in got) {
          ready.set(handle, [...got.values]);
          continue;
        }
        next = attach(got.future).then(
          (values) => { waiting.delete(handle); ready.set(handle, [...(ready.get(handle) ?? []), ...values]); },
          (error) => { waiting.delete(handle); throw error; });
        waiting.set(handle, next);
      }
      await next;
    }
  }

  _layout() {
    if (this._values === null) throw new Error('a channel used as indptr must be made with Channel.from(offsets)');
    return ints(this._values);
  }
}

// ---------------------------------------------------------------------------------------------
// forward passes and pipelines

const programs = new Map();     // a trace's JSON.stringify -> the engine's program id (per run)

/** The engine's program id for the traced function `f`. JavaScript cannot look inside a closure
 * (an arrow written in a loop is a new function each time, and one may read a variable that has
 * changed since), so `f` is traced at every use. A trace's IR text (canonicalJson, which took a
 * token's pass 0.05-0.23 ms, the trace 0.03-0.17 ms) is written, and the host asked, once per
 * distinct trace: the engine's JSON.stringify of it, a Float apart from an int, is the key. */
function program(f, nargs = 0) {
  const traced = trace(f, nargs);
  const key = JSON.stringify(traced);
  let pid = programs.get(key);
  if (pid === undefined) {
    pid = call('eta.program', canonicalJson(traced));
    programs.set(key, pid);
  }
  return pid;
}

const count = (shape) => shape.reduce((n, d) => n * d, 1);

/** One run of the model over some input rows. */
export class ForwardPass {
  constructor() {
    this._tokens = null;
    this._channel = null;
    this._indptr = null;
    this._ws = null;
    this._geometry = FOLDING;
    this._readout = null;
    this._checkpoints = null;
    this._mask = null;
    this._epilogue = null;
    this._prologue = null;
    this._adapters = [];
    this._result = null;
    this._submitted = false;
  }

  /** Input token ids, or a Channel whose next value holds them; `indptr` ([0, n0, n0+n1, ...],
   * an array or a Channel.from of one) splits them into lanes. */
  embed(tokens, indptr = null) {
    if (tokens instanceof Channel) [this._channel, this._tokens] = [tokens, null];
    else [this._tokens, this._channel] = [ints(tokens), null];
    if (indptr instanceof Channel) indptr = indptr._layout();
    this._indptr = indptr === null ? null : ints(indptr);
    return this;
  }

  /** The working set each lane extends, and how rows are placed (default: folding). */
  state(workingSets, geometry = null) {
    this._ws = workingSets instanceof WorkingSet ? [workingSets] : [...workingSets];
    this._geometry = geometry ?? FOLDING;
    return this;
  }

  /** Input rows whose outputs reach the epilogue; default: the last row of each lane. */
  readout(indices) {
    this._readout = ints(indices);
    return this;
  }

  /** Per-row attention masks: one boolean per slot of its lane's attended span (kvLen). */
  mask(rows) {
    this._mask = rows.map((row) => Array.from(row, Boolean));
    return this;
  }

  /** Lanes sharing attention state; each lane has its own working set here, so a no-op. */
  group(lane, id) {
    this._laneIndex(lane);
    return this;
  }

  input(lane, name, channel) { throw new RangeError(`the model declares no extra input '${name}': it takes only tokens`); }
  switch(lane, name, value) { throw new RangeError(`the model declares no switch '${name}' (it has none)`); }
  media(lane, spans) { throw new RangeError('the model is text-only: it takes no image or audio spans'); }

  /** Keep each lane's recurrent state at these slots, for a later cut back to one of them (a
   * model with recurrent layers; attention-only models keep nothing). */
  checkpoints(slots) {
    this._checkpoints = ints(slots);
    return this;
  }

  /** At projection `site`, replace the pass's projection output y by f(x, y) (traced). */
  adapter(site, f) {
    this._adapters.push([String(site), program(f, 2)]);
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

  _laneIndex(lane) {
    const lanes = this._indptr !== null ? this._indptr.length - 1 : 1;
    if (!(lane >= 0 && lane < lanes)) throw new RangeError(`lane ${lane} does not exist: the pass has ${lanes} lane(s)`);
    return Math.trunc(lane);
  }

  _spec() {
    return { lanes: this._lanes(), epilogue: this._epilogue, prologue: this._prologue, adapters: this._adapters };
  }

  _lanes() {
    if (this._tokens === null && this._channel === null) {
      throw new Error('a forward pass needs input: call fwd.embed(tokens) first');
    }
    if (!this._ws || !this._ws.length) {
      throw new Error('a forward pass needs working sets: call fwd.state([ws], geometry) first');
    }
    const n = this._tokens !== null ? this._tokens.length : count(this._channel._shape);
    const bounds = this._indptr ?? [0, n];
    const nLanes = bounds.length - 1;
    if (nLanes < 1 || bounds[0] !== 0 || bounds[nLanes] !== n || bounds.some((b, i) => i && bounds[i - 1] > b)) {
      throw new RangeError(`indptr [${bounds}] does not split ${n} tokens into lanes`);
    }
    if (this._ws.length !== nLanes) throw new RangeError(`${nLanes} lanes but ${this._ws.length} working sets`);
    if (this._channel !== null && nLanes !== 1) throw new RangeError('a pass taking its tokens from a channel has one lane');
    if (this._mask !== null && this._mask.length !== n) {
      throw new RangeError(`mask has ${this._mask.length} rows for ${n} input rows`);
    }
    const geometry = this._geometry._fields();
    return Array.from({ length: nLanes }, (_, i) => {
      const [lo, hi] = [bounds[i], bounds[i + 1]];
      const lane = { ws: this._ws[i]._h(), ...geometry };
      if (this._channel !== null) Object.assign(lane, { chan: this._channel._h(), tokens: [] });
      else lane.tokens = this._tokens.slice(lo, hi);
      if (this._readout !== null) lane.readout = this._readout.filter((r) => r >= lo && r < hi).map((r) => r - lo);
      if (this._checkpoints !== null) lane.checkpoints = this._checkpoints;
      if (this._mask !== null) lane.mask = this._mask.slice(lo, hi);
      return lane;
    });
  }
}

/** Passes submitted to a pipeline run in submission order; submit never blocks. */
export class Pipeline {
  constructor() { this._closed = false; }

  _check(fwd) {
    if (this._closed) throw new Error('submit on a closed pipeline');
    if (fwd._submitted) throw new Error('this forward pass was already submitted');
  }

  /** Queue one forward pass. */
  submit(fwd) {
    this._check(fwd);
    freeDropped();
    const fid = call('eta.submit', fwd._spec());
    fwd._submitted = true;
    attach(fid, fwd._result ?? deferred());
  }

  /** Queue passes that run in back-to-back scheduler waves, in order. */
  submitFrame(passes) {
    for (const fwd of passes) this.submit(fwd);
  }

  /** Run `fwd` again and again on the engine until `onToken()` returns (or resolves to) false or
   * `budget` runs were read; returns the runs kept. As Python's run_ahead, `wakeEvery` (1 to
   * model.runAheadWindow()) wakes a waiting read once that many values are there. */
  async runAhead(fwd, budget, onToken, wakeEvery = 1) {
    this._check(fwd);
    const window = model.runAheadWindow();
    if (!(Number.isInteger(wakeEvery) && wakeEvery >= 1 && wakeEvery <= window)) {
      throw new RangeError(`wakeEvery must be from 1 to model.runAheadWindow() (${window}), got ${wakeEvery}`);
    }
    freeDropped();
    const run = call('eta.run_ahead', { ...fwd._spec(), budget: Math.trunc(budget), window: 2 * window,
                                        wake_every: wakeEvery });
    fwd._submitted = true;
    let finished = false;
    const done = attach(run.done);
    done.then(() => { finished = true; }, () => { finished = true; });
    let read = 0;
    try {
      while (read < budget) {
        const go = await onToken();
        read += 1;
        if (!go) break;
        if (read % window === 0) call('eta.run_ahead_ack', [run.run, read]);
      }
    } finally {
      if (!finished) {
        call('eta.run_ahead_stop', [run.run, read]);
        for (const handle of run.puts) ready.delete(handle);   // what came past the stop is cut off too
      }
    }
    return await done;
  }

  /** No more passes; those already submitted still run. */
  close() { this._closed = true; }

  /** Park the program: its working sets may leave the engine's KV pool while it waits. */
  park() { call('eta.park'); }
}

// ---------------------------------------------------------------------------------------------
// the plain decoding loop

const greedy = () => record('reduce_argmax', record('output', 0, 'logits'));

/** Feed `tokens` into `ws`, then decode one token a pass until a token in `stop` or `maxTokens`
 * passes; yields each new token, the stop token not included. `sample` is the epilogue (greedy
 * by default). As Python's eta.generate. */
export async function* generate(ws, pipe, tokens, maxTokens, stop = [], sample = greedy) {
  const stops = new Set(stop);
  for (let i = 0; i < maxTokens; i++) {
    const fwd = new ForwardPass();
    fwd.embed(tokens);
    fwd.state([ws], StateGeometry.folding());
    const chosen = fwd.epilogue(sample);
    pipe.submit(fwd);
    const token = await chosen;
    if (stops.has(token)) return;
    yield token;
    tokens = [token];
  }
}
