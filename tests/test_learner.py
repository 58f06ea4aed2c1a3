"""The Learner on the tiny Qwen2 model (real 151,665 vocab): stats, one step per fresh batch, micro-batch
equivalence, checkpoint/resume, schedules, weight export, and batching."""

import copy
import dataclasses
import math
import pickle
import random

import pytest
import torch

from agentenv.core.config import FlashReinforceLoss, LossConfig
from agentenv.core.trajectory import Trajectory
from agentenv.samplers.tiny import QWEN25_VOCAB_SIZE, TinyConfig, tiny_model
from agentenv.trainer import Learner, LearnerConfig, collate, microbatches, token_log_probs
from agentenv.trainer import checkpoint as ckpt
from agentenv.trainer.schedule import Schedule, constant, cosine_with_min_lr

NO_TRUST = FlashReinforceLoss(no_trust=True)  # every row admitted


SHAPE = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32)


@pytest.fixture(scope="module")
def real_vocab():
    """The built-in tiny model: real Qwen2.5 vocabulary (151,665), small body."""
    return tiny_model(TinyConfig(**SHAPE, seed=2))


@pytest.fixture(scope="module")
def base():
    """The same Qwen2 architecture with a 2,048-token vocabulary, for tests whose point is not the vocabulary size
    (keeps the suite fast on a shared 2-core machine)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(2)
    cfg = Qwen2Config(vocab_size=2048, max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=0, **SHAPE)
    return Qwen2ForCausalLM(cfg).eval()


def make_trajectories(model, n, seed, *, drift=0.02, with_ids=True):
    """Multi-turn-shaped trajectories: a prompt, then sampled turns separated by observation tokens. Behaviour
    log-probs are the model's own, perturbed by ``drift`` (a slightly stale sampler)."""
    rng = random.Random(seed)
    trajs = []
    for i in range(n):
        length = rng.randint(8, 28)
        ids = [rng.randrange(model.config.vocab_size) for _ in range(length)]
        mask, t = [False] * length, rng.randint(2, 4)
        while t < length:  # alternate sampled turns and observations
            turn = rng.randint(2, 6)
            for j in range(t, min(length, t + turn)):
                mask[j] = True
            t += turn + rng.randint(1, 4)
        reward = rng.choice([0.0, 1.0, 0.5])
        trajs.append(Trajectory(token_ids=ids, action_mask=mask, behavior_logprobs=[0.0] * length,
                                policy_version=[0 if m else -1 for m in mask], reward=reward, success=reward == 1.0,
                                task=f"task{i % 3}", id=f"traj-{seed}-{i}" if with_ids else ""))
    batch = collate(trajs)
    with torch.no_grad():
        lp, _ = token_log_probs(model, batch.input_ids, batch.attention_mask, batch.action_mask)
    for i, traj in enumerate(trajs):
        traj.behavior_logprobs = [min(0.0, float(lp[i, j]) + drift * rng.uniform(-1, 1)) if m else 0.0
                                  for j, m in enumerate(traj.action_mask)]
    return trajs


def params_of(learner):
    return [p.detach().clone() for p in learner.model.parameters()]


def capture_grads(learner):
    grads = []
    learner.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: grads.append([p.grad.clone() for g in opt.param_groups for p in g["params"]]))
    return grads


STAT_KEYS = {"loss", "adv_mean", "adv_std", "acceptance_rate", "num_admitted", "seq_kl_mean", "seq_kl_max",
             "ratio_mean", "ratio_max", "ratio_min", "policy_tokens", "retained_tokens", "grad_norm", "lr", "step",
             "policy_version", "num_trajectories", "num_microbatches", "learner_time_s", "reward_mean",
             "policy_lag_mean", "policy_lag_max"}


def test_update_reports_stats_steps_once_and_bumps_the_version(real_vocab):
    base = real_vocab
    learner = Learner(copy.deepcopy(base), LearnerConfig(compute_entropy=True))
    trajs = make_trajectories(base, 6, seed=0)
    before = params_of(learner)
    stats = learner.update(trajs)
    assert STAT_KEYS | {"entropy_mean"} <= set(stats)
    assert stats["step"] == stats["policy_version"] == learner.step == learner.policy_version == 1
    assert stats["num_trajectories"] == 6 and stats["num_microbatches"] == 1
    assert stats["policy_tokens"] == sum(t.num_policy_tokens for t in trajs) == stats["retained_tokens"]
    assert stats["acceptance_rate"] == 1.0 and 0 < stats["seq_kl_max"] < 3e-3
    assert stats["lr"] == 1e-6 and stats["grad_norm"] > 0 and stats["learner_time_s"] > 0
    assert abs(stats["adv_mean"]) < 1e-6 and stats["adv_std"] > 0  # float32 advantages
    assert 0.9 < stats["ratio_min"] <= stats["ratio_mean"] <= stats["ratio_max"] < 1.1
    assert 11 < stats["entropy_mean"] < math.log(QWEN25_VOCAB_SIZE) + 1e-3  # near-uniform fresh model
    assert all(isinstance(v, (int, float)) for k, v in stats.items() if k != "admitted")
    assert stats["admitted"] == [True] * len(trajs)  # acceptance_rate is 1.0
    after = params_of(learner)
    assert any(not torch.equal(a, b) for a, b in zip(before, after))
    learner.update(make_trajectories(base, 3, seed=1))
    assert learner.step == learner.policy_version == 2


def test_a_trajectory_is_never_used_twice(base):
    learner = Learner(copy.deepcopy(base))
    first = make_trajectories(base, 3, seed=0)
    learner.update(first)
    snapshot = params_of(learner)
    fresh = make_trajectories(base, 3, seed=1)
    for bad in (first, fresh[:2] + first[:1], fresh + fresh[:1]):
        with pytest.raises(ValueError, match="already used"):
            learner.update(bad)
    assert learner.step == 1 and all(torch.equal(a, b) for a, b in zip(snapshot, params_of(learner)))
    learner.update(fresh)  # still fresh: the refusals above consumed nothing
    # without ids, the content identifies a trajectory
    anon = make_trajectories(base, 2, seed=2, with_ids=False)
    learner.update(anon)
    with pytest.raises(ValueError, match="already used"):
        learner.update([copy.deepcopy(anon[0])])


@pytest.mark.parametrize("overrides, vocab", [
    ({}, "real"),
    ({"loss": FlashReinforceLoss(negative_token_fraction=0.5, token_mean=True, no_is=True)}, "small"),
    ({"loss": "grpo"}, "small"),
])
def test_micro_batched_update_equals_the_full_batch_update(base, real_vocab, overrides, vocab):
    base = real_vocab if vocab == "real" else base
    trajs = make_trajectories(base, 6, seed=3, drift=0.05)
    results = []
    for budget in (None, 50):
        cfg = LearnerConfig(lr=1e-3, max_tokens_per_microbatch=budget, **overrides)
        learner = Learner(copy.deepcopy(base), cfg)
        grads = capture_grads(learner)
        stats = learner.update(trajs)
        results.append((stats, grads[0], params_of(learner)))
    (full_stats, full_grads, full_params), (mb_stats, mb_grads, mb_params) = results
    assert mb_stats["num_microbatches"] > 2 and full_stats["num_microbatches"] == 1
    for a, b in zip(mb_grads, full_grads):  # float32: the tied embedding's gradient sums 151,665-wide softmaxes
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
    for a, b in zip(mb_params, full_params):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    for k in ("loss", "grad_norm", "ratio_mean", "retained_tokens", "policy_tokens", "adv_std"):
        assert mb_stats[k] == pytest.approx(full_stats[k], rel=1e-5, abs=1e-7), k


def test_gradient_checkpointing_gives_the_same_update(base):
    trajs = make_trajectories(base, 4, seed=4)
    out = []
    for gc in (False, True):
        learner = Learner(copy.deepcopy(base), LearnerConfig(lr=1e-3, gradient_checkpointing=gc))
        stats = learner.update(trajs)
        out.append((stats["grad_norm"], params_of(learner)))
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-6)
    for a, b in zip(out[0][1], out[1][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_all_rejected_batch_gives_zero_gradient(base):
    trajs = make_trajectories(base, 3, seed=5)
    for t in trajs:  # the sampler was sure of every token; the learner's policy is near-uniform: huge drift
        t.behavior_logprobs = [-0.01 if m else 0.0 for m in t.action_mask]
    learner = Learner(copy.deepcopy(base))
    stats = learner.update(trajs)
    assert stats["acceptance_rate"] == 0.0 and stats["retained_tokens"] == 0 and stats["grad_norm"] == 0.0
    assert math.isnan(stats["ratio_mean"])
    # ...and the optimizer is left untouched: no AdamW momentum / weight-decay drift on a batch with no signal.
    # Changed on purpose (issue 12): policy_version names the weights, so a skipped step keeps it; step counts updates
    assert stats["optimizer_step_skipped"] == 1 and stats["policy_version"] == 0 and stats["step"] == 1
    assert stats["admitted"] == [False, False, False]
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    learner.update([dataclasses.replace(t, id=t.id + "-again") for t in trajs])
    assert all(torch.equal(before[k], v) for k, v in learner.model.state_dict().items())
    assert not learner.optimizer.state  # Adam never stepped
    # the no_trust ablation admits them, and the importance ratio pi/mu ~ 1e-5 shows it
    stats = Learner(copy.deepcopy(base), LearnerConfig(loss=NO_TRUST)).update(trajs)
    assert stats["acceptance_rate"] == 1.0 and stats["ratio_max"] < 1e-2


def test_failure_filter_in_the_learner(base):
    trajs = make_trajectories(base, 6, seed=6)
    assert any(not t.success for t in trajs)
    stats = Learner(copy.deepcopy(base), LearnerConfig(loss=FlashReinforceLoss(negative_token_fraction=0.25))).update(trajs)
    want = sum(t.num_policy_tokens if t.success else math.ceil(0.25 * t.num_policy_tokens) for t in trajs)
    assert stats["retained_tokens"] == want < stats["policy_tokens"]
    assert "entropy_mean" in stats


# --- checkpoint / resume ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["directory", "state_dict"])  # a run's checkpoint (DCP files); in memory
def test_resume_gives_the_same_next_update_bitwise(base, tmp_path, form):
    cfg = LearnerConfig(lr=1e-3, schedule="cosine", total_steps=5, warmup_ratio=0.4)
    b1, b2 = make_trajectories(base, 4, seed=7), make_trajectories(base, 4, seed=8)
    a = Learner(copy.deepcopy(base), cfg)
    a.update(b1)
    path = tmp_path / "ckpt" / "learner.pt"
    a.save(path.parent) if form == "directory" else ckpt.atomic_save(a.state_dict(), path)
    draw_after_save = torch.rand(4)
    stats_a = a.update(b2)

    other = copy.deepcopy(base)
    with torch.no_grad():
        for p in other.parameters():
            p.normal_()  # different weights: everything must come from the checkpoint
    b = Learner(other, cfg)
    b.load(path.parent) if form == "directory" else b.load_state_dict(ckpt.load(path))
    assert torch.equal(torch.rand(4), draw_after_save)  # RNG restored
    assert (b.step, b.policy_version) == (1, 1)
    stats_b = b.update(b2)
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
    for k in set(stats_a) - {"learner_time_s"}:
        assert stats_a[k] == stats_b[k] or (math.isnan(stats_a[k]) and math.isnan(stats_b[k])), k
    assert stats_b["lr"] == pytest.approx(1e-3 * cfg.lr_schedule()(1))  # the schedule resumed at step 1
    with pytest.raises(ValueError, match="already used"):
        b.update(b1)  # the consumed set survives the checkpoint
    files = {"directory": [".metadata", "__0_0.distcp", "state.pt"], "state_dict": ["learner.pt"]}[form]
    assert sorted(p.name for p in path.parent.iterdir()) == files  # no temp file left behind


def test_tail_average_is_the_mean_of_the_weights_after_each_of_the_last_n_updates(base, tmp_path):
    cfg = LearnerConfig(lr=1e-2, weight_decay=0.0, total_steps=5, average_last_updates=3)
    batches = [make_trajectories(base, 4, seed=20 + i, drift=0.0) for i in range(5)]
    a = Learner(copy.deepcopy(base), cfg)
    after = []
    for i, b in enumerate(batches):
        a.update(b)
        after.append(params_of(a))
        assert a.average.count == max(0, i + 1 - 2)  # updates 3, 4, 5 are the window
        if i == 2:
            ckpt.atomic_save(a.state_dict(), tmp_path / "mid.pt")  # one update into the window
    assert not all(torch.equal(x, y) for x, y in zip(after[2], after[4]))  # the weights moved: a mean means something
    expected = [torch.stack(ws).double().mean(0).float() for ws in zip(*after[2:])]
    version = a.policy_version
    assert a.use_average() == 3
    assert a.policy_version == version + 1  # new weights, new name
    for got, want in zip(params_of(a), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert a.use_average() == 0  # the window is empty again: nothing changes

    # a learner resumed inside the window averages the same updates (the running mean is in the checkpoint)
    b = Learner(copy.deepcopy(base), cfg)
    b.load_state_dict(ckpt.load(tmp_path / "mid.pt"))
    assert b.average.count == 1
    for batch in batches[3:]:
        b.update(batch)
    assert b.use_average() == 3
    for got, want in zip(params_of(b), params_of(a)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_tail_average_off_or_one_update_leaves_the_weights(base):
    for n in (0, 1):
        learner = Learner(copy.deepcopy(base), LearnerConfig(lr=1e-2, total_steps=2, average_last_updates=n))
        for seed in (30, 31):
            learner.update(make_trajectories(base, 3, seed=seed))
        before, version = params_of(learner), learner.policy_version
        assert learner.use_average() == n
        assert learner.policy_version == version and all(map(torch.equal, before, params_of(learner)))
    with pytest.raises(ValueError, match="average_last_updates needs total_steps"):
        LearnerConfig(average_last_updates=4)


def test_atomic_save_never_leaves_a_partial_file(tmp_path):
    path = tmp_path / "x.pt"
    ckpt.atomic_save({"v": torch.arange(3)}, path)
    with pytest.raises((AttributeError, TypeError, pickle.PicklingError)):
        ckpt.atomic_save({"v": torch.arange(5), "bad": lambda: 0}, path)  # pickling fails half-way through
    assert torch.equal(ckpt.load(path)["v"], torch.arange(3))
    assert [p.name for p in tmp_path.iterdir()] == ["x.pt"]


# --- schedules ----------------------------------------------------------------------------------------------------


def test_schedules():
    assert [constant()(s) for s in (0, 5, 10**6)] == [1.0, 1.0, 1.0]
    cos = cosine_with_min_lr(100)  # warmup round(3.0) = 3 updates
    assert cos.warmup_steps == 3
    assert [cos(s) for s in range(4)] == [1 / 3, 2 / 3, 1.0, 1.0]
    assert cos(99) == pytest.approx(0.1) and cos(500) == pytest.approx(0.1)
    mid = 3 + (99 - 3) / 2
    assert cos(int(mid)) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (int(mid) - 3) / 96)))
    values = [cos(s) for s in range(3, 100)]
    assert all(x >= y for x, y in zip(values, values[1:]))
    with pytest.raises(ValueError, match="total_steps"):
        Schedule("cosine")
    with pytest.raises(ValueError, match="unknown schedule"):
        Schedule("linear")
    with pytest.raises(ValueError, match="loss must be one of .*'grpo'.*got 'ppo'"):
        LearnerConfig(loss="ppo")
    with pytest.raises(ValueError, match="clip_eps"):
        LearnerConfig(loss={"type": "grpo", "clip_eps": 0})


# --- weights for rollout workers ----------------------------------------------------------------------------------


def test_export_weights_is_an_independent_copy_that_reloads(base):
    learner = Learner(copy.deepcopy(base))
    weights = learner.export_weights()
    assert set(weights) == set(learner.model.state_dict())
    first = {k: v.clone() for k, v in weights.items()}
    learner.update(make_trajectories(base, 3, seed=9))
    assert all(torch.equal(weights[k], first[k]) for k in weights)  # the copy did not move with the model
    fresh = copy.deepcopy(base)
    fresh.load_state_dict(learner.export_weights())
    ids = torch.tensor([[1, 2, 3, 2047]])
    assert torch.equal(fresh(input_ids=ids).logits, learner.model.eval()(input_ids=ids).logits)
    names = [n for n, _ in learner.named_weights()]
    assert names == [n for n, _ in learner.model.named_parameters()]


# --- batching -----------------------------------------------------------------------------------------------------


def test_collate_pads_and_flags_failures():
    t1 = Trajectory(token_ids=[5, 6, 7], action_mask=[False, True, True], behavior_logprobs=[0.0, -1.0, -2.0],
                    policy_version=[-1, 0, 0], reward=1.0, success=True, task="a", id="1")
    t2 = Trajectory(token_ids=[8, 9], action_mask=[False, True], behavior_logprobs=[0.0, -0.5],
                    policy_version=[-1, 0], reward=0.4, success=False, task="b", id="2", meta={"group_id": "g"})
    b = collate([t1, t2], pad_token_id=151643)
    assert b.input_ids.tolist() == [[5, 6, 7], [8, 9, 151643]]
    assert b.attention_mask.tolist() == [[True] * 3, [True, True, False]]
    assert b.action_mask.tolist() == [[False, True, True], [False, True, False]]
    assert b.behavior_log_probs.tolist() == [[0.0, -1.0, -2.0], [0.0, -0.5, 0.0]]
    assert b.failures.tolist() == [False, True] and b.group_ids == ["a", "g"] and b.ids == ["1", "2"]
    assert collate([t1, t2], failure_threshold=0.5).failures.tolist() == [False, True]
    assert collate([t1, t2], failure_threshold=0.3).failures.tolist() == [False, False]
    bad = copy.deepcopy(t2)
    bad.action_mask = [True, True]
    bad.behavior_logprobs = [-0.1, -0.5]
    bad.policy_version = [0, 0]
    with pytest.raises(ValueError, match="first token"):
        collate([bad])
    bad.action_mask, bad.behavior_logprobs, bad.policy_version = [False, False], [0.0, 0.0], [-1, -1]
    with pytest.raises(ValueError, match="no policy token"):
        collate([bad])
    with pytest.raises(ValueError, match="empty"):
        collate([])
    with pytest.raises(ValueError, match="trajectory 0"):
        collate([Trajectory(token_ids=[1, 2], action_mask=[False, True], behavior_logprobs=[0.0, 0.5],
                            policy_version=[-1, 0])])


def test_microbatches_cover_every_row_once_within_budget(base):
    batch = collate(make_trajectories(base, 9, seed=10))
    lengths = batch.lengths.tolist()
    for budget in (1, 30, 60, 10**6):
        groups = microbatches(batch, budget)
        rows = sorted(r for g, _ in groups for r in g)
        assert rows == list(range(9))
        for g, mb in groups:
            width = max(lengths[r] for r in g)
            assert mb.input_ids.shape == (len(g), width)
            assert len(g) == 1 or len(g) * width <= budget
            assert torch.equal(mb.action_mask, batch.action_mask[g, :width])
    assert len(microbatches(batch, 10**6)) == 1 and len(microbatches(batch, 1)) == 9


def test_bf16_autocast_path_runs_on_cpu(base):
    """The GPU path's dtype handling (bf16 body and lm_head, float32 softmax and loss), exercised on CPU."""
    trajs = make_trajectories(base, 4, seed=11)
    batch = collate(trajs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent = token_log_probs(base, batch.input_ids, batch.attention_mask, batch.action_mask, with_entropy=True)
    ref, _ = token_log_probs(base, batch.input_ids, batch.attention_mask, batch.action_mask)
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp, ref, rtol=0.02, atol=0.05)
    learner = Learner(copy.deepcopy(base), LearnerConfig(autocast="bf16"))
    stats = learner.update(trajs)
    assert math.isfinite(stats["loss"]) and stats["grad_norm"] > 0
    assert all(p.dtype == torch.float32 for p in learner.model.parameters())


def test_sampling_temperature_must_match(base):
    trajs = make_trajectories(base, 2, seed=12)
    trajs[1].sampling = {"temperature": 0.7}
    learner = Learner(copy.deepcopy(base))
    with pytest.raises(ValueError, match="temperature 0.7"):
        learner.update(trajs)
    stats = Learner(copy.deepcopy(base), LearnerConfig(temperature=0.7, loss=NO_TRUST)).update(trajs[1:])
    assert stats["step"] == 1


# --- one source of configuration ----------------------------------------------------------------------------------


def test_learner_config_defaults_equal_the_run_config_defaults():
    from agentenv.core.config import AlgoConfig

    algo = AlgoConfig()
    shared = {f.name for f in dataclasses.fields(LearnerConfig)} & set(AlgoConfig.model_fields)
    assert {"lr", "loss", "weight_decay"} <= shared
    mine = LearnerConfig()
    for name in sorted(shared):
        assert getattr(mine, name) == getattr(algo, name), name
    from agentenv.trainer.learner import NOT_LEARNER_FIELDS

    assert set(AlgoConfig.model_fields) - shared == NOT_LEARNER_FIELDS  # every other algo field reaches the learner


def test_every_loss_in_the_config_is_registered_with_its_section():
    from typing import get_args

    from agentenv.trainer.losses import LOSSES, get_loss

    sections = get_args(get_args(LossConfig)[0])  # Annotated[Union[...], discriminator] -> the members
    assert {s.model_fields["type"].default: s for s in sections} == {n: spec.section for n, spec in LOSSES.items()}
    assert all(get_loss(s()).section is s for s in sections)


def test_permute_rewards_reaches_the_advantages_through_the_run_config(base):
    """algo.permute_rewards (the permuted-reward control): the update's gradient is the one of the same batch with its
    rewards shuffled by one non-identity permutation (the run's loop.seed and the step pick it), and the metrics
    record says so."""
    import itertools

    from agentenv.core.config import load_config
    from agentenv.core.metrics import update_record
    from agentenv.trainer import learner_config_from

    lc = learner_config_from(load_config("python_tool", overrides=["algo.permute_rewards=true", "loop.seed=3"]),
                             lr=1e-3)
    assert lc.permute_rewards and lc.permute_seed == 3
    rewards = [0.0, 0.25, 0.5, 1.0]

    def grads_with(config, order):
        trajs = make_trajectories(base, 4, seed=5)
        for t, r in zip(trajs, (rewards[i] for i in order)):
            t.reward, t.success = r, r == 1.0
        learner = Learner(copy.deepcopy(base), config)
        grads = capture_grads(learner)
        return grads, learner.update(trajs), trajs

    permuted, stats, trajs = grads_with(lc, range(4))
    assert stats["rewards_permuted"] == 1
    rec = update_record(update=1, policy_version=1, mode="async", batch=trajs, lags=[], learner_stats=stats,
                        counters={}, timings={})
    assert rec["rewards_permuted"] == 1 and rec["reward_mean"] == sum(rewards) / 4  # what was played, not shuffled
    plain = dataclasses.replace(lc, permute_rewards=False)
    matches = [order for order in itertools.permutations(range(4))
               if all(torch.allclose(a, b) for a, b in zip(grads_with(plain, order)[0][0], permuted[0]))]
    assert len(matches) == 1 and matches[0] != (0, 1, 2, 3)
    assert "rewards_permuted" not in grads_with(plain, range(4))[1]


def test_learner_config_from_reads_every_section_it_names():
    from agentenv.core.config import load_config
    from agentenv.trainer import learner_config_from

    cfg = load_config("python_tool", overrides=["algo.loss.delta=0.02", "algo.loss.constant_length=6144",
                                           "algo.loss.no_is=true",
                                           "rollout.temperature=0.7", "loop.total_updates=12",
                                           "model.gradient_checkpointing=true", "model.dtype=bfloat16"])
    lc = learner_config_from(cfg)
    assert lc.loss is cfg.algo.loss  # the section itself: no field is copied
    assert (lc.loss.delta, lc.loss.constant_length, lc.loss.no_is, lc.temperature, lc.total_steps) == (
        0.02, 6144, True, 0.7, 12)
    assert lc.gradient_checkpointing and lc.autocast == "bf16" and lc.lr == cfg.algo.lr
    assert learner_config_from(load_config("python_tool", overrides=["model.dtype=float32"])).autocast == "none"
    with pytest.raises(ValueError, match="float16"):
        learner_config_from(load_config("python_tool", overrides=["model.dtype=float16"]))


# --- precision, saved model, versions, truncated sampling ---------------------------------------------------------


def test_bf16_model_keeps_float32_master_weights_that_learn_at_the_papers_lr(base):
    model = copy.deepcopy(base).to(torch.bfloat16)  # what loading a bf16 preset used to give the learner
    start = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    learner = Learner(model, LearnerConfig(lr=1e-6, autocast="bf16", loss=NO_TRUST))
    assert learner.components() == {"strategy": "single", "world_size": 1, "master_dtype": "float32",
                                     "compute_dtype": "bfloat16"}
    for i in range(10):
        learner.update(make_trajectories(base, 4, seed=100 + i))
    assert all(p.dtype == torch.float32 for p in learner.model.parameters())
    assert all(s.dtype == torch.float32 for st in learner.optimizer.state.values() for s in st.values()
               if torch.is_tensor(s) and s.numel() > 1)
    changed = sum(int((p.detach() != start[n]).sum()) for n, p in learner.model.named_parameters())
    total = sum(p.numel() for p in learner.model.parameters())
    assert changed / total >= 0.99, f"only {changed / total:.2%} of the master weights moved"
    assert all(v.dtype == torch.bfloat16 for v in learner.export_weights().values())  # samplers get the compute dtype


def test_save_pretrained_writes_a_loadable_model_in_the_asked_dtype_with_its_tokenizer(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentenv.samplers.tiny import materialize_tiny
    from agentenv.trainer.model_io import load_learner_model

    src = materialize_tiny(TinyConfig(**SHAPE, seed=3, vocab="small"))
    learner = Learner(load_learner_model(src), LearnerConfig(lr=1e-3, loss=NO_TRUST))
    start = {k: v.clone() for k, v in learner.model.state_dict().items()}
    learner.update(make_trajectories(learner.model, 3, seed=21))
    learner.save_pretrained(tmp_path / "final_model", source=src)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final_model", local_files_only=True)
    assert AutoTokenizer.from_pretrained(tmp_path / "final_model").get_vocab() == \
        AutoTokenizer.from_pretrained(src).get_vocab()
    state = loaded.state_dict()
    assert all(v.dtype == torch.float32 for v in state.values())
    assert all(torch.equal(state[k], v) for k, v in learner.model.state_dict().items())
    assert any(not torch.equal(state[k], start[k]) for k in start)  # differs from the starting model
    # a run saves in model.save_dtype (default the compute dtype): bf16 halves the directory and rounds each weight
    learner.save_pretrained(tmp_path / "bf16", source=src, dtype="bfloat16")
    half = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", local_files_only=True, dtype="auto")
    assert half.config.dtype == torch.bfloat16 and all(v.dtype == torch.bfloat16 for v in half.state_dict().values())
    assert all(torch.equal(half.state_dict()[k], v.to(torch.bfloat16)) for k, v in learner.model.state_dict().items())
    size = lambda d: sum(f.stat().st_size for f in d.glob("*.safetensors"))  # noqa: E731
    assert size(tmp_path / "bf16") < 0.6 * size(tmp_path / "final_model")


def test_lag_is_measured_against_the_weights_the_gradient_was_computed_at(base):
    learner = Learner(copy.deepcopy(base), LearnerConfig(loss=NO_TRUST))
    stats = learner.update(make_trajectories(base, 3, seed=31))  # sampled by version 0, learner at version 0
    assert (stats["policy_lag_mean"], stats["policy_lag_max"], stats["policy_version"]) == (0, 0, 1)
    stats = learner.update(make_trajectories(base, 3, seed=32))  # still version-0 samples, learner now at 1
    assert (stats["policy_lag_mean"], stats["policy_lag_max"], stats["policy_version"]) == (1, 1, 2)
    assert "lag0_acceptance_rate" not in stats  # no lag-0 trajectory in this batch


def test_truncated_sampling_statistic_and_lag0_rejection_warning(base, caplog):
    trajs = make_trajectories(base, 4, seed=41)
    for t in trajs[:3]:
        t.sampling = {"temperature": 1.0, "top_k": 5}
        t.behavior_logprobs = [-0.01 if m else 0.0 for m in t.action_mask]  # what top-k=5 makes mu look like
    with caplog.at_level("WARNING", logger="agentenv.trainer.learner"):
        stats = Learner(copy.deepcopy(base)).update(trajs)
    assert stats["sampling_truncated_fraction"] == 0.75 and stats["lag0_acceptance_rate"] == 0.25
    assert "rejected 75% of the lag-0 trajectories" in caplog.text and "top_k=0" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="agentenv.trainer.learner"):
        stats = Learner(copy.deepcopy(base)).update(make_trajectories(base, 4, seed=42))
    assert stats["sampling_truncated_fraction"] == 0.0 and stats["lag0_acceptance_rate"] == 1.0 and not caplog.text


def test_constant_length_ablation_through_the_learner(base):
    """The registry passes algo.loss.constant_length to the loss: each row's token sum is divided by B * L, not B * T_i."""
    trajs = make_trajectories(base, 3, seed=51, drift=0.0)
    batch = collate(trajs)
    with torch.no_grad():
        lp, _ = token_log_probs(base, batch.input_ids, batch.attention_mask, batch.action_mask)
    sums, lengths = lp.double().sum(1), batch.action_mask.sum(1).double()
    adv = batch.rewards - batch.rewards.mean()
    for kw, denom in (({}, 3 * lengths), ({"constant_length": 64}, torch.full((3,), 3 * 64.0))):
        stats = Learner(copy.deepcopy(base), LearnerConfig(loss=FlashReinforceLoss(no_trust=True, **kw))).update(
            [dataclasses.replace(t, id=f"{t.id}-{len(kw)}") for t in trajs])
        assert stats["ratio_max"] == pytest.approx(1.0, abs=1e-5)  # mu = pi: rho = 1
        assert stats["loss"] == pytest.approx(float(-(adv * sums / denom).sum()), rel=1e-4)


def test_a_new_loss_is_one_registered_function(base):
    """The registry's extension point: a plain on-policy REINFORCE registered here with its options section trains
    through the same learner, and its stats are merged the same way (per-row advantages, token counts, weighted ratio
    mean)."""
    from typing import Literal

    from agentenv.core.config import LossSection
    from agentenv.trainer.losses import LOSSES, LossResult, register_loss

    class TestReinforce(LossSection):
        type: Literal["test_reinforce"] = "test_reinforce"

    @register_loss(TestReinforce)
    def reinforce(inp, options: TestReinforce):
        adv = (inp.rewards - inp.full_batch.reward_mean).float()
        per_row = torch.where(inp.action_mask, inp.log_probs, 0.0).sum(1) / inp.action_mask.sum(1)
        loss = -(adv * per_row).sum() / inp.full_batch.num_trajectories
        n = inp.action_mask.sum(1)
        return LossResult(loss=loss, rows={"advantages": adv, "policy_tokens": n, "retained_tokens": n},
                          sums={"loss": float(loss)}, means={"ratio_mean": (1.0, float(n.sum()))})

    try:
        trajs = make_trajectories(base, 5, seed=61)
        stats = Learner(copy.deepcopy(base), LearnerConfig(loss=TestReinforce(), max_tokens_per_microbatch=40)
                        ).update(trajs)
        ref = Learner(copy.deepcopy(base), LearnerConfig(loss=FlashReinforceLoss(no_is=True), max_tokens_per_microbatch=40)).update(
            [dataclasses.replace(t, id=t.id + "-ref") for t in trajs])  # no_is: the same estimator, every row kept
        assert stats["num_microbatches"] > 1 and stats["ratio_mean"] == 1.0
        # the loss is a small difference of O(1) row terms: compare it absolutely (float32 summation order differs)
        assert stats["loss"] == pytest.approx(ref["loss"], abs=1e-6) and stats["adv_std"] == ref["adv_std"]
        assert stats["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
        assert "acceptance_rate" not in stats  # a loss without a gate reports none
    finally:
        LOSSES.pop("test_reinforce")
