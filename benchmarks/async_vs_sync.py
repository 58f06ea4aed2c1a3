"""Async single-rollout vs synchronous groups (G = 8) under heavy-tailed env latency, through the REAL training loop.

Both runs drive :class:`agentenv.trainer.loop.Trainer` (workers, dispatch, completion buffer, accounting,
metrics) unchanged; the env and the learner are stand-ins so the measurement is about scheduling:

* env: each step sleeps a lognormal latency (median ``--median-ms``, shape ``--sigma``; p99/p50 = exp(2.326 sigma),
  the measured ratio over all steps actually taken is printed), ``--turns`` steps per episode;
* policy (``--sampler``): ``instant``, a text policy that answers at once (generation cost ~0, env latency is the
  whole rollout time); ``hf`` or ``vllm``, the tiny model (``--model``) really generating (at most
  ``--max-new-tokens`` per turn) through the sampler the training loop would use (``HFPolicyFactory`` /
  ``VLLMPolicyFactory``; ``vllm`` needs vLLM, on CPU ``scripts/install_vllm_cpu.sh``), token sequences, behaviour
  log-probs and weight publishing included. A randomly initialised model almost never samples its end-of-turn
  token, and a turn cut at the token limit ends the episode before the env is ever stepped; so the model's
  end-of-turn output row is first pointed along its mean final hidden state and scaled until a turn lasts
  ~``--turn-tokens`` tokens (:func:`chatty_checkpoint`): turns then end on their own and every
  episode steps the env ``--turns`` times. The printed ``tokens/turn`` is what was actually sampled;
* learner: sleeps ``--learner-s`` per update (a fixed-cost GPU step: on a CPU a real step would compete with
  generation for the same cores) and bumps the policy version; with a real sampler it publishes the model's real
  state dict after every update, so each update also pays a real weight sync (``time_publish_s``).

Same workers x concurrency for both; batch = all rollout slots. Reported: trajectories consumed per second, the
learner's busy fraction (time inside update / wall time since the loop started, fill-up included) and ``ms/turn``:
how long an episode waited for each turn's tokens (request to result, so batching delays count; the vLLM sampler
serves requests continuously, the HF one in gathered batches).
Last line: ``async/sync throughput ratio: X; learner busy async A%, sync S%``.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import threading
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
from agentenv.core.config import LoopConfig
from agentenv.trainer.loop import Trainer

from agentenv.core.policy import SamplingParams
from agentenv.core.runtime import EpisodeSpec, RolloutConfig

_LAT_LOCK = threading.Lock()
LATENCIES: list[float] = []


class SlowEnv(gym.Env):
    """A text env whose steps take a heavy-tailed time. Reward 1 on the last turn with probability 1/2."""

    metadata = {"render_modes": []}  # noqa: RUF012 -- gymnasium's class attribute

    def __init__(self, median_s: float, sigma: float, turns: int):
        self.median_s, self.sigma, self.turns = median_s, sigma, turns
        self.rng = np.random.default_rng()
        self.t = 0

    def reset(self, *, seed=None, options=None):
        self.rng = np.random.default_rng([seed or 0, int(time.perf_counter_ns() % 2**32)])
        self.t = 0
        return "go", {"task": f"sim-{seed}"}

    def step(self, action):
        lat = self.median_s * float(np.exp(self.sigma * self.rng.standard_normal()))
        time.sleep(lat)
        with _LAT_LOCK:
            LATENCIES.append(lat)
        self.t += 1
        done = self.t >= self.turns
        return "ok", float(done and self.rng.random() < 0.5), done, False, {"success": done}


class InstantPolicy:
    """Text policy stand-in: answers at once; keeps the published version like a real sampler."""

    name = "instant"

    def __init__(self, worker_index: int = 0):
        self.policy_version = 0

    def act(self, messages, info) -> str:
        return "step"

    def load_weights(self, state_dict, version):
        self.policy_version = version


class SleepLearner:
    """Learner stand-in with the Learner's interface: a fixed-duration update, one version bump per batch; it exports
    ``weights`` (the model's own state dict for a real sampler, so every publish is a real weight load)."""

    def __init__(self, seconds: float, weights: dict | None = None):
        self.seconds, self.policy_version, self.step = seconds, 0, 0
        self.weights = weights or {}

    def update(self, trajectories):
        time.sleep(self.seconds)
        self.step += 1
        self.policy_version += 1
        return {"num_admitted": len(trajectories), "loss": 0.0}

    def export_weights(self):
        return self.weights

    def state_dict(self):
        return {"step": self.step, "policy_version": self.policy_version}

    def load_state_dict(self, s):
        self.step, self.policy_version = s["step"], s["policy_version"]


DEFAULT_MODEL = {"hf": "tiny-bpe:128x2", "vllm": "tiny:128x2"}  # vLLM's CPU attention needs head size >= 32


def policy_factory(args):
    """The sampler factory the training loop takes (``make_policy(worker_index)``), or the instant stand-in."""
    if args.sampler == "instant":
        return InstantPolicy
    if args.sampler == "hf":
        from agentenv.samplers.factory import HFPolicyFactory

        return HFPolicyFactory(args.model, seed=0, device="cpu" if args.cpu else None, dtype="float32")
    from agentenv.samplers.vllm_policy import VLLMPolicyFactory

    kv = dict(kv_cache_gb=1.0, enforce_eager=True) if args.cpu else {}
    return VLLMPolicyFactory(args.model, seed=0, dtype="float32" if args.cpu else "bfloat16",
                             max_model_len=args.max_total_tokens, **kv)


def chatty_checkpoint(name: str, out: Path, turn_tokens: float) -> Path:
    """Save ``name`` to ``out`` (untied) with its end-of-turn output row pointed along the mean final
    hidden state and scaled so that a turn lasts ~turn_tokens tokens (bisection on the scale, the expected length
    computed from the model's own sampled continuations of a rendered chat). Everything else is the model
    unchanged."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentenv.samplers.models import resolve_model

    path = resolve_model(name).path
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    eos = tok.eos_token_id
    text = tok.apply_chat_template([{"role": "user", "content": "go"}, {"role": "assistant", "content": "step"},
                                    {"role": "user", "content": "ok"}], add_generation_prompt=True, tokenize=False)
    prompt = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    n = prompt.shape[1]
    torch.manual_seed(0)
    if model.config.tie_word_embeddings:  # untie: eos is also an INPUT token (every message ends with it), and only
        model.config.tie_word_embeddings = False  # its output row may change
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    head = model.get_output_embeddings().weight
    with torch.no_grad():  # calibrate on the model's own samples: the hidden states it produces when generating
        ids = model.generate(prompt.repeat(8, 1), attention_mask=torch.ones_like(prompt).repeat(8, 1), do_sample=True,
                             top_k=0, top_p=1.0, max_new_tokens=64, min_new_tokens=64, pad_token_id=eos)
        h = model.model(ids).last_hidden_state[:, n - 1:-1]  # [8, 64] final-norm states: what the head sees
        u = h.mean((0, 1)) / h.mean((0, 1)).norm()
        others = torch.cat([head[:eos], head[eos + 1:]])
        lse_others = torch.logsumexp(h @ others.T, dim=-1)

        def mean_turn_length(c: float) -> float:  # E[tokens until eos] along each sample, eos counted
            p_eos = torch.sigmoid(c * (h @ u) - lse_others)
            survive = torch.cumprod(torch.cat([torch.ones(8, 1), 1 - p_eos[:, :-1]], dim=1), dim=1)
            return survive.sum(1).mean().item()

        lo, hi = 0.0, 1e4
        for _ in range(60):  # the mean turn length falls as the scale grows
            c = (lo + hi) / 2
            lo, hi = (c, hi) if mean_turn_length(c) > turn_tokens else (lo, c)
        head[eos] = c * u
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def model_weights(path: str) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run(mode: str, args, make_policy, weights: dict) -> dict:
    slots = args.workers * args.concurrency
    cfg = LoopConfig(mode=mode, batch_size=slots, group_size=args.group_size if mode == "sync_grpo" else 1,
                     queue_size=args.queue_size, num_workers=args.workers, concurrency=args.concurrency,
                     total_updates=args.async_updates if mode == "async" else args.sync_updates,
                     seed=0, poll_interval_s=0.002, episode_timeout_s=600.0)
    rollout = RolloutConfig(max_turns=args.turns + 1, max_total_tokens=args.max_total_tokens,
                            sampling=SamplingParams(max_new_tokens=args.max_new_tokens))
    tr = Trainer(cfg, rollout=rollout, make_env=lambda: SlowEnv(args.median_ms / 1000, args.sigma, args.turns),
                 make_policy=make_policy, learner=SleepLearner(args.learner_s, weights),
                 tasks=[EpisodeSpec(seed=i) for i in range(4096)])
    s = tr.run()
    hist = tr.history
    s["lag_mean"] = float(np.mean([m["lag_mean"] for m in hist])) if hist else 0.0
    s["lag_max"] = max((m["lag_max"] for m in hist), default=0)
    s["publish_s"] = float(np.mean([m["time_publish_s"] for m in hist])) if hist else 0.0
    s["tokens"] = sum(m["policy_tokens_mean"] * m["batch_size"] for m in hist)
    s["turns"] = sum(m["turns_mean"] * m["batch_size"] for m in hist)
    s["gen_s"] = sum(m["time_generation_s"] for m in hist)  # summed over trajectories: each turn's wait for its tokens
    return s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=16, help="episodes in flight per worker")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--queue-size", type=int, default=2)
    p.add_argument("--turns", type=int, default=4, help="env steps per episode")
    p.add_argument("--median-ms", type=float, default=15.0)
    p.add_argument("--sigma", type=float, default=1.2, help="lognormal shape; p99/p50 = exp(2.326 sigma)")
    p.add_argument("--learner-s", type=float, default=0.25, help="stand-in learner seconds per update")
    p.add_argument("--async-updates", type=int, default=40)
    p.add_argument("--sync-updates", type=int, default=12)
    p.add_argument("--sampler", choices=["instant", "hf", "vllm"], default="instant",
                   help="instant: no generation cost; hf / vllm: the tiny model generates through that sampler")
    p.add_argument("--model", default=None, help="model for --sampler hf/vllm (default: tiny-bpe:128x2 for hf, "
                                                "tiny:128x2 for vllm)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="per turn, at most (real samplers)")
    p.add_argument("--turn-tokens", type=float, default=6.0, help="mean sampled tokens per turn to aim for")
    p.add_argument("--max-total-tokens", type=int, default=1024, help="per trajectory (real samplers)")
    p.add_argument("-v", "--verbose", action="store_true", help="log every update")
    args = p.parse_args()
    args.model = args.model or DEFAULT_MODEL.get(args.sampler)
    import torch

    args.cpu = not torch.cuda.is_available()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    logging.getLogger("agentenv.core.runtime").setLevel(logging.ERROR)  # episodes cancelled at shutdown are expected

    slots = args.workers * args.concurrency
    print(f"workers={args.workers} concurrency={args.concurrency} (slots={slots}) batch={slots} G={args.group_size} "
          f"Q={args.queue_size} turns={args.turns} step~lognormal(median={args.median_ms}ms, sigma={args.sigma}) "
          f"learner={args.learner_s}s/update sampler={args.sampler}"
          + (f" model={args.model} max_new_tokens={args.max_new_tokens} ({'cpu' if args.cpu else 'cuda'})"
             if args.sampler != "instant" else ""))
    weights = {}
    tmp = tempfile.TemporaryDirectory(prefix="agentenv-bench-")  # the chatty checkpoint; removed at exit
    if args.sampler != "instant":
        args.model = str(chatty_checkpoint(args.model, Path(tmp.name) / "model", args.turn_tokens))
        weights = model_weights(args.model)
    make_policy = policy_factory(args)
    if args.sampler == "vllm":  # one engine for both runs: its start-up (tens of seconds on CPU) is not scheduling
        engine = make_policy(0)
        make_policy = lambda worker_index: engine  # noqa: E731 -- the local backend calls it once per run
    res = {}
    for mode in ("async", "sync_grpo"):
        t0 = time.perf_counter()
        res[mode] = run(mode, args, make_policy, weights)
        res[mode]["wall"] = time.perf_counter() - t0
    lat = np.array(LATENCIES)
    p50, p99 = np.percentile(lat, 50), np.percentile(lat, 99)
    print(f"env step latency over {len(lat)} steps: p50={p50 * 1000:.1f}ms p99={p99 * 1000:.1f}ms "
          f"p99/p50={p99 / p50:.1f}")
    print(f"{'mode':<12}{'updates':>8}{'traj/s':>10}{'learner busy':>14}{'lag mean':>10}{'lag max':>9}{'wall s':>8}"
          f"{'tok/s':>9}{'tok/turn':>10}{'ms/turn':>9}{'publish s':>11}")
    for mode, s in res.items():
        print(f"{mode:<12}{s['updates']:>8}{s['traj_per_s']:>10.2f}{100 * s['learner_busy']:>13.1f}%"
              f"{s['lag_mean']:>10.2f}{s['lag_max']:>9}{s['wall']:>8.1f}{s['tokens'] / s['wall']:>9.1f}"
              f"{s['tokens'] / max(1, s['turns']):>10.1f}{1000 * s['gen_s'] / max(1, s['turns']):>9.0f}"
              f"{s['publish_s']:>11.3f}")
        assert s["accounting_balance"] == 0, s
    a, b = res["async"], res["sync_grpo"]
    print(f"async/sync throughput ratio: {a['traj_per_s'] / b['traj_per_s']:.2f}; "
          f"learner busy async {100 * a['learner_busy']:.1f}%, sync {100 * b['learner_busy']:.1f}%")


if __name__ == "__main__":
    main()
