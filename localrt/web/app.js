// The chat page: the model picker, the conversation, the composer, the sidebar and the
// pull panel. Every text from the server or a model goes in as textContent or through
// markdown.js, never as HTML.

import * as api from "./api.js";
import { render } from "./markdown.js";
import { Store, UNTITLED } from "./store.js";

const $ = (id) => document.getElementById(id);
const ui = {
  models: $("model"), modelState: $("model-state"), messages: $("messages"),
  message: $("message"), send: $("send"), stop: $("stop"), attach: $("attach"),
  imageFile: $("image-file"), attached: $("attached"), attachedImage: $("attached-image"),
  attachedRemove: $("attached-remove"), conversations: $("conversations"),
  newChat: $("new-chat"), settings: $("settings"), settingsToggle: $("settings-toggle"),
  system: $("system"), temperature: $("temperature"), maxTokens: $("max-tokens"),
  error: $("error"), errorText: $("error-text"), errorClose: $("error-close"),
  keyBox: $("key-box"), keyMessage: $("key-message"), key: $("api-key"),
  keyUse: $("key-use"), pullId: $("pull-id"), pull: $("pull"), think: $("think"),
  thinkLabel: $("think-label"),
  pullProgress: $("pull-progress"), pullStatus: $("pull-status"),
};

const store = new Store();
let models = [];          // GET /v1/models' records
let streaming = null;     // the AbortController of the reply being streamed
let image = null;         // the data: URL of the picture to send with the next message
let renderTimer = 0;

// --- errors and the API key ---------------------------------------------------------

function showError(err) {
  ui.errorText.textContent = err instanceof Error ? err.message : String(err);
  ui.error.hidden = false;
}

function clearError() {
  ui.error.hidden = true;
  ui.errorText.textContent = "";
}

let keyWaiter = null;

api.onKeyNeeded((message) => new Promise((resolve) => {
  ui.keyMessage.textContent = message;
  ui.keyBox.hidden = false;
  ui.key.value = "";
  ui.key.focus();
  keyWaiter = resolve;
}));

function useKey() {
  const key = ui.key.value.trim();
  if (!key || !keyWaiter) return;
  api.setKey(key);
  ui.keyBox.hidden = true;
  const resolve = keyWaiter;
  keyWaiter = null;
  resolve();
}

// --- models -------------------------------------------------------------------------

function isRunning(m) {
  return m.status === "running";
}

function selected() {
  return models.find((m) => m.id === ui.models.value) || null;
}

async function loadModels() {
  try {
    const list = await api.json("GET", "/v1/models");
    models = Array.isArray(list.data) ? list.data : [];
  } catch (e) {
    showError(e);
    return;
  }
  fillModels();
}

function fillModels() {
  const want = store.current.model || ui.models.value;
  ui.models.replaceChildren();
  const running = models.filter(isRunning);
  const rest = models.filter((m) => !isRunning(m));
  if (!models.length) {
    const none = new Option("No models yet: pull one", "");
    none.disabled = true;
    ui.models.append(none);
  }
  for (const [label, group] of [["Running", running], ["Downloaded", rest]]) {
    if (!group.length) continue;
    const optgroup = document.createElement("optgroup");
    optgroup.label = label;
    for (const m of group) {
      const option = new Option(isRunning(m) ? `● ${m.id} (running)` : m.id, m.id);
      optgroup.append(option);
    }
    ui.models.append(optgroup);
  }
  if (models.some((m) => m.id === want)) ui.models.value = want;
  else if (models.length) ui.models.value = (running[0] || models[0]).id;
  showModelState();
}

function showModelState(text) {
  const m = selected();
  ui.modelState.textContent = text || (m ? (isRunning(m) ? "running" : "not running") : "");
  const vision = Boolean(m && Array.isArray(m.capabilities) &&
                         m.capabilities.includes("vision"));
  ui.attach.hidden = !vision;
  if (!vision) setImage(null);
  ui.thinkLabel.hidden = !reasons(m);
  ui.think.checked = store.current.think !== false;
}

// Whether a model thinks before it answers (its capabilities say "reasoning").
function reasons(m) {
  return Boolean(m && Array.isArray(m.capabilities) && m.capabilities.includes("reasoning"));
}

async function pickModel() {
  const m = selected();
  if (!m) return;
  store.current.model = m.id;
  save();
  showModelState();
  if (isRunning(m)) return;
  ui.modelState.textContent = `starting ${m.id}…`;
  ui.modelState.dataset.state = "starting";
  try {
    await api.json("POST", "/v1/models/start", { model: m.id });
    ui.modelState.dataset.state = "";
    await loadModels();
  } catch (e) {
    ui.modelState.dataset.state = "";
    showModelState();
    showError(e);
  }
}

// --- conversations ------------------------------------------------------------------

function save() {
  try {
    store.save();
  } catch (e) {
    showError(`The browser could not keep this conversation (${e.message}); ` +
              "delete old ones to make room");
  }
}

function fillSidebar() {
  ui.conversations.replaceChildren();
  for (const c of store.sorted()) {
    const li = document.createElement("li");
    li.dataset.id = c.id;
    if (c.id === store.currentId) li.className = "current";
    const open = document.createElement("button");
    open.type = "button";
    open.className = "title";
    open.textContent = c.title || UNTITLED;
    if (c.id === store.currentId) open.setAttribute("aria-current", "true");
    open.addEventListener("click", () => switchTo(c.id));
    const rename = iconButton("✎", "Rename conversation", () => startRename(li, c));
    const remove = iconButton("×", "Delete conversation", () => deleteConversation(c));
    li.append(open, rename, remove);
    ui.conversations.append(li);
  }
}

function iconButton(text, label, action) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = text;
  b.setAttribute("aria-label", label);
  b.title = label;
  b.addEventListener("click", action);
  return b;
}

function startRename(li, c) {
  const input = document.createElement("input");
  input.type = "text";
  input.value = c.title;
  input.setAttribute("aria-label", "Conversation title");
  let done = false;
  const finish = (keep) => {
    if (done) return;
    done = true;
    if (keep) store.rename(c.id, input.value);
    fillSidebar();
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") finish(true);
    else if (e.key === "Escape") finish(false);
  });
  input.addEventListener("blur", () => finish(true));
  li.replaceChildren(input);
  input.focus();
  input.select();
}

function deleteConversation(c) {
  if (streaming && c.id === store.currentId) streaming.abort();
  store.remove(c.id);
  showConversation();
}

function switchTo(id) {
  if (streaming) streaming.abort();
  store.select(id);
  showConversation();
}

function newConversation() {
  if (streaming) streaming.abort();
  store.create(ui.models.value || "");
  showConversation();
  ui.message.focus();
}

// Show the current conversation: its settings, its messages, the sidebar.
function showConversation() {
  const c = store.current;
  ui.system.value = c.system || "";
  ui.temperature.value = c.temperature ?? "";
  ui.maxTokens.value = c.maxTokens ?? "";
  performance.mark("render-start");
  const items = c.messages.map((msg) => messageItem(msg.role, msg));
  ui.messages.replaceChildren(...items);
  fillSidebar();
  scrollDown();  // reads the layout: the measure includes it
  performance.measure("render-conversation", "render-start");
  if (models.some((m) => m.id === c.model)) {
    ui.models.value = c.model;
    showModelState();
  }
}

function readSettings() {
  const c = store.current;
  c.system = ui.system.value;
  const t = parseFloat(ui.temperature.value);
  c.temperature = Number.isFinite(t) ? t : null;
  const n = parseInt(ui.maxTokens.value, 10);
  c.maxTokens = Number.isFinite(n) && n > 0 ? n : null;
  save();
}

// --- messages -----------------------------------------------------------------------

function messageItem(role, msg) {
  const li = document.createElement("li");
  li.className = "message " + role;
  li.dataset.role = role;
  const body = document.createElement("div");
  body.className = "body";
  li.append(body);
  for (const url of msg.images || []) {
    const img = document.createElement("img");
    img.src = url.startsWith("data:image/") ? url : "";
    img.alt = "Attached image";
    li.insertBefore(img, body);
  }
  if (role === "assistant" && msg.reasoning) fillThinking(li, msg);
  fillBody(li, role, msg.content || "");
  if (msg.stopped) note(li, "stopped");
  return li;
}

// A reply's thinking: a collapsed block above the answer ("Thinking…" while the model
// thinks, "Thought for N s" after), which a click opens. Its text is text, never HTML.
function fillThinking(li, msg) {
  let block = li.querySelector("details.thinking");
  if (!block) {
    block = document.createElement("details");
    block.className = "thinking";
    const summary = document.createElement("summary");
    const text = document.createElement("div");
    text.className = "thinking-text";
    block.append(summary, text);
    li.insertBefore(block, li.querySelector(".body"));
  }
  block.querySelector("summary").textContent = msg.thoughtMs == null ? "Thinking…"
    : `Thought for ${Math.max(1, Math.round(msg.thoughtMs / 1000))} s`;
  block.querySelector(".thinking-text").textContent = msg.reasoning;
}

function fillBody(li, role, text) {
  const body = li.querySelector(".body");
  if (role === "assistant") body.replaceChildren(render(text));
  else body.textContent = text;
}

function note(li, text) {
  const span = document.createElement("span");
  span.className = "note";
  span.textContent = text;
  li.append(span);
}

function scrollDown() {
  ui.messages.scrollTop = ui.messages.scrollHeight;
}

// The messages as the API takes them: an image goes as an OpenAI image_url part.
function apiMessages(c) {
  const out = [];
  if (c.system && c.system.trim()) out.push({ role: "system", content: c.system });
  for (const m of c.messages) {
    if (m.images && m.images.length) {
      out.push({ role: m.role, content: [
        { type: "text", text: m.content },
        ...m.images.map((url) => ({ type: "image_url", image_url: { url } }))] });
    } else if (m.reasoning) {  // the template keeps or drops earlier thinking
      out.push({ role: m.role, content: m.content, reasoning_content: m.reasoning });
    } else {
      out.push({ role: m.role, content: m.content });
    }
  }
  return out;
}

async function send() {
  const text = ui.message.value;
  if (streaming || (!text.trim() && !image)) return;
  const m = selected();
  if (!m) {
    showError("Pick a model first, or pull one");
    return;
  }
  clearError();
  readSettings();
  const c = store.current;
  c.model = m.id;
  const user = { role: "user", content: text };
  if (image) user.images = [image];
  c.messages.push(user);
  if (c.title === UNTITLED) c.title = text.trim().split("\n")[0].slice(0, 48) || "Image";
  store.touch(c);
  ui.message.value = "";
  setImage(null);
  ui.messages.append(messageItem("user", user));
  fillSidebar();

  const reply = { role: "assistant", content: "" };
  const li = messageItem("assistant", reply);
  li.dataset.state = "streaming";
  ui.messages.append(li);
  scrollDown();
  const body = { model: m.id, messages: apiMessages(c), stream: true };
  if (c.temperature !== null) body.temperature = c.temperature;
  if (c.maxTokens !== null) body.max_tokens = c.maxTokens;
  if (reasons(m)) body.reasoning_effort = c.think === false ? "none" : "medium";

  const controller = new AbortController();
  streaming = controller;
  setStreaming(true);
  if (!isRunning(m)) showModelState(`starting ${m.id}…`);  // the reply loads it first
  let state = "done";
  let thinkingSince = null;
  const thought = () => {  // the thinking has ended: how long it took
    if (thinkingSince !== null && reply.thoughtMs == null) {
      reply.thoughtMs = performance.now() - thinkingSince;
      fillThinking(li, reply);
    }
  };
  try {
    const resp = await api.request("POST", "/v1/chat/completions", body, controller.signal);
    if (ui.modelState.dataset.state !== "starting") {
      m.status = "running";
      showModelState();
    }
    for await (const event of api.events(resp)) {
      if (event === "[DONE]") break;
      if (event.error) {
        throw new api.ApiError(event.error.message || "The reply broke off", 0,
                               event.error.code || "");
      }
      const delta = event.choices && event.choices[0] && event.choices[0].delta;
      // Servers write thinking as reasoning_content, reasoning or both (the same text).
      const thinking = delta && (delta.reasoning_content || delta.reasoning);
      if (typeof thinking === "string" && thinking) {
        if (thinkingSince === null) thinkingSince = performance.now();
        reply.reasoning = (reply.reasoning || "") + thinking;
        fillThinking(li, reply);
      }
      if (delta && typeof delta.content === "string" && delta.content) {
        thought();
        reply.content += delta.content;
        scheduleRender(li, reply);
      }
    }
  } catch (e) {
    if (e.name === "AbortError") {
      state = "stopped";
    } else {
      state = "error";
      showError(e);
    }
  }
  clearTimeout(renderTimer);
  renderTimer = 0;
  if (streaming === controller) {
    streaming = null;
    setStreaming(false);
  }
  thought();
  if (state === "stopped") reply.stopped = true;
  if (reply.content || reply.reasoning || state === "stopped") {
    c.messages.push(reply);
    store.touch(c);
  }
  if (li.isConnected) {
    fillBody(li, "assistant", reply.content);
    if (state !== "done") note(li, state === "stopped" ? "stopped" : "error");
    li.dataset.state = state;
  }
  if (store.currentId === c.id) scrollDown();
  if (state === "done") loadModels();
}

// Re-render a growing reply at most every 40 ms: its Markdown changes as it grows.
function scheduleRender(li, reply) {
  if (renderTimer) return;
  renderTimer = setTimeout(() => {
    renderTimer = 0;
    if (!li.isConnected) return;
    const atBottom = ui.messages.scrollHeight - ui.messages.scrollTop -
      ui.messages.clientHeight < 40;
    fillBody(li, "assistant", reply.content);
    if (atBottom) scrollDown();
  }, 40);
}

function setStreaming(on) {
  ui.send.hidden = on;
  ui.stop.hidden = !on;
  if (on) ui.stop.focus();
  else if (document.activeElement === ui.stop || document.activeElement === document.body) {
    ui.message.focus();
  }
}

function stop() {
  if (streaming) streaming.abort();
}

function setImage(url) {
  image = url;
  ui.attached.hidden = !url;
  if (url) ui.attachedImage.src = url;
  else ui.attachedImage.removeAttribute("src");
  ui.imageFile.value = "";
}

function readImage() {
  const file = ui.imageFile.files && ui.imageFile.files[0];
  if (!file) return;
  if (!file.type.startsWith("image/")) {
    showError(`${file.name} is not an image`);
    return;
  }
  const reader = new FileReader();
  reader.onload = () => setImage(String(reader.result));
  reader.onerror = () => showError(`Could not read ${file.name}`);
  reader.readAsDataURL(file);
}

// --- pulls --------------------------------------------------------------------------

function progressOf(task) {
  const items = Array.isArray(task.items) ? task.items : [];
  const total = items.reduce((n, i) => n + (i.bytes || 0), 0);
  const done = items.reduce((n, i) => n + (i.downloadedBytes || 0), 0);
  return total ? done / total : 0;
}

function megabytes(n) {
  return (n / 1e6).toFixed(1) + " MB";
}

async function pull() {
  const id = ui.pullId.value.trim();
  if (!id) return;
  ui.pull.disabled = true;
  ui.pullStatus.textContent = `Pulling ${id}…`;
  ui.pullProgress.hidden = false;
  ui.pullProgress.value = 0;
  ui.pullProgress.removeAttribute("data-state");
  // Listen first, so that no event of the task comes before the stream is open.
  const listening = new AbortController();
  try {
    const stream = await api.request("GET", "/v1/events", undefined, listening.signal);
    const reply = await api.json("POST", "/v1/models/pull", { model: id });
    if (!reply.task) {
      ui.pullStatus.textContent = reply.message;
      ui.pullProgress.value = 1;
    } else {
      ui.pullStatus.textContent = reply.message;
      await follow(api.events(stream), reply.task.id);
    }
    await loadModels();
  } catch (e) {
    if (e.name !== "AbortError") {
      ui.pullStatus.textContent = e.message;
      ui.pullProgress.dataset.state = "error";
    }
  } finally {
    listening.abort();
    ui.pull.disabled = false;
  }
}

async function follow(events, taskId) {
  for await (const event of events) {
    const task = event && event.task;
    if (!task || task.id !== taskId) continue;
    const items = task.items || [];
    const total = items.reduce((n, i) => n + (i.bytes || 0), 0);
    ui.pullProgress.value = progressOf(task);
    if (event.type === "DownloadSuccess") {
      ui.pullProgress.value = 1;
      ui.pullStatus.textContent = `Pulled ${taskId}`;
      ui.pullProgress.dataset.state = "done";
      return;
    }
    if (event.type === "DownloadError" || event.type === "DownloadStopped") {
      ui.pullStatus.textContent = task.error || `The pull of ${taskId} stopped`;
      ui.pullProgress.dataset.state = "error";
      return;
    }
    ui.pullStatus.textContent = `Pulling ${taskId}: ` +
      `${Math.round(ui.pullProgress.value * 100)}% of ${megabytes(total)}`;
  }
  throw new api.ApiError("The event stream ended before the pull did; " +
                         "GET /v1/models/pull shows how far it is");
}

// --- wiring -------------------------------------------------------------------------

ui.send.addEventListener("click", send);
ui.stop.addEventListener("click", stop);
ui.message.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    send();
  }
});
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape" && streaming) stop();
});
ui.models.addEventListener("change", pickModel);
ui.think.addEventListener("change", () => {
  store.current.think = ui.think.checked;
  save();
});
ui.newChat.addEventListener("click", newConversation);
ui.settingsToggle.addEventListener("click", () => {
  ui.settings.hidden = !ui.settings.hidden;
  ui.settingsToggle.setAttribute("aria-expanded", String(!ui.settings.hidden));
});
for (const input of [ui.system, ui.temperature, ui.maxTokens]) {
  input.addEventListener("change", readSettings);
}
ui.errorClose.addEventListener("click", clearError);
ui.keyUse.addEventListener("click", useKey);
ui.key.addEventListener("keydown", (e) => {
  if (e.key === "Enter") useKey();
});
ui.attach.addEventListener("click", () => ui.imageFile.click());
ui.imageFile.addEventListener("change", readImage);
ui.attachedRemove.addEventListener("click", () => setImage(null));
ui.pull.addEventListener("click", pull);
ui.pullId.addEventListener("keydown", (e) => {
  if (e.key === "Enter") pull();
});

showConversation();
loadModels().then(() => {
  document.body.dataset.ready = "true";
});
ui.message.focus();
