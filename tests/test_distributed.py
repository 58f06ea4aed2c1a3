"""FSDP2 learner sharding on CPU: 2 gloo processes (torch.multiprocessing.spawn) vs one process on the whole batch.

A real (small) Qwen2 model and real FlashREINFORCE loss: after one sharded step the gathered full state dict must
equal the single-process step's weights, and the gathered admission mask / loss must match.
"""

import os
import socket

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist
import torch.multiprocessing as mp

from agentenv.trajectory import Trajectory


def small_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).float()


def batch_of_trajectories(n=6):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        length = 10 + 3 * i
        ids = torch.randint(0, 97, (length,), generator=g).tolist()
        mask = [False] * 4 + [bool(x) for x in (torch.rand(length - 4, generator=g) < 0.7).tolist()]
        mask[-1] = True
        lps = [float(-torch.rand(1, generator=g) * 3) if m else 0.0 for m in mask]
        out.append(Trajectory(token_ids=ids, action_mask=mask, behavior_logprobs=lps,
                              policy_version=[0 if m else -1 for m in mask], reward=float(i % 3 == 0),
                              success=i % 3 == 0, id=f"t{i}"))
    return out


def step(model, shard: bool):
    from agentenv.trainer.distributed import shard_model, sharded_flashreinforce_step

    if shard:
        shard_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    # delta admits all but the most drifted rows, so the mask is non-trivial and must be gathered correctly
    return sharded_flashreinforce_step(model, opt, batch_of_trajectories(), delta=2.0, max_grad_norm=100.0)


def _worker(rank, world, port, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from agentenv.trainer.distributed import gather_full_state_dict, init_distributed

    info = init_distributed("gloo")
    assert info.world_size == world
    model = small_model()
    stats = step(model, shard=True)
    sd = gather_full_state_dict(model)  # collective; rank 0 gets everything
    if rank == 0:
        torch.save({"state": sd, "stats": stats}, out_path)
    else:
        assert sd == {}
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_two_gloo_processes_match_single_process_step(tmp_path):
    out = tmp_path / "rank0.pt"
    mp.spawn(_worker, args=(2, free_port(), str(out)), nprocs=2, join=True)
    got = torch.load(out, weights_only=False)

    ref_model = small_model()
    ref_stats = step(ref_model, shard=False)
    ref = ref_model.state_dict()
    assert set(got["state"]) == set(ref)
    for k, v in ref.items():
        torch.testing.assert_close(got["state"][k], v, rtol=1e-5, atol=1e-6, msg=f"{k} differs after the step")
    assert got["stats"]["admitted"] == ref_stats["admitted"]
    assert 0 < ref_stats["num_admitted"] <= 6
    assert got["stats"]["loss"] == pytest.approx(ref_stats["loss"], rel=1e-5, abs=1e-7)
    assert got["stats"]["grad_norm"] == pytest.approx(ref_stats["grad_norm"], rel=1e-4)
    # the step did change the weights (the comparison is not vacuous)
    assert not torch.equal(small_model().state_dict()["lm_head.weight"], ref["lm_head.weight"])


def test_rank_rows_cover_the_batch_once():
    from agentenv.trainer.distributed import rank_rows

    rows = [rank_rows(7, r, 3) for r in range(3)]
    assert sorted(r for part in rows for r in part) == list(range(7))
    with pytest.raises(ValueError, match="batch_size >= world size"):
        rank_rows(1, 0, 2)
