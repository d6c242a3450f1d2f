// The playground page: write a program (editor.js), run it over pie serve's WebSocket (/v1/ws, the
// protocol of pie_actors/ws_protocol.py), and watch the engine (/playground/stats, once a second).
// What a program sends is only ever put into the page as text (textContent, text nodes).
import { Editor, languageOf } from "./editor.js";

const KEY_STORE = "pie-api-key";     // sessionStorage: this tab only, never a URL or a cookie
const POLL_MS = 1000;
const TEMPLATE = `from inferlet import session


async def main(input: dict) -> dict:
    session.send("Hello from an inferlet")
    return {"ok": True}
`;

const $ = (id) => document.getElementById(id);
const editor = new Editor($("editor"));
const state = {
  key: sessionStorage.getItem(KEY_STORE),
  examples: [],
  program: { files: { "main.py": TEMPLATE }, main: "main.py", open: "main.py" },
  socket: null,
  current: null,          // the process the output shows: {id, name, lastSeq, ended}
  first: null,            // the live view's first reading (histogram since the page opened)
  previous: null,         // its last one (rates)
  peaks: [],              // the largest step of each reading's interval (sparkline)
};

// ---- the server: HTTP with the key, and the WebSocket -------------------------------------------

class AuthError extends Error {}

async function api(path) {
  const headers = state.key ? { Authorization: `Bearer ${state.key}` } : {};
  const response = await fetch(path, { headers, cache: "no-store" });
  const body = await response.json().catch(() => ({}));
  if (response.status === 401 || response.status === 403) {
    throw new AuthError(body?.error?.message ?? `the server refused the key (${response.status})`);
  }
  if (!response.ok) throw new Error(body?.error?.message ?? `${path}: HTTP ${response.status}`);
  return body;
}

class Socket {
  constructor() {
    this.ids = 0;
    this.pending = new Map();
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    this.ws = new WebSocket(`${scheme}://${location.host}/v1/ws`);
    this.ws.onmessage = (message) => this.frame(JSON.parse(message.data));
    this.ws.onclose = () => this.closed();
    this.ready = new Promise((resolve, reject) => {
      this.ws.onopen = () => (state.key ? this.request({ type: "auth", key: state.key }) : Promise.resolve())
        .then(resolve, reject);
      this.ws.onerror = () => reject(new Error("the WebSocket could not connect"));
    });
  }

  get open() { return this.ws.readyState === WebSocket.OPEN; }

  request(frame) {
    const id = ++this.ids;
    return new Promise((resolve, reject) => {
      this.pending.set(id, { resolve, reject });
      this.ws.send(JSON.stringify({ ...frame, id }));
    });
  }

  frame(frame) {
    const waiter = frame.id !== undefined ? this.pending.get(frame.id) : undefined;
    if (waiter) {
      this.pending.delete(frame.id);
      if (frame.type === "error") waiter.reject(Object.assign(new Error(frame.message), { code: frame.code }));
      else waiter.resolve(frame);
      return;
    }
    if (frame.type === "error") note(`${frame.code}: ${frame.message}`, "failed");
    else processEvent(frame);
  }

  closed() {
    for (const { reject } of this.pending.values()) reject(new Error("disconnected"));
    this.pending.clear();
    if (state.socket === this) state.socket = null;
    setPill($("connection"), "disconnected", "bad");
    const current = state.current;
    if (current && !current.ended && current.attached) {
      current.attached = false;
      setPill($("run-state"), "disconnected", "bad");
      note("disconnected: the process runs on without this page (its detach rules apply); Re-attach follows it again");
      $("reattach").hidden = false;
      setControls();
    }
  }
}

async function socket() {
  if (!state.socket) {
    state.socket = new Socket();
    state.socket.ready.then(() => setPill($("connection"), "connected", "good"), () => {});
  }
  try {
    await state.socket.ready;
  } catch (e) {
    state.socket = null;
    if (e.code === "invalid_key" || e.code === "missing_key") askKey(e.message);
    throw e;
  }
  return state.socket;
}

// ---- keys ---------------------------------------------------------------------------------------

function askKey(message) {
  sessionStorage.removeItem(KEY_STORE);
  state.key = null;
  $("key-form").hidden = false;
  $("key-error").textContent = message;
  $("key").focus();
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  state.key = $("key").value;
  sessionStorage.setItem(KEY_STORE, state.key);
  $("key").value = "";
  start();
});

// ---- writing ------------------------------------------------------------------------------------

function keepEditorText() {
  state.program.files[state.program.open] = editor.value;
}

function openFile(path) {
  keepEditorText();
  state.program.open = path;
  editor.setLanguage(languageOf(path));
  editor.value = state.program.files[path];
  $("language").textContent = editor.language === "javascript" ? "JavaScript" : "Python";
  for (const tab of $("files").children) tab.setAttribute("aria-selected", String(tab.dataset.path === path));
}

function loadProgram(files, main, inputs) {
  state.program = { files: { ...files }, main, open: main };
  const tabs = Object.keys(files).length > 1 ? Object.keys(files).map((path) => {
    const tab = document.createElement("button");
    tab.type = "button";
    tab.setAttribute("role", "tab");
    tab.dataset.path = path;
    tab.textContent = path;
    tab.addEventListener("click", () => openFile(path));
    return tab;
  }) : [];
  $("files").replaceChildren(...tabs);
  editor.setLanguage(languageOf(main));
  editor.value = files[main];
  openFile(main);
  $("inputs").replaceChildren();
  for (const input of inputs) addInput(input.name, "default" in input ? shown(input.default) : "", input.required);
}

/** A default as the form shows it: strings as they are, unless they would read back as JSON. */
function shown(value) {
  if (typeof value !== "string") return JSON.stringify(value);
  try { JSON.parse(value); return JSON.stringify(value); } catch { return value; }
}

function addInput(name = "", value = "", required = false) {
  const row = document.createElement("div");
  row.className = "input-row";
  const key = Object.assign(document.createElement("input"), { value: name, placeholder: "name" });
  key.setAttribute("aria-label", "input name");
  const field = Object.assign(document.createElement("input"), { value,
    placeholder: required ? "required: text or JSON" : "text or JSON (empty: left out)" });
  const label = () => field.setAttribute("aria-label", key.value || "input value");
  key.addEventListener("input", label);
  label();
  const remove = Object.assign(document.createElement("button"), { type: "button", textContent: "×" });
  remove.setAttribute("aria-label", `remove input ${name}`.trim());
  remove.addEventListener("click", () => row.remove());
  row.append(key, field, remove);
  $("inputs").append(row);
}

/** The input dict: `--key value` as pie run reads it (a value that parses as JSON is JSON, else text). */
function collectInputs() {
  const input = {};
  for (const row of $("inputs").children) {
    const [key, field] = row.querySelectorAll("input");
    if (!key.value.trim() || field.value === "") continue;
    try { input[key.value.trim()] = JSON.parse(field.value); } catch { input[key.value.trim()] = field.value; }
  }
  return input;
}

function programPayload() {
  keepEditorText();
  const { files, main } = state.program;
  const javascript = languageOf(main) === "javascript";
  if (Object.keys(files).length > 1) {     // a bundle: the entry module runs (main.py for Python)
    return javascript ? { bundle: { ...files }, language: "javascript", entry: main } : { bundle: { ...files } };
  }
  return javascript ? { source: files[main], language: "javascript" } : { source: files[main] };
}

$("example").addEventListener("change", () => {
  const example = state.examples.find((e) => e.name === $("example").value);
  if (example) loadProgram(example.files, example.main, example.inputs);
  else loadProgram({ "main.py": TEMPLATE }, "main.py", []);
});
$("add-input").addEventListener("click", () => addInput());

// ---- running ------------------------------------------------------------------------------------

function setPill(element, text, kind = "") {
  element.textContent = text;
  element.className = `pill ${kind}`.trim();
}

function note(text, kind = "note") {
  const line = document.createElement("span");
  line.className = `end ${kind}`;
  line.textContent = text;
  $("output").append(line);
  $("output").scrollTop = $("output").scrollHeight;
}

function setControls() {
  const current = state.current;
  const live = Boolean(current && !current.ended && current.attached);
  $("kill").disabled = !live;
  $("send").disabled = !live;
}

function follow(id, name) {
  state.current = { id, name, lastSeq: -1, ended: false, attached: true };
  $("reattach").hidden = true;
  setPill($("run-state"), `running ${name}`, "good");
  setControls();
}

async function run() {
  const payload = programPayload();
  const input = collectInputs();
  const name = $("name").value.trim();
  $("output").replaceChildren();
  editor.markError(null);
  setPill($("run-state"), "starting");
  try {
    const ws = await socket();
    const previous = state.current;
    if (previous && !previous.ended && previous.attached) {
      await ws.request({ type: "detach", process: previous.id }).catch(() => {});   // it runs on, attachable
    }
    state.current = null;
    const { hash } = await ws.request({ type: "upload", program: payload });
    const launched = await ws.request({ type: "launch", hash, input, ...(name ? { name } : {}) });
    follow(launched.process, launched.name);
  } catch (e) {
    setPill($("run-state"), "not started", "bad");
    note(e.message, "failed");
  }
}

async function attach(id, name) {
  $("output").replaceChildren();
  editor.markError(null);
  try {
    const ws = await socket();
    follow(id, name);
    await ws.request({ type: "attach", process: id });
  } catch (e) {
    note(e.message, "failed");
    setPill($("run-state"), "not attached", "bad");
  }
}

async function reattach() {
  const current = state.current;
  try {
    const ws = await socket();
    await ws.request({ type: "attach", process: current.id });
    current.attached = true;
    $("reattach").hidden = true;
    setPill($("run-state"), `running ${current.name}`, "good");
    note("re-attached");
  } catch (e) {
    note(e.message, "failed");
  }
  setControls();
}

function processEvent(frame) {
  const current = state.current;
  if (!current || frame.process !== current.id) return;
  if (frame.type === "detached") {
    current.attached = false;
    setPill($("run-state"), "detached", "bad");
    note(`detached: ${frame.reason}`);
    $("reattach").hidden = false;
    setControls();
    return;
  }
  if (frame.seq <= current.lastSeq) return;            // seen before a re-attach
  current.lastSeq = frame.seq;
  const output = $("output");
  if (frame.type === "text") {
    output.append(document.createTextNode(frame.text));
  } else if (frame.type === "file") {
    note(`[a file of ${atob(frame.data).length} bytes]`);
  } else if (frame.type === "done") {
    current.ended = true;
    note(`Done\n${JSON.stringify(frame.output, null, 2)}`, "done");
    setPill($("run-state"), "done", "good");
  } else if (frame.type === "failed") {
    current.ended = true;
    const where = failureLine(frame);
    note(`Failed: ${frame.kind}\n${frame.message}${where ? `\nat ${where.path}, line ${where.line}` : ""}`, "failed");
    setPill($("run-state"), `failed: ${frame.kind}`, "bad");
    if (where) {
      if (where.path in state.program.files && where.path !== state.program.open) openFile(where.path);
      editor.markError(where.line);
    }
  }
  output.scrollTop = output.scrollHeight;
  setControls();
}

/** The file and line of the program that a failure points to: the innermost frame in one of its
 * files (Python tracebacks, and a SyntaxError's "(main.py, line N)"; JavaScript's "main.js:L:C"). */
function failureLine(frame) {
  const files = state.program.files;
  const text = `${frame.traceback ?? ""}\n${frame.message ?? ""}`;
  const found = [];
  for (const m of text.matchAll(/File "([^"]+)", line (\d+)|\(([^(),]+\.py), line (\d+)\)/g)) {
    found.push({ path: m[1] ?? m[3], line: Number(m[2] ?? m[4]) });
  }
  for (const m of text.matchAll(/([\w./-]+\.m?js):(\d+)(?::\d+)?/g)) found.unshift({ path: m[1], line: Number(m[2]) });
  const ours = found.filter((f) => f.path in files);
  return ours.length ? ours[ours.length - 1] : null;
}

$("run").addEventListener("click", run);
$("reattach").addEventListener("click", reattach);
$("kill").addEventListener("click", async () => {
  try { await (await socket()).request({ type: "kill", process: state.current.id }); } catch (e) { note(e.message, "failed"); }
});
$("send-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const raw = $("message").value;
  let message;
  try { message = JSON.parse(raw); } catch { message = raw; }
  try {
    await (await socket()).request({ type: "send", process: state.current.id, message });
    note(`> ${raw}`, "sent");
    $("message").value = "";
  } catch (e) {
    note(e.message, "failed");
  }
});

// ---- watching -----------------------------------------------------------------------------------

function deltas(now, then) {
  const out = new Map();
  for (const [lanes, steps] of Object.entries(now.batch_sizes ?? {})) {
    const n = steps - (then?.batch_sizes?.[lanes] ?? 0);
    if (n > 0) out.set(Number(lanes), n);
  }
  return out;
}

function cell(text) {
  const td = document.createElement("td");
  td.textContent = text;
  return td;
}

function showView(view) {
  $("model").textContent = view.model;
  if (view.status !== "ok") {
    $("engine-state").textContent = view.status === "loading" ? "engine loading" : `engine ${view.status}: ${view.error}`;
  } else {
    $("engine-state").textContent = `${view.running} of this key's programs running`;
    const first = state.first ??= view;
    const previous = state.previous ?? view;
    const since = deltas(view, first);
    const interval = deltas(view, previous);
    const seconds = view.time - previous.time;
    $("tokens-rate").textContent = seconds > 0
      ? String(Math.round((view.tokens_computed - previous.tokens_computed) / seconds)) : "0";
    const largest = Math.max(0, ...since.keys());
    $("largest-step").textContent = String(largest);
    state.peaks = [...state.peaks, Math.max(0, ...interval.keys())].slice(-60);
    state.previous = view;

    const most = Math.max(1, ...since.values());
    $("lanes").replaceChildren(...[...since.entries()].sort((a, b) => a[0] - b[0]).map(([lanes, steps]) => {
      const bar = document.createElement("div");
      bar.className = "bar";
      bar.dataset.lanes = String(lanes);
      bar.dataset.steps = String(steps);
      bar.title = `${lanes} lanes: ${steps} steps`;
      bar.setAttribute("aria-label", bar.title);
      bar.style.height = `${(100 * steps) / most}%`;
      const label = document.createElement("span");
      label.textContent = String(lanes);
      bar.append(label);
      return bar;
    }));
    const peak = Math.max(1, ...state.peaks);
    const step = 120 / Math.max(1, state.peaks.length - 1);
    $("sparkline").querySelector("polyline").setAttribute("points",
      state.peaks.map((p, i) => `${(i * step).toFixed(1)},${(24 - (22 * p) / peak).toFixed(1)}`).join(" "));

    const kv = view.kv;
    const rows = [["free", kv.free], ["cached", kv.cached], ["referenced", kv.referenced], ["total", kv.total],
      ["saved sets", kv.saved_sets], ["spilled sets", kv.spilled_sets], ["parked sets", kv.parked_sets]];
    $("kv").tBodies[0].replaceChildren(...rows.map(([name, value]) => {
      const tr = document.createElement("tr");
      tr.dataset.kv = name;
      tr.append(cell(name), cell(String(value ?? 0)));
      return tr;
    }));
    const c = view.compile ?? {};
    $("compile").textContent = !c.total ? "eager (nothing to compile)"
      : `${c.ready} of ${c.total} buckets ready${c.compiling ? `, compiling batch ${c.compiling}` : ""}${c.failed ? `, ${c.failed} failed` : ""}`;
  }
  $("processes").tBodies[0].replaceChildren(...view.processes.map((p) => {
    const tr = document.createElement("tr");
    tr.dataset.process = p.process;
    tr.append(cell(p.name), cell(p.state), cell(p.attached ? "yes" : "no"));
    const actions = document.createElement("td");
    const ours = state.current && state.current.id === p.process && state.current.attached;
    if (!p.attached && !ours && (p.state === "running" || p.buffered > 0)) {
      const button = Object.assign(document.createElement("button"), { type: "button", textContent: "Attach" });
      button.setAttribute("aria-label", `Attach ${p.name}`);
      button.addEventListener("click", () => attach(p.process, p.name));
      actions.append(button);
    }
    tr.append(actions);
    return tr;
  }));
}

let polling = false;

async function poll() {
  try {
    showView(await api("/playground/stats"));
  } catch (e) {
    if (e instanceof AuthError) { polling = false; askKey(e.message); return; }
    $("engine-state").textContent = `no figures: ${e.message}`;
  }
  setTimeout(poll, POLL_MS);
}

// ---- start --------------------------------------------------------------------------------------

async function start() {
  let examples;
  try {
    examples = (await api("/playground/examples")).examples;
  } catch (e) {
    if (e instanceof AuthError) askKey(e.message);
    else $("engine-state").textContent = e.message;
    return;
  }
  $("key-form").hidden = true;
  $("key-error").textContent = "";
  state.examples = examples;
  $("example").replaceChildren(new Option("(new program)", ""), ...examples.map((e) => new Option(e.name, e.name)));
  if (!polling) { polling = true; poll(); }
  socket().catch((e) => note(e.message, "failed"));
}

loadProgram({ "main.py": TEMPLATE }, "main.py", []);
start();
