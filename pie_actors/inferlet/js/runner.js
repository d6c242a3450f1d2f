// The JavaScript runner component's entry (componentize-js): implements the world's `run` export.
//
// One component serves every JavaScript inferlet: the program's source arrives with each run. It
// is an ES module (`import {...} from "inferlet"`, `export async function main(input)`), which
// the engine here cannot load from text, so its import and export statements are rewritten in
// place, without moving a line, and the body is evaluated as a function of its imports. Stacks
// and syntax errors then name main.js with the source's own lines and columns.
//
// An error is returned as the JSON object the host reads ({kind, message, traceback}), thrown as
// a string: a thrown Error object would trap the instance instead of returning `err`.

import * as inferlet from './inferlet.js';

const FILENAME = 'main.js';
const MODULES = { inferlet, '@pie-project/inferlet': inferlet };
// the function the source becomes; on the source's first line, so that no line moves
const HEADER = '(function (__pie_import) { "use strict"; ';

const IMPORT = /^([ \t]*)import\s+(?:\*\s+as\s+([\w$]+)|\{([^}]*)\}|([\w$]+))\s+from\s+(['"])([^'"]+)\5[ \t]*;?/gm;
const EXPORT = /^([ \t]*)export\s+((?:async\s+)?function\s*\*?\s*|class\s+|const\s+|let\s+|var\s+)([\w$]+)/gm;

function importModule(name) {
  const module = MODULES[name];
  if (module === undefined) {
    throw new Error(`unknown import: module "${name}" (an inferlet imports "inferlet" or "@pie-project/inferlet")`);
  }
  return module;
}

const lineBreaks = (text) => text.split('\n').length - 1;

/** `text` in place of `match`, padded with the line breaks it would lose. */
const keepLines = (match, text) => text + '\n'.repeat(lineBreaks(match) - lineBreaks(text));

/** The source as a function body: imports become declarations, exports plain declarations whose
 * names the function returns. Every rewrite keeps the lines where they were. */
function rewrite(source) {
  const exported = [];
  const body = source
    .replace(IMPORT, (match, indent, star, names, single, quote, module) => {
      const from = `__pie_import(${JSON.stringify(module)})`;
      if (star) return keepLines(match, `${indent}const ${star} = ${from};`);
      if (single) return keepLines(match, `${indent}const ${single} = ${from}.default;`);
      return keepLines(match, `${indent}const {${names.replace(/\bas\b/g, ':')}} = ${from};`);
    })
    .replace(EXPORT, (_, indent, kind, name) => {
      exported.push(name);
      return `${indent}${kind}${name}`;
    });
  return `${HEADER}${body}\nreturn { ${exported.join(', ')} };\n})\n//# sourceURL=${FILENAME}`;
}

/** Where an error points, as FILENAME:line:column of the source (not of the rewritten text). */
function location(line, column) {
  return `${FILENAME}:${line}:${line === 1 ? column - HEADER.length : column}`;
}

function loadMain(source) {
  let module;
  try {
    module = (0, eval)(rewrite(source));
  } catch (e) {
    if (e instanceof SyntaxError) {
      throw new SyntaxError(`${e.message} (${location(e.lineNumber, e.columnNumber)})`);
    }
    throw e;
  }
  const exports = module(importModule);
  if (typeof exports.main !== 'function') {
    throw new TypeError('the inferlet exports no `main` function (export async function main(input))');
  }
  return exports.main;
}

/** The frames of a stack that are the program's ("fn@main.js:line:column"), their columns on
 * line 1 put right. */
function userFrames(stack) {
  return String(stack ?? '').split('\n')
    .filter((frame) => frame.includes(`${FILENAME}:`))
    .map((frame) => frame.replace(new RegExp(`${FILENAME}:(\\d+):(\\d+)`),
                                  (_, line, col) => location(Number(line), Number(col))));
}

function errorJson(kind, error) {
  if (!(error instanceof Error)) {
    const message = `uncaught ${typeof error}: ${String(error)}`;
    return JSON.stringify({ kind, message, traceback: message });
  }
  const frames = userFrames(error.stack);
  const message = `${error.name}: ${error.message}`;
  const where = frames.length ? ` (at ${frames[0].split('@').pop()})` : '';
  const traceback = [message, ...frames.map((frame) => `    at ${frame}`)].join('\n');
  return JSON.stringify({ kind, message: message + where, traceback });
}

/** A turn of the event loop: every microtask ready now runs before it resolves. */
const nextTurn = () => new Promise((resolve) => setTimeout(resolve, 0));

/** Run the program's promise to its end. When every ready task has run and the program still
 * waits, it waits on a host future: block in the host until one completes. */
async function drive(promise) {
  let settled = false;
  promise.then(() => { settled = true; }, () => { settled = true; });
  for (;;) {
    await nextTurn();
    if (settled) return promise;
    if (inferlet._host.pending() === 0) {
      throw new Error('deadlock: every task of the inferlet is waiting, and not on anything the host will complete');
    }
    inferlet._host.wait();
  }
}

export async function run(source, code, inputJson, bundleJson) {
  try {
    if (!source) throw new Error('no inferlet source given (a JavaScript bundle is not supported yet)');
    const main = loadMain(source);
    const result = await drive(Promise.resolve().then(() => main(JSON.parse(inputJson))));
    const text = JSON.stringify(result === undefined ? null : result);
    if (text === undefined) throw new TypeError('main returned a value that is not JSON');
    return text;
  } catch (e) {
    throw errorJson('exception', e);
  }
}
