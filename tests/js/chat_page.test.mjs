// End-to-end test of the chat page (GET /) in Debian's headless Chromium driven by playwright-core:
// the page finds the model (API key) and the live stats, streams a reply, shows errors inline,
// stops a reply, notices the engine going down, and looks right (screenshot).
// Run: node chat_page.test.mjs TESSERA_CLI MODEL_DIR, or with those in the environment
// (ctest js_chat_page sets them) node --test chat_page.test.mjs.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { chromium } from 'playwright-core';
import { startServer, waitFor } from './serve_process.mjs';

const CHROMIUM = process.env.TESSERA_CHROMIUM || '/usr/bin/chromium';
const SERVED_NAME = 'tessera-chat-test';
const KEY = 'sk-chat-page-test';
const SCREENSHOT = process.env.TESSERA_SCREENSHOT || path.join(os.tmpdir(), 'tessera-chat.png');

// Whatever happens, never outlive ctest's timeout: the child processes die with us.
setTimeout(() => { console.error('chat_page.test: watchdog fired after 100 s'); process.exit(1); }, 100000).unref();

let server, browser, page;
const pageErrors = [];
// Chromium logs every 4xx fetch as a console error; the tests that provoke one allow its status.
let allowedStatus = null;

before(async () => {
  assert.ok(fs.existsSync(CHROMIUM), `${CHROMIUM} missing: run scripts/install-deps (Debian package chromium)`);
  server = await startServer(['--served-model-name', SERVED_NAME, '--api-key', KEY]);
  browser = await chromium.launch({
    executablePath: CHROMIUM,
    headless: true,
    timeout: 30000,
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
           '--disable-background-networking', '--disable-component-update', '--disable-sync',
           '--disable-dev-shm-usage'],
  });
  page = await browser.newPage({ viewport: { width: 1280, height: 800 } });
  page.setDefaultTimeout(20000);
  page.on('pageerror', (e) => pageErrors.push(`pageerror: ${e.message}`));
  page.on('console', (m) => {
    if (m.type() !== 'error') return;
    if (allowedStatus && m.text().includes(`the server responded with a status of ${allowedStatus}`)) return;
    pageErrors.push(`console: ${m.text()}`);
  });
});

after(async () => {
  if (browser) await browser.close().catch(() => {});
  if (server) server.kill();  // only if the SIGTERM test did not already stop it
});

const text = (sel) => page.locator(sel).textContent();
async function postJson(route, body) {
  const r = await fetch(server.url + route, {
    method: 'POST', headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${KEY}` },
    body: JSON.stringify(body) });
  assert.equal(r.status, 200, `${route}: ${r.status}`);
  return r.json();
}
// max_tokens that fills the context after these messages (rendered by the server's template).
async function tokensLeft(messages) {
  const tok = await postJson('/tokenize', { messages, add_generation_prompt: true });
  assert.ok(tok.count > 0 && tok.count < tok.max_model_len - 64, JSON.stringify(tok));
  return tok.max_model_len - tok.count;
}

test('the page loads, shows the model and fills the live panel', { timeout: 30000 }, async () => {
  allowedStatus = 401;  // /v1/models before the key is set
  const r = await page.goto(server.url + '/', { waitUntil: 'load' });
  assert.equal(r.status(), 200);
  assert.match(r.headers()['content-type'], /^text\/html/);
  assert.equal(await page.title(), 'Tessera chat');
  // The model name comes from GET /v1/models, which needs the key (sent as a Bearer token).
  await page.waitForFunction(() => /API key needed/.test(document.getElementById('model-name').textContent));
  await page.fill('#api-key', KEY);
  await page.press('#api-key', 'Tab');  // change event: the page asks again
  await page.waitForFunction((name) => document.getElementById('model-name').textContent === name, SERVED_NAME);
  allowedStatus = null;
  // The live panel polls /health and /stats: numbers replace the dashes.
  await page.waitForFunction(() => /^engine up$/.test(document.getElementById('health').textContent));
  await page.waitForFunction(() => /^\d+$/.test(document.getElementById('stats-running').textContent) &&
      /^\d+$/.test(document.getElementById('stats-waiting').textContent) &&
      /^\d+(\.\d+)?$/.test(document.getElementById('stats-throughput').textContent) &&
      /^\d+(\.\d+)? %$/.test(document.getElementById('stats-kv').textContent));
  assert.equal(await text('#stats-running'), '0');
  assert.equal(await text('#stats-waiting'), '0');
  assert.equal(await text('#stats-kv'), '0.0 %');  // idle server: no blocks held
});

test('a message streams a reply token by token', { timeout: 40000 }, async () => {
  // The fixture is a random model: it may sample its EOS early. The test (not the page) adds the
  // server's ignore_eos extension so every reply runs to max_tokens and the assertions are exact.
  const sent = [];
  await page.route('**/v1/chat/completions', (route) => {
    const body = { ...JSON.parse(route.request().postData()), ignore_eos: true };
    sent.push(body);
    route.continue({ postData: JSON.stringify(body) });
  });
  // The tiny model writes a whole 64-token reply in a few ms, faster than the browser renders,
  // so delivery is throttled (DevTools network emulation, ~16 KB/s: the same byte stream over
  // about a second) to make the page's incremental rendering observable. Reads then end at
  // arbitrary bytes, mid-event and mid-UTF-8, which the page's SSE parser must handle.
  const replyTokens = 64;
  const cdp = await page.context().newCDPSession(page);
  await cdp.send('Network.enable');
  await cdp.send('Network.emulateNetworkConditions',
                 { offline: false, latency: 0, downloadThroughput: 16 * 1024, uploadThroughput: -1 });
  await page.fill('#max-tokens', String(replyTokens));
  await page.fill('#temperature', '1');
  await page.fill('#seed', '4242');  // so the reply can be asked for again without streaming
  await page.fill('#system-prompt', 'You are a test.');
  // Shift+Enter is a newline, not a send.
  await page.click('#prompt');
  await page.keyboard.type('Hello,');
  await page.keyboard.press('Shift+Enter');
  await page.keyboard.type('Tessera!');
  assert.equal(await page.inputValue('#prompt'), 'Hello,\nTessera!');
  assert.equal(await page.locator('.msg.assistant').count(), 0);

  // Record the reply's length at every DOM change (each callback is one observation, made as
  // the browser handles a network read), and whether it was done by then.
  await page.evaluate(() => {
    window.__observations = [];
    new MutationObserver(() => {
      const m = document.querySelector('.msg.assistant');
      if (m) window.__observations.push({ len: m.textContent.length, done: m.dataset.done === '1', t: Math.round(performance.now()) });
    }).observe(document.getElementById('messages'),
               { subtree: true, childList: true, characterData: true, attributes: true });
  });
  await page.click('#send');
  assert.equal(await text('.msg.user'), 'Hello,\nTessera!');
  assert.equal(await page.inputValue('#prompt'), '');
  const reply = page.locator('.msg.assistant').first();
  await page.waitForSelector('.msg.assistant[data-done="1"]', { timeout: 30000 });
  const content = await reply.textContent();
  assert.ok(content.length > 0, 'the reply is empty');
  assert.equal(await page.locator('.msg.error').count(), 0, await page.locator('#messages').textContent());

  await cdp.send('Network.emulateNetworkConditions',
                 { offline: false, latency: 0, downloadThroughput: -1, uploadThroughput: -1 });
  const obs = await page.evaluate(() => window.__observations);
  const before = obs.filter((o) => !o.done).map((o) => o.len);
  const grew = before.filter((len, i) => len > 0 && (i === 0 || len > before[i - 1]));
  assert.ok(grew.length >= 2, `the text arrived at once, not streamed: ${JSON.stringify(obs)}`);
  console.log(`reply grew over ${grew.length} observations in ${obs.at(-1).t - obs[0].t} ms`);
  assert.ok(before.at(-1) <= content.length);

  // What the page sent, and that the streamed text it shows is exactly the reply: the same
  // request without streaming (same seed) gives the same text.
  assert.equal(sent.length, 1);
  const req = sent[0];
  assert.equal(req.stream, true);
  assert.deepEqual(req.messages, [{ role: 'system', content: 'You are a test.' },
                                  { role: 'user', content: 'Hello,\nTessera!' }]);
  assert.equal(req.model, SERVED_NAME);
  assert.equal(req.max_tokens, replyTokens);
  assert.equal(req.temperature, 1);
  assert.equal(req.seed, 4242);
  const again = await postJson('/v1/chat/completions', { ...req, stream: false, stream_options: undefined });
  assert.equal(content, again.choices[0].message.content);

  // The meta line under the reply reports the server's usage count.
  const meta = await page.locator('.turn.assistant .meta').first().textContent();
  const m = /(\d+) tokens/.exec(meta);
  assert.ok(m, `no token count in "${meta}"`);
  const n = Number(m[1]);
  assert.equal(n, replyTokens, meta);
  assert.match(meta, /hit max tokens/);

  // The live panel counts the generated tokens.
  await page.waitForFunction((want) =>
    Number(document.getElementById('stats-tokens').textContent.replace(/,/g, '')) >= want, n);

  fs.mkdirSync(path.dirname(SCREENSHOT), { recursive: true });
  await page.screenshot({ path: SCREENSHOT });
  console.log(`chat page screenshot: ${SCREENSHOT}`);
});

test('server errors show inline, and the failed turn leaves the conversation', { timeout: 30000 }, async () => {
  await page.click('#clear');
  const send = async (prompt) => {
    const before = await page.locator('.msg.error').count();
    await page.fill('#prompt', prompt);
    await page.click('#send');
    await page.waitForFunction((n) => document.querySelectorAll('.msg.error').length > n, before);
    return page.locator('.msg.error').last().textContent();
  };
  allowedStatus = 400;
  await page.fill('#max-tokens', '100000');  // beyond the context: 400 naming max_tokens
  const tooLong = await send('too long');
  assert.match(tooLong, /^HTTP 400: .*context.*\(max_tokens\)$/);
  allowedStatus = 401;
  await page.fill('#max-tokens', '8');
  await page.fill('#api-key', 'sk-wrong');
  assert.match(await send('wrong key'), /^HTTP 401: .*set the API key in Settings/);
  allowedStatus = null;
  await page.fill('#api-key', KEY);
  assert.equal(await page.locator('.turn.user.unsent').count(), 2);
  assert.equal(await page.locator('.msg.assistant[data-done="1"]').count(), 2);
  assert.ok(await page.isVisible('#send'));
  // The failed turns are not resent: the next request carries only its own message.
  const sent = [];
  const record = (route) => { sent.push(JSON.parse(route.request().postData())); route.fallback(); };
  await page.route('**/v1/chat/completions', record);
  await page.fill('#prompt', 'works');
  await page.click('#send');
  await page.waitForFunction(() => document.querySelectorAll('.msg.assistant[data-done="1"]').length === 3);
  await page.unroute('**/v1/chat/completions', record);
  assert.equal(await page.locator('.msg.error').count(), 2);
  assert.deepEqual(sent[0].messages.filter((m) => m.role !== 'system'), [{ role: 'user', content: 'works' }]);
});

test('the stop button aborts a reply and the server cancels it', { timeout: 40000 }, async () => {
  // A fresh conversation, so the prompt is short and the reply can take most of the context.
  await page.click('#clear');
  assert.equal(await page.locator('#messages .turn').count(), 0);
  const system = await page.inputValue('#system-prompt'), question = 'Tell me a long story.';
  await page.fill('#max-tokens', String(await tokensLeft([{ role: 'system', content: system }, { role: 'user', content: question }])));
  await page.fill('#prompt', question);
  // Click Stop from inside the page as soon as the first text shows, before the reply can end.
  await page.evaluate(() => {
    window.__stopClicked = false;
    const mo = new MutationObserver(() => {
      const m = document.querySelector('.msg.assistant');
      if (!m || !m.textContent.length) return;
      mo.disconnect();
      if (m.dataset.done !== '1') { document.getElementById('stop').click(); window.__stopClicked = true; }
    });
    mo.observe(document.getElementById('messages'), { subtree: true, childList: true, characterData: true });
  });
  await page.press('#prompt', 'Enter');  // Enter sends
  const reply = page.locator('.msg.assistant').first();
  await page.waitForSelector('.msg.assistant[data-done="1"]', { timeout: 30000 });
  const stoppedEarly = await page.evaluate(() => window.__stopClicked);
  assert.equal(await page.locator('.msg.error').count(), 0);
  assert.ok(await page.isVisible('#send'));
  assert.ok(!(await page.isVisible('#stop')));
  const meta = await page.locator('.turn.assistant .meta').first().textContent();
  // The click can still lose the race: when the server's whole stream (the tiny model writes
  // thousands of tokens a second) already sat in the page's buffer, the reply ends whole
  // ("hit max tokens") and there is nothing left to cancel.
  if (stoppedEarly && !/stopped/.test(meta)) {
    assert.match(meta, /hit max tokens|\bstop\b/);  // it ended on its own: length or EOS
    console.log(`note: the stream had fully arrived before Stop took effect (${meta}); stop not exercised`);
  } else if (stoppedEarly) {
    assert.match(meta, /stopped/);
    // The disconnect cancels the request: nothing stays running and the KV blocks come back.
    await waitFor(async () => {
      const s = await (await fetch(server.url + '/stats')).json();
      return s.running === 0 && s.waiting === 0 && s.kv_blocks_used === 0;
    }, 'the stopped request to be cancelled (running 0, kv_blocks_used 0)', 10000);
  } else {
    console.log('note: the reply finished before it could be stopped; stop not exercised');
  }
  assert.ok((await reply.textContent()).length > 0);
});

test('no script errors on the page', () => {
  assert.deepEqual(pageErrors, []);
});

test('SIGTERM stops the server with exit code 0; the page then says the engine is down', { timeout: 40000 }, async () => {
  const { code, signal } = await server.stop(30000);
  assert.equal(signal, null, server.log());
  assert.equal(code, 0, server.log());
  await page.waitForFunction(() => document.getElementById('health').textContent === 'engine down', null,
                             { timeout: 10000 });
  await browser.close();
  browser = null;
});
