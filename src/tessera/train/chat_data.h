// Supervised fine-tuning data (data.format = "chat"): conversations rendered with a model's
// chat template into tokens with a per-token loss mask (the assistant's tokens), stored in a
// data directory, and packed into fixed-length training rows of several documents.
// The rendering itself (the Jinja template) is the serve layer's; the CLI joins the two.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace tessera::train {

// One rendered conversation: its tokens and, per token, 1 when it is trained on (written by
// the assistant, end-of-turn marker included), else 0.
struct ChatDocument {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
};

// DIR/meta.json of a chat data directory ("format": "tessera-chat").
struct ChatDataMeta {
  int64_t vocab_size = 0;
  int32_t eos_id = -1;
  int32_t pad_id = 0;  // fills the tail of packed rows (never a target)
  int64_t train_docs = 0, val_docs = 0;
  int64_t train_tokens = 0, val_tokens = 0;
  int64_t train_trained = 0, val_trained = 0;  // tokens with mask 1
  std::string tokenizer;      // the tokenizer's (model) directory, as given
  std::string source;         // the JSONL file, as given
  std::string source_digest;  // xxh64 of the JSONL, the template and the tokenizer (hex)
  std::string template_origin;  // where the chat template came from
};

// Whether DIR/meta.json says "tessera-chat" (false when there is none, or it is another format).
bool is_chat_data(const std::string& dir);
ChatDataMeta read_chat_meta(const std::string& dir);  // errors name DIR/meta.json and the key
// Writes DIR/train.chat, DIR/val.chat and then DIR/meta.json (each atomically; creates DIR).
// The counts of `meta` are filled in from the documents.
void write_chat_data(const std::string& dir, ChatDataMeta meta, const std::vector<ChatDocument>& train,
                     const std::vector<ChatDocument>& val);
// The documents of one split ("train" | "val"), checked against meta.json.
std::vector<ChatDocument> read_chat_split(const std::string& dir, const std::string& split);

// Documents packed into rows of seq_len tokens. Each document of n tokens takes n slots: its
// tokens as ids, as target of slot t the token t + 1 when that token is trained on (else
// -100; the last slot has none), as positions 0 .. n-1. Documents go to rows best-fit
// decreasing (longest first, each into the row with the least room that holds it), so the
// packing depends only on the documents and seq_len. A row's unused tail is a pad document
// (pad_id, targets -100, positions 0, 1, ...). Documents longer than seq_len keep their
// first seq_len tokens (counted in `truncated`); documents left with no target are dropped.
struct PackedRows {
  int64_t seq_len = 0, rows = 0;
  std::vector<int32_t> ids, targets, positions;  // (rows, seq_len) each
  int64_t documents = 0;  // documents packed
  int64_t truncated = 0, dropped = 0;
  int64_t targets_counted = 0;  // targets != -100
  int64_t slots_used = 0;       // slots holding a document token
  double fill() const;          // slots_used / (rows x seq_len)
};
PackedRows pack_documents(const std::vector<ChatDocument>& docs, int64_t seq_len, int32_t pad_id);

}  // namespace tessera::train
