#!/usr/bin/env python3
"""Reference beam search for Tessera's engine: transformers' BeamSearchScorer algorithm
(generation/beam_search.py with generate(num_beams=W, length_penalty=lp, early_stopping=False,
num_return_sequences=n)), written out here over the plain-PyTorch model of hf_models.py in
float64, with a full forward of the whole sequence at every step (no KV cache).

The rules (the ones docs/inference.md documents for the engine):
  * beam scores start as [0, -1e9, ..., -1e9] (W beams: only the first is live at step 1);
  * next_scores = log_softmax(logits) + beam_scores, flattened over (W x vocab); the best
    max(2, 1 + E) * W (E: distinct end tokens) are taken (torch.topk);
  * in that order: an end token becomes a finished hypothesis if its rank < W (score =
    cum / generated_len ** lp, generated_len counting the end token), otherwise a live beam,
    until W live beams are taken; the W best hypotheses are kept (BeamHypotheses.add);
  * done (early_stopping=False) once W are kept and worst_score >= max(next_scores) / cur ** lp,
    cur = tokens generated so far;
  * after max_new tokens the live beams are added as hypotheses (finalize) and the n best are
    returned, best first.

Usage: beam_search_reference.py --model DIR --cases CASES.json --out OUT.json
CASES.json: [{"prompt": [ids], "width": W, "n": n, "length_penalty": lp, "max_new": T,
              "end_tokens": [ids]}, ...]
OUT.json: [{"hyps": [{"tokens": [...], "cum_logprob": x, "score": s, "finish_reason": r}],
            "min_gap": g}, ...]  (min_gap: the smallest difference between consecutive
            candidate scores around each cut, to tell a float near-tie from a real mismatch)
"""
import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_models  # noqa: E402


class Hypotheses:
    """transformers' BeamHypotheses: the best `num_beams` finished sequences."""

    def __init__(self, num_beams, length_penalty):
        self.num_beams = num_beams
        self.length_penalty = length_penalty
        self.beams = []  # (score, tokens, cum, reason)
        self.worst_score = 1e9

    def add(self, tokens, cum, generated_len, reason):
        score = cum / (generated_len ** self.length_penalty)
        if len(self.beams) < self.num_beams or score > self.worst_score:
            self.beams.append((score, tokens, cum, reason))
            if len(self.beams) > self.num_beams:
                sorted_scores = sorted([(s, idx) for idx, (s, _, _, _) in enumerate(self.beams)])
                del self.beams[sorted_scores[0][1]]
                self.worst_score = sorted_scores[1][0]
            else:
                self.worst_score = min(score, self.worst_score)

    def is_done(self, best_sum_logprobs, cur_len):
        if len(self.beams) < self.num_beams:
            return False
        return self.worst_score >= best_sum_logprobs / cur_len ** self.length_penalty


def last_logits(model, beams):
    """(W, vocab) logits of every beam's last position (beams have equal lengths)."""
    with torch.no_grad():
        return model(torch.tensor(beams, dtype=torch.long))[:, -1]


def beam_search(model, prompt, width, n, lp, max_new, end_tokens):
    hyps = Hypotheses(width, lp)
    beams = [list(prompt) for _ in range(width)]
    beam_scores = torch.full((width,), -1e9, dtype=torch.float64)
    beam_scores[0] = 0.0
    k = max(2, 1 + len(end_tokens)) * width
    min_gap = math.inf
    done = False
    for cur in range(1, max_new + 1):
        logprobs = torch.log_softmax(last_logits(model, beams), dim=-1)
        vocab = logprobs.shape[1]
        scores = (logprobs + beam_scores[:, None]).view(-1)
        top_scores, top_idx = torch.topk(scores, k + 1)
        # the gaps next to each candidate that a near-tie could reorder
        gaps = (top_scores[:-1] - top_scores[1:]).tolist()
        min_gap = min(min_gap, min(gaps))
        top_scores, top_idx = top_scores[:k], top_idx[:k]
        next_beams, next_scores = [], []
        for rank, (s, idx) in enumerate(zip(top_scores.tolist(), top_idx.tolist())):
            b, tok = divmod(idx, vocab)
            if tok in end_tokens:
                if rank >= width:
                    continue
                hyps.add(beams[b][len(prompt):], s, cur, "stop")
            else:
                next_beams.append(beams[b] + [tok])
                next_scores.append(s)
            if len(next_beams) == width:
                break
        if hyps.is_done(top_scores.max().item(), cur):
            done = True
            break
        beams = next_beams
        beam_scores = torch.tensor(next_scores, dtype=torch.float64)
    if not done:  # finalize: every live beam becomes a hypothesis
        for b, s in zip(beams, beam_scores.tolist()):
            hyps.add(b[len(prompt):], s, max_new, "length")
    ranked = sorted(hyps.beams, key=lambda h: h[0])
    out = []
    for _ in range(n):
        score, tokens, cum, reason = ranked.pop()
        out.append({"tokens": tokens, "cum_logprob": cum, "score": score, "finish_reason": reason})
    return out, min_gap


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--cases", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    model = hf_models.load_model_dir(a.model)
    model = model.double().eval()
    with open(a.cases) as f:
        cases = json.load(f)
    results = []
    for c in cases:
        hyps, gap = beam_search(model, c["prompt"], c["width"], c["n"], c["length_penalty"], c["max_new"],
                                set(c["end_tokens"]))
        results.append({"hyps": hyps, "min_gap": gap})
    with open(a.out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
