"""Supervised fine-tuning on demonstration trajectories (``agentenv sft``).

Contract:

* Input: :class:`~agentenv.core.trajectory.Trajectory` objects. Token-level ones (from ``agentenv rollout`` of an LLM, or
  built by :func:`trajectory_from_messages`) are used as they are; text-only ones (scripted experts such as the
  ALFWorld walkthrough) are tokenized from their ``messages`` through :class:`agentenv.core.chat.ChatSequence` -- the
  same machinery the runtime uses -- so the tokens, the template glue and the ``action_mask`` are exactly what RL
  will see later.
* Loss: mean negative log-likelihood over ``action_mask`` tokens (the assistant's own tokens incl. its end-of-turn
  token). By default prompt, observation and tool-output tokens are context, never targets; ``context_loss_weight``
  > 0 adds that weight times the mean NLL of those tokens too (language-model pretraining on the env's text: for a
  model trained from scratch it is ~25x more signal per sequence, and the repeats in observations -- the same
  admissible commands turn after turn -- teach it to copy, which picking a listed command needs). Computed with the
  trainer's chunked log-probs, so no ``[tokens x vocab]`` tensor is ever materialised.
* ``only_successful`` (default True) keeps demos with ``success`` -- imitation of failures teaches failure.
* Output: a transformers checkpoint directory (model + tokenizer) that ``--model DIR`` loads anywhere in agentenv.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from agentenv.core.chat import ChatSequence
from agentenv.core.policy import Generation
from agentenv.core.trajectory import Trajectory

log = logging.getLogger("agentenv.run.sft")


@dataclass
class SFTConfig:
    epochs: int = 3
    lr: float = 1e-4
    batch_size: int = 16
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    warmup_steps: int = 10
    schedule: str = "constant"  # or "cosine": after warmup, decay to min_lr_ratio x lr at the last step
    min_lr_ratio: float = 0.1
    seed: int = 0
    only_successful: bool = True
    max_tokens: int = 4096  # demos longer than this are skipped (their tokens would not fit a rollout either)
    context_loss_weight: float = 0.0  # > 0: also predict prompt/observation tokens, with this weight (see module doc)


def demos_path(demos: str) -> Path:
    """A demos file named by config: a path, or ``builtin:NAME`` for demos shipped as
    ``agentenv/envs/data/NAME.jsonl.xz`` (e.g. ``builtin:alfworld_demos``). Raises FileNotFoundError."""
    if not demos.startswith("builtin:"):
        if not Path(demos).is_file():
            raise FileNotFoundError(f"no demos file {demos!r}")
        return Path(demos)
    from agentenv import envs

    data = Path(envs.__file__).parent / "data"
    path = data / f"{demos[len('builtin:'):]}.jsonl.xz"
    if not path.is_file():
        shipped = sorted(f"builtin:{p.name[:-len('.jsonl.xz')]}" for p in data.glob("*.jsonl.xz"))
        raise FileNotFoundError(f"no shipped demos {demos!r}; shipped: {', '.join(shipped) or 'none'}")
    return path


def trajectory_from_messages(tokenizer, messages: list[dict], tools: list[dict] | None = None, **fields) -> Trajectory:
    """Tokenize a chat (system?, user, assistant, tool|user, assistant, ...) into a contract-conforming trajectory.

    Assistant messages become "sampled" tokens (mask True, log-prob 0.0 = a deterministic demonstrator, version 0)
    followed by the end-of-turn token, exactly as :meth:`ChatSequence.add_sampled` records a real sampler's turn."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None:
        raise ValueError("a demonstration needs at least one assistant message")
    seq = ChatSequence(tokenizer)
    seq.start([dict(m) for m in messages[:first]], tools)
    eos = tokenizer.eos_token_id
    for m in messages[first:]:
        if m["role"] == "assistant":
            ids = tokenizer(m["content"], add_special_tokens=False)["input_ids"] + [eos]
            seq.add_sampled(Generation(token_ids=ids, logprobs=[0.0] * len(ids), stop_reason="stop"))
        else:
            seq.add_message(m["role"], m["content"])
    if not seq.action_mask[-1]:
        # the chat ends with an observation (e.g. "Final answer received"): drop it -- nothing to learn there
        last = max(i for i, a in enumerate(seq.action_mask) if a)
        for name in ("token_ids", "action_mask", "behavior_logprobs", "policy_version"):
            setattr(seq, name, getattr(seq, name)[:last + 1])
    traj = Trajectory(token_ids=seq.token_ids, action_mask=seq.action_mask, behavior_logprobs=seq.behavior_logprobs,
                      policy_version=seq.policy_version, messages=seq.messages, tools=tools, **fields)
    traj.num_turns = sum(m["role"] == "assistant" for m in seq.messages)
    return traj


def prepare_demos(trajs: Sequence[Trajectory], tokenizer, *, only_successful: bool = True,
                  max_tokens: int = 4096) -> list[Trajectory]:
    """Token-level demos from any trajectories (see module docstring). Reports what was skipped and why."""
    out, skipped = [], {"failed": 0, "too_long": 0, "no_assistant": 0}
    for t in trajs:
        if only_successful and not t.success:
            skipped["failed"] += 1
            continue
        if not t.token_ids:
            msgs = [m for m in t.messages if m.get("role") in ("system", "user", "assistant", "tool")]
            # Scripted experts' chats end with the env's closing observation; keep up to the last assistant turn.
            while msgs and msgs[-1]["role"] != "assistant":
                msgs.pop()
            if not any(m["role"] == "assistant" for m in msgs):
                skipped["no_assistant"] += 1
                continue
            t = trajectory_from_messages(tokenizer, msgs, t.tools, env=t.env, task=t.task, task_type=t.task_type,
                                         reward=t.reward, success=t.success, id=t.id)
        if len(t.token_ids) > max_tokens:
            skipped["too_long"] += 1
            continue
        out.append(t)
    if any(skipped.values()):
        log.info("sft demos: kept %d, skipped %s", len(out), skipped)
    return out


def sft_loss(model, batch, context_loss_weight: float = 0.0) -> torch.Tensor:
    """Mean NLL over the batch's action tokens (token mean: every demonstrated token counts once), plus
    ``context_loss_weight`` x the mean NLL over its other real tokens (all but each sequence's first)."""
    from agentenv.trainer.logprobs import token_log_probs

    if not context_loss_weight:
        logp, _ = token_log_probs(model, batch.input_ids, batch.attention_mask, batch.action_mask)
        return -(logp[batch.action_mask]).mean()
    predicted = batch.attention_mask.clone()
    predicted[:, 0] = False
    logp, _ = token_log_probs(model, batch.input_ids, batch.attention_mask, predicted)
    context = predicted & ~batch.action_mask
    return -(logp[batch.action_mask]).mean() - context_loss_weight * logp[context].mean()


def train_sft(model, demos: Sequence[Trajectory], cfg: SFTConfig = SFTConfig(), *, progress: bool = True,
              on_step: Callable[[int, float], None] | None = None, should_stop: Callable[[], bool] | None = None) -> dict:
    """Fine-tune ``model`` in place on token-level ``demos``; returns ``{"steps", "loss_first", "loss_last", ...}``."""
    from agentenv.trainer.batch import collate

    if not demos:
        raise ValueError("no demonstrations to train on (all were filtered out, or the file was empty)")
    pad = getattr(model.config, "pad_token_id", None) or 0
    rng = random.Random(cfg.seed)
    steps_per_epoch = math.ceil(len(demos) / cfg.batch_size)
    total = steps_per_epoch * cfg.epochs
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                            weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(cfg, s, total))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, desc="sft", unit="step", dynamic_ncols=True)
    model.train()
    losses, step, t0 = [], 0, time.perf_counter()
    try:
        for _ in range(cfg.epochs):
            for rows in _length_grouped_batches(demos, cfg.batch_size, rng):
                batch = collate([demos[i] for i in rows], pad_token_id=pad)
                loss = sft_loss(model, batch, cfg.context_loss_weight)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                opt.step()
                sched.step()
                step += 1
                losses.append(loss.item())
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{losses[-1]:.3f}")
                elif step % max(1, total // 20) == 0 or step == total:  # greppable progress without a bar
                    log.info("sft step %d/%d loss %.3f (%.0fs)", step, total, losses[-1], time.perf_counter() - t0)
                if on_step is not None:
                    on_step(step, losses[-1])
                if should_stop is not None and should_stop():
                    raise StopIteration
    except StopIteration:
        pass
    finally:
        if bar is not None:
            bar.close()
        model.eval()
    k = max(1, min(10, len(losses) // 5))
    return {"steps": step, "demos": len(demos), "loss_first": sum(losses[:k]) / k if losses else math.nan,
            "loss_last": sum(losses[-k:]) / k if losses else math.nan, "wall_s": time.perf_counter() - t0}


def _length_grouped_batches(demos: Sequence[Trajectory], batch_size: int, rng: random.Random,
                            group: int = 16) -> list[list[int]]:
    """One epoch's batches: a shuffled order cut into groups of ``group`` batches, each group sorted by length before
    it is cut into batches, then the batches shuffled. Every demo once per epoch, as with a plain shuffle, but a batch
    holds demos of similar length (mixed-length demos waste ~30% of a plain batch on padding, ~5% this way)."""
    order = list(range(len(demos)))
    rng.shuffle(order)
    batches = []
    for g in range(0, len(order), group * batch_size):
        chunk = sorted(order[g:g + group * batch_size], key=lambda i: len(demos[i].token_ids))
        batches += [chunk[b:b + batch_size] for b in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def _lr_factor(cfg: SFTConfig, step: int, total: int) -> float:
    """Linear warmup over ``cfg.warmup_steps``, then the learner's schedule (:mod:`agentenv.trainer.schedule`,
    constant or cosine down to ``min_lr_ratio``) over the remaining steps."""
    from agentenv.trainer.schedule import Schedule

    after = Schedule(cfg.schedule, max(1, total - cfg.warmup_steps), 0.0, cfg.min_lr_ratio)  # checks the name
    return (step + 1) / cfg.warmup_steps if step < cfg.warmup_steps else after(step - cfg.warmup_steps)


def save_checkpoint_dir(model, tokenizer, out: str | Path) -> Path:
    """A transformers checkpoint directory (``--model DIR`` loads it); keeps the tiny-model marker if present."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def load_model_and_tokenizer(name: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentenv.samplers.models import resolve_model

    rm = resolve_model(name)
    tok = AutoTokenizer.from_pretrained(rm.path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(rm.path, local_files_only=True, dtype=torch.float32)
    return model, tok, rm
