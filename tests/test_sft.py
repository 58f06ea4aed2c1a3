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


@pytest.mark.parametrize("n,batch_size", [(1, 8), (37, 4), (300, 8)])
def test_length_grouped_batches_cover_every_demo_once_with_little_padding(n, batch_size):
    import random

    from agentenv.run.sft import _length_grouped_batches

    rng = random.Random(n)
    demos = [Trajectory(token_ids=[1] * rng.randrange(50, 1200)) for _ in range(n)]
    lengths = [len(d.token_ids) for d in demos]
    batches = _length_grouped_batches(demos, batch_size, random.Random(0))
    assert sorted(i for b in batches for i in b) == list(range(n))
    assert all(1 <= len(b) <= batch_size for b in batches)
    assert batches != _length_grouped_batches(demos, batch_size, random.Random(1)) or n == 1  # the seed shuffles
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches) / sum(lengths)
    order = list(range(n))
    random.Random(0).shuffle(order)
    plain = sum(max(lengths[i] for i in order[s:s + batch_size]) * len(order[s:s + batch_size])
                for s in range(0, n, batch_size)) / sum(lengths)
    assert padded <= plain and (n < 100 or padded < 1.1 < plain)


def test_sft_cosine_schedule_decays_to_the_floor():
    from agentenv.run.sft import _lr_factor

    cfg = SFTConfig(schedule="cosine", warmup_steps=10, min_lr_ratio=0.1)
    factors = [_lr_factor(cfg, s, 100) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[9:], factors[10:])) and factors[-1] == pytest.approx(0.1)
    assert all(_lr_factor(SFTConfig(), s, 100) == 1.0 for s in range(10, 100))
    with pytest.raises(ValueError, match="schedule"):
        _lr_factor(SFTConfig(schedule="linear"), 50, 100)
