// The page's one way to the server's API: JSON requests, Server-Sent Event streams,
// the API key (asked once, kept in sessionStorage) and errors with the server's message.

const KEY = "localrt.apiKey";

// An error to show a person: the API's own message (its JSON error body), or what
// went wrong on the way.
export class ApiError extends Error {
  constructor(message, status = 0, code = "") {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.code = code;
  }
}

let askKey = null;   // (message) => Promise that settles once a key is entered
let asking = null;   // the question in progress: every 401 meanwhile waits for it

// Set how the page asks for a key; the API calls it on a 401 with the server's message.
export function onKeyNeeded(ask) {
  askKey = ask;
}

export function hasKey() {
  return Boolean(sessionStorage.getItem(KEY));
}

export function setKey(key) {
  sessionStorage.setItem(KEY, key);
}

function headers(json) {
  const out = {};
  if (json) out["Content-Type"] = "application/json";
  const key = sessionStorage.getItem(KEY);
  if (key) out.Authorization = "Bearer " + key;
  return out;
}

// The error a reply carries: {"message", "error": {"message", "code"}} from localrt.
export async function errorOf(resp) {
  let text = "";
  try {
    text = await resp.text();
    const body = JSON.parse(text);
    const err = body && typeof body.error === "object" && body.error ? body.error : {};
    const message = err.message || body.message;
    if (typeof message === "string" && message) {
      return new ApiError(message, resp.status, String(err.code || ""));
    }
  } catch (e) {
    // not JSON: fall through to the status line
  }
  const said = text && text.length < 200 ? ": " + text : "";
  return new ApiError(`HTTP ${resp.status} ${resp.statusText}${said}`, resp.status);
}

// A successful Response; a 401 asks for a key (again) and retries, other errors throw.
export async function request(method, path, body, signal) {
  for (;;) {
    let resp;
    try {
      resp = await fetch(path, {
        method,
        headers: headers(body !== undefined),
        body: body === undefined ? undefined : JSON.stringify(body),
        signal,
        cache: "no-store",
      });
    } catch (e) {
      if (e.name === "AbortError") throw e;
      throw new ApiError(`The server did not answer ${method} ${path} (${e.message})`);
    }
    if (resp.status === 401 && askKey) {
      const err = await errorOf(resp);
      sessionStorage.removeItem(KEY);
      if (!asking) {
        asking = askKey(err.message).finally(() => { asking = null; });
      }
      await asking;
      continue;
    }
    if (!resp.ok) throw await errorOf(resp);
    return resp;
  }
}

export async function json(method, path, body, signal) {
  const resp = await request(method, path, body, signal);
  return resp.status === 204 ? null : resp.json();
}

// Each event of a Server-Sent Events reply: its data parsed as JSON, or "[DONE]".
export async function* events(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = block.split("\n").filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(l[5] === " " ? 6 : 5)).join("\n");
        if (!data) continue;  // a comment (heartbeat) or a bare event name
        yield data === "[DONE]" ? data : JSON.parse(data);
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}
