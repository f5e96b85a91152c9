// Conversations, kept in this browser's localStorage (never on the server): each with
// its title, model, system prompt, temperature, max tokens and messages. A message's
// pictures (`images`) and clips (`clips`) are kept in it as data: URLs, so a reload
// shows and sends them as before; a message without them simply has neither field.

const LIST = "localrt.conversations";
const CURRENT = "localrt.current";
export const UNTITLED = "New conversation";

function fresh() {
  const id = (crypto.randomUUID && crypto.randomUUID()) ||
    Date.now().toString(36) + Math.random().toString(36).slice(2);
  return { id, title: UNTITLED, model: "", system: "", temperature: null, maxTokens: null,
           messages: [], updated: Date.now() };
}

function valid(c) {
  return c && typeof c === "object" && typeof c.id === "string" && Array.isArray(c.messages);
}

export class Store {
  constructor(storage = window.localStorage) {
    this.storage = storage;
    let list = [];
    try {
      list = JSON.parse(storage.getItem(LIST) || "[]");
    } catch (e) {
      list = [];  // a damaged list starts over rather than breaking the page
    }
    this.list = Array.isArray(list) ? list.filter(valid) : [];
    this.currentId = storage.getItem(CURRENT);
    if (!this.list.length) this.list.push(fresh());
    if (!this.get(this.currentId)) this.currentId = this.sorted()[0].id;
  }

  get(id) {
    return this.list.find((c) => c.id === id) || null;
  }

  get current() {
    return this.get(this.currentId);
  }

  // Newest first, as the sidebar lists them.
  sorted() {
    return [...this.list].sort((a, b) => (b.updated || 0) - (a.updated || 0));
  }

  create(model = "") {
    const c = fresh();
    c.model = model;
    this.list.push(c);
    this.currentId = c.id;
    this.save();
    return c;
  }

  select(id) {
    if (this.get(id)) this.currentId = id;
    this.save();
  }

  rename(id, title) {
    const c = this.get(id);
    if (c) c.title = title.trim() || UNTITLED;
    this.save();
  }

  remove(id) {
    this.list = this.list.filter((c) => c.id !== id);
    if (!this.list.length) this.list.push(fresh());
    if (!this.get(this.currentId)) this.currentId = this.sorted()[0].id;
    this.save();
  }

  touch(c) {
    c.updated = Date.now();
    this.save();
  }

  // Write everything; throws (a QuotaExceededError) when the browser's storage is full.
  save() {
    this.storage.setItem(CURRENT, this.currentId);
    this.storage.setItem(LIST, JSON.stringify(this.list));
  }
}
