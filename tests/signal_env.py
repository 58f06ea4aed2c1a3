"""Test fixtures that give the random tiny model a learning signal, so the learner really steps.

The random tiny model almost never samples its end-of-turn token, so its turns end at ``max_new_tokens``, the env
is never stepped and every reward is 0: every batch has zero advantage and the learner skips the optimizer step
(``policy_version`` does not move). :class:`ShortTurnTinyFactory` makes a third of the vocabulary end a turn (the
sampler is the real HFPolicy; only its stop set is larger), and :class:`CoinRewardEnv` pays 1 for an action of odd
length, so batches have reward variance and real steps happen. Picklable, so Ray actors can build them.
"""

from __future__ import annotations

import gymnasium as gym


class CoinRewardEnv(gym.Wrapper):
    def step(self, action):
        obs, _, _, truncated, info = self.env.step(action)
        return obs, float(len(action) % 2), True, truncated, info


class CoinEnvFactory:
    def __call__(self):
        import agentenv  # noqa: F401

        return CoinRewardEnv(gym.make("agentenv/GuessNumber-v0"))


class ShortTurnTinyFactory:
    """HFPolicy over the tiny model (a fresh load, or a deep copy of ``shared=(model, tokenizer, path)``)."""

    def __init__(self, shared=None):
        self.shared = shared

    def __call__(self, worker_index: int = 0):
        import copy

        from agentenv.samplers.hf_policy import HFPolicy
        from agentenv.samplers.factory import load_hf_policy

        if self.shared is None:
            pol = load_hf_policy("tiny", seed=worker_index, device="cpu")
        else:
            model, tok, path = self.shared
            pol = HFPolicy(copy.deepcopy(model), tok, name="tiny", model_path=path, seed=worker_index, device="cpu")
        pol.stop_ids = set(pol.stop_ids) | set(range(1000, 150000, 3))
        return pol


gym.register("CoinGuess-v0", entry_point=lambda **kw: CoinRewardEnv(gym.make("agentenv/GuessNumber-v0", **kw)))


def two_token_model_dir(out) -> str:
    """A tiny Qwen2 checkpoint (real tokenizer) that samples almost only "a" or the end-of-turn token, 50/50: its
    turns are short, end properly, and their lengths vary -- with :class:`CoinRewardEnv`, batches have reward variance
    and every update is a real optimizer step. Built deterministically from the tiny model's config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

    import agentenv  # noqa: F401
    from agentenv.samplers.models import resolve_model

    path = resolve_model("tiny").path
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    cfg = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).config
    cfg.tie_word_embeddings = False
    torch.manual_seed(0)
    m = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        m.model.embed_tokens.weight[:, 0] = 100.0  # residual dim 0 is a large constant ...
        for layer in m.model.layers:  # ... that no layer writes to
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
        m.model.norm.weight.zero_()
        m.model.norm.weight[0] = 1.0  # so the final hidden state is ~sqrt(hidden) on dim 0 and 0 elsewhere
        m.lm_head.weight.zero_()
        for t in (tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("<|im_end|>")):
            m.lm_head.weight[t, 0] = 2.0
    m.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)
