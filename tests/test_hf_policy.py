"""transformers backend: behaviour log-probs equal an independent forward pass under the same processing."""

import itertools
import math

import gymnasium as gym
import pytest
import torch

from agentenv.core.policy import GenerationRequest, SamplingParams
from agentenv.core.runtime import RolloutConfig, run_episodes


def reference_logprobs(model, token_ids, temperature, top_p, top_k):
    """Independent recomputation: ONE full-sequence forward (no KV cache, no batching, no padding), then the
    sampler's processing written the other way round (ascending sort, drop the low tail whose mass <= 1 - top_p)."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0, :-1].float() / temperature
    if top_k > 0:
        logits = logits.masked_fill(logits < torch.topk(logits, top_k, dim=-1).values[:, -1:], float("-inf"))
    if top_p < 1.0:
        asc, order = torch.sort(logits, dim=-1)
        tail = asc.softmax(-1).cumsum(-1) <= 1 - top_p
        tail[:, -1] = False
        logits = logits.masked_fill(torch.zeros_like(tail).scatter(-1, order, tail), float("-inf"))
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, torch.tensor(token_ids[1:])[:, None])[:, 0].tolist()


def _clone(policy):
    import copy

    from agentenv.samplers.hf_policy import HFPolicy

    return HFPolicy(copy.deepcopy(policy.model), policy.tokenizer, name=policy.name, model_path=policy.model_path)


@pytest.fixture(scope="module")
def chatty_policy(tiny_policy):
    """The tiny model with its <|im_end|> embedding row scaled up, so turns end on their own after a few tokens
    (a random init almost never samples it). Still a real model: every log-prob comes from its forward pass."""
    p = _clone(tiny_policy)
    with torch.no_grad():
        emb = p.model.get_input_embeddings().weight
        eos = p.tokenizer.eos_token_id
        emb[eos] = emb[eos] / emb[eos].norm() * 60.0 * emb.norm(dim=-1).mean()
    return p


@pytest.mark.parametrize("temperature,top_p,top_k", list(itertools.product([0.7, 1.0], [0.9, 1.0], [0, 20])))
def test_multi_turn_behavior_logprobs_match_forward(chatty_policy, temperature, top_p, top_k):
    cfg = RolloutConfig(max_turns=3, max_total_tokens=400, concurrency=2,
                        sampling=SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=16))
    trajs = run_episodes(lambda: gym.make("agentenv/GuessNumber-v0"), chatty_policy, 3, cfg, seed=7)
    assert max(t.num_turns for t in trajs) >= 2
    worst, where = 0.0, None
    for t in trajs:
        ref = reference_logprobs(chatty_policy.model, t.token_ids, temperature, top_p, top_k)
        for pos in range(1, len(t.token_ids)):
            if t.action_mask[pos] and abs(ref[pos - 1] - t.behavior_logprobs[pos]) > worst:
                worst, where = abs(ref[pos - 1] - t.behavior_logprobs[pos]), (t, pos)
    assert worst <= 1e-4, _mismatch_report(chatty_policy.model, *where, worst)


def _mismatch_report(model, traj, pos, diff) -> str:
    """What a failure needs to be told apart: a boundary tie (the k-th and next logits nearly equal) or a wrong
    context (the sampled token's logit itself moved)."""
    with torch.no_grad():
        logits = model(torch.tensor([traj.token_ids[:pos]])).logits[0, -1].float()
    top = logits.topk(22).values
    tok = traj.token_ids[pos]
    return (f"behaviour log-prob off by {diff:.3g} at position {pos} of {len(traj.token_ids)} (token {tok}, rank "
            f"{int((logits > logits[tok]).sum())}, turns {traj.num_turns}, finish {traj.finish_reason}); reference "
            f"logits at ranks 19-22: {[round(float(v), 5) for v in top[18:]]}; behaviour {traj.behavior_logprobs[pos]:.6f}")


def test_batched_requests_of_different_lengths_match_single(tiny_policy):
    tok = tiny_policy.tokenizer
    prompts = [tok("short", add_special_tokens=False)["input_ids"],
               tok("a much longer prompt with many more tokens in it", add_special_tokens=False)["input_ids"]]
    sp = SamplingParams(temperature=1.0, max_new_tokens=5)
    gens = tiny_policy.generate([GenerationRequest(p, sp, return_entropy=True) for p in prompts])
    for p, g in zip(prompts, gens):
        ref = reference_logprobs(tiny_policy.model, p + g.token_ids, 1.0, 1.0, 0)[len(p) - 1:]
        assert max(abs(a - b) for a, b in zip(ref, g.logprobs)) <= 1e-4
        assert len(g.entropies) == len(g.token_ids) and all(e > 0 for e in g.entropies)


def test_load_weights_bumps_version_and_changes_outputs(tiny_policy):
    tok = tiny_policy.tokenizer
    prompt = tok("hello", add_special_tokens=False)["input_ids"]
    p = _clone(tiny_policy)
    v0 = p.policy_version
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in p.model.state_dict().items()}
    before = p.generate([GenerationRequest(prompt, SamplingParams(max_new_tokens=3))])[0]
    p.load_weights(state)
    after = p.generate([GenerationRequest(prompt, SamplingParams(max_new_tokens=3))])[0]
    assert p.policy_version == v0 + 1 and before.policy_version == v0 and after.policy_version == v0 + 1
    ref = reference_logprobs(p.model, prompt + after.token_ids, 1.0, 1.0, 0)[len(prompt) - 1:]
    assert max(abs(a - b) for a, b in zip(ref, after.logprobs)) <= 1e-4


def test_bad_sampling_settings_are_clear_errors():
    for kw, msg in (({"temperature": 0}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -1}, "top_k"),
                    ({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": float("nan")}, "temperature")):
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**kw)


def test_load_weights_is_strict_and_keeps_the_version_on_mismatch(tiny_policy):
    p = _clone(tiny_policy)
    v0 = p.policy_version
    good = {k: v.clone() for k, v in p.model.state_dict().items()}
    first = next(iter(good))
    snapshot = good[first].clone()
    renamed = {("model." + k if not k.startswith("model.") else k[len("model."):]): v + 1.0 for k, v in good.items()}
    dropped = next(k for k in good if "norm" in k)
    partial = {k: v + 1.0 for k, v in good.items() if k != dropped}
    wrong_shape = dict(good, **{first: torch.zeros(3)})
    for bad, msg in ((renamed, "missing keys"), (renamed, "unexpected keys"), (partial, f"1 missing keys .*{dropped}"),
                     (wrong_shape, "shape mismatches")):
        with pytest.raises(ValueError, match=msg):
            p.load_weights(bad)
        assert p.policy_version == v0 and torch.equal(p.model.state_dict()[first], snapshot)  # nothing copied
    # the tiny model ties lm_head to the embeddings: the tied copy may be left out
    assert p.model.get_output_embeddings().weight.data_ptr() == p.model.get_input_embeddings().weight.data_ptr()
    p.load_weights({k: v for k, v in good.items() if "lm_head" not in k}, version=v0 + 7)
    assert p.policy_version == v0 + 7
    assert p.backend == "hf"


def test_stop_ids_include_every_generation_config_eos(tiny_policy):
    import copy

    from agentenv.samplers.hf_policy import HFPolicy

    model = copy.deepcopy(tiny_policy.model)
    tok = tiny_policy.tokenizer
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    model.generation_config.eos_token_id = [tok.eos_token_id, eot]
    assert HFPolicy(model, tok).stop_ids == {tok.eos_token_id, eot}
    assert tiny_policy.stop_ids == {tok.eos_token_id}


def test_prefix_cache_runs_only_the_new_tokens_and_never_outlives_the_weights(chatty_policy):
    """A turn that extends an earlier sequence reuses its keys/values: the log-probs are those of a full forward, the
    draws are those of a sampler without the cache (same seed), and loading weights empties the cache (a kept
    key/value of the old weights would mix two policy versions in one generation)."""
    import copy

    from agentenv.samplers.hf_policy import HFPolicy

    tok = chatty_policy.tokenizer
    fresh = lambda cache: HFPolicy(copy.deepcopy(chatty_policy.model), tok, seed=3,  # noqa: E731
                                   prefix_cache_tokens=cache)
    on, off = fresh(1 << 16), fresh(0)
    sp = SamplingParams(temperature=1.0, max_new_tokens=6)
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ("a first question", "another, longer one here")]
    for turn in range(3):  # each row's next prompt = its prompt + what was sampled + an observation
        got_on = on.generate([GenerationRequest(p, sp) for p in prompts])
        got_off = off.generate([GenerationRequest(p, sp) for p in prompts])
        for p, a, b in zip(prompts, got_on, got_off):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5
            ref = reference_logprobs(on.model, p + a.token_ids, 1.0, 1.0, 0)[len(p) - 1:]
            assert max(abs(x - y) for x, y in zip(ref, a.logprobs)) <= 1e-4
        prompts = [p + g.token_ids + tok(f" observation {turn}", add_special_tokens=False)["input_ids"]
                   for p, g in zip(prompts, got_on)]
    assert on.prefix_cache.hits == 4 and on.prefix_cache.misses == 2 and off.prefix_cache is None
    assert on.prefix_cache.tokens > 0
    on.load_weights({k: v + 0.05 * torch.randn_like(v) for k, v in on.model.state_dict().items()})
    assert on.prefix_cache.tokens == 0
    g = on.generate([GenerationRequest(prompts[0], sp)])[0]
    assert on.prefix_cache.misses == 3  # recomputed under the new weights
    ref = reference_logprobs(on.model, prompts[0] + g.token_ids, 1.0, 1.0, 0)[len(prompts[0]) - 1:]
    assert max(abs(x - y) for x, y in zip(ref, g.logprobs)) <= 1e-4


def test_fast_decode_draws_what_the_plain_transformers_path_draws(chatty_policy):
    """The grouped-query decode attention and the preallocated cache are exact: with the same seed, a policy with
    them and one on transformers' own sdpa + concatenated cache draw the same tokens with the same log-probs (to
    float rounding) over multi-turn, mixed-length batches that hit the prefix cache, at two sampling settings."""
    import copy

    from agentenv.samplers.hf_policy import GQA_DECODE, HFPolicy

    tok = chatty_policy.tokenizer
    fast = HFPolicy(copy.deepcopy(chatty_policy.model), tok, seed=11)
    plain = HFPolicy(copy.deepcopy(chatty_policy.model), tok, seed=11, fast_decode=False)
    assert fast.model.config._attn_implementation == GQA_DECODE and fast._cache_layers == 2
    assert plain.model.config._attn_implementation == "sdpa" and plain._cache_layers == 0
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ("go", "a much longer first prompt than that",
                                                                       "a middling one")]
    worst = 0.0
    for turn in range(4):
        sp = SamplingParams(temperature=1.0 if turn % 2 else 0.8, top_p=1.0 if turn % 2 else 0.9, max_new_tokens=12)
        got = [p.generate([GenerationRequest(q, sp) for q in prompts]) for p in (fast, plain)]
        for a, b in zip(*got):
            assert a.token_ids == b.token_ids and a.stop_reason == b.stop_reason
            worst = max([worst] + [abs(x - y) for x, y in zip(a.logprobs, b.logprobs)])
        prompts = [q + g.token_ids + tok(f" obs {turn}" * (i + 1), add_special_tokens=False)["input_ids"]
                   for i, (q, g) in enumerate(zip(prompts, got[0]))]
    assert worst <= 1e-5
    assert fast.prefix_cache.hits == plain.prefix_cache.hits == 9


def test_a_seeded_request_draws_the_same_whatever_it_is_batched_with(chatty_policy):
    """``GenerationRequest.seed`` fixes a request's draws: alone, or batched with other (longer, unseeded) requests,
    or after the policy's own stream has moved, the same seed gives the same tokens; other seeds give other draws;
    and the recorded log-probs are still those of a full forward under the processing."""
    import copy

    from agentenv.samplers.hf_policy import HFPolicy

    tok = chatty_policy.tokenizer
    policy = HFPolicy(copy.deepcopy(chatty_policy.model), tok, seed=0)
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10)
    prompt = tok("the seeded one", add_special_tokens=False)["input_ids"]
    others = [tok(t, add_special_tokens=False)["input_ids"]
              for t in ("a far longer prompt with many more words in it", "x")]
    alone = policy.generate([GenerationRequest(prompt, sp, seed=42)])[0]
    batched = policy.generate([GenerationRequest(others[0], sp), GenerationRequest(prompt, sp, seed=42),
                               GenerationRequest(others[1], sp, seed=7)])[1]
    assert batched.token_ids == alone.token_ids
    assert max(abs(x - y) for x, y in zip(alone.logprobs, batched.logprobs)) <= 1e-5
    draws = {tuple(policy.generate([GenerationRequest(prompt, sp, seed=s)])[0].token_ids) for s in range(12)}
    assert len(draws) > 3  # seeds are not all the same stream
    ref = reference_logprobs(policy.model, prompt + alone.token_ids, 1.0, 0.9, 0)[len(prompt) - 1:]
    assert max(abs(x - y) for x, y in zip(ref, alone.logprobs)) <= 1e-4


def test_seeded_draws_follow_the_processed_distribution(tiny_policy):
    """Inverse-CDF draws from seeded streams are draws from the processed distribution: over 2,000 seeds the first
    token's frequencies match exp(log mu) (total variation < 0.05; with top-k 5 nothing outside the top 5 appears)."""
    import collections

    tok = tiny_policy.tokenizer
    prompt = tok("frequencies", add_special_tokens=False)["input_ids"]
    sp = SamplingParams(temperature=2.0, top_k=5, max_new_tokens=1)
    gens = tiny_policy.generate([GenerationRequest(prompt, sp, seed=s) for s in range(2000)])
    counts = collections.Counter(g.token_ids[0] for g in gens)
    mu = {g.token_ids[0]: math.exp(g.logprobs[0]) for g in gens}
    assert len(counts) <= 5 and abs(sum(mu.values()) - 1.0) < 1e-4  # every top-5 token was drawn at least once
    assert 0.5 * sum(abs(counts[t] / 2000 - p) for t, p in mu.items()) < 0.05


def test_seeded_episodes_replay_whatever_the_concurrency(chatty_policy):
    """Episodes with a ``EpisodeSpec.sampling_seed`` are the same token for token whether they run one at a time or three
    at once (batched differently every turn): what evaluation relies on to pair two evaluations' draws."""
    from agentenv.core.runtime import EpisodeSpec

    def play(concurrency):
        cfg = RolloutConfig(max_turns=3, max_total_tokens=400, concurrency=concurrency,
                            sampling=SamplingParams(temperature=1.0, max_new_tokens=16))
        tasks = [EpisodeSpec(seed=i % 2, sampling_seed=100 + i) for i in range(5)]
        trajs = run_episodes(lambda: gym.make("agentenv/GuessNumber-v0"), chatty_policy, 5, cfg, tasks=tasks)
        return {t.meta["sampling_seed"]: t.token_ids for t in trajs}

    one, three = play(1), play(3)
    assert sorted(one) == list(range(100, 105)) and one == three
    assert len({tuple(v) for v in one.values()}) == 5  # same game (seed i % 2), other draws


def test_non_finite_logits_are_a_clear_error(chatty_policy):
    """A model whose forward yields NaN (broken weights) makes generate raise a ValueError that says so, rather
    than drawing an out-of-range id; the runtime records it as the episode's policy_error."""
    import copy

    from agentenv.samplers.hf_policy import HFPolicy

    model = copy.deepcopy(chatty_policy.model)
    with torch.no_grad():
        model.get_output_embeddings().weight.fill_(float("nan"))
    policy = HFPolicy(model, chatty_policy.tokenizer, seed=0)
    with pytest.raises(ValueError, match="not finite"):
        policy.generate([GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=4))])


def test_replica_samples_alone_and_keeps_its_own_weights(chatty_policy):
    """A replica holds a copy of the weights at the same version: the same seeded draws as the original, and a
    later weight load on the original changes nothing in the replica (two threads can sample at once)."""
    src = _clone(chatty_policy)
    src.load_weights(src.model.state_dict(), version=7)
    twin = src.replica(1)
    assert twin.policy_version == 7 and twin.model is not src.model
    req = [GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=8), seed=11)]
    assert twin.generate(req)[0].token_ids == src.generate(req)[0].token_ids
    before = {k: v.clone() for k, v in twin.model.state_dict().items()}
    src.load_weights({k: torch.zeros_like(v) for k, v in src.model.state_dict().items()})
    assert src.policy_version == 8 and twin.policy_version == 7
    assert all(torch.equal(before[k], v) for k, v in twin.model.state_dict().items())


def test_evaluation_on_two_samplers_plays_what_one_plays(chatty_policy):
    """eval.samplers=2 deals the plays to the policy and a replica on two threads: every seeded play is the same
    episode token for token (to float rounding: see below), the summary is the same, and the process's torch threads
    are restored."""
    from agentenv.core.config import ConfigError, load_config
    from agentenv.run.evaluation import _play, evaluate
    from agentenv.core.turns import mix_seed

    def cfg(samplers):
        return load_config("text_env", overrides=[
            "env.id=guess", "env.num_tasks=3", "eval.samples=2", "rollout.max_turns=3", "rollout.max_new_tokens=16",
            "rollout.max_total_tokens=400", f"eval.samplers={samplers}"])

    from agentenv.run.episodes import EpisodeSet

    def plays(samplers):
        episodes = EpisodeSet.of(cfg(samplers), None, eval=True, samples=2)
        for t in episodes.tasks:
            t.sampling_seed = mix_seed(0, None, t.meta["task"], t.meta["sample"])
        return {(t.meta["task"], t.meta["sample"]): t.token_ids
                for t in _play(cfg(samplers), chatty_policy, episodes, progress=False)}

    def asked(policy):  # turns the policy itself was asked to sample
        return policy.prefix_cache.hits + policy.prefix_cache.misses

    threads = torch.get_num_threads()
    n0 = asked(chatty_policy)
    one = plays(1)
    n1 = asked(chatty_policy)
    two = plays(2)
    n2 = asked(chatty_policy)
    def same_to_rounding(x: list, y: list) -> bool:
        """Equal, or equal up to one draw that fell on the boundary between two adjacent ids. Batches of another
        shape (3 plays per sampler, not 6) and prefix-cache hits can change a logit in its last bits; the random
        model's distribution is nearly flat over 151k ids, so a seeded uniform within ~1e-7 of a cumulative-probability
        boundary then picks the neighbouring id (inverse-CDF sampling), and the episodes part there. A real fault
        (the replica's weights, a play dealt the wrong seed) changes the draws, not one id by one."""
        if x == y:
            return True
        j = next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
        return j is not None and abs(x[j] - y[j]) == 1

    assert len(one) == 6 and one.keys() == two.keys()
    assert all(same_to_rounding(one[k], two[k]) for k in one), [k for k in one if one[k] != two[k]]
    assert sum(one[k] == two[k] for k in one) >= 5
    assert 0 < n2 - n1 < n1 - n0  # with two samplers the replica played some of the turns
    assert len({tuple(v) for v in one.values()}) == 6
    a, b = evaluate(cfg(1), chatty_policy, progress=False), evaluate(cfg(2), chatty_policy, progress=False)
    for m in (a, b):
        m.pop("wall_s")
    assert a.keys() == b.keys() and a["episodes"] == b["episodes"] == 6 and a["successes"] == b["successes"]
    assert torch.get_num_threads() == threads
    with pytest.raises(ConfigError, match="eval.samplers"):
        load_config("text_env", overrides=["model.backend=vllm", "eval.samplers=2"])
