// The host boundary (wit/inferlet.wit): synchronous calls, and futures completed later.

import { call as wasmCall, poll as wasmPoll, waitAny as wasmWaitAny }
  from 'pie:inferlet/host@0.1.0';

const NO_TIMEOUT_MS = 0xFFFFFFFF;

/** A host operation or a host future failed; the message is the host's. */
export class HostError extends Error {
  constructor(message) {
    super(message);
    this.name = 'HostError';
  }
}

const pending = new Map();     // host future id -> {resolve, reject} of the Promise awaiting it

/** Run host operation `op` on `args` (JSON); its result, or HostError with the host's message. */
export const call = (op, args = null) => callJson(op, JSON.stringify(args));

/** call() with its arguments as JSON text already. Binary data (base64) goes this way:
 * JSON.stringify's buffer of a megabyte string costs the sandbox's heap several megabytes. */
export function callJson(op, argsJson) {
  let out;
  try {
    out = wasmCall(op, argsJson);
  } catch (e) {
    // the host's `err` arrives as an Error whose payload is the host's message
    if (e && e.payload !== undefined) throw new HostError(`${op}: ${e.payload}`);
    throw e;
  }
  return JSON.parse(out);
}

/** A Promise with its resolve and reject beside it. */
export function deferred() {
  const d = {};
  d.promise = new Promise((resolve, reject) => { d.resolve = resolve; d.reject = reject; });
  return d;
}

/** Settle `d` (a deferred) when the host completes future `fid`; returns its Promise. */
export function attach(fid, d = deferred()) {
  if (pending.has(fid)) throw new Error(`host future ${fid} is already awaited`);
  pending.set(fid, d);
  return d.promise;
}

/** Call an op that returns a host future id; a Promise of what the future completes with. */
export function callAsync(op, args = null) {
  return attach(call(op, args));
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

/** Whole numbers of `values` (what Python's int() makes of them). */
export const ints = (values) => Array.from(values, (v) => Math.trunc(Number(v)));

const BASE64 = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/';
const CODES = Array.from(BASE64, (c) => c.charCodeAt(0));
const CHUNK = 3 * 1024;      // bytes encoded per string piece (4,096 characters)

/** Bytes (a Uint8Array, or text as UTF-8) as base64, the form binary data crosses in. Encoded a
 * piece at a time into a reused buffer: btoa of a byte string costs the sandbox's heap many times
 * the data's size. */
export function toBase64(data) {
  const bytes = typeof data === 'string' ? new TextEncoder().encode(data) : data instanceof Uint8Array ? data
    : Uint8Array.from(data);
  const pieces = [];
  const out = new Uint16Array(CHUNK / 3 * 4);
  for (let start = 0; start < bytes.length; start += CHUNK) {
    const end = Math.min(start + CHUNK, bytes.length);
    let n = 0;
    for (let i = start; i < end; i += 3) {
      const left = end - i;
      const word = (bytes[i] << 16) | ((left > 1 ? bytes[i + 1] : 0) << 8) | (left > 2 ? bytes[i + 2] : 0);
      out[n++] = CODES[word >>> 18];
      out[n++] = CODES[(word >>> 12) & 63];
      out[n++] = left > 1 ? CODES[(word >>> 6) & 63] : 61;     // 61: "="
      out[n++] = left > 2 ? CODES[word & 63] : 61;
    }
    pieces.push(String.fromCharCode.apply(null, out.subarray(0, n)));
  }
  return pieces.join('');
}

const VALUES = new Uint8Array(128);     // character code -> its 6 bits
CODES.forEach((code, i) => { VALUES[code] = i; });

export function fromBase64(text) {
  const clean = text.replace(/=+$/, '');
  const bytes = new Uint8Array(Math.floor(clean.length * 3 / 4));
  let n = 0;
  for (let i = 0; i < clean.length; i += 4) {
    const word = (VALUES[clean.charCodeAt(i)] << 18) | (VALUES[clean.charCodeAt(i + 1)] << 12)
      | (VALUES[clean.charCodeAt(i + 2)] << 6) | VALUES[clean.charCodeAt(i + 3)];
    bytes[n++] = word >>> 16;
    if (n < bytes.length) bytes[n++] = (word >>> 8) & 255;
    if (n < bytes.length) bytes[n++] = word & 255;
  }
  return bytes;
}
