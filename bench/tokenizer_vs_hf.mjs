#!/usr/bin/env node
// `tessera bench tokenizer` side by side with Hugging Face `tokenizers` (its Rust crate via
// the @anush008/tokenizers binding in tests/js/node_modules) on the same tokenizer.json and
// text: one string (the whole text), and a batch (its non-empty lines). Prints tokens/s of
// each and the ratio. Hugging Face's batch runs on its own thread pool (RAYON_NUM_THREADS, all
// cores by default); Tessera's batch gets --threads as many.
// Usage: node bench/tokenizer_vs_hf.mjs [--tessera BIN] [--tokenizer FILE]... [--file TEXT]
//        [--seconds 2] [--threads N]
// Defaults: build/bin/tessera; the llama2, gemma3 and gpt4o files of tests/js/node_modules;
// the 1 MB mixed-script text of tests/js/mixed_text.mjs. Run `npm ci` in tests/js first.
import { execFileSync } from 'node:child_process';
import { createRequire } from 'node:module';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const js = path.join(root, 'tests', 'js');
const { Tokenizer } = createRequire(path.join(js, 'package.json'))('@anush008/tokenizers');
const { mixedText } = await import(path.join(js, 'mixed_text.mjs'));

const args = { tessera: path.join(root, 'build', 'bin', 'tessera'), tokenizer: [], file: '', seconds: 2,
               threads: Number(process.env.RAYON_NUM_THREADS) || os.availableParallelism() };
for (let i = 2; i < process.argv.length; i += 2) {
  const [k, v] = [process.argv[i].replace(/^--/, ''), process.argv[i + 1]];
  if (!(k in args) || v === undefined) throw new Error(`unknown or valueless option ${process.argv[i]}`);
  if (k === 'tokenizer') args.tokenizer.push(v); else args[k] = typeof args[k] === 'number' ? Number(v) : v;
}
if (!args.tokenizer.length)
  args.tokenizer = ['llama2', 'gemma3', 'gpt4o'].map((n) => path.join(js, 'node_modules', '@lenml', `tokenizer-${n}`, 'models', 'tokenizer.json'));
const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'tessera-tok-bench-'));
process.on('exit', () => fs.rmSync(tmp, { recursive: true, force: true }));
if (!args.file) {
  args.file = path.join(tmp, 'text.txt');
  fs.writeFileSync(args.file, mixedText(1 << 20));
}
const text = fs.readFileSync(args.file, 'utf8');
const lines = text.split('\n').filter((l) => l.length > 0);

// Median seconds of `fn` over at least 5 calls and `seconds` in all, after one warm-up call.
async function median(fn) {
  await fn();
  const times = [];
  const start = performance.now();
  while (times.length < 5 || performance.now() - start < args.seconds * 1000) {
    const t0 = performance.now();
    await fn();
    times.push((performance.now() - t0) / 1000);
  }
  times.sort((a, b) => a - b);
  return times[Math.floor(times.length / 2)];
}

function tessera(file) {
  const out = execFileSync(args.tessera, ['bench', 'tokenizer', '--tokenizer', file, '--file', args.file,
                                          '--min-seconds', String(args.seconds), '--batch', '--threads',
                                          String(args.threads)]).toString();
  const json = out.split('\n').filter((l) => l.startsWith('{')).map((l) => JSON.parse(l));
  return { single: json[0].tokenizer_encode_tokens_per_s, batch: json[1].tokenizer_batch_tokens_per_s };
}

const fmt = (x) => `${(x / 1e6).toFixed(2)} M`;
console.log(`text: ${args.file === path.join(tmp, 'text.txt') ? 'mixed_text.mjs' : args.file}, ` +
            `${(Buffer.byteLength(text) / 1e6).toFixed(2)} MB, ${lines.length} lines; batch threads: ${args.threads}`);
console.log('| tokenizer | mode | Tessera tokens/s | HF tokenizers tokens/s | Tessera / HF |');
console.log('|---|---|---|---|---|');
for (const file of args.tokenizer) {
  const hf = Tokenizer.fromFile(file);
  const nSingle = (await hf.encode(text, null, { addSpecialTokens: true })).getLength();
  const single = nSingle / await median(() => hf.encode(text, null, { addSpecialTokens: true }));
  const nBatch = (await hf.encodeBatch(lines, { addSpecialTokens: false })).reduce((n, e) => n + e.getLength(), 0);
  const batch = nBatch / await median(() => hf.encodeBatch(lines, { addSpecialTokens: false }));
  const t = tessera(file);
  const name = path.basename(path.dirname(path.dirname(file))).replace(/^tokenizer-/, '') || file;
  console.log(`| ${name} | one string | ${fmt(t.single)} | ${fmt(single)} | ${(t.single / single).toFixed(2)}x |`);
  console.log(`| ${name} | batch | ${fmt(t.batch)} | ${fmt(batch)} | ${(t.batch / batch).toFixed(2)}x |`);
}
