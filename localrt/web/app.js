// The chat page: the model picker, the conversation, the composer (with its attached
// pictures and clips, and the microphone), the sidebar and the pull panel. Every text
// from the server or a model goes in as textContent or through markdown.js, never as HTML.

import * as api from "./api.js";
import * as audio from "./audio.js";
import { render } from "./markdown.js";
import { Store, UNTITLED } from "./store.js";

const $ = (id) => document.getElementById(id);
const ui = {
  models: $("model"), modelState: $("model-state"), messages: $("messages"),
  message: $("message"), send: $("send"), stop: $("stop"), attach: $("attach"),
  attachFile: $("attach-file"), attached: $("attached"), mic: $("mic"),
  recording: $("recording"), conversations: $("conversations"),
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
let pending = [];         // data: URLs of the pictures and clips the next message sends
let recorder = null;      // the microphone's audio.Recorder while it records
let recordTimer = 0;
const players = new Map();  // a clip's data: URL -> the blob: URL its <audio> plays
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
  const sees = can(m, "vision");
  const hears = can(m, "audio");
  ui.attach.hidden = !sees && !hears;
  const what = sees && hears ? "image or audio" : hears ? "audio" : "image";
  ui.attach.setAttribute("aria-label", "Attach " + what);
  ui.attach.title = "Attach " + what;
  ui.attachFile.accept = [sees ? "image/*" : "", hears ? AUDIO_FILES : ""]
    .filter(Boolean).join(",");
  ui.mic.hidden = !hears;
  if (!hears && recorder) cancelRecording();
  const kept = pending.filter((url) => (url.startsWith("data:audio/") ? hears : sees));
  if (kept.length !== pending.length) {
    const clip = pending.some((url) => url.startsWith("data:audio/") && !hears);
    showError(`${m ? m.id : "No model"} takes no ${clip ? "audio" : "images"}: ` +
              `the attached ${clip ? "clip" : "image"} was removed`);
    setPending(kept);
  }
  ui.thinkLabel.hidden = !can(m, "reasoning");
  ui.think.checked = store.current.think !== false;
}

// What the file chooser offers for a model that hears: the formats the server reads.
const AUDIO_FILES = ".wav,.mp3,.flac,audio/wav,audio/x-wav,audio/mpeg,audio/flac,audio/x-flac";

// Whether a model's capabilities include `what`: "vision" (it takes pictures), "audio"
// (clips), "reasoning" (it thinks before it answers).
function can(m, what) {
  return Boolean(m && Array.isArray(m.capabilities) && m.capabilities.includes(what));
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
  for (const [data, url] of players) {  // the last conversation's players
    if (!pending.includes(data)) {
      URL.revokeObjectURL(url);
      players.delete(data);
    }
  }
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
  for (const url of msg.clips || []) {
    if (url.startsWith("data:audio/")) li.insertBefore(player(url), body);
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

// An <audio> element with controls that plays a clip's data: URL (a note instead for
// one that damaged storage left unreadable).
function player(url) {
  try {
    if (!players.has(url)) players.set(url, audio.playable(url));
  } catch (e) {
    const span = document.createElement("span");
    span.className = "note";
    span.textContent = "an audio clip the browser could not read";
    return span;
  }
  const element = document.createElement("audio");
  element.controls = true;
  element.preload = "metadata";
  element.className = "clip";
  element.src = players.get(url);
  element.setAttribute("aria-label", "Audio clip");
  return element;
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

// The messages as the API takes them: an image goes as an OpenAI image_url part, a clip
// as an input_audio part.
function apiMessages(c) {
  const out = [];
  if (c.system && c.system.trim()) out.push({ role: "system", content: c.system });
  for (const m of c.messages) {
    if ((m.images && m.images.length) || (m.clips && m.clips.length)) {
      out.push({ role: m.role, content: [
        ...(m.content ? [{ type: "text", text: m.content }] : []),  // a clip may go alone
        ...(m.images || []).map((url) => ({ type: "image_url", image_url: { url } })),
        ...(m.clips || []).map((url) => ({ type: "input_audio", input_audio: {
          data: audio.base64Of(url), format: audio.formatOf(url) } }))] });
    } else if (m.reasoning) {  // the template keeps or drops earlier thinking
      out.push({ role: m.role, content: m.content, reasoning_content: m.reasoning });
    } else {
      out.push({ role: m.role, content: m.content });
    }
  }
  return out;
}

async function send() {
  if (recorder) await finishRecording();  // what was said so far goes with the message
  const text = ui.message.value;
  if (streaming || (!text.trim() && !pending.length)) return;
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
  const images = pending.filter((url) => url.startsWith("data:image/"));
  const clips = pending.filter((url) => url.startsWith("data:audio/"));
  if (images.length) user.images = images;
  if (clips.length) user.clips = clips;
  c.messages.push(user);
  if (c.title === UNTITLED) {
    c.title = text.trim().split("\n")[0].slice(0, 48) || (images.length ? "Image" : "Audio clip");
  }
  store.touch(c);
  ui.message.value = "";
  setPending([]);
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
  if (can(m, "reasoning")) body.reasoning_effort = c.think === false ? "none" : "medium";

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

// --- attachments and the microphone -------------------------------------------------

// Show what the next message sends: each picture or clip with a button that removes it.
function setPending(urls) {
  pending = urls;
  ui.attached.replaceChildren(...pending.map((url) => {
    const li = document.createElement("li");
    const clip = url.startsWith("data:audio/");
    if (clip) {
      li.append(player(url));
    } else {
      const img = document.createElement("img");
      img.src = url;
      img.alt = "Attached image";
      li.append(img);
    }
    li.append(iconButton("×", clip ? "Remove audio" : "Remove image",
                         () => setPending(pending.filter((u) => u !== url))));
    return li;
  }));
  ui.attached.hidden = !pending.length;
}

function attach(url) {
  setPending([...pending, url]);
}

function dataUrlOf(blob) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(String(reader.result));
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(blob);
  });
}

// A chosen file: a picture for a model that sees, a clip (told apart by its bytes, as
// the server does) for one that hears; anything else is refused with a note.
async function readFile() {
  const file = ui.attachFile.files && ui.attachFile.files[0];
  ui.attachFile.value = "";
  if (!file) return;
  const m = selected();
  const name = m ? m.id : "this model";
  try {
    // The first 12 bytes tell the format: the file itself is read once, into its URL.
    const format = audio.sniff(new Uint8Array(await file.slice(0, 12).arrayBuffer()));
    if (format) {
      if (!can(m, "audio")) {
        showError(`${file.name} is audio, and ${name} takes no audio: pick a model ` +
                  "whose capabilities include audio");
      } else {
        attach(await dataUrlOf(audio.blob(file, format)));
      }
    } else if (file.type.startsWith("image/")) {
      if (!can(m, "vision")) showError(`${file.name} is an image, and ${name} takes no images`);
      else attach(await dataUrlOf(file));
    } else if (file.type.startsWith("audio/") || /\.(wav|mp3|flac)$/i.test(file.name)) {
      showError(`${file.name} is not a WAV, MP3 or FLAC file (by its bytes)`);
    } else {
      showError(`${file.name} is neither an image nor a WAV, MP3 or FLAC clip`);
    }
  } catch (e) {
    showError(`Could not read ${file.name} (${e.message})`);
  }
}

// The microphone button: the first press asks the browser for the microphone and
// records, the second stops and attaches the clip as a WAV.
async function toggleRecording() {
  if (recorder) {
    await finishRecording();
    return;
  }
  clearError();
  const r = new audio.Recorder();
  ui.mic.disabled = true;  // until the browser's prompt is answered
  try {
    await r.start();
  } catch (e) {
    ui.mic.disabled = false;
    showError(microphoneError(e));
    return;
  }
  ui.mic.disabled = false;
  recorder = r;
  setRecording(true);
}

async function finishRecording() {
  const r = recorder;
  recorder = null;
  setRecording(false);
  ui.mic.disabled = true;
  try {
    const bytes = await r.stop();
    if (bytes) attach(await dataUrlOf(audio.blob(bytes, "wav")));
    else showError("Nothing was recorded: the microphone gave no sound");
  } catch (e) {
    showError(`The recording failed (${e.message})`);
  } finally {
    ui.mic.disabled = false;
  }
}

function cancelRecording() {
  recorder.release();
  recorder = null;
  setRecording(false);
}

function setRecording(on) {
  ui.mic.setAttribute("aria-pressed", String(on));
  const label = on ? "Stop recording" : "Record audio";
  ui.mic.setAttribute("aria-label", label);
  ui.mic.title = label;
  ui.recording.hidden = !on;
  clearInterval(recordTimer);
  recordTimer = 0;
  if (!on) return;
  const tick = () => {
    const s = Math.floor(recorder ? recorder.seconds : 0);
    ui.recording.textContent = `Recording ${Math.floor(s / 60)}:${String(s % 60).padStart(2, "0")}`;
  };
  tick();
  recordTimer = setInterval(tick, 250);
}

function microphoneError(e) {
  if (!(e instanceof DOMException)) return e.message;  // the page's own (an insecure page)
  if (e.name === "NotAllowedError") return "The browser was not allowed to use the microphone";
  if (e.name === "NotFoundError") return "The browser found no microphone";
  return `The microphone could not start (${e.message})`;
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
ui.attach.addEventListener("click", () => ui.attachFile.click());
ui.attachFile.addEventListener("change", readFile);
ui.mic.addEventListener("click", toggleRecording);
ui.pull.addEventListener("click", pull);
ui.pullId.addEventListener("keydown", (e) => {
  if (e.key === "Enter") pull();
});

showConversation();
loadModels().then(() => {
  document.body.dataset.ready = "true";
});
ui.message.focus();
