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
export function call(op, args = null) {
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

/** Bytes (a Uint8Array, or text as UTF-8) as base64, the form binary data crosses in. */
export function toBase64(data) {
  const bytes = typeof data === 'string' ? new TextEncoder().encode(data) : Uint8Array.from(data);
  let binary = '';
  for (let i = 0; i < bytes.length; i += 0x8000) {
    binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  }
  return btoa(binary);
}

export function fromBase64(text) {
  const binary = atob(text);
  return Uint8Array.from(binary, (c) => c.charCodeAt(0));
}
