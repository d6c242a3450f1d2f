// The playground's editor: a textarea (what the user types in, and what tests and screen readers
// see: a textbox) over a highlighted copy of its text, with line numbers and an error line mark.
// The highlighting is a small tokenizer per language; every token becomes a text node, never markup.

const PYTHON_KEYWORDS = "False None True and as assert async await break class continue def del elif else except " +
  "finally for from global if import in is lambda nonlocal not or pass raise return try while with yield match case";
const PYTHON_BUILTINS = "print len range list dict set tuple str int float bool min max sum sorted enumerate zip " +
  "isinstance type super object Exception ValueError KeyError RuntimeError self";
const JS_KEYWORDS = "async await break case catch class const continue debugger default delete do else export " +
  "extends finally for function if import in instanceof let new of return static super switch this throw try " +
  "typeof var void while with yield null undefined true false from";
const JS_BUILTINS = "Array Object String Number Boolean Promise Map Set JSON Math Error console";

const words = (text) => new Set(text.split(" "));

const LANGUAGES = {
  python: {
    keywords: words(PYTHON_KEYWORDS), builtins: words(PYTHON_BUILTINS), defines: words("def class"),
    // comment | string (triple-quoted, then one-line, with prefixes) | decorator | number | word
    token: /(#[^\n]*)|((?:[rRbBuUfF]{0,2})(?:"""[\s\S]*?(?:"""|$)|'''[\s\S]*?(?:'''|$)|"(?:\\.|[^"\\\n])*"?|'(?:\\.|[^'\\\n])*'?))|(@[\w.]+)|(\b\d[\w.]*)|([A-Za-z_]\w*)/g,
  },
  javascript: {
    keywords: words(JS_KEYWORDS), builtins: words(JS_BUILTINS), defines: words("function class"),
    token: /(\/\/[^\n]*|\/\*[\s\S]*?(?:\*\/|$))|(`(?:\\[\s\S]|[^`\\])*`?|"(?:\\.|[^"\\\n])*"?|'(?:\\.|[^'\\\n])*'?)|(@[\w$.]+)|(\b\d[\w.]*)|([A-Za-z_$][\w$]*)/g,
  },
};

/** The language a file name is written in: JavaScript for .js, else Python. */
export function languageOf(path) {
  return /\.(m?js)$/.test(path) ? "javascript" : "python";
}

/** [text, class] pieces of `source` in `language`; class "" is plain text. */
export function tokens(source, language) {
  const lang = LANGUAGES[language];
  const out = [];
  let last = 0, defining = false;
  lang.token.lastIndex = 0;
  for (let m; (m = lang.token.exec(source)) !== null;) {
    if (m.index > last) out.push([source.slice(last, m.index), ""]);
    const [text, comment, string, decorator, number, word] = m;
    let kind = "";
    if (comment) kind = "comment";
    else if (string) kind = "string";
    else if (decorator) kind = "decorator";
    else if (number) kind = "number";
    else if (word) {
      kind = defining ? "def" : lang.keywords.has(word) ? "keyword" : lang.builtins.has(word) ? "builtin" : "";
      defining = lang.defines.has(word);
    }
    out.push([text, kind]);
    last = m.index + text.length;
  }
  if (last < source.length) out.push([source.slice(last), ""]);
  return out;
}

export class Editor {
  constructor(root) {
    this.root = root;
    this.textarea = root.querySelector("textarea");
    this.code = root.querySelector("pre code");
    this.pre = root.querySelector("pre");
    this.gutter = root.querySelector(".gutter");
    this.language = "python";
    this.errorLine = null;
    this.escaped = false;
    this.textarea.addEventListener("input", () => { this.errorLine = null; this.render(); });
    this.textarea.addEventListener("scroll", () => this.sync());
    this.textarea.addEventListener("keydown", (e) => this.key(e));
  }

  get value() { return this.textarea.value; }

  set value(text) {
    this.textarea.value = text;
    this.errorLine = null;
    this.textarea.scrollTop = 0;
    this.render();
  }

  setLanguage(language) {
    this.language = language;
    this.root.dataset.language = language;
    this.render();
  }

  /** Mark `line` (1-based; null: none) as where a failure points, and scroll it into view. */
  markError(line) {
    this.errorLine = line;
    if (line === null) delete this.root.dataset.errorLine; else this.root.dataset.errorLine = String(line);
    this.render();
    if (line !== null) {
      const height = this.textarea.scrollHeight / Math.max(1, this.value.split("\n").length);
      this.textarea.scrollTop = Math.max(0, (line - 4) * height);
      this.sync();
    }
  }

  render() {
    const lines = this.value.split("\n");
    const marked = this.errorLine !== null && this.errorLine <= lines.length ? this.errorLine : null;
    if (marked === null) delete this.root.dataset.errorLine;
    const gutter = document.createDocumentFragment();
    lines.forEach((_, i) => {
      const number = document.createElement("div");
      number.textContent = String(i + 1);
      if (i + 1 === marked) number.className = "error-line";
      gutter.append(number);
    });
    this.gutter.replaceChildren(gutter);

    const code = document.createDocumentFragment();
    let line = 1, lineBox = null;
    const target = () => (line === marked ? (lineBox ??= code.appendChild(Object.assign(
      document.createElement("span"), { className: "error-line" }))) : code);
    for (const [text, kind] of tokens(this.value + "\n", this.language)) {
      // a token may span lines (a docstring): split it so the error line's box holds its own text only
      text.split(/(\n)/).forEach((part) => {
        if (!part) return;
        const parent = target();
        if (part === "\n") {
          parent.append("\n");
          line += 1;
          return;
        }
        if (kind) {
          const span = document.createElement("span");
          span.className = `tok-${kind}`;
          span.textContent = part;
          parent.append(span);
        } else {
          parent.append(part);
        }
      });
    }
    this.code.replaceChildren(code);
    this.sync();
  }

  sync() {
    this.pre.scrollTop = this.textarea.scrollTop;
    this.pre.scrollLeft = this.textarea.scrollLeft;
    this.gutter.scrollTop = this.textarea.scrollTop;
  }

  key(event) {
    // Tab indents by four spaces; Escape, then Tab, leaves the editor (as CodeMirror does), so the
    // keyboard is never trapped
    const escaped = this.escaped;
    this.escaped = event.key === "Escape";
    if (event.key !== "Tab" || escaped || event.shiftKey || event.ctrlKey || event.altKey || event.metaKey) return;
    event.preventDefault();
    const { selectionStart: start, selectionEnd: end } = this.textarea;
    this.textarea.setRangeText("    ", start, end, "end");
    this.render();
  }
}
