"""PythonToolEnv with the real sandbox (bubblewrap where it works here, and the subprocess backend), task sets,
task-file loading, session lifetime, and a scripted tool-using policy through the real runtime."""

from __future__ import annotations

import gc
import json
import re
import time
import warnings

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

from agentenv.envs.python_tool import TASK_FAMILIES, PythonToolEnv, builtin_tasks
from agentenv.envs.tasks import Task, load_tasks
from agentenv.sandboxes import Limits, make_sandbox

LIMITS = Limits(timeout_s=1.0, cpu_s=1.0, memory_mb=256, max_output_bytes=4096)


def _bubblewrap_reason() -> str | None:
    try:
        make_sandbox("bubblewrap").close()
    except RuntimeError as e:
        return str(e)
    return None


BWRAP_MISSING = _bubblewrap_reason()
BACKENDS = [
    pytest.param("bubblewrap", marks=pytest.mark.skipif(BWRAP_MISSING is not None, reason=f"bubblewrap unusable: {BWRAP_MISSING}")),
    "subprocess",
]


def make_env(backend: str, **kw) -> PythonToolEnv:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the subprocess backend warns that it is unsafe, on purpose
        return PythonToolEnv(backend=backend, limits=kw.pop("limits", LIMITS), **kw)


@pytest.fixture(params=BACKENDS)
def env(request):
    e = make_env(request.param, num_tasks=16)
    yield e
    e.close()


def call(code: str) -> str:
    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"


# --- episodes --------------------------------------------------------------------------------------------------------

def test_correct_tool_using_episode_is_rewarded(env):
    obs, info = env.reset(seed=0, options={"task_index": 0})
    assert env.task.type == "product" and info["task"] == env.task.id
    assert [t["function"]["name"] for t in info["tools"]] == ["python"] and "persist" in info["tools"][0]["function"]["description"]
    a, b = map(int, re.findall(r"\d+", obs))
    obs, r, term, trunc, info = env.step(f"Let me compute.\n{call(f'print({a} * {b})')}")
    assert obs == str(a * b) and (r, term, trunc) == (0.0, False, False)
    assert (info["role"], info["tool_calls"], info["tool_errors"], info["tool_timeouts"]) == ("tool", 1, 0, 0)
    obs, r, term, trunc, info = env.step(f"The product is \\boxed{{{obs}}}.")
    assert (r, term, info["success"], info["tool_call_before_answer"]) == (1.0, True, True, True)


def test_state_persists_within_an_episode_but_not_across_episodes(env):
    env.reset(seed=0)
    assert env.step(call("import math\nx = 6\ndef f(n): return math.factorial(n)"))[0].startswith("(no output")
    assert env.step(call("f(x) + x"))[0] == "726"  # trailing expression echoed, notebook style
    env.reset(seed=1)
    obs, _, _, _, info = env.step(call("print(x)"))
    assert "NameError" in obs and info["tool_errors"] == 1


@pytest.mark.skipif(BWRAP_MISSING is not None, reason=f"bubblewrap unusable: {BWRAP_MISSING}")
def test_envs_sharing_a_pool_take_warm_sessions_and_hand_them_back():
    from agentenv.sandboxes import SandboxPool

    with SandboxPool("bubblewrap", size=1, limits=LIMITS) as pool:
        a, b = PythonToolEnv(pool=pool, num_tasks=4), PythonToolEnv(pool=pool, num_tasks=4)
        assert a.limits == LIMITS and a.sandbox is pool.sandbox
        a.reset(seed=0)
        a.step(call("x = 41"))
        assert a.step(call("x + 1"))[0] == "42"
        b.reset(seed=0)
        obs, _, _, _, info = b.step(call("print(1)"))  # the pool's one session is a's: b waits out its budget
        assert obs.startswith("[not run: no sandbox of the pool") and info["tool_timeouts"] == 1
        a.step("\\boxed{0}")  # a's episode ends: its session goes back, its interpreter killed
        obs, _, _, _, info = b.step(call("print(x)"))
        assert "NameError" in obs and info["tool_errors"] == 1
        b.close()
        a.close()
        assert not pool.sandbox.closed  # the pool's owner closes it
        with pytest.raises(ValueError, match="memory_mb"):
            PythonToolEnv(pool=pool, limits=LIMITS.replace(memory_mb=512))
        with pytest.raises(ValueError, match="persistent"):
            PythonToolEnv(pool=pool, persistent=False)


def test_crashing_code_is_observed_and_counted(env):
    env.reset(seed=0)
    obs, _, term, _, info = env.step(call("print('before')\n1/0"))
    assert obs.startswith("before\n") and "ZeroDivisionError: division by zero" in obs and "[exit code 1]" in obs
    assert (info["tool_calls"], info["tool_errors"], info["tool_timeouts"], info["invalid_action"]) == (1, 1, 0, False)
    assert not term
    assert env.step(call("print('still alive')"))[0] == "still alive"


def test_malformed_tool_calls_are_observed_and_counted(env):
    env.reset(seed=0)
    obs, _, term, _, info = env.step(
        '<tool_call>{"name": "python", "arguments": {"code": "print(1)"</tool_call>'  # broken JSON
        '<tool_call>{"name": "python", "arguments": {"source": "print(1)"}}</tool_call>'  # wrong argument name
        '<tool_call>{"name": "bash", "arguments": {"cmd": "ls"}}</tool_call>'  # unknown tool
        + call("print(2)"))
    # the broken-JSON block is malformed, not a call (issue 12); the other three are calls, two of them failing
    assert (info["tool_calls"], info["tool_errors"], info["tool_malformed"], info["invalid_action"]) == (3, 2, 1, True)
    assert "not valid JSON" in obs and "missing required argument 'code'" in obs and "unexpected argument 'source'" in obs
    assert "unknown tool 'bash'" in obs and obs.endswith("[4] python:\n2") and not term


def test_infinite_loop_times_out_and_nothing_hangs(env):
    env.reset(seed=0)
    env.step(call("y = 1"))
    t0 = time.monotonic()
    obs, _, term, _, info = env.step(call("while True:\n    pass"))
    assert time.monotonic() - t0 < 5
    assert (info["tool_errors"], info["tool_timeouts"]) == (1, 1) and not term
    assert "timed out" in obs and "interpreter was restarted" in obs
    obs = env.step(call("print(y)"))[0]  # the restarted interpreter works, and says nothing survived
    assert "NameError" in obs


def test_limits_and_output_markers(env):
    env.reset(seed=0)
    obs, *_, info = env.step(call("print('x' * 100000)"))
    assert "output truncated" in obs and info["tool_errors"] == 1
    obs, *_, info = env.step(call("b = bytearray(1 << 30)"))
    assert "MemoryError" in obs or "memory limit" in obs
    assert info["tool_errors"] == 1


def test_turn_limit_truncates_without_success(env):
    env.max_turns = 2
    env.reset(seed=0)
    assert env.step(call("1"))[3] is False
    _, r, term, trunc, info = env.step(call("2"))
    assert (r, term, trunc, info["success"], info["finish_reason"]) == (0.0, False, True, False, "max_turns")
    assert env._slot.session is None  # the episode's interpreter was closed with the episode


@pytest.mark.parametrize("backend", BACKENDS)
def test_fresh_process_per_call_when_not_persistent(backend):
    env = make_env(backend, persistent=False, num_tasks=8)
    try:
        env.reset(seed=0)
        assert "nothing carries over" in env.tool_schemas()[0]["function"]["description"]
        env.step(call("z = 3"))
        assert "NameError" in env.step(call("print(z)"))[0]
    finally:
        env.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_session_closed_on_end_reset_close_and_gc(backend):
    env = make_env(backend, num_tasks=8)
    env.reset(seed=0)
    env.step(call("1"))
    s1 = env._slot.session
    env.step("\\boxed{0}")  # final answer ends the episode
    assert s1.closed and env._slot.session is None
    env.reset(seed=0)
    env.step(call("1"))
    s2 = env._slot.session
    env.reset(seed=1)
    assert s2.closed
    env.step(call("1"))
    s3 = env._slot.session
    env.close()
    assert s3.closed
    env = make_env(backend, num_tasks=8)
    env.reset(seed=0)
    env.step(call("1"))
    s4 = env._slot.session
    assert s4.alive
    sandbox = env.sandbox
    del env
    gc.collect()
    assert s4.closed and not s4.alive and sandbox.closed


# --- registration, check_env, runtime --------------------------------------------------------------------------------

ENV_ID = "agentenv/PythonTool-v0"
if ENV_ID not in gym.registry:  # until agentenv.envs registers it
    gym.register(ENV_ID, entry_point="agentenv.envs.python_tool:PythonToolEnv", disable_env_checker=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_check_env_through_gym_make(backend):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        env = gym.make(ENV_ID, backend=backend, num_tasks=8, limits={"timeout_s": 2.0})
        try:
            check_env(env.unwrapped)  # also re-makes the env from its spec (render modes)
            assert env.unwrapped.limits.timeout_s == 2.0
        finally:
            env.close()


class ScriptedSolver:
    """A TextPolicy that computes with the tool before answering: proves the env's accounting through the runtime."""

    name = "scripted-solver"

    def act(self, messages, info):
        last = messages[-1]
        if last["role"] == "user":
            a, b = map(int, re.findall(r"\d+", last["content"]))
            return "First a typo:\n" + call(f"print({a} * {b}") + "\nthen:\n" + call(f"p = {a} * {b}\np")
        return f"\\boxed{{{last['content'].splitlines()[-1]}}}"


def test_scripted_policy_through_the_runtime(tmp_path):
    from agentenv.core.runtime import EpisodeSpec, RolloutConfig, run_episode

    env = make_env("subprocess" if BWRAP_MISSING else "bubblewrap", num_tasks=8)
    try:
        traj = run_episode(env, ScriptedSolver(), RolloutConfig(max_turns=10), EpisodeSpec(seed=0, options={"task_index": 0}))
    finally:
        env.close()
    assert (traj.reward, traj.success, traj.finish_reason, traj.num_turns) == (1.0, True, "done", 2)
    assert (traj.num_tool_calls, traj.num_tool_errors, traj.num_tool_timeouts) == (2, 1, 0)
    assert traj.tool_call_before_answer and traj.task_type == "product" and traj.tools[0]["function"]["name"] == "python"
    assert [m["role"] for m in traj.messages] == ["system", "user", "assistant", "tool", "assistant", "user"]


# --- tasks -----------------------------------------------------------------------------------------------------------

def test_builtin_tasks_are_deterministic_and_cover_every_family():
    a, b = builtin_tasks(24, seed=3), builtin_tasks(24, seed=3)
    assert a == b and a != builtin_tasks(24, seed=4)
    assert {t.type for t in a} == set(TASK_FAMILIES) and len({t.id for t in a}) == 24
    assert all(t.answer.lstrip("-").isdigit() for t in a)


def test_builtin_answers_against_brute_force():
    """The generator's shortcuts (inclusion-exclusion, sieve) against the slow obvious computation, once per family."""
    first = {}
    for t in builtin_tasks(16, seed=1):
        first.setdefault(t.type, t)
    n, a, b, c = map(int, re.findall(r"\d+", first["count"].question)[1:])
    assert int(first["count"].answer) == sum(1 for k in range(1, n + 1) if (k % a == 0 or k % b == 0) and k % c)
    (n,) = map(int, re.findall(r"\d+", first["primes"].question))
    assert int(first["primes"].answer) == sum(all(k % d for d in range(2, int(k**0.5) + 1)) for k in range(2, n))


def test_load_jsonl_tasks_and_use_them(tmp_path):
    p = tmp_path / "tasks.jsonl"
    p.write_text('{"question": "What is 17*19?", "answer": 323, "id": "m1", "type": "mul", "source": "me"}\n\n'
                 '{"question": "Name the capital of France.", "answer": "Paris"}\n')
    tasks = load_tasks(p)
    assert tasks[0] == Task("What is 17*19?", "323", "m1", "mul") and tasks[0].meta == {"source": "me"}
    assert tasks[1].id.startswith("q-") and tasks[1].type is None
    env = make_env("subprocess", tasks=str(p))
    try:
        obs, info = env.reset(options={"task_id": "m1"})
        assert obs == "What is 17*19?" and info["task_type"] == "mul"
        assert env.step("\\boxed{323}")[1] == 1.0
    finally:
        env.close()


def test_task_file_errors_are_clear(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": 1}\n{"question": "q2"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: missing \['answer'\]"):
        load_tasks(bad)
    bad.write_text('{"question": "q", "answer": 1}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        load_tasks(bad)
    (tmp_path / "t.csv").write_text("question,answer\n")
    with pytest.raises(ValueError, match="unsupported task file type"):
        load_tasks(tmp_path / "t.csv")
    with pytest.raises(FileNotFoundError):
        load_tasks(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no tasks"):
        load_tasks(tmp_path / "empty.jsonl")
    renamed = tmp_path / "renamed.jsonl"
    renamed.write_text('{"problem": "What is 2+2?", "solution": "4"}\n')
    assert load_tasks(renamed, question_key="problem", answer_key="solution")[0].answer == "4"


def test_load_parquet_tasks(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="Parquet task files need pyarrow")
    import pyarrow.parquet as pq

    p = tmp_path / "tasks.parquet"
    pq.write_table(pa.table({"question": ["What is 2**100?", "What is 3**3?"], "answer": [2**100 % 10**9, 27],
                             "type": ["pow", "pow"]}), p)
    tasks = load_tasks(p)
    assert [(t.question, t.answer, t.type) for t in tasks] == [("What is 2**100?", str(2**100 % 10**9), "pow"),
                                                               ("What is 3**3?", "27", "pow")]


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if neither is installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    monkeypatch.setitem(sys.modules, "pandas", None)
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    with pytest.raises(ImportError, match="pip install pyarrow"):
        load_tasks(tmp_path / "t.parquet")
