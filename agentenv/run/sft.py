"""Supervised fine-tuning on demonstration trajectories (``agentenv sft``).

Contract:

* Input: :class:`~agentenv.core.trajectory.Trajectory` objects. Token-level ones (from ``agentenv rollout`` of an LLM, or
  built by :func:`trajectory_from_messages`) are used as they are; text-only ones (scripted experts such as the
  ALFWorld walkthrough) are tokenized from their ``messages`` through :class:`agentenv.core.chat.ChatSequence` -- the
  same machinery the runtime uses -- so the tokens, the template glue and the ``action_mask`` are exactly what RL
  will see later.
* Batches: a plain shuffle per epoch, so every optimizer step sees an unbiased sample of the demos (length-sorted
  batches hold one kind of demo each when kinds differ in length, and the decision the kinds disagree on then swings
  step to step); each batch runs as length-bucketed micro-batches whose gradients sum to the batch's.
* Report: the mean loss of each epoch over all its action tokens, per demo kind (:func:`demo_kind`), and the NLL of
  held-out demos (never trained on) after each epoch, one greppable ``sft epoch`` line each.
* Loss: mean negative log-likelihood over ``action_mask`` tokens (the assistant's own tokens incl. its end-of-turn
  token). By default prompt, observation and tool-output tokens are context, never targets; ``context_loss_weight``
  > 0 adds that weight times the mean NLL of those tokens too (language-model pretraining on the env's text: for a
  model trained from scratch it is ~25x more signal per sequence, and the repeats in observations -- the same
  admissible commands turn after turn -- teach it to copy, which picking a listed command needs). Computed with the
  trainer's chunked log-probs, so no ``[tokens x vocab]`` tensor is ever materialised.
* ``only_successful`` (default True) keeps demos with ``success`` -- imitation of failures teaches failure.
* Device: SFT trains where the model is; ``agentenv sft`` and a run's warm start put it on the GPU when there is one
  (:func:`sft_device`), with float32 weights and a bf16 autocast forward there, as the learner does.
* Output: a transformers checkpoint directory (model + tokenizer) that ``--model DIR`` loads anywhere in agentenv.
"""

from __future__ import annotations

import logging
import math
import random
import sys
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
    max_tokens_per_microbatch: int | None = 4096  # padded tokens per forward/backward within one step (None: one)


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
                                         reward=t.reward, success=t.success, id=t.id, meta=dict(t.meta),
                                         num_tool_calls=t.num_tool_calls)
        if len(t.token_ids) > max_tokens:
            skipped["too_long"] += 1
            continue
        out.append(t)
    if any(skipped.values()):
        log.info("sft demos: kept %d, skipped %s", len(out), skipped)
    return out


def demo_kind(t: Trajectory) -> str:
    """What sort of demonstration ``t`` is, for per-kind losses: ``meta["demo_kind"]`` (scripted demos), else the
    player that made it (``meta["player"]``: the ALFWorld walkthrough or searcher), else whether it calls a tool."""
    return str(t.meta.get("demo_kind") or t.meta.get("player") or ("tool" if t.num_tool_calls else "no tool"))


def _row_nll(model, batch, context_loss_weight: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: summed NLL of its action tokens, their count, and the summed NLL of its other real tokens (all but
    the first; zeros when ``context_loss_weight`` is 0, which skips computing them)."""
    from agentenv.trainer.logprobs import token_log_probs

    batch = batch.to(_device(model))
    if not context_loss_weight:
        with _autocast(model):
            logp, _ = token_log_probs(model, batch.input_ids, batch.attention_mask, batch.action_mask)
        return -(logp * batch.action_mask).sum(1), batch.action_mask.sum(1), torch.zeros(len(batch))
    predicted = batch.attention_mask.clone()
    predicted[:, 0] = False
    with _autocast(model):
        logp, _ = token_log_probs(model, batch.input_ids, batch.attention_mask, predicted)
    context = predicted & ~batch.action_mask
    return -(logp * batch.action_mask).sum(1), batch.action_mask.sum(1), -(logp * context).sum(1)


def sft_device(requested: str | None = None) -> str:
    """Where SFT trains: ``model.device`` when set, else the GPU when there is one (SFT of a GPU-sized model on the
    host would take hours), else the CPU."""
    return requested or ("cuda" if torch.cuda.is_available() else "cpu")


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _autocast(model):
    """On a GPU the forward runs in bf16 autocast over the float32 weights (the learner's own precision split)."""
    device = _device(model)
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def split_heldout(demos: Sequence[Trajectory], n: int, seed: int = 0) -> tuple[list, list]:
    """``(train, heldout)``: ``n`` demos drawn at random (seeded) to measure SFT on, never to train on; none when
    that would leave fewer than ``n`` to train on (a handful of demos is better spent on training)."""
    if n <= 0 or len(demos) < 2 * n:
        return list(demos), []
    idx = set(random.Random(seed).sample(range(len(demos)), n))
    return [d for i, d in enumerate(demos) if i not in idx], [d for i, d in enumerate(demos) if i in idx]


def sft_loss(model, batch, context_loss_weight: float = 0.0) -> torch.Tensor:
    """Mean NLL over the batch's action tokens (token mean: every demonstrated token counts once), plus
    ``context_loss_weight`` x the mean NLL over its other real tokens (all but each sequence's first)."""
    nll, n, ctx = _row_nll(model, batch, context_loss_weight)
    loss = nll.sum() / n.sum()
    if context_loss_weight:
        predicted = batch.attention_mask.sum() - len(batch)
        loss = loss + context_loss_weight * ctx.sum() / (predicted - n.sum())
    return loss


@torch.no_grad()
def demo_nll(model, demos: Sequence[Trajectory], *, max_tokens: int = 8192) -> dict[str, dict]:
    """Mean NLL per action token of ``demos`` under ``model``, per :func:`demo_kind` and over all (``"all"``):
    ``{kind: {"nll": nats per token, "worst": the largest single-token NLL, "demos": n}}``."""
    from agentenv.trainer.batch import collate, microbatches
    from agentenv.trainer.logprobs import token_log_probs

    was_training = model.training
    model.eval()
    sums: dict[str, list[float]] = {}
    try:
        pad = getattr(model.config, "pad_token_id", None) or 0
        for rows, mb in microbatches(collate(list(demos), pad_token_id=pad), max_tokens):
            mb = mb.to(_device(model))
            with _autocast(model):
                logp, _ = token_log_probs(model, mb.input_ids, mb.attention_mask, mb.action_mask)
            for r, i in enumerate(rows):
                mask = mb.action_mask[r]
                nll = -logp[r][mask]
                for kind in (demo_kind(demos[i]), "all"):
                    acc = sums.setdefault(kind, [0.0, 0, 0.0, 0])
                    acc[0] += nll.sum().item()
                    acc[1] += int(mask.sum())
                    acc[2] = max(acc[2], nll.max().item())
                    acc[3] += 1
    finally:
        model.train(was_training)
    return {k: {"nll": s / max(1, n), "worst": w, "demos": d} for k, (s, n, w, d) in sums.items()}


def train_sft(model, demos: Sequence[Trajectory], cfg: SFTConfig = SFTConfig(), *, progress: bool = True,
              heldout: Sequence[Trajectory] = (), on_step: Callable[[int, float], None] | None = None,
              should_stop: Callable[[], bool] | None = None, echo: Callable[[str], None] | None = None) -> dict:
    """Fine-tune ``model`` in place on token-level ``demos``.

    Every optimizer step is one batch drawn by a plain shuffle, so each batch is an unbiased sample of the demos:
    batches sorted by length hold one kind of demo each when kinds differ in length (the CPU demo's tool and
    no-tool demos), and a decision the kinds disagree on -- the first token: call the tool or answer -- then swings
    with every step and ends wherever the last batches leave it. Padding is saved inside the step instead: the batch
    runs as length-bucketed micro-batches (``cfg.max_tokens_per_microbatch``) whose gradients add up to the batch's
    token mean exactly.

    Returns ``{"steps", "demos", "loss_first", "loss_last", "epochs", "heldout", "wall_s"}``: ``loss_first`` /
    ``loss_last`` are the means over the first / last epoch's action tokens (not one step's value), ``epochs`` has
    each epoch's mean per demo kind, and ``heldout`` the NLL per kind of ``heldout`` demos (never trained on) after
    each epoch, as :func:`demo_nll` returns it."""
    from agentenv.trainer.batch import collate

    if not demos:
        raise ValueError("no demonstrations to train on (all were filtered out, or the file was empty)")
    echo = echo or log.info
    pad = getattr(model.config, "pad_token_id", None) or 0
    rng = random.Random(cfg.seed)
    steps_per_epoch = math.ceil(len(demos) / cfg.batch_size)
    total = steps_per_epoch * cfg.epochs
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                            weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(cfg, s, total))
    bar = None
    if progress and sys.stderr.isatty():  # a bar drawn into a redirected log hides the greppable lines
        from tqdm import tqdm

        bar = tqdm(total=total, desc="sft", unit="step", dynamic_ncols=True)
    model.train()
    epochs: list[dict] = []
    held: list[dict] = []
    step, t0 = 0, time.perf_counter()
    try:
        for epoch in range(cfg.epochs):
            sums: dict[str, list[float]] = {}  # kind -> [summed NLL, action tokens, demos]
            order = list(range(len(demos)))
            rng.shuffle(order)
            for start in range(0, len(order), cfg.batch_size):
                rows = order[start:start + cfg.batch_size]
                opt.zero_grad(set_to_none=True)
                nll, n = backward_batch(model, collate([demos[i] for i in rows], pad_token_id=pad), cfg)
                for i, row_nll, row_n in zip(rows, nll, n):
                    acc = sums.setdefault(demo_kind(demos[i]), [0.0, 0, 0])
                    acc[0] += row_nll
                    acc[1] += row_n
                    acc[2] += 1
                step_nll, tokens = sum(nll), sum(n)
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                opt.step()
                sched.step()
                step += 1
                step_loss = step_nll / tokens
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{step_loss:.3f}")
                elif step % max(1, total // 20) == 0 or step == total:  # greppable progress without a bar
                    log.info("sft step %d/%d loss %.3f (%.0fs)", step, total, step_loss, time.perf_counter() - t0)
                if on_step is not None:
                    on_step(step, step_loss)
                if should_stop is not None and should_stop():
                    raise StopIteration
            epochs.append(_epoch_summary(epoch + 1, sums))
            if heldout:
                held.append(demo_nll(model, heldout))
            echo(_epoch_line(epochs[-1], held[-1] if heldout else None, cfg.epochs))
    except StopIteration:
        pass
    finally:
        if bar is not None:
            bar.close()
        model.eval()
    return {"steps": step, "demos": len(demos), "epochs": epochs, "heldout": held,
            "loss_first": epochs[0]["loss"] if epochs else math.nan,
            "loss_last": epochs[-1]["loss"] if epochs else math.nan, "wall_s": time.perf_counter() - t0}


def backward_batch(model, batch, cfg: SFTConfig) -> tuple[list[float], list[int]]:
    """Accumulate the gradient of :func:`sft_loss` over ``batch`` into ``model`` by length-bucketed micro-batches of
    at most ``cfg.max_tokens_per_microbatch`` padded tokens (each normalised by the whole batch's token counts, so the
    sum is the batch's gradient). Returns each row's summed action-token NLL and action-token count, in row order."""
    from agentenv.trainer.batch import microbatches

    tokens = int(batch.action_mask.sum())
    context = int(batch.attention_mask.sum()) - len(batch) - tokens
    nll_rows, n_rows = [0.0] * len(batch), [0] * len(batch)
    for sub, mb in microbatches(batch, cfg.max_tokens_per_microbatch):
        nll, n, ctx = _row_nll(model, mb, cfg.context_loss_weight)
        loss = nll.sum() / tokens
        if cfg.context_loss_weight:
            loss = loss + cfg.context_loss_weight * ctx.sum() / max(1, context)
        loss.backward()
        for r, i in enumerate(sub):
            nll_rows[i], n_rows[i] = nll[r].item(), int(n[r])
    return nll_rows, n_rows


def _epoch_summary(epoch: int, sums: dict[str, list[float]]) -> dict:
    total = sum(s for s, _, _ in sums.values()), sum(n for _, n, _ in sums.values())
    return {"epoch": epoch, "loss": total[0] / max(1, total[1]),
            "by_kind": {k: {"loss": s / max(1, n), "demos": d} for k, (s, n, d) in sorted(sums.items())}}


def _epoch_line(e: dict, held: dict | None, epochs: int) -> str:
    """One greppable line: the epoch's mean loss per action token, per kind, and the held-out NLL per kind."""
    kinds = ", ".join(f"{k} {v['loss']:.3f}" for k, v in e["by_kind"].items())
    line = f"sft epoch {e['epoch']}/{epochs}: train loss {e['loss']:.3f} per token ({kinds})"
    if held:
        parts = ", ".join(f"{k} {v['nll']:.3f} (worst token {v['worst']:.1f})" for k, v in held.items() if k != "all")
        line += f"; held-out NLL {held['all']['nll']:.3f} ({parts}) on {held['all']['demos']} fresh demos"
    return line


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
    return model.to(sft_device()), tok, rm
