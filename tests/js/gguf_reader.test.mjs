// GGUF files written by `tessera export` read by an independent parser, the `@huggingface/gguf`
// npm package: version, metadata keys with llama.cpp's value types, the tokenizer, and every
// tensor's name, shape, type and aligned offset as the model's config.json implies them.
// Run: node gguf_reader.test.mjs TESSERA_CLI MODEL_DIR, or with those in the environment
// (ctest js_gguf_reader sets them) node --test gguf_reader.test.mjs.
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { gguf, GGUFValueType, GGMLQuantizationType } from '@huggingface/gguf';
import { servePaths } from './serve_process.mjs';

const { cli, model } = servePaths();
const config = JSON.parse(fs.readFileSync(path.join(model, 'config.json'), 'utf8'));
const tokenizer = JSON.parse(fs.readFileSync(path.join(model, 'tokenizer.json'), 'utf8'));
const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'tessera-gguf-js-'));
after(() => fs.rmSync(dir, { recursive: true, force: true }));

async function exported(type) {
  const out = path.join(dir, `${type}.gguf`);
  execFileSync(cli, ['export', '--format', 'gguf', '--model', model, '--out', out, '--type', type,
                     '--name', 'tessera-js'], { stdio: 'pipe' });
  return gguf(out, { allowLocalFile: true, typedMetadata: true, computeParametersCount: true });
}

// The tensors a Llama checkpoint of this config.json becomes, with GGUF shapes (innermost
// first) and whether they are weight matrices (quantized) or vectors (F32).
function expectedTensors() {
  const H = config.hidden_size, F = config.intermediate_size, V = config.vocab_size;
  const D = config.head_dim ?? H / config.num_attention_heads;
  const Q = config.num_attention_heads * D, KV = config.num_key_value_heads * D;
  const t = { 'token_embd.weight': [H, V], 'output_norm.weight': [H] };
  if (!config.tie_word_embeddings) t['output.weight'] = [H, V];
  for (let l = 0; l < config.num_hidden_layers; ++l) {
    Object.assign(t, {
      [`blk.${l}.attn_norm.weight`]: [H], [`blk.${l}.ffn_norm.weight`]: [H],
      [`blk.${l}.attn_q.weight`]: [H, Q], [`blk.${l}.attn_k.weight`]: [H, KV], [`blk.${l}.attn_v.weight`]: [H, KV],
      [`blk.${l}.attn_output.weight`]: [Q, H], [`blk.${l}.ffn_gate.weight`]: [H, F],
      [`blk.${l}.ffn_up.weight`]: [H, F], [`blk.${l}.ffn_down.weight`]: [F, H],
    });
  }
  return t;
}

for (const [type, weightType, fileType] of [['f16', GGMLQuantizationType.F16, 1],
                                            ['q8_0', GGMLQuantizationType.Q8_0, 7],
                                            ['q4_0', GGMLQuantizationType.Q4_0, 2]]) {
  test(`a ${type} export parses with its metadata and tensors`, async () => {
    const { metadata, typedMetadata, tensorInfos, tensorDataOffset, parameterCount } = await exported(type);
    assert.equal(metadata.version, 3);
    assert.equal(metadata['general.architecture'], 'llama');
    assert.equal(metadata['general.name'], 'tessera-js');
    assert.equal(metadata['general.file_type'], fileType);
    const u32 = {
      'llama.block_count': config.num_hidden_layers, 'llama.context_length': config.max_position_embeddings,
      'llama.embedding_length': config.hidden_size, 'llama.feed_forward_length': config.intermediate_size,
      'llama.attention.head_count': config.num_attention_heads,
      'llama.attention.head_count_kv': config.num_key_value_heads,
      'llama.rope.dimension_count': config.head_dim, 'general.file_type': fileType,
    };
    for (const [key, value] of Object.entries(u32)) {
      assert.equal(typedMetadata[key].type, GGUFValueType.UINT32, key);
      assert.equal(typedMetadata[key].value, value, key);
    }
    for (const [key, value] of [['llama.rope.freq_base', config.rope_theta],
                                ['llama.attention.layer_norm_rms_epsilon', config.rms_norm_eps]]) {
      assert.equal(typedMetadata[key].type, GGUFValueType.FLOAT32, key);
      assert.equal(Math.fround(typedMetadata[key].value), Math.fround(value), key);
    }

    // The tokenizer as llama.cpp's converter writes a byte-level BPE one.
    assert.equal(metadata['tokenizer.ggml.model'], 'gpt2');
    assert.equal(metadata['tokenizer.ggml.pre'], 'gpt-2');
    const tokens = metadata['tokenizer.ggml.tokens'];
    assert.equal(typedMetadata['tokenizer.ggml.tokens'].subType, GGUFValueType.STRING);
    assert.equal(tokens.length, config.vocab_size);
    for (const [token, id] of Object.entries(tokenizer.model.vocab)) assert.equal(tokens[id], token);
    const types = metadata['tokenizer.ggml.token_type'];
    assert.equal(typedMetadata['tokenizer.ggml.token_type'].subType, GGUFValueType.INT32);
    for (const added of tokenizer.added_tokens) {
      assert.equal(tokens[added.id], added.content);
      assert.equal(types[added.id], added.special ? 3 : 4);  // CONTROL / USER_DEFINED
    }
    const merges = tokenizer.model.merges.map((m) => (Array.isArray(m) ? m.join(' ') : m));
    assert.deepEqual(metadata['tokenizer.ggml.merges'], merges);
    assert.equal(metadata['tokenizer.ggml.eos_token_id'], config.eos_token_id);
    assert.equal(typedMetadata['tokenizer.ggml.eos_token_id'].type, GGUFValueType.UINT32);
    assert.match(metadata['tokenizer.chat_template'], /im_start/);

    // Tensors: the names, shapes and types the config implies, data aligned to 32 bytes.
    const want = expectedTensors();
    assert.deepEqual(tensorInfos.map((t) => t.name).sort(), Object.keys(want).sort());
    let params = 0;
    for (const t of tensorInfos) {
      assert.deepEqual(t.shape.map(Number), want[t.name], t.name);
      const matrix = want[t.name].length === 2;
      const expectedType = !matrix ? GGMLQuantizationType.F32
        : t.name === 'output.weight' && type === 'q4_0' ? GGMLQuantizationType.Q8_0 : weightType;
      assert.equal(t.dtype, expectedType, t.name);
      assert.equal(Number(tensorDataOffset + t.offset) % 32, 0, t.name);
      params += want[t.name].reduce((a, b) => a * b, 1);
    }
    assert.equal(parameterCount, params);
  });
}
