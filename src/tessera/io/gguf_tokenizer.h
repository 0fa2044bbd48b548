// Byte-level BPE tokenizers as GGUF metadata (tokenizer.ggml.*, what llama.cpp's
// convert_hf_to_gguf.py writes for a "gpt2" tokenizer) and back, SentencePiece ("llama")
// vocabularies read from it, and the tokenizer of a model path (a Hugging Face directory or
// a GGUF file).
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include "tessera/io/gguf.h"
#include "tessera/io/tokenizer.h"

namespace tessera::io {

// llama.cpp's token types (llama_token_type / gguf.TokenType).
enum class GgufTokenType : int32_t { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };

// tokenizer.ggml.model "gpt2", .pre (llama.cpp's name for the pre-tokenizer: "gpt-2",
// "llama-bpe" or "qwen2"; any other split pattern is a one-line error), .tokens and
// .token_type for ids 0..vocab_size-1 (special added tokens CONTROL, other added tokens
// USER_DEFINED, ids no token has "[PAD<id>]" UNUSED), .merges, .bos_token_id /
// .eos_token_id, .add_bos_token / .add_eos_token, and tokenizer.chat_template when
// tokenizer_config.json has one. vocab_size: the model's (at least the tokenizer's).
GgufMetadata gguf_tokenizer_metadata(const Tokenizer& tok, int64_t vocab_size);

// The tokenizer.json (and tokenizer_config.json) equivalent of the metadata. "gpt2": the
// vocabulary from NORMAL / BYTE tokens, CONTROL and USER_DEFINED tokens as added tokens
// (special or not), UNUSED ids left out, the merges, and the pre-tokenizer named by
// tokenizer.ggml.pre ("gpt-2", "llama-bpe", "qwen2" and their aliases). "llama"
// (SentencePiece, merged by tokenizer.ggml.scores in llama.cpp): SentencePiece-style BPE as
// Hugging Face's LlamaConverter writes it, merges derived from the scores (each split of a
// token into two tokens, highest-scoring merged token first), byte fallback to the BYTE
// tokens, unk, add_space_prefix as Llama 2's Prepend normalizer and Strip decoder, BOS added
// unless add_bos_token is false. Other models are one-line errors naming the key. `source`
// names the file.
Tokenizer tokenizer_from_gguf(const GgufHeader& h, const std::string& source);

// The tokenizer of a model path: DIR/tokenizer.json, or a GGUF file's metadata; nullopt
// when there is none (a directory without tokenizer.json, a GGUF file without tokenizer.ggml.*).
std::optional<Tokenizer> load_model_tokenizer(const std::string& model_path);

}  // namespace tessera::io
