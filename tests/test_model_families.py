"""Per model family, the learner's pi of sampled tokens equals the sampler's mu at lag 0.

Randomly initialised tiny models of each architecture the CLI lists (Qwen2, Qwen3, Llama) plus the families whose HF
forward processes the logits after the LM head (Gemma-2 final-logit softcapping, Cohere logit_scale, Granite
logits_scaling), sized to the project's small tokenizer. The sampler is the real HFPolicy (full model forward with
a KV cache, processed distribution at temperature 1, no top-k/top-p); pi is the learner's chunked path. For the
processing families the test also shows that skipping the processing would break the equality (it can fail).
"""

import math

import pytest
import torch

from agentenv.samplers.hf_policy import HFPolicy
from agentenv.core.policy import GenerationRequest, SamplingParams
from agentenv.samplers.tiny import small_tokenizer
from agentenv.trainer.logprobs import FinalLogits, final_logits_of, token_log_probs
from agentenv.trainer.preflight import lag0_trust_check

BODY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=256, initializer_range=0.2)  # large init: logits big enough to hit a softcap


def family_model(name, vocab):
    import transformers as tf

    kw = dict(BODY, vocab_size=vocab, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    if name == "qwen2":
        cfg = tf.Qwen2Config(**kw)
    elif name == "qwen3":
        cfg = tf.Qwen3Config(head_dim=16, **kw)
    elif name == "llama":
        cfg = tf.LlamaConfig(**kw)
    elif name == "gemma2":
        cfg = tf.Gemma2Config(head_dim=16, final_logit_softcapping=2.0, query_pre_attn_scalar=16, sliding_window=64,
                              **kw)
    elif name == "cohere":
        cfg = tf.CohereConfig(logit_scale=0.25, **kw)
    elif name == "granite":
        cfg = tf.GraniteConfig(logits_scaling=4.0, **kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg).float().eval()


@pytest.fixture(scope="module")
def tok():
    return small_tokenizer()


def sample_and_score(model, tok, *, post=None):
    prompt = tok("The robot opened the drawer and")["input_ids"]
    policy = HFPolicy(model, tok, seed=1, device="cpu")
    sp = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=24)
    gens = policy.generate([GenerationRequest(prompt, sp), GenerationRequest(prompt[:3], sp)])
    mus, pis = [], []
    for prompt_ids, g in zip((prompt, prompt[:3]), gens):
        ids = torch.tensor([prompt_ids + g.token_ids])
        act = torch.zeros_like(ids, dtype=torch.bool)
        act[0, len(prompt_ids):] = True
        with torch.no_grad():
            if post is None:
                pi, _ = token_log_probs(model, ids, torch.ones_like(act), act)
            else:  # the chunked path with a given processing, to show what skipping it would do
                from agentenv.trainer.logprobs import chunked_log_probs

                hidden = model.get_decoder()(input_ids=ids).last_hidden_state[:, :-1][act[:, 1:]]
                pi, _ = chunked_log_probs(hidden, model.get_output_embeddings().weight, ids[:, 1:][act[:, 1:]],
                                          post=post)
                pi = torch.zeros(ids.shape).masked_scatter(act, pi)
        mus.append(torch.tensor(g.logprobs))
        pis.append(pi[act])
    return torch.cat(mus), torch.cat(pis)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama", "gemma2", "cohere", "granite"])
def test_pi_equals_mu_at_lag0(family, tok):
    model = family_model(family, len(tok))
    mu, pi = sample_and_score(model, tok)
    assert mu.numel() >= 10
    torch.testing.assert_close(pi, mu, rtol=0, atol=1e-5)
    post = final_logits_of(model.config)
    if family in ("gemma2", "cohere", "granite"):
        assert post != FinalLogits()
        _, pi_raw = sample_and_score(model, tok, post=FinalLogits())
        assert (pi_raw - mu).abs().max() > 1e-2  # without the family's processing pi would not be mu
    else:
        assert post == FinalLogits()


def test_chunked_gradient_with_softcap_and_scale_matches_autograd():
    from agentenv.trainer.logprobs import chunked_log_probs, naive_log_probs

    torch.manual_seed(0)
    h = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    w = (3 * torch.randn(11, 5, dtype=torch.float64)).requires_grad_()
    t = torch.randint(0, 11, (7,))
    post = FinalLogits(scale=0.7, softcap=2.5)
    lp, ent = chunked_log_probs(h, w, t, chunk_size=3, temperature=0.8, post=post, with_entropy=True)
    ref, ref_ent = naive_log_probs(h, w, t, temperature=0.8, post=post, with_entropy=True)
    torch.testing.assert_close(lp, ref)
    torch.testing.assert_close(ent, ref_ent)
    g = torch.randn(7, dtype=torch.float64)
    torch.testing.assert_close(torch.autograd.grad(lp, (h, w), g), torch.autograd.grad(ref, (h, w), g))


def test_unknown_post_head_processing_is_refused():
    from transformers import Qwen2Config

    cfg = Qwen2Config(vocab_size=8, hidden_size=8)
    cfg.lm_head_multiplier = 0.5
    with pytest.raises(NotImplementedError, match="lm_head_multiplier"):
        final_logits_of(cfg)


def test_lag0_trust_check_refuses_top_k_and_admits_untruncated_sampling(tok):
    model = family_model("qwen2", len(tok))
    acc, kl = lag0_trust_check(model, tok, temperature=1.0, top_p=1.0, top_k=0, delta=1e-3, n_tokens=16)
    assert acc == 1.0 and kl < 1e-6
    acc, kl = lag0_trust_check(model, tok, temperature=1.0, top_p=1.0, top_k=5, delta=1e-3, n_tokens=16)
    assert acc == 0.0 and kl > 0.1 and math.isfinite(kl)
