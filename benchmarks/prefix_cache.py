"""HFPolicy's prefix cache: the same multi-turn generations with and without it, on the built-in tiny model.

Each of ``--episodes`` rows plays ``--turns`` turns; a turn's prompt is the previous prompt + the tokens sampled +
an observation of ``--obs-tokens`` tokens (what the runtime sends), so without the cache every turn re-reads the
whole history. Prints seconds per turn-batch, with and without, and their ratio (same seed: the same draws).

    python benchmarks/prefix_cache.py [--model tiny-bpe-alfworld:128x4] [--episodes 8] [--turns 12]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from agentenv.hf_policy import HFPolicy
from agentenv.models import resolve_model
from agentenv.policy import GenerationRequest, SamplingParams


def play(policy: HFPolicy, episodes: int, turns: int, obs_tokens: int, first: int) -> tuple[float, int]:
    rng = random.Random(0)
    vocab = len(policy.tokenizer) - 30  # ordinary ids, never the specials at the end
    prompts = [[rng.randrange(vocab) for _ in range(first)] for _ in range(episodes)]
    sp = SamplingParams(temperature=1.0, max_new_tokens=12)
    t0 = time.perf_counter()
    for _ in range(turns):
        gens = policy.generate([GenerationRequest(p, sp) for p in prompts])
        prompts = [p + g.token_ids + [rng.randrange(vocab) for _ in range(obs_tokens)] for p, g in zip(prompts, gens)]
    return (time.perf_counter() - t0) / turns, max(len(p) for p in prompts)


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
    times = {}
    for name, budget in (("without", 0), ("with", 1 << 19)):
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
        policy = HFPolicy(model, tok, seed=0, prefix_cache_tokens=budget)
        play(policy, 2, 2, a.obs_tokens, a.first)  # warm-up
        times[name], length = play(policy, a.episodes, a.turns, a.obs_tokens, a.first)
        print(f"{name:8s} prefix cache: {times[name] * 1e3:7.1f} ms per turn ({a.episodes} rows, final length {length})")
    print(f"ratio: {times['without'] / times['with']:.2f}x faster with the cache")


if __name__ == "__main__":
    main()
