"""HFPolicy's prefix cache and fast decode: the same multi-turn generations three ways, on the built-in tiny model.

Each of ``--episodes`` rows plays ``--turns`` turns; a turn's prompt is the previous prompt + the tokens sampled +
an observation of ``--obs-tokens`` tokens (what the runtime sends), so without the cache every turn re-reads the
whole history. The three samplers: no prefix cache (transformers' sdpa and cache); the prefix cache; the prefix cache
with the fast decode (grouped-query decode attention and a preallocated cache, ``fast_decode=True``, the default).
Prints milliseconds per turn-batch for each and the ratios; the same seed gives the same draws (checked).

    python benchmarks/prefix_cache.py [--model tiny-bpe-alfworld:128x4] [--episodes 8] [--turns 12]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from agentenv.samplers.hf_policy import HFPolicy
from agentenv.samplers.models import resolve_model
from agentenv.core.policy import GenerationRequest, SamplingParams


def play(policy: HFPolicy, episodes: int, turns: int, obs_tokens: int, first: int) -> tuple[float, int, list]:
    rng = random.Random(0)
    vocab = len(policy.tokenizer) - 30  # ordinary ids, never the specials at the end
    prompts = [[rng.randrange(vocab) for _ in range(first)] for _ in range(episodes)]
    sp = SamplingParams(temperature=1.0, max_new_tokens=12)
    t0, drawn = time.perf_counter(), []
    for _ in range(turns):
        gens = policy.generate([GenerationRequest(p, sp) for p in prompts])
        drawn += [g.token_ids for g in gens]
        prompts = [p + g.token_ids + [rng.randrange(vocab) for _ in range(obs_tokens)] for p, g in zip(prompts, gens)]
    return (time.perf_counter() - t0) / turns, max(len(p) for p in prompts), drawn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-bpe-alfworld:128x4")
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--obs-tokens", type=int, default=80)
    ap.add_argument("--first", type=int, default=250, help="tokens of the first prompt (system + opening)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(a.model).path
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    times, draws = {}, {}
    for name, budget, fast in (("no prefix cache", 0, False), ("prefix cache", 1 << 19, False),
                               ("+ fast decode", 1 << 19, True)):
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
        policy = HFPolicy(model, tok, seed=0, prefix_cache_tokens=budget, fast_decode=fast)
        play(policy, 2, 2, a.obs_tokens, a.first)  # warm-up
        policy.generator.manual_seed(0)
        times[name], length, draws[name] = play(policy, a.episodes, a.turns, a.obs_tokens, a.first)
        print(f"{name:16s} {times[name] * 1e3:7.1f} ms per turn ({a.episodes} rows, final length {length})")
    same = len({tuple(map(tuple, d)) for d in draws.values()}) == 1
    print(f"ratio: {times['no prefix cache'] / times['prefix cache']:.2f}x faster with the prefix cache; "
          f"{times['prefix cache'] / times['+ fast decode']:.2f}x faster again with the fast decode "
          f"({'the same draws' if same else 'DIFFERENT DRAWS'} in all three)")


if __name__ == "__main__":
    main()
