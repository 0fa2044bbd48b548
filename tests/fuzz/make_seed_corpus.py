#!/usr/bin/env python3
"""Writes the seed corpora of the libFuzzer targets (valid and invalid inputs of each format).

Run from anywhere: python3 tests/fuzz/make_seed_corpus.py [NAME...] (default: all). The
files are committed; rerun only to change the seeds. The tokenizer seeds are made with the
independent Python reference (tests/parity/tokenizer_reference.py: needs the `regex` module).

Input layouts (see each *_fuzz.cc): openai_request = one byte (odd: chat; even with bit 1
set: embeddings; else completions) + body; jinja = template NUL variables-JSON; tokenizer = tokenizer.json
[NUL text [NUL tokenizer_config.json]]; model_config = config.json; run_config = TOML;
gguf = a GGUF file's bytes.
"""
import argparse
import json
import os
import struct
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def compact(obj):
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


# ----------------------------------------------------------------------------- safetensors

def st(header, data_len, pad=True):
    text = header if isinstance(header, str) else json.dumps(header, separators=(",", ":"))
    raw = text.encode()
    if pad:
        raw += b" " * ((8 - len(raw) % 8) % 8)
    return struct.pack("<Q", len(raw)) + raw + bytes(range(256)) * (data_len // 256) + bytes(
        range(data_len % 256))


def t(dtype, shape, b, e):
    return {"dtype": dtype, "shape": shape, "data_offsets": [b, e]}


SAFETENSORS = {
    "valid_one_f32": st({"w": t("F32", [2, 3], 0, 24)}, 24),
    "valid_many": st({"__metadata__": {"format": "pt"}, "a": t("BF16", [4], 0, 8),
                      "b": t("I64", [1, 1], 8, 16), "c": t("U8", [3], 16, 19),
                      "d": t("F16", [0, 5], 19, 19), "e": t("I32", [], 19, 23)}, 23),
    "valid_empty": st({}, 0),
    "valid_metadata_only": st({"__metadata__": {"k": "v", "x": ""}}, 0),
    "valid_unpadded": st({"w": t("I8", [5], 0, 5)}, 5, pad=False),
    "bad_overlap": st({"a": t("F32", [2], 0, 8), "b": t("F32", [2], 4, 12)}, 12),
    "bad_hole": st({"a": t("F32", [1], 0, 4), "b": t("F32", [1], 8, 12)}, 12),
    "bad_dtype": st({"a": t("F64", [1], 0, 8)}, 8),
    "bad_shape": st({"a": t("F32", [-1, 4294967296], 0, 4)}, 4),
    "bad_size": st({"a": t("BF16", [4], 0, 12)}, 12),
    "bad_duplicate": st('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                        '"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', 2),
    "bad_truncated": st({"w": t("F32", [2, 3], 0, 24)}, 24)[:40],
}


# ----------------------------------------------------------------------------- OpenAI requests

def chat(body):
    return b"c" + (body if isinstance(body, bytes) else compact(body))


def completion(body):
    return b"p" + (body if isinstance(body, bytes) else compact(body))


def embeddings(body):
    return b"r" + (body if isinstance(body, bytes) else compact(body))


OPENAI_REQUEST = {
    "completion_basic": completion({"model": "fuzz-model", "prompt": "Once upon a time", "max_tokens": 16,
                                    "temperature": 0.7, "top_p": 0.9, "stop": ["\n", "The end"], "seed": 42,
                                    "logprobs": 2}),
    "completion_ids_batch": completion({"prompt": [[1, 2, 3], [256, 257, 258]], "n": 2, "temperature": 1.0,
                                        "stream": True, "stream_options": {"include_usage": True}}),
    "completion_strings": completion({"prompt": ["a", "<|endoftext|>b c"], "max_tokens": 4, "min_tokens": 1,
                                      "stop_token_ids": [268], "ignore_eos": False, "echo": False, "best_of": 1,
                                      "top_k": 40, "min_p": 0.05, "user": "u-1", "return_token_ids": False}),
    "completion_ids": completion({"prompt": [72, 101, 108, 108, 111], "max_completion_tokens": 8,
                                  "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
                                  "logit_bias": {}, "suffix": None, "response_format": {"type": "text"}}),
    "completion_echo_bias": completion({"prompt": ["ab", [5, 6]], "echo": True, "logprobs": 2,
                                        "logit_bias": {"5": -100, "7": 3.5}, "prompt_logprobs": 1, "max_tokens": 4,
                                        "n": 2, "temperature": 0.5}),
    "embeddings_basic": embeddings({"input": ["ab", [5, 6], "c"], "encoding_format": "base64", "dimensions": 64,
                                    "user": "u"}),
    "chat_basic": chat({"model": "fuzz-model",
                        "messages": [{"role": "system", "content": "You are a helpful assistant."},
                                     {"role": "user", "content": "Hello! What is 2+2?"}],
                        "max_tokens": 32, "temperature": 0.2, "logprobs": True, "top_logprobs": 3}),
    "chat_parts_stream": chat({"messages": [{"role": "developer", "content": "Be brief."},
                                            {"role": "user", "content": [{"type": "text", "text": "part one"},
                                                                         {"type": "text", "text": ", two"}]},
                                            {"role": "assistant", "content": "ok", "name": "bot"},
                                            {"role": "tool", "content": "{\"x\": 1}"},
                                            {"role": "user", "content": "caf\u00e9 \u4f60\u597d \U0001F600"}],
                               "stream": True, "stream_options": {"include_usage": True,
                                                                  "continuous_usage_stats": True},
                               "n": 3, "temperature": 1.0, "seed": 7, "stop": "###",
                               "max_completion_tokens": 8, "add_generation_prompt": True}),
    "chat_greedy": chat({"messages": [{"role": "user", "content": "x"}], "temperature": 0, "n": 1,
                         "tools": [], "response_format": None, "max_tokens": None}),
    "chat_tools": chat({"messages": [{"role": "user", "content": "Weather in Paris?"},
                                     {"role": "assistant", "content": None, "tool_calls": [
                                         {"id": "call_1", "type": "function",
                                          "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                                     {"role": "tool", "tool_call_id": "call_1", "content": "{\"t\": 21}"}],
                        "tools": [{"type": "function", "function": {
                            "name": "get_weather", "description": "Weather",
                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                           "required": ["city"], "$defs": {"u": {"enum": ["c", "f"]}}}}},
                                  {"type": "function", "function": {"name": "get_time"}}],
                        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                        "parallel_tool_calls": False, "max_tokens": 8}),
    "chat_tools_required": chat({"messages": [{"role": "user", "content": "<tool_call>\n{\"name\": \"get_time\", "
                                                                        "\"arguments\": {}}\n</tool_call>"}],
                                 "tools": [{"type": "function", "function": {"name": "get_time"}}],
                                 "tool_choice": "required"}),
    "bad_json": chat(b'{"messages": [{"role": "user", "content": "hi"}'),
    "bad_utf8": completion(b'{"prompt": "caf\xc3 ok", "max_tokens": 2}'),
    "bad_types": chat({"messages": "hi", "stream": "yes", "n": "2", "logprobs": 3}),
    "bad_ranges": completion({"prompt": [99999, -1], "max_tokens": 0, "top_p": 2, "n": 1000,
                              "best_of": 5, "stop": [""], "logprobs": 99}),
}

# ----------------------------------------------------------------------------- Jinja chat templates

# Real chat templates (the same ones tests/serve/chat_template_test.cc checks against jinja2).
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
          "{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
QWEN2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
         "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
         "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
MISTRAL_V01 = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
               "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
               "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
               "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
               "{{ message['content'] + eos_token + ' ' }}{% else %}{{ raise_exception('Only user and "
               "assistant roles are supported!') }}{% endif %}{% endfor %}")
MISTRAL_V02 = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""
# Interpreter features real templates use (namespace, macros, filters, tests, slices, loops).
FEATURES = """{# comment #}
{%- set ns = namespace(count=0, sys='') -%}
{% macro render_role(role, upper=false) %}{{ role | upper if upper else role }}{% endmacro %}
{% for m in messages %}
    {% if m.role == 'system' %}
        {% set ns.sys = m['content'] | trim %}
    {% else %}
        {% set ns.count = ns.count + 1 %}
    {% endif %}
{% endfor %}
sys={{ ns.sys }} count={{ ns.count }} n={{ messages | length }}
{% for m in messages if m.role != 'system' %}
  [{{ loop.index }}/{{ loop.length }} {{ loop.index0 }} first={{ loop.first }} last={{ loop.last }}] {{ render_role(m.role, upper=loop.first) }}: {{ m.content[:10] }}|{{ m.content[::-1][:5] }}|{{ m.content.strip().split(' ') | join(',') }}
{% else %}
  none
{% endfor %}
{{- messages | selectattr('role', 'equalto', 'user') | map(attribute='content') | list | length }} users
{{ messages | rejectattr('role', 'equalto', 'user') | list | tojson }}
{{ messages[-1] | tojson(indent=2) }}
{% set d = {'b': 1, 'a': [1, 2.5, none, true, 'x"y']} %}{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}
{{ d.get('zz', 'dflt') }} {{ d.missing | default('dd') }} {{ d.b is defined }} {{ d.zz is defined }} {{ none is none }} {{ 'x' is string }} {{ d is mapping }} {{ d.a is iterable }}
{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 1 + 2 * 3 }} {{ 'a' ~ 1 ~ none }} {{ 3 in [1, 2, 3] }} {{ 'q' not in 'abc' }} {{ [1, 2] + [3] }}
{{ 'Hello'.startswith('He') }} {{ 'Hello'.endswith(('x', 'lo')) }} {{ 'a-b-c'.replace('-', '+') }} {{ 'MiXed'.lower() }}{{ 'MiXed'.upper() }} {{ '  pad  '.strip() }}|{{ 'x,y,,z'.split(',') }}
{{ messages | first | tojson }} {{ (messages | last).role }} {{ 'abc' | first }} {{ [3, 1, 2] | sort | join('') }} {{ 'text' | string | length }}
{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 4 %}{% break %}{% endif %}{{ i }}{% endfor %}
{% for m in messages %}{% set leaked = m.role %}{% endfor %}{{ leaked is defined }} {% set blk %}B{{ 1 + 1 }}{% endset %}{{ blk }} {{ 0.1 + 0.2 }} {{ 1e20 * 1.0 }}

    {%+ if true %}kept-indent{% endif %}
{{ "a" if messages | length > 100 else "b" }} {{ "c" if false }}.
{% if add_generation_prompt -%}
    GEN
{%- endif %}
"""
CONVERSATION = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Hello, who are you?"},
                {"role": "assistant", "content": "I am an assistant."},
                {"role": "user", "content": " Thanks! caf\u00e9 \u4f60\u597d "}]
ALTERNATING = CONVERSATION[1:]


def jinja(template, variables):
    return template.encode() + b"\0" + (variables if isinstance(variables, bytes) else compact(variables))


def chat_vars(messages, gen=True, bos="", eos="", **extra):
    return dict({"messages": messages, "add_generation_prompt": gen, "bos_token": bos, "eos_token": eos}, **extra)


JINJA = {
    "chatml": jinja(CHATML, chat_vars(CONVERSATION, True, "<s>", "<|im_end|>")),
    "llama3": jinja(LLAMA3, chat_vars(CONVERSATION, True, "<|begin_of_text|>", "<|eot_id|>")),
    "qwen2": jinja(QWEN2, chat_vars(ALTERNATING, False, "", "<|im_end|>")),
    "mistral_v01": jinja(MISTRAL_V01, chat_vars(ALTERNATING, True, "<s>", "</s>")),
    "mistral_v01_raises": jinja(MISTRAL_V01, chat_vars(CONVERSATION, True, "<s>", "</s>")),
    "mistral_v02": jinja(MISTRAL_V02, chat_vars(CONVERSATION, True, "<s>", "</s>")),
    "features": jinja(FEATURES, chat_vars(CONVERSATION, True)),
    "tools": jinja("{%- if tools %}{{ '<tools>' }}{% for t in tools %}{{ t | tojson }}{% endfor %}"
                   "{{ '</tools>' }}{% endif %}{% for m in messages %}{{ m.role | capitalize }}: "
                   "{{ m.content | replace('\\n', ' ') | truncate(20) }}{{ '\\n' }}{% endfor %}",
                   chat_vars(CONVERSATION, True, tools=[{"type": "function", "function": {
                       "name": "get_weather", "parameters": {"type": "object", "properties": {
                           "city": {"type": "string"}}}}}])),
    "bare_messages": jinja(CHATML, compact(ALTERNATING)),
    "no_variables": CHATML.encode(),
    "bad_syntax": jinja("{% for m in messages %}{{ m.content }", chat_vars(CONVERSATION)),
    "bad_unclosed_if": jinja("{% if messages %}x{% for a in b %}{% endif %}", chat_vars(CONVERSATION)),
    # Found by this target: an empty subscript parsed to a null operand (UBSan null member access).
    "regress_empty_subscript": b"{%if s[]%}{%endif%}",
}

# ----------------------------------------------------------------------------- tokenizer.json

def tokenizer_seeds():
    sys.path.insert(0, os.path.join(ROOT, "tests", "parity"))
    import tokenizer_reference as ref  # noqa: E402 (needs the `regex` module)

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.txt")
        with open(corpus, "w", encoding="utf-8") as f:
            f.write(ref.mixed_text(4000))
        trained = os.path.join(tmp, "trained.json")
        ref.cmd_train(argparse.Namespace(corpus=corpus, vocab_size=300, out=trained,
                                         special=["<|endoftext|>"], min_frequency=2))
        with open(trained, encoding="utf-8") as f:
            t = json.load(f)
        base = os.path.join(tmp, "base.json")
        with open(base, "w", encoding="utf-8") as f:
            json.dump({"model": t}, f)
        styles = os.path.join(tmp, "styles")
        ref.cmd_styles(argparse.Namespace(base=base, out_dir=styles))
        texts = {"gpt2": "Hello, world!<|endoftext|> don't 123",
                 "llama3": "<|begin_of_text|>Tessera \u3053\u3093\u306b\u3061\u306f 123\n\n",
                 "qwen2": "<|im_start|>user\ncafe\u0301 caf\u00e9<|im_end|>\n",
                 "roberta": "<s> a <mask> b </s>"}
        for style, text in texts.items():
            d = os.path.join(styles, style)
            with open(os.path.join(d, "tokenizer.json"), encoding="utf-8") as f:
                tj = compact(json.load(f))
            cfg_path = os.path.join(d, "tokenizer_config.json")
            seed = tj + b"\0" + text.encode()
            if os.path.exists(cfg_path):
                with open(cfg_path, encoding="utf-8") as f:
                    seed += b"\0" + compact(json.load(f))
            out[style] = seed
            if style == "gpt2":
                out["gpt2_no_text"] = tj
                out["bad_truncated"] = tj[: len(tj) // 2]
                bad = json.loads(tj)
                bad["model"]["merges"].append("nosuchtoken x")
                out["bad_merge"] = compact(bad)
                bad = json.loads(tj)
                bad["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": "(a"}, "behavior": "Isolated"}
                out["bad_regex"] = compact(bad)
    # Found by this target: nlohmann's out_of_range.406 (number overflow) escaped parse_json_text.
    out["regress_number_overflow"] = b"\x003E\x003E2222E"
    out.update(spm_tokenizer_seeds())
    return out


# SentencePiece-style BPE (byte fallback, the Llama 2 / Gemma / Metaspace shapes) on a
# hand-made vocabulary: the one tests/io/tokenizer_spm_test.cc uses.
SPM_CHARS = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "i", "\u00e9"]
SPM_MERGES = ["\u2581 h", "e l", "\u2581h el", "l o", "\u2581hel lo", "\u2581 w", "o r", "\u2581w or", "l d",
              "\u2581wor ld"]


def spm_tokenizer_json():
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({"<0x%02X>" % b: 3 + b for b in range(256)})
    vocab.update({c: 259 + i for i, c in enumerate(SPM_CHARS)})
    vocab.update({m.replace(" ", ""): 269 + i for i, m in enumerate(SPM_MERGES)})
    added = [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, c in enumerate(["<unk>", "<s>", "</s>"])]
    replace_space = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"}, replace_space]},
            "pre_tokenizer": None,
            "post_processor": {"type": "TemplateProcessing",
                               "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                          {"Sequence": {"id": "A", "type_id": 0}}],
                               "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
            "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                      "vocab": vocab, "merges": SPM_MERGES}}


def spm_tokenizer_seeds():
    text = "hello world <s> \u00f1\u20ac \u4f60\u597d \t\n  h\u00e9".encode()
    llama2 = spm_tokenizer_json()
    gemma = json.loads(json.dumps(llama2))
    gemma["normalizer"] = llama2["normalizer"]["normalizers"][1]
    gemma["pre_tokenizer"] = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious",
                              "invert": False}
    gemma["decoder"]["decoders"] = gemma["decoder"]["decoders"][:3]
    gemma["model"]["merges"] = [m.split(" ") for m in SPM_MERGES]
    meta = json.loads(json.dumps(llama2))
    meta["normalizer"] = None
    meta["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": True}
    meta["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "ByteFallback"}, {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": True}]}
    return {name: compact(j) + b"\0" + text for name, j in
            [("llama2_spm", llama2), ("gemma_spm", gemma), ("metaspace_spm", meta)]}

# ----------------------------------------------------------------------------- config.json

LLAMA_TINY = {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
              "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5632,
              "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": 32,
              "num_hidden_layers": 22, "num_key_value_heads": 4, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
              "rope_scaling": None, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "transformers_version": "4.35.0", "use_cache": True, "vocab_size": 32000}
LLAMA3_1B = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
             "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_act": "silu",
             "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
             "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
             "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
             "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": True,
             "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 128256}
QWEN2_05B = {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
             "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
             "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21,
             "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
             "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
             "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
MISTRAL_7B = {"architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
              "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
              "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
              "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
              "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32000}
GPT2 = {"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
        "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12,
        "n_layer": 12, "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": None,
        "summary_first_dropout": 0.1, "summary_proj_to_labels": True, "summary_type": "cls_index",
        "summary_use_proj": True, "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
        "vocab_size": 50257}

MODEL_CONFIG = {
    "llama_tinyllama": compact(LLAMA_TINY),
    "llama3_1b": compact(LLAMA3_1B),
    "llama3_1b_rope_scaling": compact(dict(LLAMA3_1B, rope_scaling={
        "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3"})),
    "qwen2_0.5b": compact(QWEN2_05B),
    "mistral_7b": compact(MISTRAL_7B),
    "gpt2": compact(GPT2),
    "gpt2_pretty": json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 300,
                               "n_inner": None, "tie_word_embeddings": True}, indent=2).encode(),
    "bad_huge": compact(dict(LLAMA_TINY, hidden_size=9223372036854775807, num_hidden_layers=4294967296,
                             vocab_size=18446744073709551615)),
    "bad_heads": compact(dict(QWEN2_05B, num_key_value_heads=3, head_dim=0)),
    "bad_types": compact(dict(GPT2, n_embd="768", layer_norm_epsilon="nan")),
    "bad_model_type": compact({"model_type": "bert", "hidden_size": 768}),
    # Found by this target: nlohmann's out_of_range.406 (number overflow) escaped parse_json_text.
    "regress_number_overflow": b'1E+444444"',
}

# ----------------------------------------------------------------------------- run configs (TOML)

RUN_CONFIG = {
    "minimal": b'[data]\ndir = "runs/data"\n',
    "muon_wsd_fp16": b"""[run]
out_dir = "runs/muon"
[model]
shape = "small"
arch = "qwen2"
vocab_size = 4096
[data]
dir = "runs/data"
tokenizer = "runs/tok"
seq_len = 256
batch_size = 4
grad_accum = 2
[optimizer]
name = "muon"
lr = 1e-3
muon_lr = 0.02
muon_momentum = 0.95
muon_nesterov = false
muon_ns_steps = 5
[schedule]
kind = "wsd"
warmup_steps = 5
decay_fraction = 0.3
wsd_decay = "sqrt"
[training]
steps = 50
precision = "fp16"
bf16_mode = "emulated"
activation_checkpointing = "selective"
fp16_init_scale = 1024.0
fp16_growth_interval = 100
""",
    "zero3_hf_config": b"""[run]
out_dir = 'runs/zero3'
[model]
config = "models/llama/config.json"
seed = 7
tie_word_embeddings = false
[data]
dir = "runs/data"
seed = 3
[parallel]
zero_stage = 3
bucket_mb = 12.5
offload = true
prefetch = false
algorithm = "hierarchical"
timeout_s = 60
[checkpoint]
every = 10
keep = 1
async = false
[spike_guard]
enabled = true
sigma = 4.0
window = 20
min_history = 10
policy = "rollback"
max_rollbacks = 2
[logging]
progress = false
peak_gflops = 100.0
plot = false
trace = "runs/zero3/trace.json"
""",
    "fine_tune": b'[model]\ninit_from = "runs/base/model"\n[data]\ndir = "d"\n[training]\nsteps = 1\n'
                 b'precision = "fp32"\nmax_grad_norm = 0\neval_every = 0\neval_batches = 0\n'
                 b'[schedule]\nkind = "constant"\nwarmup_steps = 0\nmin_lr_ratio = 1.0\n',
    "bad_unknown_key": b'[data]\ndir = "d"\nsequence_length = 128\n',
    "bad_types": b'[data]\ndir = 5\n[training]\nsteps = "many"\n[optimizer]\nlr = -1\n',
    "bad_toml": b'[data\ndir = "d"\n',
    "inline_tables": b'data = { dir = "d", seq_len = 64 }\nrun = { out_dir = "o" }\n[model]\n'
                     b'hidden_size = 0x40\nnum_layers = 1_0\n',
    # Inputs on which toml++ 3.3.0 reaches undefined behaviour unless io/toml_text.cc's scan
    # turns them away (the first found by this target: TOML_UNREACHABLE on U+FEFB).
    "regress_unreachable_fefb": b'p=2[[7\x19"\xef\xbb\xbb',
    "regress_nonascii_after_value": "[data]\ndir = \"d\"\na = 1\u00e9\n".encode(),
    "regress_ml_string_backslash": 's = """\\\n\u00a7"""\n'.encode(),
    "regress_header_amp": b"[&\n",
    "regress_array_brace": b"a = [1, }\n",
    "regress_time": b"t = 1979-05-27T'07:32:00\n",
}


# ----------------------------------------------------------------------------------- gguf

def g_str(v):
    v = v.encode() if isinstance(v, str) else v
    return struct.pack("<Q", len(v)) + v


def g_kv(key, typ, payload):
    return g_str(key) + struct.pack("<I", typ) + payload


def g_tensor(name, ne, typ, offset):
    return g_str(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne) + struct.pack(
        "<IQ", typ, offset)


def gguf(kvs, tensors, data_len, version=3, align=32):
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(tensors)
    head += b"\0" * ((align - len(head) % align) % align)
    return head + bytes(range(256)) * (data_len // 256) + bytes(range(data_len % 256))


def g_strings(items):
    return struct.pack("<IQ", 8, len(items)) + b"".join(g_str(i) for i in items)


def g_i32s(items):
    return struct.pack("<IQ", 5, len(items)) + b"".join(struct.pack("<i", i) for i in items)


# A two-layer llama header with a 260-token byte-level tokenizer (the byte alphabet, two
# merges, two special tokens): what a model load reads first.
def gguf_llama():
    u32 = lambda k, v: g_kv(k, 4, struct.pack("<I", v))
    kvs = [g_kv("general.architecture", 8, g_str("llama")), u32("llama.block_count", 1),
           u32("llama.embedding_length", 32), u32("llama.feed_forward_length", 64),
           u32("llama.attention.head_count", 2), u32("llama.attention.head_count_kv", 1),
           g_kv("llama.attention.layer_norm_rms_epsilon", 6, struct.pack("<f", 1e-5)),
           g_kv("tokenizer.ggml.model", 8, g_str("gpt2")), g_kv("tokenizer.ggml.pre", 8, g_str("gpt-2"))]
    alpha = ["%c" % c for c in range(0x21, 0x7F)] + ["%c" % c for c in range(0xA1, 0xAD)] + [
        "%c" % c for c in range(0xAE, 0x100)]
    alpha += ["%c" % (0x100 + i) for i in range(256 - len(alpha))]
    tokens = alpha + ["he", "\u0120t", "<|endoftext|>", "<|im_start|>"]
    kvs += [g_kv("tokenizer.ggml.tokens", 9, g_strings(tokens)),
            g_kv("tokenizer.ggml.token_type", 9, g_i32s([1] * 258 + [3, 3])),
            g_kv("tokenizer.ggml.merges", 9, g_strings(["h e", "\u0120 t"])),
            u32("tokenizer.ggml.eos_token_id", 258)]
    tensors = [g_tensor("token_embd.weight", [32, 260], 8, 0), g_tensor("output_norm.weight", [32], 0, 9376)]
    return gguf(kvs, tensors, 9376 + 128)


# The same vocabulary as SentencePiece GGUF metadata (tokenizer.ggml.model "llama"): tokens,
# scores that order the merged pieces, token types (UNKNOWN, CONTROL, BYTE, NORMAL).
def gguf_llama_spm():
    tokens = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % b for b in range(256)] + SPM_CHARS + [
        m.replace(" ", "") for m in SPM_MERGES]
    scores = [0.0] * 259 + [-1000.0 - i for i in range(10)] + [-1.0 - i for i in range(10)]
    types = [2, 3, 3] + [6] * 256 + [1] * 20
    u32 = lambda k, v: g_kv(k, 4, struct.pack("<I", v))
    kvs = [g_kv("tokenizer.ggml.model", 8, g_str("llama")), g_kv("tokenizer.ggml.tokens", 9, g_strings(tokens)),
           g_kv("tokenizer.ggml.scores", 9, struct.pack("<IQ", 6, len(scores)) +
                b"".join(struct.pack("<f", x) for x in scores)),
           g_kv("tokenizer.ggml.token_type", 9, g_i32s(types)), u32("tokenizer.ggml.bos_token_id", 1),
           u32("tokenizer.ggml.eos_token_id", 2), u32("tokenizer.ggml.unknown_token_id", 0)]
    return gguf(kvs, [], 0)


GGUF = {
    "valid_empty": gguf([], [], 0),
    "valid_v2": gguf([], [], 0, version=2),
    "valid_types": gguf([g_kv("u8", 0, b"\x07"), g_kv("i16", 3, b"\xff\xff"), g_kv("f64", 12, struct.pack("<d", 0.5)),
                         g_kv("b", 7, b"\x01"), g_kv("s", 8, g_str("x")), g_kv("a", 9, g_strings(["p", "q"])),
                         g_kv("nested", 9, struct.pack("<IQ", 9, 1) + g_i32s([1, 2]))], [], 0),
    "valid_blocks": gguf([g_kv("general.alignment", 4, struct.pack("<I", 64))],
                         [g_tensor("f", [4, 2], 0, 0), g_tensor("q8", [32], 8, 64), g_tensor("q4k", [256], 12, 128),
                          g_tensor("q6k", [256], 14, 320), g_tensor("bf", [3], 30, 576)], 582, align=64),
    "valid_llama": gguf_llama(),
    "valid_llama_spm": gguf_llama_spm(),
    "bad_magic": b"GGML" + gguf([], [], 0)[4:],
    "bad_version": gguf([], [], 0, version=1),
    "bad_count": b"GGUF" + struct.pack("<IQQ", 3, 1 << 60, 1 << 60),
    "bad_unaligned": gguf([], [g_tensor("t", [4], 0, 8)], 64),
    "bad_overlap": gguf([], [g_tensor("a", [16], 0, 0), g_tensor("b", [16], 0, 32)], 96),
    "bad_type": gguf([], [g_tensor("t", [32], 4, 0)], 64),
    "bad_row": gguf([], [g_tensor("t", [48], 2, 0)], 64),
    "bad_past_end": gguf([], [g_tensor("t", [64], 0, 0)], 100),
    # Found by the fuzzer: a zero row length used to hide an overflowing product of rows.
    "regress_zero_row_overflow": gguf([], [g_tensor("t", [0, 1 << 40, 1 << 40], 0, 0)], 0),
}


def example_toml():
    with open(os.path.join(ROOT, "configs", "example.toml"), "rb") as f:
        return f.read()


def corpora():
    return {
        "safetensors": lambda: SAFETENSORS,
        "openai_request": lambda: OPENAI_REQUEST,
        "jinja": lambda: JINJA,
        "tokenizer": tokenizer_seeds,
        "model_config": lambda: MODEL_CONFIG,
        "run_config": lambda: dict(RUN_CONFIG, example=example_toml()),
        "gguf": lambda: GGUF,
    }


def main():
    all_corpora = corpora()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help="corpora to write: " + ", ".join(sorted(all_corpora)) + " (default: all)")
    names = p.parse_args().names or sorted(all_corpora)
    for name in names:
        if name not in all_corpora:
            p.error(f"unknown corpus '{name}'")
    for name in names:
        out = os.path.join(HERE, "corpus_" + name)
        os.makedirs(out, exist_ok=True)
        for seed, data in all_corpora[name]().items():
            with open(os.path.join(out, seed), "wb") as f:
                f.write(data)
        print(f"corpus_{name}: {len(os.listdir(out))} files")


if __name__ == "__main__":
    main()
