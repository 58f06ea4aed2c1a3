"""One episode's turns, two ways: :class:`TokenTurns` for a sampler (token ids in, token ids out) and
:class:`TextTurns` for a text policy (a scripted expert: messages in, text out).

:func:`agentenv.core.runtime.run_episode` owns the loop (turn limit, env steps, timings, finish reasons); a turns
object owns what differs between the two kinds of policy:

* ``sample(traj, info) -> (action, None)``, or ``(None, reason)`` when a limit leaves no room for another turn;
  exceptions are the policy's (``policy_error``).
* ``overran() -> reason | None``: the turn just sampled stopped at a limit instead of ending itself.
* ``observe(role, obs) -> reason | None``: append the env's answer; a reason when it cannot fit (``context_limit``);
  raises :class:`TemplateFailed` when the chat template fails or rewrites history.
* ``record(role, obs)``: the final observation, kept for reading only.
* ``sync(traj)``: copy what was collected into the trajectory (on every exit, failures included).

The token side keeps the trajectory contract (:mod:`agentenv.core.trajectory`): sampled ids appended verbatim, each
observation only as its chat-template delta, each turn's token budget clipped to the tightest of ``max_new_tokens``,
what is left of ``max_generated_tokens`` and of the context.
"""

from __future__ import annotations

import hashlib

from agentenv.core.chat import ChatSequence
from agentenv.core.policy import CutText, GenerationRequest, SamplingParams
from agentenv.core.trajectory import Trajectory


def mix_seed(*parts) -> int:
    """A 63-bit seed mixed from ``parts`` (their ``str``): e.g. an eval play's ``(eval seed, split, task, play)``,
    a turn's ``(sampling_seed, turn)``. Stable across processes and Python versions, unlike ``hash``."""
    return int.from_bytes(hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()) >> 1


class TemplateFailed(Exception):
    """The chat template failed on (or rewrote history for) an observation; ``cause`` is what it raised."""

    def __init__(self, cause: Exception):
        super().__init__(str(cause))
        self.cause = cause


class TextTurns:
    """A text policy's episode: plain chat messages, ``policy.act(messages, info) -> text``; no tokens. Every turn's
    ``info`` carries the reset's tool schemas (a policy that forwards them, an endpoint, needs them each turn); a
    :class:`~agentenv.core.policy.CutText` reply was cut at its length limit and ends the episode ungraded."""

    def __init__(self, policy, messages: list[dict]):
        self.policy, self.messages = policy, messages
        self.cut = False

    def sample(self, traj: Trajectory, info: dict) -> tuple[str | None, str | None]:
        action = self.policy.act([dict(m) for m in self.messages], {**info, "tools": traj.tools} if traj.tools else info)
        self.cut = isinstance(action, CutText)
        self.messages.append({"role": "assistant", "content": str(action)})
        return action, None

    def overran(self) -> str | None:
        return "max_new_tokens" if self.cut else None

    def observe(self, role: str, obs: str) -> str | None:
        self.messages.append({"role": role, "content": obs})
        return None

    def record(self, role: str, obs: str) -> None:
        self.messages.append({"role": role, "content": obs})

    def sync(self, traj: Trajectory) -> None:
        traj.messages = [dict(m) for m in self.messages]


class TokenTurns:
    """A sampler's episode: ONE token sequence (:class:`~agentenv.core.chat.ChatSequence`), each turn one
    ``generate_fn(GenerationRequest)`` call (a shared :func:`~agentenv.core.serving.request_server`, or the policy
    itself).
    ``cfg`` is the episode's :class:`~agentenv.core.runtime.RolloutConfig` (limits, sampling, template policy)."""

    def __init__(self, policy, cfg, sampling_seed: int | None, generate_fn=None):
        self.cfg, self.sampling_seed = cfg, sampling_seed
        self.seq = ChatSequence(policy.tokenizer, on_rewrite=cfg.on_template_rewrite)
        self.generate = generate_fn or (lambda req: policy.generate([req])[0])
        self.generated = 0  # sampled tokens so far, for max_generated_tokens
        self.limits: dict[str, int] = {}
        self.gen = None

    def start(self, messages: list[dict], tools) -> None:
        """Render the prompt (raises when the template rejects the env's first messages)."""
        self.seq.start(messages, tools)

    def sample(self, traj: Trajectory, info: dict) -> tuple[str | None, str | None]:
        cfg, seq = self.cfg, self.seq
        self.limits = limits = turn_limits(cfg, len(seq), self.generated)
        budget = min(limits.values())
        if budget < 1:
            return None, binding(limits)
        sp = cfg.sampling if budget == cfg.sampling.max_new_tokens else _with_budget(cfg.sampling, budget)
        seed = None if self.sampling_seed is None else mix_seed(self.sampling_seed, traj.num_turns)
        gen = self.generate(GenerationRequest(list(seq.token_ids), sp, cfg.return_entropy, seed))
        if len(gen.token_ids) > budget:
            raise RuntimeError(f"sampler returned {len(gen.token_ids)} tokens, over the budget of {budget}")
        action = seq.add_sampled(gen)
        self.generated += len(gen.token_ids)
        self.gen = gen
        if cfg.return_entropy and gen.entropies is not None:
            traj.meta.setdefault("entropies", []).extend(gen.entropies)
        return action, None

    def overran(self) -> str | None:
        return binding(self.limits) if self.gen.stop_reason == "length" else None

    def observe(self, role: str, obs: str) -> str | None:
        seq = self.seq
        try:
            delta = seq.delta_for(role, obs)
        except Exception as e:  # noqa: BLE001 -- TemplateNotAppendOnly or the template raising: keep the tokens
            seq.messages.append({"role": role, "content": obs})
            raise TemplateFailed(e) from e
        if len(seq) + len(delta.ids) >= self.cfg.max_total_tokens:
            seq.messages.append({"role": role, "content": obs})  # kept for reading; its tokens would not fit
            return "context_limit"
        seq.add_message(role, obs, delta)
        return None

    def record(self, role: str, obs: str) -> None:
        self.seq.messages.append({"role": role, "content": obs})

    def sync(self, traj: Trajectory) -> None:
        seq = self.seq
        traj.token_ids, traj.action_mask = seq.token_ids, seq.action_mask
        traj.behavior_logprobs, traj.policy_version = seq.behavior_logprobs, seq.policy_version
        traj.messages = seq.messages


def turn_limits(cfg, length: int, generated: int) -> dict[str, int]:
    """How many tokens the next turn may sample under each limit, keyed by the finish reason it would give.
    Insertion order breaks ties: the per-turn limit first, then the generation budget, then the context."""
    limits = {"max_new_tokens": cfg.sampling.max_new_tokens}
    if cfg.max_generated_tokens is not None:
        limits["generation_budget"] = cfg.max_generated_tokens - generated
    limits["context_limit"] = cfg.max_total_tokens - length
    return limits


def binding(limits: dict[str, int]) -> str:
    """The finish reason of the tightest limit (the first one on ties)."""
    low = min(limits.values())
    return next(k for k, v in limits.items() if v == low)


def _with_budget(sp: SamplingParams, budget: int) -> SamplingParams:
    return SamplingParams(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, max_new_tokens=budget)
