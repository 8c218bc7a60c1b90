// lockstep's chat page: the server's own OpenAI route (/v1/chat/completions, streamed).
// Text goes into the page as textContent only, never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "lockstep-api-key";
const state = {
  messages: [],            // the conversation sent with each request (the system prompt aside)
  model: null,             // the id /v1/models answers
  key: sessionStorage.getItem(KEY_STORE) || "",
  controller: null,        // aborts the reply being streamed; the server then aborts its request
};

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.key) h.Authorization = "Bearer " + state.key;
  return h;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

// Ask which model the server serves; a 401 means it wants an API key (--api-key).
async function connect() {
  let response;
  try {
    response = await fetch("/v1/models", { headers: headers() });
  } catch (err) {
    $("model").textContent = "server unreachable";
    return;
  }
  if (response.status === 401) {
    $("key-form").hidden = false;
    $("model").textContent = state.key ? "the API key was refused" : "this server needs an API key";
    $("api-key").focus();
    return;
  }
  if (!response.ok) {
    $("model").textContent = await errorText(response);
    return;
  }
  state.model = (await response.json()).data[0].id;
  $("model").textContent = state.model;
  $("key-form").hidden = !state.key;
}

function scrollDown() {
  const list = $("messages");
  list.scrollTop = list.scrollHeight;
}

function addMessage(role, text) {
  const box = document.createElement("div");
  box.className = "msg " + role;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role === "user" ? "You" : "Assistant";
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  box.append(who, content);
  $("messages").append(box);
  scrollDown();
  return box;
}

// The reasoning block (`reasoning_content` deltas, from a server with --reasoning-parser), kept
// apart from the answer; made on its first delta.
function reasoningText(box) {
  let block = box.querySelector(".reasoning");
  if (!block) {
    block = document.createElement("details");
    block.className = "reasoning";
    block.open = true;
    const summary = document.createElement("summary");
    summary.textContent = "Reasoning";
    block.append(summary, document.createElement("div"));
    box.querySelector(".content").before(block);
  }
  return block.querySelector("div");
}

function setStatus(box, text, isError = false) {
  const status = document.createElement("div");
  status.className = isError ? "status error" : "status";
  status.textContent = text;
  box.append(status);
}

// The JSON events of a server-sent-event stream, up to `data: [DONE]`.
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice("data: ".length);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function describe(usage, finish, seconds) {
  if (!usage) return finish || "done";
  const rate = usage.completion_tokens / Math.max(seconds, 1e-3);
  const cut = finish === "length" ? " · stopped at max tokens" : "";
  return `${usage.completion_tokens} tokens · ${rate.toFixed(1)} tokens/s${cut}`;
}

function busy(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
}

async function send(text) {
  const history = state.messages;  // "New chat" while this streams starts another one
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const box = addMessage("assistant", "");
  box.classList.add("streaming");
  const content = box.querySelector(".content");
  const system = $("system").value.trim();
  const body = {
    model: state.model || "default",
    messages: system ? [{ role: "system", content: system }, ...history] : history,
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("temperature").value),
    max_tokens: Number($("max-tokens").value),
  };
  const controller = (state.controller = new AbortController());
  busy(true);
  let reply = "";
  let usage = null;
  let finish = null;
  const started = performance.now();
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) {
      const why = await errorText(response);
      if (response.status === 401) connect();
      throw new Error(why);
    }
    for await (const event of sseEvents(response)) {
      if (event.error) throw new Error(event.error.message);
      if (event.usage) usage = event.usage;
      const choice = event.choices && event.choices[0];
      if (!choice) continue;
      const delta = choice.delta || {};
      if (delta.reasoning_content) reasoningText(box).textContent += delta.reasoning_content;
      if (delta.content) {
        reply += delta.content;
        content.textContent = reply;
      }
      if (choice.finish_reason) finish = choice.finish_reason;
      scrollDown();
    }
    setStatus(box, describe(usage, finish, (performance.now() - started) / 1000));
  } catch (err) {
    if (err.name === "AbortError") setStatus(box, "stopped");
    else setStatus(box, err.message, true);
  } finally {
    box.classList.remove("streaming");
    if (state.controller === controller) {
      state.controller = null;
      busy(false);
    }
    // A turn without a reply leaves no trace: chat templates want user and assistant to alternate.
    if (reply) history.push({ role: "assistant", content: reply });
    else history.pop();
    scrollDown();
  }
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("input").value.trim();
  if (!text || state.controller) return;
  $("input").value = "";
  send(text);
});

$("input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});

$("stop").addEventListener("click", () => state.controller && state.controller.abort());

$("new-chat").addEventListener("click", () => {
  if (state.controller) state.controller.abort();
  state.messages = [];
  $("messages").replaceChildren();
  $("input").focus();
});

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  state.key = $("api-key").value.trim();
  sessionStorage.setItem(KEY_STORE, state.key);
  connect();
});

connect();
