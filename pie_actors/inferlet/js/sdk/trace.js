// Tracing: an epilogue's eta operations recorded into the IR {"ops": [[op, args]...], "outputs"},
// written byte for byte as the Python SDK writes it, so that the engine compiles one program
// for both.
//
// Numbers: JavaScript has one number type, Python two, and the IR keeps Python's. A whole
// number is written as an int (2), any other as a float (0.7); `float(x)` marks a number that
// Python would hold as a float even when it is whole (Python's 1.0, float("-inf")).

/** A placeholder for a device tensor while an epilogue is traced. JavaScript has no operator
 * overloading: `x.div(0.7)` is Python's `x / 0.7`. */
export class Tensor {
  constructor(ref) { this._ref = ref; }
  toString() { return `Tensor(%${this._ref})`; }
  add(o) { return record('add', this, o); }
  sub(o) { return record('sub', this, o); }
  mul(o) { return record('mul', this, o); }
  div(o) { return record('div', this, o); }
  neg() { return record('neg', this); }
}

/** A number the IR writes as a float, as Python writes its floats (see float()). */
class Float {
  constructor(value) { this.value = Number(value); }

  /** In JSON.stringify of a trace (passes.js keys its programs by it), a Float stays apart from
   * an int and from a tensor ({t}), and keeps NaN, the infinities and -0. */
  toJSON() { return { f: Object.is(this.value, -0) ? '-0' : String(this.value) }; }
}

/** `x` as a float in the IR: float(1) is Python's 1.0 (a whole JavaScript number is an int). */
export const float = (x) => (x instanceof Float ? x : new Float(x));

let tracing = null;     // the op list of the trace in progress

/** Whether an epilogue or prologue is being traced now. */
export const isTracing = () => tracing !== null;

function irArg(value) {
  switch (typeof value) {
    case 'number': return Number.isInteger(value) ? value : new Float(value);
    case 'boolean':
    case 'string': return value;
    default:
      if (value instanceof Tensor) return { t: value._ref };
      if (Array.isArray(value)) return value.map(irArg);
      if (value === null || value instanceof Float) return value;
      throw new TypeError(`an eta operation cannot take ${typeof value} values`);
  }
}

/** Record eta operation `op` on `args` into the trace in progress; the tensor it makes. */
export function record(op, ...args) {
  if (tracing === null) {
    throw new Error(`eta operation '${op}' used outside an epilogue or prologue ` +
                    '(they run on the device, traced by fwd.epilogue(f))');
  }
  tracing.push([op, args.map(irArg)]);
  return new Tensor(tracing.length - 1);
}

/** Trace `f(...args)` into the IR; its `nargs` arguments are placeholders (adapters: x and y). */
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

/** A float as Python's repr writes it: the shortest digits that read back (as JavaScript's),
 * with exponents below 1e-4 and from 1e16 on, "e-05" style, and ".0" on whole numbers. */
function pythonFloat(x) {
  if (Number.isNaN(x)) return 'NaN';
  if (!Number.isFinite(x)) return x > 0 ? 'Infinity' : '-Infinity';
  if (x === 0) return Object.is(x, -0) ? '-0.0' : '0.0';
  const [mantissa, e] = Math.abs(x).toExponential().split('e');
  const sign = x < 0 ? '-' : '';
  const digits = mantissa.replace('.', '');
  const exp = Number(e);
  if (exp < -4 || exp >= 16) {
    const head = digits.length > 1 ? `${digits[0]}.${digits.slice(1)}` : digits;
    return `${sign}${head}e${exp < 0 ? '-' : '+'}${String(Math.abs(exp)).padStart(2, '0')}`;
  }
  if (exp < 0) return `${sign}0.${'0'.repeat(-exp - 1)}${digits}`;
  const whole = digits.slice(0, exp + 1).padEnd(exp + 1, '0');
  return `${sign}${whole}.${digits.slice(exp + 1) || '0'}`;
}

/** JSON text as Python's json.dumps(sort_keys=True, separators=(",", ":")) writes it: the IR's
 * bytes are the program's identity in the engine's cache, the same from either SDK. */
export function canonicalJson(value) {
  if (value instanceof Float) return pythonFloat(value.value);
  if (typeof value === 'number') {
    return Number.isInteger(value) ? BigInt(value).toString() : pythonFloat(value);
  }
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
// in camelCase: reduce_argmax -> reduceArgmax.
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
