// session (whoever started the inferlet, and the owner's other processes), runtime (spawning
// processes) and http (requests the host makes within the run's guards).

import { send as wasmSend } from 'pie:inferlet/host@0.1.0';
import { HostError, call, callAsync, callJson, fromBase64, toBase64 } from './host.js';

export const session = {
  /** Stream `message` to the client now: text as is, anything else as JSON. */
  send: (message) => wasmSend(typeof message === 'string' ? message : JSON.stringify(message)),
  /** The next message for this process, from its client or another process's sendTo. */
  receive: () => callAsync('session.receive'),
  /** receive(), with who sent it: [sender, message], sender null for the client. */
  receiveFrom: () => callAsync('session.receive_from'),
  /** Send binary data (a Uint8Array, or text as UTF-8) to the client. */
  sendFile: (data) => callJson('session.send_file', `"${toBase64(data)}"`),
  /** The next binary message from the client, as a Uint8Array. */
  receiveFile: async () => fromBase64(await callAsync('session.receive_file')),
  /** The file attached at launch as `pie run --file name=path`, as a Uint8Array. */
  file: (name) => fromBase64(call('session.file', String(name))),
  /** Deliver `message` (text or a JSON value) to the named process of the same owner (a name,
   * or a child from runtime.spawn). */
  sendTo: (process, message) => call('session.send_to', [String(process?.name ?? process), message]),
};

/** A spawned process: its `name`, `await result()` (main's output; a failed child rejects with
 * HostError) and `kill()`. */
export class Child {
  constructor(id, name) {
    this._id = id;
    this.name = name;
  }

  result() { return callAsync('runtime.result', this._id); }
  kill() { call('runtime.kill', this._id); }
  toString() { return `Child(${this.name})`; }
}

// a module of the bundle is a path of words ("worker", "agents/judge.js"); anything else is source
const MODULE = /^[\w$@.\/-]+$/;

export const runtime = {
  /** Start `program` (a module of this inferlet's bundle, by path, or JavaScript source) on `input`.
   * Options: name, detached, node, model (as Python's keywords). */
  spawn: async (program, input = null, { name = null, detached = false, node = null, model = null } = {}) => {
    const text = String(program);
    const spec = MODULE.test(text) ? { module: text } : { source: text };
    const info = call('runtime.spawn', { program: spec, input, name, detached: Boolean(detached), node, model });
    return new Child(info.id, info.name);
  },
  /** This process's name: what other processes' sendTo reach it by. */
  name: () => call('runtime.name'),
  /** This program may run again from its start if its engine is lost under it. */
  declareRestartable: () => call('runtime.declare_restartable'),
};

const HTTP_KINDS = ['refused', 'timeout', 'too_large', 'failed'];

/** A request the host refused or could not complete; `kind` is one of refused, timeout,
 * too_large, failed. */
export class HttpError extends Error {
  constructor(kind, message) {
    super(message);
    this.name = 'HttpError';
    this.kind = kind;
  }
}

/** What the server answered: status, url, headers (lower-case names; headerList keeps repeats),
 * body (a Uint8Array), and text / json(). */
export class Response {
  constructor(raw) {
    this.status = raw.status;
    this.url = raw.url;
    this.headerList = raw.headers.map(([k, v]) => [k.toLowerCase(), v]);
    this.headers = Object.fromEntries(this.headerList);
    this.body = fromBase64(raw.body);
  }

  get ok() { return this.status >= 200 && this.status < 300; }
  get text() { return new TextDecoder().decode(this.body); }
  json() { return JSON.parse(this.text); }
}

function httpError(e) {
  let text = e.message;
  if (text.startsWith('http.fetch: ')) text = text.slice('http.fetch: '.length);   // refused before it went out
  const at = text.indexOf(': ');
  const kind = at < 0 ? '' : text.slice(0, at);
  return HTTP_KINDS.includes(kind) ? new HttpError(kind, text.slice(at + 2)) : new HttpError('failed', text);
}

export const http = {
  /** Make an HTTP request; `body` is a Uint8Array or text (sent as UTF-8); `timeout` in seconds. */
  fetch: async (url, { method = 'GET', headers = {}, body = null, timeout = 10.0 } = {}) => {
    const args = { url: String(url), method, headers: { ...headers }, timeout,
                   body: body === null || body === undefined ? null : toBase64(body) };
    try {
      return new Response(await callAsync('http.fetch', args));
    } catch (e) {
      if (e instanceof HostError) throw httpError(e);
      throw e;
    }
  },
};
