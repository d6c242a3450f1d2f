// model and chat: the model's facts, its tokenizer, and each piece of a conversation as token
// ids from the model's chat template.

import { call, ints } from './host.js';

let info = null;     // model.info, asked for once per run (each run is a fresh instance)

function modelInfo(key) {
  if (info === null) info = call('model.info');
  return info[key];
}

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
