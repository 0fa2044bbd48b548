#!/usr/bin/env python3
"""What prompt log-probabilities and embeddings cost a running `tessera serve`, against the
plain prefill of the same prompts (completions with max_tokens 1), over HTTP.

Start a server without prefix caching (so every request computes its prompt; --shape has no tokenizer, so token-id prompts), e.g.
  build/bin/tessera serve --shape small --port 8123 --no-prefix-caching
then: bench/api_extras_cost.py --url http://127.0.0.1:8123 [--prompts 16 --len 256 --runs 5]

Each run sends the same batch (one request, `--prompts` token-id prompts of `--len` random
tokens) as: a plain completion (max_tokens 1); with prompt_logprobs 0 and 5 (alternatives per
position; echo with logprobs 5 asks for the same); and as /v1/embeddings inputs. Prints the median
seconds of each and its ratio to the plain prefill.
"""
import argparse
import json
import random
import statistics
import time
import urllib.request


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return time.perf_counter() - t, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8123")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--len", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=32000)
    a = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, a.vocab) for _ in range(a.len)] for _ in range(a.prompts)]
    base = {"prompt": prompts, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    kinds = {
        "prefill (max_tokens 1)": ("/v1/completions", base),
        "prompt_logprobs 0": ("/v1/completions", {**base, "prompt_logprobs": 0}),
        "prompt_logprobs 5": ("/v1/completions", {**base, "prompt_logprobs": 5}),
        "embeddings": ("/v1/embeddings", {"input": prompts}),
    }
    post(a.url + "/v1/completions", base)  # warm-up
    times = {k: [] for k in kinds}
    for _ in range(a.runs):
        for k, (path, body) in kinds.items():
            times[k].append(post(a.url + path, body)[0])
    ref = statistics.median(times["prefill (max_tokens 1)"])
    print(f"{a.prompts} prompts x {a.len} tokens, median of {a.runs} runs")
    for k in kinds:
        m = statistics.median(times[k])
        print(f"  {k:24s} {m:7.3f} s  {m / ref:5.2f}x  ({a.prompts * a.len / m:8.0f} prompt tokens/s)")


if __name__ == "__main__":
    main()
