// The chat page served at GET /: a conversation view that streams replies from
// /v1/chat/completions, sampling settings, and a live panel fed by /stats and /health.
// Kept as plain HTML/CSS/JS in raw string literals so the binary needs no files and no build step.
#include "tessera/serve/chat_page.h"

namespace tessera::serve {
namespace {

// Element ids used by tests/js/chat_page.test.mjs: #prompt #send #stop #messages #model-name
// #stats-throughput #stats-running #stats-waiting #stats-kv; replies are ".msg.assistant" and get
// data-done="1" when their stream ends. Change them together.

constexpr const char* kHead = R"TESSERA_HTML(<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Tessera chat</title>
<link rel="icon" href="data:,">
<style>
:root {
  --bg: #f5f6f8; --panel: #fff; --line: #e2e5ea; --text: #1c2330; --muted: #667085;
  --accent: #2f5bd3; --accent-soft: #e9effc; --ok: #1a7f46; --ok-soft: #e3f4ea;
  --bad: #b42318; --bad-soft: #fdecea; --warn: #b54708;
  --radius: 12px; --shadow: 0 1px 2px rgba(16, 24, 40, .06);
}
* { box-sizing: border-box; }
html, body { height: 100%; margin: 0; }
body {
  font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
  color: var(--text); background: var(--bg); display: flex; flex-direction: column;
}
header.top {
  display: flex; align-items: center; gap: 16px; padding: 10px 20px; background: var(--panel);
  border-bottom: 1px solid var(--line); flex: none;
}
.brand { font-weight: 650; font-size: 17px; letter-spacing: .2px; display: flex; align-items: center; gap: 8px; }
.logo { width: 22px; height: 22px; border-radius: 6px; display: inline-grid; place-items: center;
  background: var(--accent); color: #fff; font-size: 13px; }
.model { color: var(--muted); font-size: 14px; min-width: 0; overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
#model-name { color: var(--text); font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 13px; }
#model-name.warn { color: var(--warn); font-family: inherit; }
.spacer { flex: 1; }
.badge { font-size: 12.5px; font-weight: 600; padding: 3px 10px; border-radius: 999px;
  background: #eef0f3; color: var(--muted); white-space: nowrap; }
.badge::before { content: ""; display: inline-block; width: 7px; height: 7px; border-radius: 50%;
  background: currentColor; margin-right: 6px; vertical-align: 1px; }
.badge.up { background: var(--ok-soft); color: var(--ok); }
.badge.down { background: var(--bad-soft); color: var(--bad); }
main.layout { flex: 1; min-height: 0; display: grid; grid-template-columns: minmax(0, 1fr) 320px; }
section.chat { display: flex; flex-direction: column; min-height: 0; }
#messages { flex: 1; overflow-y: auto; padding: 24px max(20px, calc((100% - 820px) / 2)); display: flex;
  flex-direction: column; gap: 14px; }
.empty { margin: auto; text-align: center; color: var(--muted); max-width: 420px; }
.empty b { display: block; color: var(--text); font-size: 18px; margin-bottom: 4px; }
.turn { display: flex; flex-direction: column; max-width: 85%; }
.turn.user { align-self: flex-end; align-items: flex-end; }
.turn.assistant { align-self: flex-start; }
.msg { padding: 10px 14px; border-radius: var(--radius); white-space: pre-wrap; overflow-wrap: anywhere;
  box-shadow: var(--shadow); }
.turn.unsent { opacity: .55; }
.msg.user { background: var(--accent); color: #fff; border-bottom-right-radius: 4px; }
.msg.assistant { background: var(--panel); border: 1px solid var(--line); border-bottom-left-radius: 4px; min-width: 48px; }
.msg.assistant.blank { display: none; }
.msg.streaming::after { content: "\258D"; color: var(--accent); animation: blink 1s steps(1) infinite; margin-left: 1px; }
@keyframes blink { 50% { opacity: 0; } }
.msg.error { background: var(--bad-soft); color: var(--bad); border: 1px solid #f5c2bc; margin-top: 6px; box-shadow: none; }
.meta { font-size: 12px; color: var(--muted); margin-top: 4px; padding: 0 4px; }
form#composer { flex: none; display: flex; gap: 10px; align-items: flex-end;
  padding: 14px max(20px, calc((100% - 820px) / 2)) 18px; border-top: 1px solid var(--line); background: var(--bg); }
#prompt { flex: 1; resize: none; min-height: 46px; max-height: 200px; padding: 12px 14px; font: inherit;
  border: 1px solid var(--line); border-radius: var(--radius); background: var(--panel); outline: none; }
#prompt:focus, .card input:focus, .card textarea:focus { border-color: var(--accent); box-shadow: 0 0 0 3px var(--accent-soft); }
button { font: inherit; font-weight: 600; border-radius: 10px; border: 1px solid transparent; cursor: pointer;
  padding: 0 18px; height: 46px; }
#send { background: var(--accent); color: #fff; }
#send:disabled { opacity: .5; cursor: default; }
#stop { background: var(--panel); color: var(--bad); border-color: #f5c2bc; }
button.ghost { background: transparent; border-color: var(--line); color: var(--text); height: 34px; font-weight: 500; }
button[hidden] { display: none; }
aside.side { border-left: 1px solid var(--line); overflow-y: auto; padding: 16px; display: flex;
  flex-direction: column; gap: 16px; background: var(--bg); }
.card { background: var(--panel); border: 1px solid var(--line); border-radius: var(--radius); padding: 14px 16px;
  box-shadow: var(--shadow); }
.card h2 { font-size: 13px; text-transform: uppercase; letter-spacing: .06em; color: var(--muted); margin: 0 0 10px;
  display: flex; justify-content: space-between; font-weight: 650; }
.big { font-size: 28px; font-weight: 650; font-variant-numeric: tabular-nums; line-height: 1.2; }
.big small { font-size: 13px; color: var(--muted); font-weight: 500; }
svg#spark { width: 100%; height: 36px; display: block; margin: 6px 0 10px; }
svg#spark polyline { fill: none; stroke: var(--accent); stroke-width: 1.5; vector-effect: non-scaling-stroke; }
svg#spark polygon { fill: var(--accent-soft); stroke: none; }
dl.grid { display: grid; grid-template-columns: 1fr 1fr; gap: 8px 12px; margin: 0 0 12px; }
dl.grid div { background: var(--bg); border-radius: 8px; padding: 6px 10px; }
dl.grid dt { font-size: 12px; color: var(--muted); }
dl.grid dd { margin: 0; font-weight: 600; font-variant-numeric: tabular-nums; }
.kv-head { display: flex; justify-content: space-between; font-size: 13px; margin-bottom: 5px; }
.kv-head span:first-child { color: var(--muted); }
#stats-kv { font-weight: 600; font-variant-numeric: tabular-nums; }
.bar { height: 10px; border-radius: 999px; background: #eceef2; overflow: hidden; }
#stats-kv-bar { height: 100%; width: 0; background: var(--accent); border-radius: 999px; transition: width .4s ease; }
#stats-kv-bar.warm { background: #d97706; }
#stats-kv-bar.hot { background: var(--bad); }
.sub { font-size: 12px; color: var(--muted); margin-top: 4px; font-variant-numeric: tabular-nums; }
.card label { display: block; font-size: 13px; color: var(--muted); margin-bottom: 10px; }
.card input, .card textarea { display: block; width: 100%; margin-top: 3px; font: inherit; font-size: 14px; color: var(--text);
  padding: 6px 9px; border: 1px solid var(--line); border-radius: 8px; background: var(--panel); outline: none; }
.card textarea { resize: vertical; }
.row2 { display: grid; grid-template-columns: 1fr 1fr; gap: 10px; }
@media (max-width: 860px) {
  body { height: auto; min-height: 100%; }
  main.layout { grid-template-columns: 1fr; }
  section.chat { height: calc(100vh - 54px); }
  aside.side { border-left: none; border-top: 1px solid var(--line); }
  .turn { max-width: 94%; }
  .model .label { display: none; }
}
</style>
</head>
)TESSERA_HTML";

constexpr const char* kBody = R"TESSERA_HTML(<body>
<header class="top">
  <div class="brand"><span class="logo">T</span>Tessera</div>
  <div class="model"><span class="label">model </span><span id="model-name">&hellip;</span></div>
  <div class="spacer"></div>
  <div id="health" class="badge" title="GET /health">connecting</div>
</header>
<main class="layout">
  <section class="chat">
    <div id="messages" role="log" aria-live="polite">
      <div id="empty" class="empty"><b>Chat with the served model</b>Replies stream token by token.
        Enter sends, Shift+Enter starts a new line; sampling settings are on the right.</div>
    </div>
    <form id="composer" autocomplete="off">
      <textarea id="prompt" rows="1" placeholder="Message (Enter to send, Shift+Enter for a new line)" aria-label="Message"></textarea>
      <button id="send" type="submit">Send</button>
      <button id="stop" type="button" hidden title="Stop generating (Esc)">Stop</button>
    </form>
  </section>
  <aside class="side">
    <div class="card" id="live">
      <h2><span>Live</span><span id="stats-uptime" title="server uptime"></span></h2>
      <div class="big"><span id="stats-throughput">&ndash;</span> <small>tokens/s generated</small></div>
      <svg id="spark" viewBox="0 0 120 30" preserveAspectRatio="none" aria-hidden="true"><polygon points=""></polygon><polyline points=""></polyline></svg>
      <dl class="grid">
        <div><dt>running</dt><dd id="stats-running">&ndash;</dd></div>
        <div><dt>waiting</dt><dd id="stats-waiting">&ndash;</dd></div>
        <div><dt>tokens generated</dt><dd id="stats-tokens">&ndash;</dd></div>
        <div><dt>prompt tokens</dt><dd id="stats-prompt-tokens">&ndash;</dd></div>
      </dl>
      <div class="kv-head"><span>KV cache</span><span id="stats-kv">&ndash;</span></div>
      <div class="bar" role="progressbar" aria-label="KV cache usage" aria-valuemin="0" aria-valuemax="100"><div id="stats-kv-bar"></div></div>
      <div class="sub"><span id="stats-kv-blocks"></span> <span id="stats-requests"></span></div>
    </div>
    <div class="card" id="settings">
      <h2><span>Settings</span></h2>
      <label>System prompt<textarea id="system-prompt" rows="3" placeholder="(none)"></textarea></label>
      <div class="row2">
        <label>Temperature<input id="temperature" type="number" min="0" max="2" step="0.1" value="0.8"></label>
        <label>top_p<input id="top-p" type="number" min="0" max="1" step="0.05" value="1"></label>
      </div>
      <div class="row2">
        <label>Max tokens<input id="max-tokens" type="number" min="1" step="1" value="256"></label>
        <label>Seed<input id="seed" type="number" step="1" placeholder="random"></label>
      </div>
      <label>API key<input id="api-key" type="password" placeholder="(none)" autocomplete="off" spellcheck="false"></label>
      <button id="clear" class="ghost" type="button">Clear conversation</button>
    </div>
  </aside>
</main>
<noscript><p style="padding:20px">This page needs JavaScript.</p></noscript>
)TESSERA_HTML";

constexpr const char* kScript = R"TESSERA_HTML(<script>
(() => {
'use strict';
const $ = (id) => document.getElementById(id);
const messages = $('messages'), prompt = $('prompt'), sendBtn = $('send'), stopBtn = $('stop');
const modelName = $('model-name'), health = $('health');
const state = { model: null, needKey: false, history: [], controller: null, spark: [], conversation: 0 };

// Settings survive reloads (the API key included: it only ever goes to this server).
const SETTINGS = ['system-prompt', 'temperature', 'top-p', 'max-tokens', 'seed', 'api-key'];
const store = {
  get(k) { try { return localStorage.getItem('tessera.' + k); } catch (e) { return null; } },
  set(k, v) { try { localStorage.setItem('tessera.' + k, v); } catch (e) { /* private mode */ } },
};
for (const id of SETTINGS) {
  const el = $(id), saved = store.get(id);
  if (saved !== null) el.value = saved;
  el.addEventListener('input', () => store.set(id, el.value));
}
$('api-key').addEventListener('change', loadModel);

function authHeaders() {
  const key = $('api-key').value.trim();
  return key ? { Authorization: 'Bearer ' + key } : {};
}
function numberSetting(id, integer) {
  const raw = $(id).value.trim();
  if (raw === '') return undefined;
  const v = Number(raw);
  return Number.isFinite(v) ? (integer ? Math.trunc(v) : v) : undefined;
}
const fmtInt = (v) => Number.isFinite(v) ? Math.round(v).toLocaleString('en-US') : '\u2013';
function fmtDuration(s) {
  if (!Number.isFinite(s)) return '';
  if (s < 60) return Math.floor(s) + ' s';
  if (s < 3600) return Math.floor(s / 60) + ' min';
  return (s / 3600).toFixed(1) + ' h';
}

// ---- model name ----
async function loadModel() {
  try {
    const r = await fetch('/v1/models', { headers: authHeaders(), cache: 'no-store' });
    state.needKey = r.status === 401;
    if (state.needKey) {
      state.model = null;
      modelName.textContent = 'API key needed (Settings)';
      modelName.classList.add('warn');
      return;
    }
    const body = await r.json();
    const m = body && body.data && body.data[0];
    if (!m) return;
    state.model = m.id;
    modelName.textContent = m.id;
    modelName.classList.remove('warn');
    if (m.max_model_len) modelName.title = 'context ' + m.max_model_len + ' tokens, vocabulary ' + m.vocab_size;
  } catch (e) {
    setTimeout(loadModel, 2000);  // server not up yet
  }
}

// ---- live panel: /health and /stats once a second ----
function setHealth(up, why) {
  health.textContent = up ? 'engine up' : 'engine down';
  health.className = 'badge ' + (up ? 'up' : 'down');
  health.title = why;
}
function renderStats(s) {
  const num = (v) => (typeof v === 'number' && Number.isFinite(v)) ? v : NaN;
  const tps = num(s.generation_tokens_per_s);
  $('stats-throughput').textContent = Number.isFinite(tps) ? tps.toFixed(tps >= 100 ? 0 : 1) : '\u2013';
  $('stats-running').textContent = fmtInt(num(s.running));
  $('stats-waiting').textContent = fmtInt(num(s.waiting));
  $('stats-tokens').textContent = fmtInt(num(s.generation_tokens_total));
  $('stats-prompt-tokens').textContent = fmtInt(num(s.prompt_tokens_total));
  const used = num(s.kv_blocks_used), total = num(s.kv_blocks_total);
  let usage = num(s.kv_usage);
  if (!Number.isFinite(usage) && total > 0) usage = used / total;
  if (Number.isFinite(usage)) {
    usage = Math.min(1, Math.max(0, usage));
    $('stats-kv').textContent = (usage * 100).toFixed(1) + ' %';
    const bar = $('stats-kv-bar');
    bar.style.width = (usage * 100) + '%';
    bar.className = usage > 0.9 ? 'hot' : usage > 0.7 ? 'warm' : '';
    bar.parentElement.setAttribute('aria-valuenow', (usage * 100).toFixed(0));
  }
  $('stats-kv-blocks').textContent = Number.isFinite(total) ? fmtInt(used) + ' / ' + fmtInt(total) + ' blocks' : '';
  $('stats-requests').textContent = Number.isFinite(num(s.requests_total)) ? '\u00b7 ' + fmtInt(s.requests_total) + (s.requests_total === 1 ? ' request' : ' requests') : '';
  $('stats-uptime').textContent = Number.isFinite(num(s.uptime_s)) ? 'up ' + fmtDuration(s.uptime_s) : '';
  if (!state.model && !state.needKey && typeof s.model === 'string' && s.model) {
    state.model = s.model;
    modelName.textContent = s.model;
  }
  state.spark.push(Number.isFinite(tps) ? tps : 0);
  if (state.spark.length > 60) state.spark.shift();
  drawSpark();
}
function drawSpark() {
  const v = state.spark, max = Math.max(1, ...v), n = 60;
  const pts = v.map((y, i) => ((n - v.length + i) * 120 / (n - 1)).toFixed(1) + ',' + (29 - y / max * 27).toFixed(1));
  const svg = $('spark');
  svg.querySelector('polyline').setAttribute('points', pts.join(' '));
  if (pts.length) {
    const x0 = pts[0].split(',')[0];
    svg.querySelector('polygon').setAttribute('points', x0 + ',30 ' + pts.join(' ') + ' 120,30');
  }
}
async function fetchWithTimeout(url, ms) {
  const ctl = new AbortController();
  const timer = setTimeout(() => ctl.abort(), ms);
  try { return await fetch(url, { cache: 'no-store', signal: ctl.signal }); } finally { clearTimeout(timer); }
}
async function pollLive() {
  const [h, s] = await Promise.allSettled([fetchWithTimeout('/health', 2500), fetchWithTimeout('/stats', 2500)]);
  if (h.status === 'fulfilled') setHealth(h.value.status === 200, 'GET /health answered ' + h.value.status);
  else setHealth(false, 'the server does not answer');
  if (s.status === 'fulfilled' && s.value.ok) {
    try { renderStats(await s.value.json()); } catch (e) { /* partial body: next poll */ }
  }
  setTimeout(pollLive, 1000);
}

// ---- conversation ----
function scrollIfAtBottom(force) {
  const near = messages.scrollHeight - messages.scrollTop - messages.clientHeight < 80;
  if (force || near) messages.scrollTop = messages.scrollHeight;
}
function addTurn(role, text) {
  const empty = $('empty');
  if (empty) empty.remove();
  const turn = document.createElement('div');
  turn.className = 'turn ' + role;
  const msg = document.createElement('div');
  msg.className = 'msg ' + role;
  const node = document.createTextNode(text);
  msg.appendChild(node);
  turn.appendChild(msg);
  messages.appendChild(turn);
  scrollIfAtBottom(true);
  return { turn, msg, node };
}
function addNote(turn, cls, text) {
  const el = document.createElement('div');
  el.className = cls;
  el.textContent = text;
  turn.appendChild(el);
  return el;
}
async function errorMessage(r) {
  let text = '';
  try {
    const raw = await r.text();
    try {
      const body = JSON.parse(raw);
      text = (body && body.error && body.error.message) || raw;
      if (body && body.error && body.error.param) text += ' (' + body.error.param + ')';
    } catch (e) { text = raw; }
  } catch (e) { /* no body */ }
  let msg = 'HTTP ' + r.status + (text ? ': ' + text.trim() : '');
  if (r.status === 401) msg += ' \u2014 set the API key in Settings.';
  if (r.status === 429 && r.headers.get('Retry-After')) msg += ' Retry after ' + r.headers.get('Retry-After') + ' s.';
  return msg;
}

// Server-sent events: `data:` lines up to a blank line make one event. Network reads split the
// stream anywhere (mid-line, mid-UTF-8 sequence, between \r and \n), so only whole lines are used.
function sseParser(onEvent) {
  let buf = '', data = [];
  const eol = /\r\n|\r|\n/g;
  return function feed(chunk, last) {
    buf += chunk;
    let start = 0, m;
    eol.lastIndex = 0;
    while ((m = eol.exec(buf)) !== null) {
      if (m[0] === '\r' && m.index === buf.length - 1 && !last) break;  // maybe half of \r\n
      const line = buf.slice(start, m.index);
      start = eol.lastIndex;
      if (line === '') {
        if (data.length) onEvent(data.join('\n'));
        data = [];
      } else if (line.startsWith('data:')) {
        data.push(line.slice(line.charAt(5) === ' ' ? 6 : 5));
      }  // ':' comments and other fields carry nothing for us
    }
    buf = buf.slice(start);
    if (last) {
      if (buf.startsWith('data:')) data.push(buf.slice(buf.charAt(5) === ' ' ? 6 : 5));
      if (data.length) onEvent(data.join('\n'));
      buf = ''; data = [];
    }
  };
}

function setBusy(busy) {
  sendBtn.hidden = busy;
  stopBtn.hidden = !busy;
  if (!busy) prompt.focus();
}

async function send() {
  const text = prompt.value;
  if (!text.trim() || state.controller) return;
  prompt.value = '';
  autosize();
  const asked = addTurn('user', text);
  state.history.push({ role: 'user', content: text });

  const body = { messages: [], stream: true, stream_options: { include_usage: true } };
  const system = $('system-prompt').value.trim();
  if (system) body.messages.push({ role: 'system', content: system });
  body.messages.push(...state.history);
  if (state.model) body.model = state.model;
  const fields = [['temperature', 'temperature', false], ['top_p', 'top-p', false],
                  ['max_tokens', 'max-tokens', true], ['seed', 'seed', true]];
  for (const [key, id, integer] of fields) {
    const v = numberSetting(id, integer);
    if (v !== undefined) body[key] = v;
  }

  const reply = addTurn('assistant', '');
  reply.msg.classList.add('streaming');
  const conversation = state.conversation;
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  const t0 = performance.now();
  let tFirst = 0, content = '', finish = null, usage = null, error = null, stopped = false;
  try {
    const r = await fetch('/v1/chat/completions', {
      method: 'POST', signal: controller.signal,
      headers: Object.assign({ 'Content-Type': 'application/json', Accept: 'text/event-stream' }, authHeaders()),
      body: JSON.stringify(body),
    });
    if (!r.ok) throw new Error(await errorMessage(r));
    const feed = sseParser((payload) => {
      if (payload === '[DONE]') return;
      const chunk = JSON.parse(payload);
      if (chunk.error) throw new Error(chunk.error.message || 'server error');
      for (const c of chunk.choices || []) {
        const piece = c.delta && c.delta.content;
        if (piece) {
          if (!tFirst) tFirst = performance.now();
          content += piece;
          reply.node.appendData(piece);
          scrollIfAtBottom(false);
        }
        if (c.finish_reason) finish = c.finish_reason;
      }
      if (chunk.usage) usage = chunk.usage;
    });
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    for (;;) {
      const { value, done } = await reader.read();
      if (done) { feed(decoder.decode(), true); break; }
      feed(decoder.decode(value, { stream: true }), false);
    }
  } catch (e) {
    if (e && e.name === 'AbortError') stopped = true;
    else error = (e && e.message) || String(e);
    if (error && e instanceof TypeError) error = 'cannot reach the server (' + error + ')';
    controller.abort();  // a parse error mid-stream: hang up so the server cancels the request
  }
  state.controller = null;
  reply.msg.classList.remove('streaming');
  if (!content) reply.msg.classList.add('blank');
  if (conversation !== state.conversation) {
    // cleared while streaming: this reply belongs to no conversation any more
  } else if (content) state.history.push({ role: 'assistant', content });
  else if (error) {  // nothing came back: drop the unanswered turn from the conversation
    state.history.pop();
    asked.turn.classList.add('unsent');
    asked.turn.title = 'not part of the conversation: the request failed';
  }
  if (error) addNote(reply.turn, 'msg error', error);
  const seconds = ((tFirst ? performance.now() - tFirst : 0)) / 1000;
  const parts = [];
  const n = usage ? usage.completion_tokens : undefined;
  if (Number.isFinite(n)) parts.push(n + ' tokens');
  if (tFirst) parts.push('first token ' + Math.round(tFirst - t0) + ' ms');
  if (Number.isFinite(n) && n > 1 && seconds > 0) parts.push(((n - 1) / seconds).toFixed(1) + ' tokens/s');
  if (stopped) parts.push('stopped');
  else if (finish) parts.push(finish === 'length' ? 'hit max tokens' : finish);
  if (parts.length) addNote(reply.turn, 'meta', parts.join(' \u00b7 '));
  reply.msg.dataset.done = '1';
  setBusy(false);
  scrollIfAtBottom(false);
}

function autosize() {
  prompt.style.height = 'auto';
  prompt.style.height = Math.min(prompt.scrollHeight + 2, 200) + 'px';
}
prompt.addEventListener('input', autosize);
prompt.addEventListener('keydown', (e) => {
  if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    send();
  }
});
document.addEventListener('keydown', (e) => {
  if (e.key === 'Escape' && state.controller) state.controller.abort();
});
$('composer').addEventListener('submit', (e) => { e.preventDefault(); send(); });
stopBtn.addEventListener('click', () => { if (state.controller) state.controller.abort(); });
$('clear').addEventListener('click', () => {
  if (state.controller) state.controller.abort();
  state.history = [];
  state.conversation++;
  messages.querySelectorAll('.turn').forEach((t) => t.remove());
  prompt.focus();
});

loadModel();
pollLive();
prompt.focus();
})();
</script>
</body>
</html>
)TESSERA_HTML";

}  // namespace

const std::string& chat_page_html() {
  static const std::string page = std::string(kHead) + kBody + kScript;
  return page;
}

}  // namespace tessera::serve
