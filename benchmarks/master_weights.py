"""How much of the model 10 AdamW steps at the paper's lr move: bf16 master weights (what loading a bf16 preset used
to give the learner) vs the learner's float32 master weights with bf16 compute.

    python benchmarks/master_weights.py [--steps 10] [--lr 1e-6]

Prints the share of parameters whose value changed, per setting. The tiny Qwen2 body with the project's small
tokenizer; trajectories are the model's own samples scored by the learner (mu = pi, all rewards distinct).
"""

from __future__ import annotations

import argparse
import copy
import random

import torch


def trajectories(model, n, seed):
    from agentenv.core.trajectory import Trajectory

    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(12, 40)
        ids = [rng.randrange(model.config.vocab_size) for _ in range(length)]
        mask = [j >= 4 for j in range(length)]
        out.append(Trajectory(token_ids=ids, action_mask=mask, behavior_logprobs=[-1.0 if m else 0.0 for m in mask],
                              policy_version=[0 if m else -1 for m in mask], reward=rng.random(), success=False,
                              id=f"{seed}-{i}"))
    return out


def changed_share(model, steps, lr, *, fp32_master: bool) -> float:
    from agentenv.trainer import Learner, LearnerConfig

    model = copy.deepcopy(model).to(torch.bfloat16)
    start = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    cfg = LearnerConfig(lr=lr, autocast="bf16", loss={"no_trust": True})
    learner = Learner(model, cfg)
    if not fp32_master:  # the old behaviour: the optimizer steps the bf16 weights themselves
        learner.model.to(torch.bfloat16)
        learner.optimizer = torch.optim.AdamW(learner.model.parameters(), lr=lr, weight_decay=cfg.weight_decay)
    for s in range(steps):
        learner.update(trajectories(model, 4, seed=s))
    moved = sum(int((p.detach().float() != start[n]).sum()) for n, p in learner.model.named_parameters())
    return moved / sum(p.numel() for p in learner.model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-6)
    args = ap.parse_args()
    from agentenv.samplers.tiny import TinyConfig, tiny_model

    model = tiny_model(TinyConfig(vocab="small"))
    for label, fp32 in (("bf16 master weights (old)", False), ("fp32 master weights, bf16 compute", True)):
        share = changed_share(model, args.steps, args.lr, fp32_master=fp32)
        print(f"{label:36s} {args.steps} steps at lr {args.lr:g}: {100 * share:.2f}% of the weights changed")


if __name__ == "__main__":
    main()
