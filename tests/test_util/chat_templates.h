// Real models' chat templates, verbatim, shared by the chat template and SFT rendering tests.
#pragma once

namespace tessera::testing {

// Meta-Llama-3-8B-Instruct tokenizer_config.json "chat_template" (as quoted verbatim in
// public code, e.g. Together's model list for meta-llama/Meta-Llama-3-*-Instruct and many
// fine-tuning scripts that hard-code "llama3-instruct").
inline constexpr const char* kLlama3 =
    R"TPL({% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %})TPL";

// Qwen/Qwen2-7B-Instruct tokenizer_config.json: ChatML with a default system prompt.
inline constexpr const char* kQwen2 =
    R"TPL({% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %})TPL";

}  // namespace tessera::testing
