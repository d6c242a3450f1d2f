// The JavaScript runner component's entry (componentize-js): implements the world's `run` export.
//
// One component serves every JavaScript inferlet: the program's source arrives with each run,
// and so do a bundle's other modules. Each is an ES module (`import {...} from "inferlet"`,
// `import {...} from "./util.js"`, `export async function main(input)`), which the engine here
// cannot load from text, so its import and export statements are rewritten in place, without
// moving a line, and the body is evaluated as a function of its imports. Stacks and syntax
// errors then name the module's file with the source's own lines and columns. The main module's
// rewritten text is handed to the host, which hands it back as `code` to the next run of the
// same source (the rewrite, interpreted regular expressions, cost a start ~0.2 ms).
//
// An error is returned as the JSON object the host reads ({kind, message, traceback}), thrown as
// a string: a thrown Error object would trap the instance instead of returning `err`.

import { compiled } from 'pie:inferlet/host@0.1.0';
import * as inferlet from './inferlet.js';

const MAIN = 'main.js';       // the filename of a program given as source alone
const SDK = { inferlet, '@pie-project/inferlet': inferlet };
// the function a module becomes; on the source's first line, so that no line moves
const HEADER = '(function (__pie_import) { "use strict"; ';

const IMPORT = /^([ \t]*)import\s+(?:\*\s+as\s+([\w$]+)|\{([^}]*)\}|([\w$]+))\s+from\s+(['"])([^'"]+)\5[ \t]*;?/gm;
const EXPORT = /^([ \t]*)export\s+((?:async\s+)?function\s*\*?\s*|class\s+|const\s+|let\s+|var\s+)([\w$]+)/gm;

const lineBreaks = (text) => text.split('\n').length - 1;

/** `text` in place of `match`, padded with the line breaks it would lose. */
const keepLines = (match, text) => text + '\n'.repeat(lineBreaks(match) - lineBreaks(text));

/** A module's source as a function body: imports become declarations, exports plain
 * declarations whose names the function returns. Every rewrite keeps the lines where they were. */
function rewrite(source, filename) {
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
  return `${HEADER}${body}\nreturn { ${exported.join(', ')} };\n})\n//# sourceURL=${filename}`;
}

/** Where an error points, as file:line:column of the source (not of the rewritten text). */
function location(filename, line, column) {
  return `${filename}:${line}:${line === 1 ? column - HEADER.length : column}`;
}

/** The modules of one run: file path -> source, and what each evaluated to. */
class Modules {
  /** `code`: the main module `main` as an earlier run rewrote it ('': rewrite it now). */
  constructor(files, main, code) {
    this.files = files;
    this.main = main;
    this.code = code;
    this.exports = new Map();     // path -> its exports (null while it is being evaluated)
  }

  /** Module `path` as the text of a function: the main module's as handed over, or rewritten
   * now and handed to the host before any of the program's code runs (its first host call). */
  text(path) {
    if (path === this.main && this.code) return this.code;
    const text = rewrite(this.files.get(path), path);
    if (path === this.main) compiled(text);
    return text;
  }

  /** The exports of module `path`, evaluated on first import. */
  load(path) {
    if (this.exports.has(path)) {
      const done = this.exports.get(path);
      if (done === null) throw new Error(`import cycle: ${path} imports itself (through other modules)`);
      return done;
    }
    this.exports.set(path, null);
    let module;
    try {
      module = (0, eval)(this.text(path));
    } catch (e) {
      if (e instanceof SyntaxError) {
        throw new SyntaxError(`${e.message} (${location(path, e.lineNumber, e.columnNumber)})`);
      }
      throw e;
    }
    const exports = module((name) => this.resolve(name, path));
    this.exports.set(path, exports);
    return exports;
  }

  /** What `import ... from name` in module `importer` gets. */
  resolve(name, importer) {
    if (name in SDK) return SDK[name];
    if (name.startsWith('./') || name.startsWith('../')) {
      const path = joinPath(importer, name);
      for (const candidate of [path, `${path}.js`, `${path}/index.js`]) {
        if (this.files.has(candidate)) return this.load(candidate);
      }
      throw new Error(`unknown import: module "${name}" in ${importer} (no ${path} in the bundle)`);
    }
    throw new Error(`unknown import: module "${name}" in ${importer} (an inferlet imports "inferlet", ` +
                    '"@pie-project/inferlet" or its own bundle\'s modules, as "./name.js")');
  }
}

/** The bundle path `name` (relative) names from module `importer`. */
function joinPath(importer, name) {
  const parts = importer.split('/').slice(0, -1);
  for (const part of name.split('/')) {
    if (part === '..') parts.pop();
    else if (part !== '.' && part !== '') parts.push(part);
  }
  return parts.join('/');
}

/** The program's main function: `source` as main.js, or the bundle's "main" module (with the
 * bundle's other modules beside it: {name: [path, isPackage, source]}); `code`: the main module
 * as an earlier run rewrote it, or ''. */
function loadMain(source, code, bundle) {
  const files = new Map(Object.values(bundle).map(([path, , text]) => [path, text]));
  programFiles = new Set(files.keys()).add(MAIN);
  let main = MAIN;
  if (source) files.set(MAIN, source);
  else if (bundle.main) [main] = bundle.main;
  else throw new Error('no inferlet source given, and the bundle names no main module');
  const exports = new Modules(files, main, code).load(main);
  if (typeof exports.main !== 'function') {
    throw new TypeError(`${main} exports no \`main\` function (export async function main(input))`);
  }
  return exports.main;
}

const FRAME_FILE = /@([^@]+\.js):(\d+):(\d+)$/;
let programFiles = new Set();      // the files of the program this run loaded

// Load a two-module program, and trace an epilogue, once here at build time: the runner's start is
// snapshotted, so every run begins with the rewrite's regular expressions compiled (the engine here
// interprets them, and compiling them took a run ~0.6 ms) and the loader's and the tracer's
// functions compiled, not parsed again at their first call in each run (loadMain alone: ~0.06 ms
// of a start). Its main module comes as handed over, and nothing here calls the host.
{
  const util = 'export const one = 1;\n';
  const main = 'import { one } from "./util.js";\nimport * as all from "inferlet";\nexport async function main() { return one; }\n';
  loadMain('', rewrite(main, 'warm/main.js'), { main: ['warm/main.js', false, main], util: ['warm/util.js', false, util] });
  programFiles = new Set();
  const traced = inferlet.trace(() => inferlet.reduceArgmax(inferlet.intrinsics.output(0, 'logits').div(inferlet.float(0.5))));
  inferlet.canonicalJson(traced);
  JSON.stringify(traced);
}

/** The frames of a stack that are the program's ("fn@file.js:line:column"), their columns on
 * line 1 put right; the runner's and the SDK's own frames are left out. */
function userFrames(stack) {
  return String(stack ?? '').split('\n').flatMap((frame) => {
    const found = FRAME_FILE.exec(frame);
    if (found === null || !programFiles.has(found[1])) return [];
    return [frame.replace(FRAME_FILE, (_, file, line, col) => `@${location(file, Number(line), Number(col))}`)];
  });
}

// what SpiderMonkey throws when an allocation fails at the sandbox's memory limit
const OUT_OF_MEMORY = 'out of memory';

function errorJson(kind, error) {
  if (error === OUT_OF_MEMORY || (error instanceof Error && error.message === OUT_OF_MEMORY)) {
    // the message the host gives a Python run that ran out of memory
    return JSON.stringify({ kind: 'memory', message: 'the inferlet ran out of memory', traceback: OUT_OF_MEMORY });
  }
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
    const main = loadMain(source, code, bundleJson ? JSON.parse(bundleJson) : {});
    // main runs now, up to its first await: a turn of the event loop first would cost its start ~0.2 ms
    const result = await drive(Promise.resolve(main(JSON.parse(inputJson))));
    const text = JSON.stringify(result === undefined ? null : result);
    if (text === undefined) throw new TypeError('main returned a value that is not JSON');
    return text;
  } catch (e) {
    throw errorJson('exception', e);
  }
}
