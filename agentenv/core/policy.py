"""Policy (sampler) protocol.

A policy turns token-id prompts into sampled continuations. Contract for every backend:

* ``generate(requests)`` takes a list of :class:`GenerationRequest` (one per episode that wants its next assistant
  turn; prompts may have different lengths) and returns one :class:`Generation` per request, in order.
* ``Generation.token_ids`` are exactly the tokens the sampler drew, ending with the end-of-turn token when the model
  stopped by itself (``stop_reason == "stop"``) or cut at ``max_new_tokens`` (``stop_reason == "length"``).
* ``Generation.logprobs[k]`` is log mu(token_k): the log-probability of that token under the distribution the sampler
  ACTUALLY drew from, i.e. after temperature scaling and top-k / top-p truncation and renormalisation. A learner can
  use it as the behaviour policy mu of importance sampling without any correction.
* ``Generation.entropies`` (only when ``request.return_entropy``) is the entropy of that same processed distribution
  at each sampled position.
* ``policy_version`` is the version of the weights that produced every token of this generation.
* ``submit(request) -> concurrent.futures.Future[Generation]`` (optional): a sampler that serves continuously (vLLM)
  takes each request on its own and resolves it as soon as it finishes; the runtime then calls it per request
  instead of gathering batches (:func:`agentenv.core.serving.request_server`). ``generate`` must still work.
* ``GenerationRequest.seed`` (optional) fixes the request's random draws: the same seed, prompt and distribution give
  the same tokens whatever else is batched with it (to float rounding). Evaluation seeds each (task, play, turn):
  the same weights score the same, and the evaluations before and after training draw with common random numbers;
  training requests carry no seed (the sampler's own stream: a prompt issued again is a fresh draw).

* ``backend`` (optional class attribute) names the sampler: ``"hf"`` (:class:`agentenv.samplers.hf_policy.HFPolicy`),
  ``"vllm"``; the runtime records it in every trajectory's ``sampling["backend"]`` (``"text"`` for a
  :class:`TextPolicy`, ``"unknown"`` for a token-level policy that does not set it).
* A turn stops on any of the sampler's stop ids; ``agentenv.core.chat`` closes the turn the way the chat template does
  whichever stop id was sampled.

Policies never see chat messages: the runtime owns the token sequence (see :mod:`agentenv.core.chat`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Protocol, Sequence, runtime_checkable


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings. ``top_k=0`` and ``top_p=1.0`` mean "off"; nothing else is ever applied silently."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256

    def __post_init__(self) -> None:
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens!r}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    sampling: SamplingParams
    return_entropy: bool = False
    seed: int | None = None  # see the module docstring


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" (end-of-turn token sampled) or "length" (max_new_tokens reached)
    policy_version: int = 0
    entropies: list[float] | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"sampler returned {len(self.token_ids)} tokens but {len(self.logprobs)} log-probs; they must align 1:1"
            )
        if self.stop_reason not in ("stop", "length"):
            raise ValueError(f"unknown stop_reason {self.stop_reason!r}")


@runtime_checkable
class Policy(Protocol):
    """Token-level sampler used by :mod:`agentenv.core.runtime`."""

    name: str  # model name (alias or hub id), recorded as ``model`` in trajectories
    model_path: str | None  # local directory AutoModelForCausalLM.from_pretrained can load, or None
    tokenizer: object  # a transformers tokenizer with a chat template
    policy_version: int

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]: ...


@runtime_checkable
class TextPolicy(Protocol):
    """A non-LLM policy (scripted expert, human) that answers with text. The runtime records its messages,
    reward and outcome but no token-level fields (there is no sampler distribution to record). A policy whose turn
    was cut at its length limit returns a :class:`CutText`: the runtime then ends the episode as ``max_new_tokens``
    (truncated, never graded), as it does for a token-level sampler's ``stop_reason == "length"``."""

    name: str

    def act(self, messages: list[dict], info: dict) -> str: ...


class CutText(str):
    """The text of a turn that hit its length limit before the model ended it (see :class:`TextPolicy`)."""
