"""Demonstrations for any env, written as OpenAI-format chats, rendered exactly as the env renders a live episode
(``agentenv sft --env MODULE:ENV_ID --demos FILE.jsonl``).

File format (JSONL, one demo a line)::

    {"task_index": 0, "messages": [
        {"role": "user", "content": "<the env's question for task 0>"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"type": "function", "function": {"name": "lookup", "arguments": {"item": "apple"}}}]},
        {"role": "tool", "content": "0.5"},
        {"role": "assistant", "content": "\\\\boxed{60}"}]}

The conversation after the system prompt: the ``user`` question, then assistant turns (``content`` and/or
``tool_calls``; ``arguments`` a JSON object or its JSON text) and the observations between them (``tool``
messages, one per call, in call order, or ``user`` messages for envs that answer as the user). Observations may be
left out (the env's own are used); given, they must equal the env's.

Contract of :func:`load_env_demos`:

* Each demo is PLAYED: the env is reset with ``{"task_index": i}`` and the runtime (:func:`agentenv.core.runtime.
  run_episode`) runs it with a token-level policy that emits each assistant turn as its tokens plus the end-of-turn
  token (tool calls as the Hermes ``<tool_call>`` blocks the env parses, built as :func:`agentenv.samplers.endpoint.
  reply_to_action` builds them). So the system prompt, tool schemas, template glue and observation tokens are
  exactly those of a live episode: SFT trains on the tokens RL will see. Reward and ``success`` are the env's.
* A demo that does not match the env raises :class:`DemoError`, one line: ``FILE:LINE: FIELD: what is wrong`` --
  not JSON, a task index out of range, a question other than the env's for that task, a system message (the env
  supplies its own), a call to a tool the env does not have, arguments that are not a JSON object, an observation
  other than the env's, turns after the env ended the episode, or an episode that failed to play.
* A demo longer than ``max_tokens`` is skipped and counted (its tokens would not fit a rollout either).

:func:`demo_from_trajectory` is the other direction (``agentenv rollout --demos FILE``): a played episode as a demo
line -- the chat after the system prompt up to its last assistant turn, assistant turns with structured
``tool_calls`` (:func:`agentenv.samplers.endpoint.to_openai_messages`), one ``tool`` message per call (the results
of malformed calls, which have no call to answer, are left out: the env's own are used when it is played). Played
again it gives the same turns and rewards; an episode that cannot be a demo (it failed, or its last turn was cut at
its length limit) gives None.
"""

from __future__ import annotations

import json
from pathlib import Path

from agentenv.core.policy import Generation


class DemoError(ValueError):
    """A demo does not match its env; the message names the file, line and field."""


class _Player:
    """A token-level policy that emits given assistant texts, one per turn (log-prob 0: a deterministic demonstrator)."""

    backend, name, model_path, policy_version = "demo", "demo", None, 0

    def __init__(self, tokenizer, actions: list[str]):
        self.tokenizer, self.actions = tokenizer, list(actions)

    def generate(self, requests):
        out = []
        for _ in requests:
            ids = self.tokenizer(self.actions.pop(0), add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            out.append(Generation(token_ids=ids, logprobs=[0.0] * len(ids), stop_reason="stop"))
        return out


def _tool_text(calls: list[str], contents: list[str]) -> str:
    """Per-call results joined the way :class:`agentenv.envs.tool_env.ToolEnv` joins them into one message."""
    if len(contents) == 1:
        return contents[0]
    return "\n\n".join(f"[{i}] {n}:\n{c}" for i, (n, c) in enumerate(zip(calls, contents), 1))


def _calls(m: dict, where: str, tools: set[str] | None) -> list[str]:
    """The names of an assistant message's tool calls, each checked (known tool, arguments a JSON object)."""
    calls = m.get("tool_calls") or []
    if not calls and not isinstance(m.get("content"), str):
        raise DemoError(f"{where}: an assistant turn needs content or tool_calls")
    names = []
    for k, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        field = f"{where}.tool_calls[{k}].function"
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise DemoError(f"{field}.name: each tool call needs a function name")
        if tools is not None and fn["name"] not in tools:
            raise DemoError(f"{field}.name: unknown tool {fn['name']!r}; the env's tools: {', '.join(sorted(tools)) or 'none'}")
        args = fn.get("arguments", {})
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError as e:
            raise DemoError(f"{field}.arguments: not JSON ({e})") from None
        if not isinstance(args, dict):
            raise DemoError(f"{field}.arguments: not a JSON object")
        names.append(fn["name"])
    return names


def _parse(demo, where: str, n_tasks: int, tools: set[str] | None):
    """-> (task_index, actions, observations): per action but the last, the demo's observation after it
    (``{"role", "texts", "first": message index, "names": the calls it answers}``) or None where left out."""
    from agentenv.samplers.endpoint import reply_to_action

    if not isinstance(demo, dict) or not isinstance(demo.get("messages"), list) or not demo["messages"]:
        raise DemoError(f"{where}: messages: expected {{\"task_index\": i, \"messages\": [...]}} with a non-empty list")
    i = demo.get("task_index")
    if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n_tasks:
        raise DemoError(f"{where}: task_index: {i!r} is not a task index of this env (0..{n_tasks - 1})")
    msgs = demo["messages"]
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "tool"):
            role = m.get("role") if isinstance(m, dict) else m
            hint = "; the env supplies its own system prompt, leave it out" if role == "system" else ""
            raise DemoError(f"{where}: messages[{j}].role: {role!r} is not user, assistant or tool{hint}")
    if msgs[0]["role"] != "user":
        raise DemoError(f"{where}: messages[0].role: a demo starts with the user question, not {msgs[0]['role']!r}")
    actions, names, observations, pending = [], [], [], None
    for j, m in enumerate(msgs[1:], 1):
        if m["role"] == "assistant":
            if actions:
                observations.append(pending)  # None: left out, the env's own is used
            names = _calls(m, f"{where}: messages[{j}]", tools)
            actions.append(reply_to_action(m))
            pending = None
        elif not actions:
            raise DemoError(f"{where}: messages[{j}]: one user question, then an assistant turn")
        else:
            if not isinstance(m.get("content"), str):
                raise DemoError(f"{where}: messages[{j}].content: an observation needs text content")
            if pending is None:
                pending = {"role": m["role"], "texts": [], "first": j, "names": names}
            elif pending["role"] != m["role"]:
                raise DemoError(f"{where}: messages[{j}].role: {m['role']!r} after {pending['role']!r} observations")
            pending["texts"].append(m["content"])
            if m["role"] == "tool" and len(pending["texts"]) > max(1, len(names)):
                raise DemoError(f"{where}: messages[{j}]: more tool messages than the calls before them")
    if msgs[-1]["role"] != "assistant":
        raise DemoError(f"{where}: messages[{len(msgs) - 1}]: a demo ends with an assistant turn (nothing to learn "
                        "after it)")
    return i, actions, observations


def env_demos(env: str, path: str | Path, tokenizer, **kw) -> list:
    """The demos of ``path`` played in ``env`` (an alias, gymnasium id or ``MODULE:ENV_ID``), built with the
    constructor arguments of the env's preset, as ``agentenv run --env`` builds it; raises :class:`DemoError`."""
    import logging

    from agentenv.core.config import load_config
    from agentenv.envs import spec
    from agentenv.run.episodes import env_factory

    cfg = load_config(spec.default_preset(spec.resolve(env)), [], [f"env.id={env}"])
    trajs, skipped = load_env_demos(path, env_factory(cfg), tokenizer, **kw)
    if any(skipped.values()):
        logging.getLogger("agentenv.run.sft").info("demos: kept %d, skipped %s", len(trajs), skipped)
    if not trajs:
        raise DemoError(f"{path}: no demo to train on (skipped: {skipped}; --all keeps unsuccessful demos)")
    return trajs


def load_env_demos(path: str | Path, make_env, tokenizer, *, max_tokens: int = 4096, only_successful: bool = True,
                   limit: int | None = None) -> tuple[list, dict]:
    """Play every demo of ``path`` (the first ``limit``) in ``make_env()`` (see the module docstring) ->
    (trajectories, skipped counts)."""
    from agentenv.envs import spec
    from agentenv.core.policy import SamplingParams
    from agentenv.core.runtime import RolloutConfig, EpisodeSpec, run_episode

    if path is None or not Path(path).is_file():
        raise FileNotFoundError(f"--env needs --demos FILE.jsonl of chat demos (docs/tool_envs.md); got {path!r}")
    path = Path(path)
    env = make_env()
    out, skipped = [], {"failed": 0, "too_long": 0}
    try:
        n_tasks = len(spec.task_options(env) or [])
        if not n_tasks:
            raise DemoError(f"{path}: this env has no task list (reset options task_index), so demos cannot name tasks")
        raw_tools = getattr(env.unwrapped, "tools", None)
        tools = set(raw_tools) if isinstance(raw_tools, dict) else None
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            if limit is not None and len(out) + sum(skipped.values()) >= limit:
                break
            where = f"{path}:{lineno}"
            try:
                demo = json.loads(line)
            except json.JSONDecodeError as e:
                raise DemoError(f"{where}: not JSON ({e})") from None
            i, actions, observations = _parse(demo, where, n_tasks, tools)
            cfg = RolloutConfig(max_turns=len(actions), max_total_tokens=max_tokens, concurrency=1,
                                sampling=SamplingParams(max_new_tokens=max_tokens))
            traj = run_episode(env, _Player(tokenizer, actions), cfg, EpisodeSpec(seed=i, options={"task_index": i}))
            _check(traj, i, demo["messages"], actions, observations, where)
            if traj.finish_reason == "context_limit":
                skipped["too_long"] += 1
            elif only_successful and not traj.success:
                skipped["failed"] += 1
            else:
                traj.meta.update(demo_line=lineno, task=i)
                out.append(traj)
    finally:
        env.close()
    return out, skipped


def _check(traj, i: int, msgs: list[dict], actions: list[str], observations: list, where: str) -> None:
    """The played episode against the demo: question, observations, and that every turn was played."""
    if traj.finish_reason in ("env_error", "policy_error", "template_error"):
        raise DemoError(f"{where}: the demo could not be played ({traj.finish_reason}): {traj.error}")
    played = [m for m in traj.messages if m["role"] != "system"]
    if played[0]["content"] != msgs[0]["content"]:
        raise DemoError(f"{where}: messages[0].content: the env's question for task_index {i} is "
                        f"{played[0]['content']!r}, the demo has {msgs[0]['content']!r}")
    if traj.num_turns < len(actions) and traj.finish_reason != "context_limit":
        last = [j for j, m in enumerate(msgs) if m["role"] == "assistant"][traj.num_turns - 1]
        raise DemoError(f"{where}: messages[{last + 1}]: the env ended the episode after messages[{last}] "
                        f"(finish_reason {traj.finish_reason}); nothing may follow it")
    env_obs = [m for m in played[1:] if m["role"] != "assistant"]
    for ob, got in zip(observations, env_obs):
        if ob is None:
            continue
        tool = ob["role"] == "tool"
        want = _tool_text(ob["names"], ob["texts"]) if tool and ob["names"] else "\n\n".join(ob["texts"])
        if got["role"] != ob["role"] or got["content"] != want:
            raise DemoError(f"{where}: messages[{ob['first']}]: the env answered {got['role']} {got['content'][:200]!r}, "
                            f"the demo has {ob['role']} {want[:200]!r}")


def demo_from_trajectory(traj, task_index: int) -> dict | None:
    """A played episode as a demo line (see the module docstring), or None when it cannot be one."""
    from agentenv.samplers.endpoint import to_openai_messages

    if traj.finish_reason in ("env_error", "policy_error", "template_error", "max_new_tokens"):
        return None
    msgs = [m for m in traj.messages if m["role"] != "system"]
    last = max((j for j, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
    if last is None or msgs[0]["role"] != "user":
        return None
    out = [{"role": "user", "content": msgs[0]["content"]}]
    for j in range(1, last + 1):
        m = msgs[j]
        if m["role"] == "assistant":
            obs = msgs[j + 1] if j < last and msgs[j + 1]["role"] == "tool" else None
            turn = to_openai_messages([m] + ([obs] if obs else []))
            out += [x for x in turn if x["role"] != "user"]  # a "user" here answers malformed calls: left out
        elif m["role"] != "tool":  # tool results were taken with their call above
            out.append({"role": m["role"], "content": m["content"]})
    return {"task_index": task_index, "messages": out}

