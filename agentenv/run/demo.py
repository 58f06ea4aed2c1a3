"""The CPU demo task: multiplications that are (nearly) impossible without the Python tool and trivial with it.

Contract:

* :func:`demo_tasks` -- ``"What is A * B?"`` with A in [3000, 9999] and B in [34, 99], so the product always has 6
  digits. Guessing it is ~hopeless; ``print(A * B)`` gives it exactly. Fixed widths keep every demo the same
  token layout, which a tiny model can learn to copy from (digit tokens are single tokens in Qwen's vocabulary).
  The questions are split once and for all by a hash of the question (:func:`is_heldout`, one in eight held out):
  RL tasks and SFT demos are drawn only from the ``"train"`` side, the demo's evaluation and the SFT report's
  held-out NLL only from the ``"heldout"`` side, so no evaluated question was ever trained on, whatever the seeds
  and counts.
  ``easy_fraction`` (default 0, the demo itself) asks that share of the questions as ``What is A * 100`` instead
  (task type ``multiply_easy``; no "?", so the prompt keeps the hard questions' token count): there the no-tool guess is right, so answering without the tool is sometimes rewarded -- the
  ablations' task family, on which a policy can give the tool up (``env.demo_easy_fraction``).
* :func:`scripted_demo` -- the messages of one demonstration: with the tool (call python, then copy its output into
  ``\\boxed{}``) or without (answer at once with a rough but always wrong guess: ``A * 100``). :func:`demo_trajectories` builds ``n`` of them with a given tool share through
  :func:`agentenv.run.sft.trajectory_from_messages`, i.e. through the same ChatSequence the runtime uses.
* The env is the real ``agentenv/PythonTool-v0`` (sandboxed python) with these tasks and :data:`SYSTEM_PROMPT`.

The demo's story: SFT on a mix where only ~30% of demos use the tool gives a policy that rarely calls it; RL
(FlashREINFORCE) then finds that tool-calling trajectories are the ones that succeed and amplifies them.
"""

from __future__ import annotations

import hashlib
import json
import random

from agentenv.envs.tasks import Task

SYSTEM_PROMPT = "Answer with \\boxed{}. You may use the python tool."
# A terse tool description keeps the prompt short: with a tiny model every prompt token is paid in every update.
TOOL_DOC = """Run Python code and return what it prints.

Args:
    code: Python source code.
"""
ENV_ID = "agentenv/PythonTool-v0"


SPLITS = ("train", "heldout")
HELDOUT_SEED = 0  # the evaluation set is the same for every run seed, so runs compare on the same questions


def is_heldout(a: int, b: int) -> bool:
    """The fixed partition of the question space: a stable hash, so it needs no list of what was trained on."""
    return hashlib.sha256(f"{a}*{b}".encode()).digest()[0] < 32  # 1 in 8


def demo_tasks(n: int, seed: int = 0, split: str = "train", easy_fraction: float = 0.0) -> list[Task]:
    """``n`` distinct questions of ``split`` ("train": RL tasks and SFT demos; "heldout": evaluation only), a share
    ``easy_fraction`` of them (in expectation) easy ones, ``A * 100``."""
    if split not in SPLITS:
        raise ValueError(f"the demo's tasks have splits {SPLITS}, not {split!r}")
    if not 0.0 <= easy_fraction <= 1.0:
        raise ValueError(f"easy_fraction must be in [0, 1], got {easy_fraction}")
    r = random.Random(seed)
    out, seen = [], set()
    while len(out) < n:
        a = r.randrange(3000, 10000)
        # the easy draw only when asked for, so the default demo's question sequence stays what it was
        easy = bool(easy_fraction) and r.random() < easy_fraction
        b = 100 if easy else r.randrange(34, 100)
        if is_heldout(a, b) != (split == "heldout") or (a, b) in seen:
            continue
        seen.add((a, b))
        # An easy question drops its "?": Qwen's tokenizer splits digits, so "100" is a token longer than a two-digit
        # B, and a tiny model that copies A at fixed offsets miscopied A on nearly every "A * 100?" (held-out easy
        # success 0.02 after RL); without the "?" the prompt has the hard questions' length token for token.
        question = f"What is {a} * {b}" + ("" if easy else "?")
        out.append(Task(question, str(a * b), id=f"mul-{split}-{seed}-{len(out)}",
                        type="multiply_easy" if easy else "multiply"))
    return out


def _operands(task: Task) -> tuple[int, int]:
    q = task.question.removeprefix("What is ").removesuffix("?")
    a, b = q.split(" * ")
    return int(a), int(b)


def scripted_demo(task: Task, use_tool: bool, rng: random.Random) -> list[dict]:
    """Messages after the prompt: assistant (and tool) turns of one demonstration."""
    a, b = _operands(task)
    if use_tool:
        call = {"name": "python", "arguments": {"code": f"print({a} * {b})"}}
        return [{"role": "assistant", "content": f"<tool_call>\n{json.dumps(call)}\n</tool_call>"},
                {"role": "tool", "content": str(a * b)},
                {"role": "assistant", "content": f"\\boxed{{{a * b}}}"}]
    # A guess a person might make without computing: round B up to 100 (always wrong, since B < 100). It is a
    # copy of A, so the warm start learns the same copying skill the tool path needs, and RL has to discover that
    # only the tool's output is right.
    wrong = a * 100
    return [{"role": "assistant", "content": f"\\boxed{{{wrong}}}"}]


def tool_schemas() -> list[dict]:
    """The python tool's schema exactly as the demo env shows it (built without starting a sandbox)."""
    from agentenv.envs.tools import Tool

    def python(code: str) -> str:
        return code

    python.__doc__ = TOOL_DOC
    return [Tool.from_function(python).schema()]


def demo_trajectories(tokenizer, n: int, tool_fraction: float = 0.25, seed: int = 1, tools: list[dict] | None = None,
                      split: str = "train", easy_fraction: float = 0.0):
    """``n`` token-level demos (success marked True so SFT keeps them all: they are what we want imitated), each
    with ``meta["demo_kind"]`` "tool" or "guess". ``split="heldout"`` draws fresh ones for measuring, never training.
    ``easy_fraction``: the RL task mix's share of easy questions (``env.demo_easy_fraction``), so the warm start has
    seen their layout (a 3-digit ``100``) and both of its answers to them -- a tiny model never shown one answers
    it with garbage, whichever path it takes."""
    from agentenv.run.sft import trajectory_from_messages

    rng = random.Random(seed)
    tools = tools if tools is not None else tool_schemas()
    out = []
    for task in demo_tasks(n, seed=seed + 10_000, split=split, easy_fraction=easy_fraction):  # not RL's seed
        prompt = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.question}]
        use = rng.random() < tool_fraction
        t = trajectory_from_messages(tokenizer, prompt + scripted_demo(task, use, rng), tools,
                                     env=ENV_ID, task=task.id, task_type=task.type, success=True, reward=1.0,
                                     meta={"demo_kind": "tool" if use else "guess"})
        t.num_tool_calls = int(use)
        out.append(t)
    return out
