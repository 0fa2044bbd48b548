// Writes the small served model the serve tests (C++ and JS) run against: a byte-level BPE
// tokenizer trained on a fixed English text, a random 2-layer Llama sized to it, and a
// tokenizer_config.json with a ChatML chat template. Usage: make_serve_model OUT_DIR
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "tessera/base/error.h"
#include "tessera/io/json_file.h"
#include "tessera/io/tokenizer.h"
#include "tessera/model/config.h"
#include "tessera/model/model.h"

namespace {

const char* kText =
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a "
    "single step. All that glitters is not gold. To be or not to be, that is the question. "
    "Hello world! How are you today? I am fine, thank you. The weather is nice and the sun is "
    "shining. Numbers like 12345 and 2026 appear in text, as do words such as server, model, "
    "token, stream, request and response. Caf\xc3\xa9 na\xc3\xafve \xe6\x97\xa5\xe6\x9c\xac "
    "\xf0\x9f\x98\x80 emoji and accents keep the byte-level tokenizer honest.\n";

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_serve_model OUT_DIR\n");
    return 2;
  }
  namespace fs = std::filesystem;
  using namespace tessera;
  try {
    const std::string dir = argv[1];
    fs::create_directories(dir);
    const std::string corpus = dir + "/corpus.txt";
    {
      std::ofstream out(corpus);
      for (int i = 0; i < 20; ++i) out << kText;
    }
    io::BpeTrainOptions bo;
    bo.vocab_size = 384;
    bo.special_tokens = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
    bo.progress = false;
    const auto tok = io::train_bpe({corpus}, bo);
    fs::remove(corpus);
    tok.save(dir);
    // ChatML, with <|im_end|> as the end of a turn.
    auto cfg = io::read_json_file(dir + "/tokenizer_config.json");
    cfg["chat_template"] =
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
        "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\\n' }}{% endif %}";
    cfg["eos_token"] = "<|im_end|>";
    io::write_file_atomic(dir + "/tokenizer_config.json", cfg.dump(2));

    auto mc = model::ModelConfig::named_shape("tiny");
    mc.vocab_size = tok.vocab_size();
    mc.max_position_embeddings = 512;
    mc.eos_token_id = tok.token_to_id("<|im_end|>");
    mc.bos_token_id = -1;
    model::Model::random(mc, DType::kF32, 7).save(dir);
    std::printf("%s: vocab %lld\n", dir.c_str(), static_cast<long long>(mc.vocab_size));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make_serve_model: %s\n", e.what());
    return 1;
  }
}
