"""SFT: demos tokenized through ChatSequence match what the runtime builds; the loss covers only policy tokens."""

import gymnasium as gym
import pytest
import torch

import agentenv  # noqa: F401
from agentenv.core.chat import ChatSequence
from agentenv.run.demo import ENV_ID, SYSTEM_PROMPT, TOOL_DOC, demo_tasks, demo_trajectories, scripted_demo, tool_schemas
from agentenv.core.policy import Generation
from agentenv.run.sft import SFTConfig, prepare_demos, sft_loss, train_sft, trajectory_from_messages
from agentenv.samplers.tiny import TinyConfig, qwen_tokenizer, tiny_model
from agentenv.core.trajectory import Trajectory


@pytest.fixture(scope="module")
def tok():
    return qwen_tokenizer()


def test_demo_tokens_equal_a_runtime_sequence(tok):
    task = demo_tasks(1, seed=3)[0]
    msgs = scripted_demo(task, True, __import__("random").Random(0))
    prompt = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.question}]
    t = trajectory_from_messages(tok, prompt + msgs, tool_schemas())
    # The same chat built turn by turn as the runtime does (sampled tokens + template deltas)
    seq = ChatSequence(tok)
    seq.start(prompt, tool_schemas())
    for m in msgs:
        if m["role"] == "assistant":
            ids = tok(m["content"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            seq.add_sampled(Generation(ids, [0.0] * len(ids), "stop"))
        else:
            seq.add_message(m["role"], m["content"])
    assert t.token_ids == seq.token_ids and t.action_mask == seq.action_mask
    t.validate()
    text = tok.decode([i for i, m in zip(t.token_ids, t.action_mask) if m])
    assert "<tool_call>" in text and f"\\boxed{{{task.answer}}}" in text and "<|im_end|>" in text
    assert task.answer not in tok.decode([i for i, m in zip(t.token_ids, t.action_mask) if not m]).split("user")[1]


def test_demo_env_shows_the_same_tools_and_grades_the_demo():
    env = gym.make(ENV_ID, tasks=[t.__dict__ for t in demo_tasks(2)], system_prompt=SYSTEM_PROMPT, tool_doc=TOOL_DOC,
                   backend="subprocess")
    try:
        _, info = env.reset(options={"task_index": 0})
        assert info["tools"] == tool_schemas() and info["system"] == SYSTEM_PROMPT
        task = demo_tasks(2)[0]
        msgs = scripted_demo(task, True, __import__("random").Random(0))
        obs, *_ = env.step(msgs[0]["content"])
        assert obs == msgs[1]["content"]  # the scripted tool output is the real tool output
        _, reward, terminated, _, info = env.step(msgs[2]["content"])
        assert reward == 1.0 and terminated and info["tool_call_before_answer"]
    finally:
        env.close()


def test_easy_questions_are_answered_right_without_the_tool():
    """The ablations' task family: an easy question is A * 100, so the scripted no-tool guess earns the reward there
    (the env grades it), while the default demo has no easy question and keeps its question sequence."""
    import random

    from agentenv.core.config import load_config
    from agentenv.run.demo import is_heldout
    from agentenv.run.episodes import env_kwargs

    mixed = demo_tasks(400, seed=7, easy_fraction=0.5)
    easy = [t for t in mixed if t.type == "multiply_easy"]
    assert 140 <= len(easy) <= 260 and all(t.question.endswith(" * 100") for t in easy)
    tok = qwen_tokenizer()  # the same token count as a hard question: a tiny model copies A at the same offsets
    assert {len(tok.encode(t.question)) for t in mixed} == {12}
    held = demo_tasks(50, seed=0, split="heldout", easy_fraction=0.5)
    assert all(is_heldout(*map(int, t.question[8:].rstrip("?").split(" * "))) for t in held)
    assert all(t.type == "multiply" for t in demo_tasks(200, seed=7))
    pair = [easy[0], next(t for t in mixed if t.type == "multiply")]
    env = gym.make(ENV_ID, tasks=[t.__dict__ for t in pair], system_prompt=SYSTEM_PROMPT, tool_doc=TOOL_DOC,
                   backend="subprocess")
    try:
        rewards = []
        for index, task in enumerate(pair):
            env.reset(options={"task_index": index})
            _, reward, terminated, _, _ = env.step(scripted_demo(task, False, random.Random(0))[0]["content"])
            assert terminated
            rewards.append(reward)
        assert rewards == [1.0, 0.0]
    finally:
        env.close()
    cfg = load_config("demo", [], ["env.demo_easy_fraction=0.3"])
    types = {t["type"] for t in env_kwargs(cfg, "heldout")["tasks"]} | {t["type"] for t in env_kwargs(cfg)["tasks"]}
    assert types == {"multiply", "multiply_easy"}
    assert {t["type"] for t in env_kwargs(load_config("demo", [], []))["tasks"]} == {"multiply"}
    with pytest.raises(Exception, match="env.tasks=demo"):
        load_config("python_tool", [], ["env.demo_easy_fraction=0.3"])


def test_the_warm_starts_demos_ask_what_rl_asks(qwen_tok):
    """With easy questions in the RL mix, the scripted SFT demos hold them too (both paths, the guess right on them),
    so the warm start has seen their layout; the default mix is unchanged, question for question."""
    mixed = demo_trajectories(qwen_tok, 200, tool_fraction=0.3, easy_fraction=0.3)
    easy = [t for t in mixed if t.task_type == "multiply_easy"]
    assert 30 <= len(easy) <= 100 and {t.meta["demo_kind"] for t in easy} == {"tool", "guess"}
    guess = next(t for t in easy if t.meta["demo_kind"] == "guess")
    a = qwen_tok.decode(guess.token_ids).split("What is ")[-1].split(" * ")[0]
    assert "* 100<|im_end|>" in qwen_tok.decode(guess.token_ids)
    assert f"\\boxed{{{int(a) * 100}}}" in qwen_tok.decode(guess.token_ids)  # the guess is the right answer there
    plain = [qwen_tok.decode(t.token_ids) for t in demo_trajectories(qwen_tok, 50, tool_fraction=0.3)]
    assert plain == [qwen_tok.decode(t.token_ids) for t in demo_trajectories(qwen_tok, 50, tool_fraction=0.3,
                                                                             easy_fraction=0.0)]
    assert all(t.task_type == "multiply" for t in demo_trajectories(qwen_tok, 50, tool_fraction=0.3))


def test_tool_fraction_and_wrong_direct_answers(tok):
    demos = demo_trajectories(tok, 40, tool_fraction=0.25, seed=5)
    share = sum(d.num_tool_calls > 0 for d in demos) / len(demos)
    assert 0.1 <= share <= 0.45
    for d in demos:
        if d.num_tool_calls == 0:
            answer = d.messages[-1]["content"]
            q = d.messages[1]["content"].removeprefix("What is ").removesuffix("?").split(" * ")
            assert answer != f"\\boxed{{{int(q[0]) * int(q[1])}}}"


def test_prepare_demos_tokenizes_text_trajectories_and_skips_failures(tok):
    ok = Trajectory(messages=[{"role": "user", "content": "go"}, {"role": "assistant", "content": "<action>look</action>"},
                              {"role": "user", "content": "You won."}], success=True)
    bad = Trajectory(messages=ok.messages, success=False)
    out = prepare_demos([ok, bad], tok)
    assert len(out) == 1 and out[0].action_mask[-1] and sum(out[0].action_mask) > 2


def test_sft_reduces_loss_on_policy_tokens_only(tok):
    torch.manual_seed(0)
    model = tiny_model(TinyConfig())
    demos = demo_trajectories(tok, 8, tool_fraction=0.5, seed=1)
    from agentenv.trainer.batch import collate

    b = collate(demos, pad_token_id=model.config.pad_token_id)
    before = sft_loss(model, b).item()
    r = train_sft(model, demos, SFTConfig(epochs=6, lr=3e-3, batch_size=8, warmup_steps=1), progress=False)
    after = sft_loss(model, b).item()
    assert r["steps"] == 6 and after < before - 0.5


def _tool_first_prob(model, tok, questions) -> float:
    """Mean probability that the model's first token answers a demo question with a tool call."""
    from agentenv.core.chat import ChatSequence

    call = tok.convert_tokens_to_ids("<tool_call>")
    probs = []
    with torch.no_grad():
        for q in questions:
            seq = ChatSequence(tok)
            seq.start([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}], tool_schemas())
            logits = model(torch.tensor([seq.token_ids])).logits[0, -1]
            probs.append(torch.softmax(logits.float(), -1)[call].item())
    return sum(probs) / len(probs)


def test_sft_learns_the_mix_of_two_demo_kinds_of_different_length():
    """The regression behind the CPU demo's collapse: length-sorted batches held one demo kind each (tool demos are
    longer), so the first-token decision -- call the tool or answer -- swung with every step and ended near 0. Each
    batch must be an unbiased sample: after SFT on a 30% tool mix the model calls the tool about 30% of the time."""
    from agentenv.samplers.models import resolve_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model("tiny-bpe").path
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    demos = demo_trajectories(tok, 480, tool_fraction=0.3, seed=3)
    r = train_sft(model, demos, SFTConfig(epochs=2, lr=2e-3, batch_size=16, seed=0), progress=False)
    questions = [t.question for t in demo_tasks(24, seed=9, split="heldout")]
    p = _tool_first_prob(model, tok, questions)
    assert 0.15 <= p <= 0.5, f"P(tool call first) = {p:.3f} after SFT on a 30% tool mix"
    assert set(r["epochs"][-1]["by_kind"]) == {"tool", "guess"}
    assert r["loss_last"] < r["loss_first"]


def test_microbatches_within_a_step_give_the_full_batch_gradient():
    from agentenv.run.sft import backward_batch
    from agentenv.samplers.tiny import small_tokenizer
    from agentenv.trainer.batch import collate

    stok = small_tokenizer()
    batch = collate(demo_trajectories(stok, 8, tool_fraction=0.5, seed=4), pad_token_id=0)
    grads, stats = [], []
    for budget in (None, 300):  # 300 tokens: one or two rows per micro-batch
        model = tiny_model(TinyConfig(vocab="small"))
        stats.append(backward_batch(model, batch, SFTConfig(max_tokens_per_microbatch=budget, context_loss_weight=0.5)))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        if budget is None:
            model.zero_grad()
            (sft_loss(model, batch, 0.5)).backward()
            assert torch.allclose(grads[0], torch.cat([p.grad.flatten() for p in model.parameters()]), atol=1e-7)
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4)
    assert stats[0][1] == stats[1][1] and stats[0][0] == pytest.approx(stats[1][0], rel=1e-5)


def test_sft_reports_epoch_means_per_kind_and_a_heldout_nll(tok):
    from agentenv.run.sft import demo_nll

    model = tiny_model(TinyConfig(vocab="small"))
    from agentenv.samplers.tiny import small_tokenizer

    stok = small_tokenizer()
    demos = demo_trajectories(stok, 32, tool_fraction=0.5, seed=6)
    held = demo_trajectories(stok, 8, tool_fraction=0.5, seed=7, split="heldout")
    lines = []
    r = train_sft(model, demos, SFTConfig(epochs=2, lr=3e-3, batch_size=8, warmup_steps=1), progress=False,
                  heldout=held, echo=lines.append)
    assert [e["epoch"] for e in r["epochs"]] == [1, 2] and len(r["heldout"]) == 2
    e = r["epochs"][0]
    n = {k: v["demos"] for k, v in e["by_kind"].items()}
    assert sum(n.values()) == 32 and set(n) == {"tool", "guess"}
    assert r["loss_first"] == e["loss"] and r["loss_last"] == r["epochs"][-1]["loss"]
    again = demo_nll(model, held)
    assert again["all"]["nll"] == pytest.approx(r["heldout"][-1]["all"]["nll"], rel=1e-5)
    assert {"tool", "guess", "all"} == set(again) and again["all"]["demos"] == 8
    assert len(lines) == 2 and lines[1].startswith("sft epoch 2/2: train loss") and "held-out NLL" in lines[1]
    assert not {d.task for d in held} & {d.task for d in demos}


def test_demo_questions_split_into_train_and_heldout_sides():
    from agentenv.run.demo import is_heldout

    train, held = demo_tasks(400, seed=0), demo_tasks(100, seed=0, split="heldout")
    assert len({t.question for t in train}) == 400 and len({t.question for t in held}) == 100
    assert not {t.question for t in train} & {t.question for t in held}
    assert all(is_heldout(*map(int, t.question[8:].rstrip("?").split(" * "))) for t in held)
    assert 0.08 < sum(is_heldout(a, b) for a in range(3000, 3400) for b in range(34, 100)) / (400 * 66) < 0.17
    with pytest.raises(ValueError, match="splits"):
        demo_tasks(1, split="valid")


def test_sft_cosine_schedule_decays_to_the_floor():
    from agentenv.run.sft import _lr_factor

    cfg = SFTConfig(schedule="cosine", warmup_steps=10, min_lr_ratio=0.1)
    factors = [_lr_factor(cfg, s, 100) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[9:], factors[10:])) and factors[-1] == pytest.approx(0.1)
    assert all(_lr_factor(SFTConfig(), s, 100) == 1.0 for s in range(10, 100))
    with pytest.raises(ValueError, match="schedule"):
        _lr_factor(SFTConfig(schedule="linear"), 50, 100)
