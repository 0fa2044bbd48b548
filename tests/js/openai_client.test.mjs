// The official `openai` npm client against `tessera serve --api-key`: completions, chat, streaming
// chat and completions, models (list, retrieve), embeddings (float, base64), echo, logit_bias,
// errors (401, 400 with `param`, 404), cancelling a stream, and structured outputs
// (response_format json_schema / json_object, guided_choice, guided_regex).
// Run: node openai_client.test.mjs TESSERA_CLI MODEL_DIR, or with those in the environment
// (ctest js_openai_client sets them) node --test openai_client.test.mjs.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import crypto from 'node:crypto';
import OpenAI from 'openai';
import { startServer, waitFor } from './serve_process.mjs';

const MODEL = 'tessera-openai-test';
const KEY = 'sk-tessera-' + crypto.randomBytes(8).toString('hex');

setTimeout(() => { console.error('openai_client.test: watchdog fired after 100 s'); process.exit(1); }, 100000).unref();

let server, client;

before(async () => {
  server = await startServer(['--api-key', KEY, '--served-model-name', MODEL]);
  client = new OpenAI({ baseURL: `http://127.0.0.1:${server.port}/v1`, apiKey: KEY, maxRetries: 0, timeout: 20000 });
});
after(() => { if (server) server.kill(); });

// /stats is open (no key): what the engine holds right now.
const stats = async () => (await fetch(server.url + '/stats')).json();

test('models.list returns the served model', async () => {
  const ids = [];
  for await (const m of client.models.list()) ids.push(m.id);
  assert.deepEqual(ids, [MODEL]);
  const m = (await client.models.list()).data[0];
  assert.equal(m.object, 'model');
  assert.equal(m.owned_by, 'tessera');
  assert.ok(m.max_model_len > 0);
});

test('completions.create with ignore_eos gives exactly max_tokens tokens', async () => {
  // Unknown fields travel in the body unchanged: ignore_eos is Tessera's (and vLLM's) extension.
  const r = await client.completions.create({ model: MODEL, prompt: 'The quick brown fox', max_tokens: 8, ignore_eos: true });
  assert.equal(r.object, 'text_completion');
  assert.equal(r.model, MODEL);
  assert.equal(r.choices.length, 1);
  assert.equal(typeof r.choices[0].text, 'string');
  assert.equal(r.choices[0].finish_reason, 'length');
  assert.equal(r.usage.completion_tokens, 8);
  assert.ok(r.usage.prompt_tokens > 0);
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens);
});

test('completions.create with n=2 and a token-id prompt', async () => {
  const r = await client.completions.create({ model: MODEL, prompt: [1, 2, 3, 4], max_tokens: 5, n: 2, ignore_eos: true });
  assert.deepEqual(r.choices.map((c) => c.index).sort(), [0, 1]);
  assert.equal(r.usage.prompt_tokens, 4);
  assert.equal(r.usage.completion_tokens, 10);
});

test('chat.completions.create with a system and a user message', async () => {
  const r = await client.chat.completions.create({
    model: MODEL, max_tokens: 8, ignore_eos: true, temperature: 0.7, top_p: 0.9,
    messages: [{ role: 'system', content: 'You are terse.' }, { role: 'user', content: 'Say hi.' }],
  });
  assert.equal(r.object, 'chat.completion');
  assert.equal(r.choices[0].message.role, 'assistant');
  assert.equal(typeof r.choices[0].message.content, 'string');
  assert.equal(r.choices[0].finish_reason, 'length');
  assert.equal(r.usage.completion_tokens, 8);
  assert.ok(r.usage.prompt_tokens > 2);  // the template adds role markers around both messages
});

test('the same seed gives the same chat reply', async () => {
  const ask = () => client.chat.completions.create({
    model: MODEL, max_tokens: 12, temperature: 1, seed: 1234, ignore_eos: true,
    messages: [{ role: 'user', content: 'Pick some words.' }],
  });
  const a = await ask(), b = await ask();
  assert.equal(a.choices[0].message.content, b.choices[0].message.content);
});

test('streaming chat delivers deltas, a finish_reason and usage', async () => {
  const stream = await client.chat.completions.create({
    model: MODEL, max_tokens: 12, ignore_eos: true, stream: true, stream_options: { include_usage: true },
    messages: [{ role: 'system', content: 'You are a test.' }, { role: 'user', content: 'Stream, please.' }],
  });
  let deltas = 0, text = '', finish = null, usage = null, chunks = 0, afterUsage = 0;
  for await (const chunk of stream) {
    chunks++;
    assert.equal(chunk.object, 'chat.completion.chunk');
    if (usage) afterUsage++;
    if (chunk.usage) {
      usage = chunk.usage;
      assert.deepEqual(chunk.choices, []);  // OpenAI's usage chunk carries no choices
    }
    for (const c of chunk.choices) {
      if (c.delta?.content) { deltas++; text += c.delta.content; }
      if (c.finish_reason) { assert.equal(finish, null, 'two finish_reasons'); finish = c.finish_reason; }
    }
  }
  assert.ok(deltas >= 1, `no content deltas in ${chunks} chunks`);
  assert.equal(finish, 'length');
  assert.ok(usage, 'stream_options.include_usage gave no usage chunk');
  assert.equal(usage.completion_tokens, 12);
  assert.equal(afterUsage, 0, 'chunks after the usage chunk');
  assert.equal(typeof text, 'string');
});

test('streaming completions match the non-streaming text for the same seed', async () => {
  const req = { model: MODEL, prompt: 'Once upon a time', max_tokens: 10, seed: 7, temperature: 1, ignore_eos: true };
  const whole = await client.completions.create(req);
  const stream = await client.completions.create({ ...req, stream: true });
  let text = '', finish = null;
  for await (const chunk of stream) {
    for (const c of chunk.choices) { text += c.text; if (c.finish_reason) finish = c.finish_reason; }
  }
  assert.equal(finish, 'length');
  assert.equal(text, whole.choices[0].text);
});

test('aborting a stream cancels the request on the server', async () => {
  let maxLen = 0;
  for await (const m of client.models.list()) maxLen = m.max_model_len;
  assert.ok(maxLen > 64, `max_model_len ${maxLen}`);
  const stream = await client.chat.completions.create({
    model: MODEL, max_tokens: maxLen - 48, ignore_eos: true, stream: true,
    messages: [{ role: 'user', content: 'Go on.' }],
  });
  let seen = 0;
  for await (const chunk of stream) {
    if (chunk.choices[0]?.delta?.content) seen++;
    if (seen >= 2) { stream.controller.abort(); break; }
  }
  assert.equal(seen, 2);
  await waitFor(async () => { const s = await stats(); return s.running === 0 && s.kv_blocks_used === 0; },
                'the aborted request to be cancelled (running 0, kv_blocks_used 0)', 10000);
});

test('a wrong or missing key is an AuthenticationError (401)', async () => {
  const wrong = new OpenAI({ baseURL: client.baseURL, apiKey: 'sk-wrong', maxRetries: 0, timeout: 10000 });
  await assert.rejects(wrong.models.list(), (e) => {
    assert.ok(e instanceof OpenAI.AuthenticationError, `${e.constructor.name}: ${e.message}`);
    assert.equal(e.status, 401);
    assert.ok(e.error && typeof e.error.message === 'string' && e.error.message.length > 0, JSON.stringify(e.error));
    return true;
  });
  await assert.rejects(
    wrong.chat.completions.create({ model: MODEL, messages: [{ role: 'user', content: 'hi' }], max_tokens: 2 }),
    (e) => e instanceof OpenAI.AuthenticationError && e.status === 401);
  const r = await fetch(`${server.url}/v1/models`);  // no Authorization header at all
  assert.equal(r.status, 401);
  assert.equal(typeof (await r.json()).error.message, 'string');
});

test('bad requests are 400 BadRequestErrors naming the field', async () => {
  const cases = [
    [{ model: MODEL, messages: [{ role: 'user', content: 'x' }], max_tokens: -1 }, 'max_tokens'],
    [{ model: MODEL, messages: [{ role: 'user', content: 'x' }], temperature: -3 }, 'temperature'],
    [{ model: MODEL, messages: [] }, 'messages'],
  ];
  for (const [body, param] of cases) {
    await assert.rejects(client.chat.completions.create(body), (e) => {
      assert.ok(e instanceof OpenAI.BadRequestError, `${JSON.stringify(body)}: ${e.constructor.name} ${e.message}`);
      assert.equal(e.status, 400);
      assert.equal(e.param, param, `${JSON.stringify(body)}: ${JSON.stringify(e.error)}`);
      return true;
    });
  }
});

test('models.retrieve returns the served model; an unknown id is a NotFoundError', async () => {
  const m = await client.models.retrieve(MODEL);
  assert.equal(m.id, MODEL);
  assert.equal(m.object, 'model');
  assert.equal(m.owned_by, 'tessera');
  assert.equal(typeof m.created, 'number');
  const listed = (await client.models.list()).data[0];
  assert.deepEqual(m, listed);
  await assert.rejects(client.models.retrieve('no-such-model'), (e) => {
    assert.ok(e instanceof OpenAI.NotFoundError, `${e.constructor.name}: ${e.message}`);
    assert.equal(e.status, 404);
    assert.equal(e.code, 'model_not_found');
    return true;
  });
  // A completion for an unknown model is the same NotFoundError, as on OpenAI's API.
  await assert.rejects(
    client.chat.completions.create({ model: 'no-such-model', messages: [{ role: 'user', content: 'hi' }], max_tokens: 2 }),
    (e) => {
      assert.ok(e instanceof OpenAI.NotFoundError, `${e.constructor.name}: ${e.message}`);
      assert.equal(e.code, 'model_not_found');
      assert.equal(e.param, 'model');
      return true;
    });
});

// Little-endian f32 values of a base64 string, decoded here (not by the client).
const f32FromBase64 = (s) => {
  const b = Buffer.from(s, 'base64');
  assert.equal(b.length % 4, 0);
  return Array.from({ length: b.length / 4 }, (_, i) => b.readFloatLE(4 * i));
};

test('embeddings.create: float, base64 and the client default agree', async () => {
  const input = ['The quick brown fox', 'Hello world!'];
  const f = await client.embeddings.create({ model: MODEL, input, encoding_format: 'float' });
  assert.equal(f.object, 'list');
  assert.equal(f.model, MODEL);
  assert.equal(f.data.length, 2);
  const dim = f.data[0].embedding.length;
  assert.ok(dim > 0);
  f.data.forEach((d, i) => {
    assert.equal(d.object, 'embedding');
    assert.equal(d.index, i);
    assert.equal(d.embedding.length, dim);
    assert.ok(d.embedding.every(Number.isFinite));
  });
  assert.notDeepEqual(f.data[0].embedding, f.data[1].embedding);
  assert.ok(f.usage.prompt_tokens > 2);
  assert.equal(f.usage.total_tokens, f.usage.prompt_tokens);
  // Without encoding_format the client asks for base64 and decodes it itself: the same floats.
  const d = await client.embeddings.create({ model: MODEL, input });
  assert.deepEqual(d.data.map((x) => x.embedding), f.data.map((x) => x.embedding));
  // Asked for explicitly, base64 comes back as the string: little-endian f32 bytes.
  const b = await client.embeddings.create({ model: MODEL, input, encoding_format: 'base64' });
  assert.equal(typeof b.data[1].embedding, 'string');
  assert.deepEqual(f32FromBase64(b.data[1].embedding), f.data[1].embedding);
  // Token ids give the same embedding as the text they encode (each alone: batched with
  // another input, the GEMMs have other row counts, whose last bits may differ).
  const alone = await client.embeddings.create({ model: MODEL, input: input[1], encoding_format: 'float' });
  const ids = (await (await fetch(`${server.url}/tokenize`, { method: 'POST', body: JSON.stringify({ prompt: input[1] }) })).json()).tokens;
  const t = await client.embeddings.create({ model: MODEL, input: ids, encoding_format: 'float' });
  assert.deepEqual(t.data[0].embedding, alone.data[0].embedding);
  alone.data[0].embedding.forEach((x, j) => assert.ok(Math.abs(x - f.data[1].embedding[j]) < 1e-4 * Math.max(1, Math.abs(x)), `${j}`));
  await assert.rejects(client.embeddings.create({ model: MODEL, input: 'x', dimensions: dim + 1 }),
                       (e) => e instanceof OpenAI.BadRequestError && e.param === 'dimensions');
  await assert.rejects(client.embeddings.create({ model: MODEL, input: '' }),
                       (e) => e instanceof OpenAI.BadRequestError && e.param === 'input');
});

test('completions with echo and logprobs return the prompt first', async () => {
  const prompt = 'Once upon a time';
  const req = { model: MODEL, prompt, max_tokens: 4, temperature: 0, ignore_eos: true };
  const plain = await client.completions.create(req);
  const r = await client.completions.create({ ...req, echo: true, logprobs: 2 });
  assert.equal(r.choices[0].text, prompt + plain.choices[0].text);
  const lp = r.choices[0].logprobs;
  assert.equal(lp.tokens.length, r.usage.prompt_tokens + 4);
  assert.equal(lp.token_logprobs[0], null);
  assert.ok(lp.token_logprobs.slice(1).every((x) => typeof x === 'number' && x <= 0));
  // logit_bias: +100 on a token makes greedy decoding pick it every time.
  const biased = await client.completions.create({ ...req, logit_bias: { 200: 100 }, return_token_ids: true, stream: true });
  const got = [];
  for await (const chunk of biased) for (const c of chunk.choices) got.push(...(c.token_ids ?? []));
  assert.deepEqual(got, [200, 200, 200, 200]);
});

// Structured outputs: every choice parses and matches the schema (checked here field by field).
test('response_format json_schema: every choice is JSON matching the schema', async () => {
  const schema = {
    type: 'object',
    properties: {
      name: { type: 'string', minLength: 1, maxLength: 12 },
      age: { type: 'integer' },
      pets: { type: 'array', items: { enum: ['cat', 'dog'] }, maxItems: 3 },
      nickname: { type: ['string', 'null'], maxLength: 6 },
    },
    required: ['name', 'age', 'pets'],
    additionalProperties: false,
  };
  const r = await client.chat.completions.create({
    model: MODEL, temperature: 1, seed: 3, n: 3, max_tokens: 400,
    messages: [{ role: 'user', content: 'Describe a person.' }],
    response_format: { type: 'json_schema', json_schema: { name: 'person', schema, strict: true } },
  });
  assert.equal(r.choices.length, 3);
  for (const c of r.choices) {
    assert.equal(c.finish_reason, 'stop', c.message.content);
    const v = JSON.parse(c.message.content);
    assert.deepEqual(Object.keys(v).filter((k) => !['name', 'age', 'pets', 'nickname'].includes(k)), []);
    assert.equal(typeof v.name, 'string');
    assert.ok([...v.name].length >= 1 && [...v.name].length <= 12, v.name);
    assert.ok(Number.isInteger(v.age), String(v.age));
    assert.ok(Array.isArray(v.pets) && v.pets.length <= 3 && v.pets.every((p) => p === 'cat' || p === 'dog'));
    if ('nickname' in v) assert.ok(v.nickname === null || (typeof v.nickname === 'string' && [...v.nickname].length <= 6));
  }
  // Streamed deltas join into the same kind of document.
  const stream = await client.chat.completions.create({
    model: MODEL, temperature: 1, seed: 4, max_tokens: 400, stream: true,
    messages: [{ role: 'user', content: 'Describe a person.' }],
    response_format: { type: 'json_schema', json_schema: { name: 'person', schema } },
  });
  let text = '';
  for await (const chunk of stream) text += chunk.choices[0]?.delta?.content ?? '';
  assert.ok(Number.isInteger(JSON.parse(text).age), text);
});

test('json_object, guided_choice and guided_regex; a bad schema is a 400 naming response_format', async () => {
  const obj = await client.completions.create({
    model: MODEL, prompt: 'JSON:', temperature: 1, seed: 1, max_tokens: 300,
    response_format: { type: 'json_object' },
  });
  if (obj.choices[0].finish_reason === 'stop') assert.equal(typeof JSON.parse(obj.choices[0].text), 'object');
  const choice = await client.completions.create({
    model: MODEL, prompt: 'Pick:', temperature: 1, seed: 2, max_tokens: 20, guided_choice: ['alpha', 'beta gamma'],
  });
  assert.ok(['alpha', 'beta gamma'].includes(choice.choices[0].text), choice.choices[0].text);
  const re = await client.completions.create({
    model: MODEL, prompt: 'Date:', temperature: 1, seed: 5, max_tokens: 30, guided_regex: '20[0-9]{2}-(0[1-9]|1[0-2])',
  });
  assert.match(re.choices[0].text, /^20[0-9]{2}-(0[1-9]|1[0-2])$/);
  await assert.rejects(client.chat.completions.create({
    model: MODEL, messages: [{ role: 'user', content: 'x' }],
    response_format: { type: 'json_schema', json_schema: { name: 'n', schema: { type: 'integer', minimum: 3 } } },
  }), (e) => e instanceof OpenAI.BadRequestError && e.param === 'response_format' && /minimum/.test(e.message));
  await assert.rejects(client.completions.create({ model: MODEL, prompt: 'x', guided_regex: '(a' }),
                       (e) => e instanceof OpenAI.BadRequestError && e.param === 'guided_regex');
});

test('SIGTERM stops the server with exit code 0', { timeout: 40000 }, async () => {
  const { code, signal } = await server.stop(30000);
  assert.equal(signal, null, server.log());
  assert.equal(code, 0, server.log());
});
