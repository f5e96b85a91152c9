// A small Markdown renderer for untrusted text (a model's reply). It builds DOM nodes and
// sets only textContent, a link's checked href and fixed attributes, so nothing in the
// text is ever parsed as HTML: raw HTML shows as the text it is. Links are made only
// of http: and https: URLs. What it renders: paragraphs, headings, emphasis, strong,
// strike-through, inline code, fenced code blocks (with a copy button), lists,
// block quotes, rules, tables and links.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})(?:\s+(.*?))?(?:\s+#+)?\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?(.*)$/;
const ITEM = /^( {0,12})([-*+]|\d{1,9}[.)])(?:\s+(.*))?$/;
const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

function el(tag, text) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = text;
  return node;
}

// The whole text as a DocumentFragment.
export function render(text) {
  const out = document.createDocumentFragment();
  blocks(String(text).replace(/\r\n?/g, "\n").split("\n"), out);
  return out;
}

function startsBlock(lines, i) {
  const line = lines[i];
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
    ITEM.test(line) || isTable(lines, i);
}

function isTable(lines, i) {
  return lines[i].includes("|") && i + 1 < lines.length && lines[i + 1].includes("-") &&
    TABLE_RULE.test(lines[i + 1]);
}

function blocks(lines, parent) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (!line.trim()) {
      i++;
    } else if ((m = FENCE.exec(line))) {
      i = fence(lines, i, m, parent);
    } else if ((m = HEADING.exec(line))) {
      const h = el("h" + m[1].length);
      inline(m[2] || "", h);
      parent.append(h);
      i++;
    } else if (RULE.test(line)) {
      parent.append(el("hr"));
      i++;
    } else if (QUOTE.test(line)) {
      const inner = [];
      while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
        inner.push(m[1]);
        i++;
      }
      const quote = el("blockquote");
      blocks(inner, quote);
      parent.append(quote);
    } else if (ITEM.test(line)) {
      i = list(lines, i, parent);
    } else if (isTable(lines, i)) {
      i = table(lines, i, parent);
    } else {
      const para = [line];
      i++;
      while (i < lines.length && lines[i].trim() && !startsBlock(lines, i)) {
        para.push(lines[i]);
        i++;
      }
      const p = el("p");
      inline(para.map((l) => l.trim()).join("\n"), p);
      parent.append(p);
    }
  }
}

function fence(lines, i, m, parent) {
  const marker = m[1];
  const code = [];
  i++;
  while (i < lines.length) {
    const line = lines[i].trim();
    if (line.startsWith(marker[0].repeat(marker.length)) && !line.replace(/[`~]/g, "")) break;
    code.push(lines[i]);
    i++;
  }
  const text = code.join("\n");
  const box = el("div");
  box.className = "code";
  const bar = el("div");
  bar.className = "code-bar";
  bar.append(el("span", m[2] || "code"));
  const copy = el("button", "Copy");
  copy.type = "button";
  copy.setAttribute("aria-label", "Copy code");
  copy.addEventListener("click", () => copyText(text, copy));
  bar.append(copy);
  const pre = el("pre");
  const codeEl = el("code", text);
  if (m[2]) codeEl.dataset.lang = m[2];
  pre.append(codeEl);
  box.append(bar, pre);
  parent.append(box);
  return i + 1;
}

function copyText(text, button) {
  const done = () => {
    button.textContent = "Copied";
    setTimeout(() => { button.textContent = "Copy"; }, 1500);
  };
  if (navigator.clipboard && window.isSecureContext) {
    navigator.clipboard.writeText(text).then(done, () => { button.textContent = "Failed"; });
  } else {
    button.textContent = "Failed";
  }
}

function list(lines, i, parent) {
  const first = ITEM.exec(lines[i]);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const node = el(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) node.start = parseInt(first[2], 10);
  let m;
  while (i < lines.length && (m = ITEM.exec(lines[i])) && m[1].length <= indent + 1 &&
         /\d/.test(m[2]) === ordered) {
    const width = m[1].length + m[2].length + 1;
    const inner = [m[3] || ""];
    i++;
    // The item's own lines: indented ones (a nested list, a continuation), and lazy
    // continuation lines of its first paragraph.
    while (i < lines.length) {
      const line = lines[i];
      if (!line.trim()) {
        if (i + 1 < lines.length && /^\s{2,}\S/.test(lines[i + 1]) &&
            !(ITEM.test(lines[i + 1]) && ITEM.exec(lines[i + 1])[1].length <= indent + 1)) {
          inner.push("");
          i++;
          continue;
        }
        break;
      }
      const im = ITEM.exec(line);
      if (im && im[1].length <= indent + 1) break;
      if (!im && !/^\s/.test(line) && startsBlock(lines, i)) break;
      inner.push(line.slice(Math.min(width, line.length - line.trimStart().length)));
      i++;
    }
    const li = el("li");
    if (inner.length === 1 || (!inner.some((l) => !l.trim()) && !inner.slice(1).some(
      (l, k) => startsBlock(inner, k + 1)))) {
      inline(inner.map((l) => l.trim()).join("\n"), li);
    } else {
      blocks(inner, li);
    }
    node.append(li);
    while (i < lines.length && !lines[i].trim() && i + 1 < lines.length &&
           (m = ITEM.exec(lines[i + 1])) && m[1].length <= indent + 1 &&
           /\d/.test(m[2]) === ordered) {
      i++;  // a blank line between two items keeps the list going
    }
  }
  parent.append(node);
  return i;
}

function cells(line) {
  let s = line.trim();
  if (s.startsWith("|")) s = s.slice(1);
  if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
  return s.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
}

function table(lines, i, parent) {
  const head = cells(lines[i]);
  const aligns = cells(lines[i + 1]).map((c) =>
    c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" :
      c.startsWith(":") ? "left" : "");
  const node = el("table");
  const thead = el("thead");
  const row = el("tr");
  head.forEach((c, k) => row.append(cell("th", c, aligns[k])));
  thead.append(row);
  node.append(thead);
  const body = el("tbody");
  i += 2;
  while (i < lines.length && lines[i].includes("|") && lines[i].trim()) {
    const tr = el("tr");
    const values = cells(lines[i]);
    head.forEach((_, k) => tr.append(cell("td", values[k] || "", aligns[k])));
    body.append(tr);
    i++;
  }
  node.append(body);
  const wrap = el("div");
  wrap.className = "table";
  wrap.append(node);
  parent.append(wrap);
  return i;
}

function cell(tag, text, align) {
  const node = el(tag);
  if (align) node.className = "align-" + align;
  inline(text, node);
  return node;
}

// --- inline -------------------------------------------------------------------------

const INLINE = new RegExp([
  "(?<code>`+)",
  "\\\\(?<esc>[!-/:-@\\[-`{-~])",
  "\\[(?<label>[^\\]\\n]*)\\]\\((?<href>[^\\s()]*(?:\\([^\\s()]*\\)[^\\s()]*)*)" +
    "(?:\\s+\"[^\"\\n]*\")?\\)",
  "<(?<auto>[a-zA-Z][a-zA-Z0-9+.-]*:[^\\s<>]+)>",
  "(?<bare>\\bhttps?:\\/\\/[^\\s<>]*[^\\s<>.,:;\"')\\]!?*_~])",
  "(?<delim>\\*\\*|__|~~|\\*|_)(?=\\S)",
  "(?<br>\\n)",
].join("|"));

// The URL of a link we may make: an absolute http: or https: URL; otherwise null.
export function safeUrl(href) {
  try {
    const url = new URL(href);
    return url.protocol === "http:" || url.protocol === "https:" ? url.href : null;
  } catch (e) {
    return null;
  }
}

function link(href, label, parent, linked) {
  const url = linked ? null : safeUrl(href);
  if (!url) return false;
  const a = el("a");
  a.href = url;
  a.rel = "noopener noreferrer";
  a.target = "_blank";
  inline(label, a, true);
  parent.append(a);
  return true;
}

const TAGS = { "**": "strong", "__": "strong", "~~": "del", "*": "em", "_": "em" };

// Append `text`'s inline Markdown to `parent`; `linked` inside a link (no links in it).
export function inline(text, parent, linked = false) {
  let rest = String(text);
  let plain = "";
  const flush = () => {
    if (plain) parent.append(document.createTextNode(plain));
    plain = "";
  };
  while (rest) {
    const m = INLINE.exec(rest);
    if (!m) {
      plain += rest;
      break;
    }
    plain += rest.slice(0, m.index);
    const before = m.index > 0 ? rest[m.index - 1] : (plain ? plain[plain.length - 1] : "");
    let after = rest.slice(m.index + m[0].length);
    const g = m.groups;
    if (g.code !== undefined) {
      const close = new RegExp("(?<!`)" + g.code + "(?!`)").exec(after);
      if (close) {
        flush();
        let code = after.slice(0, close.index).replace(/\n/g, " ");
        if (/^ .* $/.test(code)) code = code.slice(1, -1);
        parent.append(el("code", code));
        after = after.slice(close.index + g.code.length);
      } else {
        plain += g.code;
      }
    } else if (g.esc !== undefined) {
      plain += g.esc;
    } else if (g.label !== undefined) {
      flush();
      if (!link(g.href, g.label, parent, linked)) plain += m[0];
    } else if (g.auto !== undefined) {
      flush();
      if (!link(g.auto, g.auto, parent, linked)) plain += m[0];
    } else if (g.bare !== undefined) {
      flush();
      if (!link(g.bare, g.bare, parent, linked)) plain += m[0];
    } else if (g.br !== undefined) {
      flush();
      parent.append(el("br"));
    } else {
      const d = g.delim;
      const close = closing(d, after);
      if (close >= 0 && !(d[0] === "_" && /\w/.test(before))) {
        flush();
        const node = el(TAGS[d]);
        inline(after.slice(0, close), node, linked);
        parent.append(node);
        after = after.slice(close + d.length);
      } else {
        plain += d;
      }
    }
    rest = after;
  }
  flush();
}

// Where the delimiter `d` that closes an emphasis starts in `text`, or -1.
function closing(d, text) {
  for (let k = 1; k < text.length; k++) {
    if (text.startsWith(d, k) && !/\s/.test(text[k - 1])) {
      const next = text[k + d.length] || "";
      if (d.length === 1 && next === d) { k++; continue; }  // part of ** or __
      if (d[0] === "_" && /\w/.test(next)) continue;       // snake_case, not emphasis
      return k;
    }
  }
  return -1;
}
