// Builds the JavaScript runner component with componentize-js (pinned in package.json), changing
// one function of the bindings it generates for the world's imports and exports.
//
//     node build-runner.mjs RUNNER.js WIT_DIR WORLD OUT.wasm [disabled WASI feature...]
//
// The bindings hand each string to the host through `_utf8AllocateAndEncode`, which measures the
// string's UTF-8 length in a loop of JavaScript before encoding it. The engine here interprets
// JavaScript, and that loop cost ~0.2 µs a character: a host call with 1,000 characters of
// arguments took 0.29 ms against 0.05 ms with one. Here the string is encoded by the engine's
// native TextEncoder, and its bytes copied to the memory the host reads.

import { writeFile } from 'node:fs/promises';
import { resolve } from 'node:path';

import { componentize } from '@bytecodealliance/componentize-js';
// the very module componentize-js calls (the package exports no path to it)
import { splicer } from './node_modules/@bytecodealliance/componentize-js/lib/spidermonkey-embedding-splicer.js';

const GENERATED = /^function _utf8AllocateAndEncode\(s, realloc, memory\) \{\n[\s\S]*?\n\}\n/m;
const NATIVE = `function _utf8AllocateAndEncode(s, realloc, memory) {
  if (typeof s !== 'string') {
    throw new TypeError('expected a string, received [' + typeof s + ']');
  }
  if (s.length === 0) { return { ptr: 1, len: 0 }; }
  const bytes = TEXT_ENCODER_UTF8.encode(s);
  const ptr = realloc(0, 0, 1, bytes.length);
  new Uint8Array(memory.buffer, ptr, bytes.length).set(bytes);
  return { ptr, len: bytes.length };
}
`;

const spliceBindings = splicer.spliceBindings;
splicer.spliceBindings = (...args) => {
  const spliced = spliceBindings(...args);
  if (!GENERATED.test(spliced.jsBindings)) {
    throw new Error('the bindings componentize-js generated have no _utf8AllocateAndEncode to replace '
                    + '(was componentize-js upgraded?)');
  }
  return { ...spliced, jsBindings: spliced.jsBindings.replace(GENERATED, NATIVE) };
};

const [runner, wit, worldName, out, ...disableFeatures] = process.argv.slice(2);
if (!out) {
  console.error('usage: node build-runner.mjs RUNNER.js WIT_DIR WORLD OUT.wasm [disabled WASI feature...]');
  process.exit(2);
}
const { component } = await componentize({ sourcePath: resolve(runner), witPath: resolve(wit), worldName, disableFeatures });
await writeFile(out, component);
