"""The sharded learner on CPU: 2 FSDP2 gloo ranks (spawned processes) running the ONE Learner, against the
single-process Learner on the same batch.

A real small Qwen2 model (untied LM head, so the head is a separate root parameter the chunked path must gather) and
the real FlashREINFORCE loss with the failure filter and micro-batching on: after one update the gathered weights must
equal the single-process update's to 1e-6, and the stats (admission mask, loss, grad norm) must match.

Every rank builds the model on the meta device and rank 0's weights are broadcast into the shards; a checkpoint is a
directory with one shard file per rank, and a learner of another world size (one process here) resumes it: a tied
model, so the meta init must keep the LM head and the embedding one parameter.
"""

import math

import pytest

torch = pytest.importorskip("torch")

from agentenv.core.config import FlashReinforceLoss
from agentenv.core.trajectory import Trajectory
from agentenv.trainer import Learner, LearnerConfig
from agentenv.trainer.distributed import ShardedLearner
from agentenv.trainer.model_io import load_learner_model

VOCAB = 97


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from agentenv.samplers.tiny import small_tokenizer

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, pad_token_id=0)
    out = tmp_path_factory.mktemp("model")
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    small_tokenizer().save_pretrained(out)  # a tokenizer for save_pretrained to copy (ids beyond VOCAB unused)
    return str(out)


def batch_of_trajectories(n=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 10 + 3 * i
        ids = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        mask = [False] * 4 + [bool(x) for x in (torch.rand(length - 4, generator=g) < 0.7).tolist()]
        mask[-1] = True
        lps = [float(-torch.rand(1, generator=g) * 3) if m else 0.0 for m in mask]
        out.append(Trajectory(token_ids=ids, action_mask=mask, behavior_logprobs=lps,
                              policy_version=[0 if m else -1 for m in mask], reward=float(i % 3 == 0),
                              success=i % 3 == 0, id=f"s{seed}-t{i}"))
    return out


# delta admits all but the most drifted rows, so the mask is non-trivial and must be gathered correctly; the failure
# filter needs entropies; a token budget gives the two ranks DIFFERENT numbers of micro-batches; the two updates are
# the weight average's window, each rank averaging its own shard
CONFIG = LearnerConfig(lr=1e-6, loss=FlashReinforceLoss(delta=1.3, negative_token_fraction=0.5), max_grad_norm=100.0,
                       max_tokens_per_microbatch=60, autocast="none", total_steps=2, average_last_updates=2)


def test_two_gloo_ranks_update_equals_the_single_process_update(model_dir, tmp_path):
    single = Learner(load_learner_model(model_dir), CONFIG)
    start = {k: v.clone() for k, v in single.model.state_dict().items()}
    sharded = ShardedLearner(CONFIG, model_dir, 2)
    try:
        assert sharded.components() == {"strategy": "fsdp2", "world_size": 2, "master_dtype": "float32",
                                         "compute_dtype": "float32"}
        for seed in (1, 2):  # two updates: the second runs on AdamW state
            trajs = batch_of_trajectories(seed=seed)
            ref, got = single.update(trajs), sharded.update(trajs)
            assert got["admitted"] == ref["admitted"] and 0 < ref["num_admitted"] < 6
            assert ref["num_microbatches"] > 2 and got["num_microbatches"] > 2  # summed over ranks
            for key in ("loss", "grad_norm", "seq_kl_mean", "ratio_mean", "entropy_mean", "adv_std"):
                assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-8), key
            assert (got["step"], got["policy_version"]) == (ref["step"], ref["policy_version"]) == (seed, seed)
        weights = sharded.export_weights()
        assert set(weights) == set(start)
        for k, v in single.model.state_dict().items():
            torch.testing.assert_close(weights[k], v, rtol=0, atol=1e-6, msg=f"{k} differs after the updates")
        assert not torch.equal(start["lm_head.weight"], weights["lm_head.weight"])  # not vacuous
        # the same refusals as the single learner, and the learner stays usable after them
        with pytest.raises(ValueError, match="already used"):
            sharded.update(batch_of_trajectories(seed=1))
        with pytest.raises(ValueError, match="learner ranks a row"):
            sharded.update(batch_of_trajectories(n=1, seed=3))
        # a saved model: float32 HF directory with the tokenizer, equal to the gathered weights
        sharded.save_pretrained(tmp_path / "final")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final", local_files_only=True)
        AutoTokenizer.from_pretrained(tmp_path / "final", local_files_only=True)
        for k, v in loaded.state_dict().items():
            assert v.dtype == torch.float32 and torch.equal(v, weights[k]), k
        # checkpoint round trip through the ranks (the weight average is gathered, then sharded again)
        state = sharded.state_dict()
        assert state["averaged_updates"] == 2
        assert set(state["weight_average"]) == {k for k, _ in single.model.named_parameters()}
        sharded.load_state_dict(state)
        assert (sharded.step, sharded.policy_version) == (2, 2)
        # the mean of the two updates' weights, swapped in on every rank, equals the single learner's
        assert sharded.use_average() == single.use_average() == 2
        assert sharded.policy_version == single.policy_version == 3
        averaged = sharded.export_weights()
        for k, v in single.model.state_dict().items():
            torch.testing.assert_close(averaged[k], v, rtol=0, atol=1e-6, msg=f"{k}: averaged weights differ")
        assert not torch.equal(averaged["lm_head.weight"], weights["lm_head.weight"])
    finally:
        sharded.close()
    assert math.isfinite(ref["loss"])


def test_a_rank_that_cannot_start_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="sharded learner info: .*missing"):  # the ranks reported, promptly
        ShardedLearner(CONFIG, str(tmp_path / "missing"), 2, timeout_s=120)


def test_bf16_compute_keeps_float32_master_weights_on_the_ranks(model_dir):
    import dataclasses

    sharded = ShardedLearner(dataclasses.replace(CONFIG, autocast="bf16", lr=1e-3), model_dir, 2)
    try:
        assert sharded.components()["compute_dtype"] == "bfloat16"
        assert sharded.components()["master_dtype"] == "float32"
        before = sharded.export_weights(dtype=torch.float32)
        stats = sharded.update(batch_of_trajectories(seed=5))
        assert stats["policy_version"] == 1 and math.isfinite(stats["loss"])
        after = sharded.export_weights()
        assert all(v.dtype == torch.bfloat16 for v in after.values())  # samplers get the compute dtype
        full = sharded.export_weights(dtype=torch.float32)
        assert any(not torch.equal(full[k], before[k]) for k in before)
    finally:
        sharded.close()


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    """The tiny models' shape of tying: the LM head IS the embedding (one parameter under two names)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, pad_token_id=0)
    out = tmp_path_factory.mktemp("tied")
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    return str(out)


def test_meta_init_and_a_sharded_checkpoint_resumed_by_one_process(tied_model_dir, tmp_path):
    import dataclasses

    # the tail average's window (updates 2-3) straddles the checkpoint: its sharded mean must travel too
    # lr: an update moves the weights by ~1e-4, so AdamW's moments (not loaded: a fresh-moment step) show beyond 1e-6
    cfg = dataclasses.replace(CONFIG, lr=1e-4, total_steps=3, average_last_updates=2)
    start = load_learner_model(tied_model_dir).state_dict()
    sharded = ShardedLearner(cfg, tied_model_dir, 2)
    try:
        init = sharded.export_weights()  # ranks built on the meta device, filled from rank 0: the same weights
        assert set(init) == set(start) and all(torch.equal(init[k], v) for k, v in start.items())
        for seed in (1, 2):
            sharded.update(batch_of_trajectories(seed=seed))
        sharded.save(tmp_path / "ckpt")
        cont = sharded.update(batch_of_trajectories(seed=3))
        after = sharded.export_weights()
        assert sharded.use_average() == 2
        averaged = sharded.export_weights()
    finally:
        sharded.close()
    # each rank wrote its own shard; no file holds the full model
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                                     "state.pt"]
    assert "model" not in torch.load(tmp_path / "ckpt" / "state.pt", weights_only=True)
    # one process resumes it (DCP reshards 2 -> 1) and takes the update the sharded learner took next
    single = Learner(load_learner_model(tied_model_dir), cfg)
    single.load(tmp_path / "ckpt")
    assert (single.step, single.policy_version, single.average.count) == (2, 2, 1)
    ref = single.update(batch_of_trajectories(seed=3))
    assert ref["admitted"] == cont["admitted"]
    for key in ("loss", "grad_norm", "seq_kl_mean"):
        assert cont[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-8), key
    for k, v in single.model.state_dict().items():
        torch.testing.assert_close(after[k], v, rtol=0, atol=1e-6, msg=f"{k} differs after the resumed update")
    assert torch.equal(after["lm_head.weight"], after["model.embed_tokens.weight"])  # still one tied parameter
    assert not torch.equal(after["lm_head.weight"], start["lm_head.weight"])  # and it moved
    assert single.use_average() == 2
    for k, v in single.model.state_dict().items():
        torch.testing.assert_close(averaged[k], v, rtol=0, atol=1e-6, msg=f"{k}: averaged weights differ")
