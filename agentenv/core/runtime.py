"""The multi-turn runtime: (policy, env) -> trajectories that honour the contract in :mod:`agentenv.core.trajectory`.

* :func:`run_episode` plays one episode. The token sequence is a :class:`agentenv.core.chat.ChatSequence`; each turn asks
  the policy for a continuation through ``generate_fn`` (so many episodes can share a batched sampler), appends the
  sampled tokens verbatim, steps the env with their text, and appends only the observation's template delta. What
  differs between a sampler and a text policy is in :mod:`agentenv.core.turns` (a token turn, a text turn).
* Limits end an episode with a finish reason and keep everything collected so far; every limit is a truncation
  (``truncated=True``, never success): ``max_turns``; ``max_new_tokens`` (a turn that did not emit its end-of-turn
  token); ``context_limit`` (the prompt plus the next turn cannot fit in ``max_total_tokens``: the turn budget is
  shrunk to what fits and an observation that would overflow is recorded in ``messages`` but not appended as
  tokens); ``generation_budget`` (the sampled tokens summed over turns reached ``max_generated_tokens``: each turn's
  ``max_new_tokens`` is clipped to what is left). ``env_error`` / ``policy_error`` / ``template_error`` when a call
  raises (the exception text is stored in ``error``; a chat template that fails or rewrites history mid-episode is a
  ``template_error`` with every token collected so far kept).
* Tool counters add up the env's per-step ``info`` (see :mod:`agentenv.envs.base`): well-formed calls, their errors
  and timeouts, malformed blocks, and per-tool call / error counts.
* ``traj.sampling["backend"]`` records the sampler: the policy's ``backend`` attribute (``"hf"``, ``"vllm"``),
  ``"text"`` for non-LLM policies, ``"unknown"`` for a token-level policy that does not say.
* :class:`RolloutEngine` keeps up to ``concurrency`` episodes in flight on threads. Episodes reach the sampler through
  :func:`agentenv.core.serving.request_server`: per request for a sampler that serves continuously (vLLM: a turn
  enters the running engine when asked for and returns when it alone finishes), else through a
  :class:`~agentenv.core.serving.Batcher`, which runs one batched ``policy.generate`` over whatever requests are
  waiting and hands each episode its result as soon as the batch returns. Each episode then steps its own env at
  once. There is no barrier across episodes: a slow env step delays only its own episode.
* Non-LLM :class:`agentenv.core.policy.TextPolicy` policies (scripted experts, a served model behind an endpoint) run
  through the same loop and produce trajectories with messages and outcomes but empty token fields. Every turn's
  ``info`` carries the reset's ``tools``; a :class:`~agentenv.core.policy.CutText` reply ends the episode as
  ``max_new_tokens``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import gymnasium as gym

from agentenv.core.policy import Generation, GenerationRequest, SamplingParams
from agentenv.core.serving import Batcher, PerRequest, request_server  # noqa: F401  (also importable from here)
from agentenv.core.trajectory import Trajectory
from agentenv.core.turns import TemplateFailed, TextTurns, TokenTurns

log = logging.getLogger("agentenv.core.runtime")


@dataclass
class RolloutConfig:
    max_turns: int = 10
    max_total_tokens: int = 4096  # prompt + every turn: the context limit
    sampling: SamplingParams = field(default_factory=SamplingParams)  # max_new_tokens is the per-turn limit
    concurrency: int = 8
    return_entropy: bool = False
    on_template_rewrite: str = "error"  # or "segment", see agentenv.core.chat
    max_generated_tokens: int | None = None  # sampled tokens summed over turns; None = no cap beyond the context

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_total_tokens < 1:
            raise ValueError(f"max_turns and max_total_tokens must be >= 1, got {self.max_turns}, {self.max_total_tokens}")
        if self.max_generated_tokens is not None and self.max_generated_tokens < 1:
            raise ValueError(f"max_generated_tokens must be >= 1 or None, got {self.max_generated_tokens}")
        if self.on_template_rewrite not in ("error", "segment"):
            raise ValueError(f"on_template_rewrite must be 'error' or 'segment', got {self.on_template_rewrite!r}")


@dataclass
class EpisodeSpec:
    """What one episode runs: a seed and optional reset options (e.g. a specific game or question). Not a task: a
    tool env's question/answer row is :class:`agentenv.envs.tasks.Task`; an EpisodeSpec is one play of one.
    ``sampling_seed``: seeds the policy's draws too (turn ``t`` asks with seed ``sampling_seed``, ``t`` mixed), so
    two policies playing the same task draw with common random numbers and the same weights replay the same
    episode (evaluation sets it; training does not)."""

    seed: int | None = None
    options: dict | None = None
    meta: dict = field(default_factory=dict)
    sampling_seed: int | None = None


GenerateFn = Callable[[GenerationRequest], Generation]


def _env_name(env: gym.Env) -> str:
    spec = getattr(env, "spec", None) or getattr(getattr(env, "unwrapped", None), "spec", None)
    return spec.id if spec is not None else type(getattr(env, "unwrapped", env)).__name__


class _Failed(Exception):
    """A call inside the episode raised: the episode ends with ``reason`` and ``cause`` as its error."""

    def __init__(self, reason: str, cause: Exception):
        super().__init__(reason)
        self.reason, self.cause = reason, cause


def run_episode(env: gym.Env, policy, cfg: RolloutConfig, task: EpisodeSpec = EpisodeSpec(),
                generate_fn: GenerateFn | None = None) -> Trajectory:
    """Play one episode. Never raises for env/policy failures: they end the episode with a recorded reason."""
    t_start = time.perf_counter()
    text_policy = not hasattr(policy, "generate")
    backend = getattr(policy, "backend", None) or ("text" if text_policy else "unknown")
    traj = Trajectory(env=_env_name(env), model=getattr(policy, "name", ""), model_path=getattr(policy, "model_path", None),
                      sampling={**cfg.sampling.to_dict(), "backend": backend}, id=uuid.uuid4().hex, meta=dict(task.meta))
    if task.sampling_seed is not None:
        traj.meta["sampling_seed"] = task.sampling_seed
    try:
        t0 = time.perf_counter()
        obs, info = env.reset(seed=task.seed, options=task.options)
        traj.time_env_s += time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 -- recorded, never lost
        return _fail(traj, "env_error", e, t_start)
    traj.task = str(info.get("task", "")) or (f"seed={task.seed}" if task.seed is not None else "")
    traj.task_type = info.get("task_type")
    traj.tools = info.get("tools") or None
    messages = ([{"role": "system", "content": info["system"]}] if info.get("system") else []) + [{"role": "user", "content": obs}]

    if text_policy:
        turns = TextTurns(policy, messages)
    else:
        turns = TokenTurns(policy, cfg, task.sampling_seed, generate_fn)
        try:
            turns.start(messages, traj.tools)
        except Exception as e:  # noqa: BLE001 -- e.g. the template rejects the env's first messages
            traj.messages = [dict(m) for m in messages]
            return _fail(traj, "template_error", e, t_start)
        traj.segments = turns.seq.segments
    try:
        finish = _play(env, turns, cfg, traj, info)
    except _Failed as f:
        turns.sync(traj)
        return _fail(traj, f.reason, f.cause, t_start)
    turns.sync(traj)
    traj.finish_reason = finish
    traj.wall_time_s = time.perf_counter() - t_start
    if not text_policy:
        traj.validate()
    return traj


def _play(env: gym.Env, turns: TextTurns | TokenTurns, cfg: RolloutConfig, traj: Trajectory, info: dict) -> str:
    """Policy turn, env turn, until the episode ends: its finish reason. A limit sets ``truncated``; a call that
    raises becomes :class:`_Failed`."""
    while True:
        if traj.num_turns >= cfg.max_turns:
            traj.truncated = True
            return "max_turns"
        t0 = time.perf_counter()
        try:
            action, limit = turns.sample(traj, info)
        except Exception as e:  # noqa: BLE001
            traj.time_generation_s += time.perf_counter() - t0
            raise _Failed("policy_error", e) from e
        if limit is not None:  # no room left for another turn
            traj.truncated = True
            return limit
        traj.time_generation_s += time.perf_counter() - t0
        traj.num_turns += 1
        if (limit := turns.overran()) is not None:
            traj.truncated = True
            return limit
        t0 = time.perf_counter()
        try:
            obs, reward, terminated, truncated, info = env.step(action)
        except Exception as e:  # noqa: BLE001
            traj.time_env_s += time.perf_counter() - t0
            raise _Failed("env_error", e) from e
        traj.time_env_s += time.perf_counter() - t0
        traj.reward += float(reward)
        _count_tools(traj, info)
        role = info.get("role", "user")
        if terminated or truncated:
            traj.terminated, traj.truncated = bool(terminated), bool(truncated) and not terminated
            traj.success = bool(info.get("success", False))
            traj.tool_call_before_answer = bool(info.get("tool_call_before_answer", traj.num_tool_calls > 0))
            turns.record(role, obs)
            return info.get("finish_reason") or ("done" if terminated else "max_turns")
        try:
            limit = turns.observe(role, obs)
        except TemplateFailed as e:
            raise _Failed("template_error", e.cause) from e
        if limit is not None:
            traj.truncated = True
            return limit


def _count_tools(traj: Trajectory, info: dict) -> None:
    """Add one env step's tool counters (see agentenv.envs.base) to the trajectory's episode totals."""
    traj.num_tool_calls += int(info.get("tool_calls", 0))
    traj.num_tool_errors += int(info.get("tool_errors", 0))
    traj.num_tool_timeouts += int(info.get("tool_timeouts", 0))
    traj.num_tool_malformed += int(info.get("tool_malformed", 0))
    traj.num_invalid_actions += int(bool(info.get("invalid_action", False)))
    for src, dst in (("tool_calls_by_name", traj.tool_calls_by_name), ("tool_errors_by_name", traj.tool_errors_by_name)):
        for name, n in (info.get(src) or {}).items():
            dst[str(name)] = dst.get(str(name), 0) + int(n)


class EpisodeCancelled(Exception):
    """Raised inside an episode's generate / act call once its caller has given up on it (a loop's timeout, a
    crashed worker, shutdown). The episode ends as a ``policy_error`` like any sampler failure, but it is the
    caller's decision, not a fault: logged at INFO as a cancellation, and the caller discards the result."""


def _fail(traj: Trajectory, reason: str, exc: BaseException, t_start: float) -> Trajectory:
    if isinstance(exc, EpisodeCancelled):
        log.info("episode %s cancelled by its caller (%s); its result is discarded", traj.id[:8], exc)
    else:
        log.warning("episode %s ended with %s: %s", traj.id[:8], reason, exc)
    traj.finish_reason, traj.truncated, traj.success = reason, True, False
    traj.error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    traj.wall_time_s = time.perf_counter() - t_start
    return traj


class RolloutEngine:
    """Runs episodes concurrently and yields trajectories in completion order.

    ``make_env`` builds one env per worker thread (envs are not shared across threads). ``tasks`` is any iterable of
    :class:`EpisodeSpec`; the engine pulls the next task as soon as a worker is free, so ``concurrency`` episodes stay in
    flight. Every started task yields exactly one trajectory, failures included.
    """

    def __init__(self, make_env: Callable[[], gym.Env], policy, cfg: RolloutConfig):
        self.make_env, self.policy, self.cfg = make_env, policy, cfg
        self.batcher = request_server(policy) if hasattr(policy, "generate") else None

    def run(self, tasks: Iterable[EpisodeSpec]) -> Iterator[Trajectory]:
        task_iter = iter(tasks)
        task_lock = threading.Lock()
        out: queue.Queue = queue.Queue()
        stop = threading.Event()

        def generate(req: GenerationRequest) -> Generation:
            if stop.is_set():  # the consumer went away (Ctrl-C, an error): end this episode at its next turn
                raise RuntimeError("rollout stopped")
            return self.batcher(req)

        def worker() -> None:
            env = None
            try:
                env = self.make_env()
                while not stop.is_set():
                    with task_lock:
                        task = next(task_iter, None)
                    if task is None:
                        break
                    out.put(run_episode(env, self.policy, self.cfg, task, generate if self.batcher else None))
            except Exception as e:  # noqa: BLE001 -- a worker that cannot even build its env reports once
                log.error("rollout worker failed: %s", e)
                out.put(e)
            finally:
                if env is not None:
                    try:
                        env.close()
                    except Exception:  # noqa: BLE001
                        pass
                out.put(None)

        threads = [threading.Thread(target=worker, name=f"agentenv-episode-{i}", daemon=True)
                   for i in range(max(1, self.cfg.concurrency))]
        for t in threads:
            t.start()
        live = len(threads)
        try:
            while live:
                item = out.get()
                if item is None:
                    live -= 1
                elif isinstance(item, Exception):
                    raise RuntimeError(f"could not build the environment: {item}") from item
                else:
                    yield item
        finally:
            stop.set()
            if self.batcher is not None:
                self.batcher.fail_pending("rollout stopped")
            # Join the episode threads before returning (also on Ctrl-C): a thread left inside a torch kernel while
            # the interpreter exits aborts the process ("terminate called without an active exception").
            deadline = time.monotonic() + 30
            for t in threads:
                t.join(timeout=max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.close()


def run_episodes(make_env: Callable[[], gym.Env], policy, n: int, cfg: RolloutConfig, *, seed: int = 0,
                 tasks: Iterable[EpisodeSpec] | None = None, progress: bool = False,
                 on_trajectory: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
    """Run ``n`` episodes (seeds ``seed, seed+1, ...`` unless ``tasks`` is given) and return them in completion order."""
    tasks = list(tasks) if tasks is not None else [EpisodeSpec(seed=seed + i) for i in range(n)]
    engine = RolloutEngine(make_env, policy, cfg)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(tasks), desc="episodes", unit="ep", dynamic_ncols=True)
    out: list[Trajectory] = []
    try:
        for traj in engine.run(tasks):
            out.append(traj)
            if on_trajectory is not None:
                on_trajectory(traj)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(success=f"{sum(t.success for t in out) / len(out):.2f}")
    finally:
        engine.close()
        if bar is not None:
            bar.close()
    return out
