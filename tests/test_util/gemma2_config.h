// Gemma 2's pieces switched on over a small test config (what config.json's gemma2 sets).
#pragma once
#include "tessera/model/config.h"

namespace tessera::testing {

inline void make_gemma2(model::ModelConfig& c, double query_pre_attn_scalar, float attn_softcap, float final_softcap,
                        int64_t window) {
  c.model_type = "gemma2";
  c.gelu_mlp = c.norm_offset = c.sandwich_norms = c.embed_scale = true;
  c.query_pre_attn_scalar = query_pre_attn_scalar;
  c.attn_softcap = attn_softcap;
  c.final_softcap = final_softcap;
  c.sliding_window = window;
  c.window_alternate = true;
}

}  // namespace tessera::testing
