"""Tool declaration, <tool_call> parsing, execution errors, grading and the ToolEnv episode loop (no sandbox)."""

from __future__ import annotations

import json
import os
from typing import Literal, Optional, Union

import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import given, settings
from hypothesis import strategies as st

from agentenv.envs.grading import extract_answer, extract_boxed, grade_answer
from agentenv.envs.tool_env import ToolEnv
from agentenv.envs import tool_errors as tools_module
from agentenv.envs.tools import Tool, ToolCall, ToolDefinitionError, ToolOutput, execute, parse_tool_calls, tool


@tool
def power(base: int, exponent: int = 2, modulus: Optional[int] = None) -> int:
    """Raise a number to a power.

    Args:
        base: The base.
        exponent: The exponent; long descriptions
            may continue on the next line.
        modulus: Reduce modulo this, if given.

    Returns:
        The power.
    """
    return pow(base, exponent, modulus)


# --- schemas ---------------------------------------------------------------------------------------------------------

def test_schema_from_hints_and_google_docstring():
    s = power.schema()
    assert s["type"] == "function"
    f = s["function"]
    assert f["name"] == "power" and f["description"] == "Raise a number to a power."
    p = f["parameters"]
    assert p["required"] == ["base"]
    assert p["properties"]["base"] == {"type": "integer", "description": "The base."}
    assert p["properties"]["exponent"]["default"] == 2
    assert p["properties"]["exponent"]["description"] == "The exponent; long descriptions may continue on the next line."
    assert p["properties"]["modulus"]["type"] == ["integer", "null"]
    json.dumps(s)  # must be JSON for the chat template


def test_schema_types():
    def f(a: list[float], b: dict[str, int], c: Literal["x", "y"], d: bool, e: int | str, g: list = None) -> str:
        """F."""

    props = Tool.from_function(f).parameters["properties"]
    assert props["a"] == {"type": "array", "items": {"type": "number"}}
    assert props["b"] == {"type": "object", "additionalProperties": {"type": "integer"}}
    assert props["c"] == {"type": "string", "enum": ["x", "y"]}
    assert props["d"] == {"type": "boolean"}
    assert props["e"] == {"type": ["integer", "string"]}
    assert props["g"] == {"type": "array", "default": None}


def test_schema_renders_in_the_project_chat_template():
    # The same jinja environment apply_chat_template uses, without building the 150k-token tokenizer (slow).
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from agentenv.samplers.tiny import CHAT_TEMPLATE

    text = _compile_jinja_template(CHAT_TEMPLATE).render(
        messages=[{"role": "user", "content": "hi"}], tools=[power.schema()], add_generation_prompt=True)
    assert '"name": "power"' in text and '"required": ["base"]' in text and "<tools>" in text


def _no_hint(x) -> str:
    """Doc."""


def _varargs(*xs: int) -> str:
    """Doc."""


def _kwargs(**kw: int) -> str:
    """Doc."""


def _bad_type(x: set[int]) -> str:
    """Doc."""


def _no_doc(x: int) -> str:
    pass


def _bad_literal(x: Literal["a", 1]) -> str:
    """Doc."""


def _posonly(x: int, /) -> str:
    """Doc."""


def _doc_names_unknown(x: int) -> str:
    """Doc.

    Args:
        y: not a parameter.
    """


@pytest.mark.parametrize("fn, message", [
    (_no_hint, "parameter 'x': missing type annotation"),
    (_varargs, "*args / **kwargs"),
    (_kwargs, "*args / **kwargs"),
    (_bad_type, "unsupported type"),
    (_no_doc, "has no description"),
    (_bad_literal, "Literal values"),
    (_posonly, "positional-only"),
    (_doc_names_unknown, "not parameters"),
])
def test_declaration_errors_are_clear(fn, message):
    with pytest.raises(ToolDefinitionError, match=message.replace("*", r"\*")) as e:
        Tool.from_function(fn)
    assert repr(fn.__name__) in str(e.value)


def test_decorator_with_options_and_direct_call():
    @tool(name="add", description="Add.")
    def _add(a: int, b: int) -> int:
        return a + b

    assert _add.name == "add" and _add(a=1, b=2) == 3


# --- parsing ---------------------------------------------------------------------------------------------------------

def test_parse_multiple_calls_in_order_and_unclosed_last():
    text = ('think first <tool_call>\n{"name": "power", "arguments": {"base": 3}}\n</tool_call> then '
            '<tool_call>{"name": "power", "arguments": "{\\"base\\": 2, \\"exponent\\": 10}"}</tool_call>'
            '<tool_call>```json\n{"name": "power", "arguments": {"base": 5}}\n```</tool_call>'
            '<tool_call>{"name": "power", "arguments": {"base": 7}}')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("power", {"base": 3}, None), ("power", {"base": 2, "exponent": 10}, None),
        ("power", {"base": 5}, None), ("power", {"base": 7}, None)]
    assert [execute(c, {"power": power}).content for c in calls] == ["9", "1024", "25", "49"]


@pytest.mark.parametrize("body, message", [
    ("{not json}", "not valid JSON"),
    ('["power", {}]', "must be a JSON object"),
    ('{"arguments": {}}', "must be a JSON object"),
    ('{"name": "power", "arguments": "oops"}', "not a JSON object"),
])
def test_malformed_calls_become_error_results(body, message):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    r = execute(call, {"power": power})
    assert r.error and r.malformed and message in r.content


@pytest.mark.parametrize("args, message", [
    ({}, "missing required argument 'base'"),
    ({"base": "3"}, "argument 'base': expected integer, got string"),
    ({"base": True}, "expected integer, got boolean"),
    ({"base": 3, "bogus": 1}, "unexpected argument 'bogus'"),
    ([1, 2], "arguments must be a JSON object"),
])
def test_bad_arguments_are_explained_with_the_signature(args, message):
    r = execute(ToolCall("power", args), {"power": power})
    assert r.error and not r.malformed and message in r.content
    if isinstance(args, dict):
        assert "Signature: power(base: integer" in r.content


def test_unknown_tool_lists_available_tools():
    r = execute(ToolCall("pwr", {}), {"power": power})
    assert r.error and "unknown tool 'pwr'" in r.content and "power" in r.content


def test_tool_raising_shows_the_model_type_and_message_and_the_log_the_traceback_once(caplog):
    tools_module._reported.clear()  # logged once per process: start this test from none
    with caplog.at_level("WARNING", logger="agentenv.envs.tools"):
        r = execute(ToolCall("power", {"base": 2, "exponent": -1, "modulus": 4}), {"power": power})
        again = execute(ToolCall("power", {"base": 6, "exponent": -1, "modulus": 4}), {"power": power})
    assert r.error and not r.timeout and again.error
    assert r.content.startswith("Error: tool 'power' raised ValueError: ")
    here = os.path.dirname(os.path.abspath(__file__))
    assert "Traceback" not in r.content and here not in r.content and "File " not in r.content
    [rec] = [x for x in caplog.records if "raised ValueError" in x.getMessage()]  # once, with the frames
    assert rec.exc_info is not None and "power" in rec.getMessage() and __file__.rstrip("c") in rec.getMessage()


def test_tool_exception_message_loses_host_paths():
    def read(name: str) -> str:
        """Read a file next to the tool.

        Args:
            name: File name.
        """
        return open(os.path.join(os.path.dirname(os.path.abspath(__file__)), name)).read()

    r = execute(ToolCall("read", {"name": "nope.txt"}), {"read": Tool.from_function(read)})
    assert r.error and "FileNotFoundError" in r.content and "nope.txt" in r.content
    assert os.path.dirname(os.path.abspath(__file__)) not in r.content


def test_return_value_policy(caplog):
    class Opaque:
        pass

    def make(value):
        def f() -> str:
            """Return something."""
            return value
        return Tool.from_function(f)

    assert execute(ToolCall("f", {}), {"f": make("text")}).content == "text"
    assert execute(ToolCall("f", {}), {"f": make({"a": [1, 2.5, None]})}).content == '{"a": [1, 2.5, null]}'
    assert execute(ToolCall("f", {}), {"f": make(None)}).content == "null"
    tools_module._reported.clear()
    for bad in (b"bytes", Opaque()):
        with caplog.at_level("WARNING", logger="agentenv.envs.tools"):
            r = execute(ToolCall("f", {}), {"f": make(bad)})
        assert r.error and "not text" in r.content and type(bad).__name__ in r.content
    # the developer is told where and how to fix it, once per tool and kind of value
    logged = [x.getMessage() for x in caplog.records if "returned a" in x.getMessage()]
    assert any("returned a bytes" in m and "decode" in m and "test_tools.py" in m for m in logged)
    r = execute(ToolCall("f", {}), {"f": make(ToolOutput("slow", timeout=True))})
    assert r.timeout and r.error and r.content == "slow"


def test_timeout_error_counts_as_timeout_and_int_is_given_to_float_params():
    def slow(x: float) -> str:
        """Slow."""
        assert isinstance(x, float)
        raise TimeoutError("took too long")

    r = execute(ToolCall("slow", {"x": 1}), {"slow": Tool.from_function(slow)})
    assert r.timeout and r.error and "took too long" in r.content


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["<tool_call>", "</tool_call>", "{", "}", "[", "]", '"', ":", ",", " ", "name",
                                  "arguments", '"power"', '"base"', "1", "-2", "null", "true", "```", "\\"])).map("".join))
def test_parse_and_execute_never_raise(text):
    for call in parse_tool_calls(text):
        assert isinstance(execute(call, {"power": power}).content, str)


# --- grading ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("response, expected, ok", [
    ("so \\boxed{\\frac{1}{2}}", "0.5", True),
    ("\\boxed{7}, not 8", "7", True),
    ("3 * 4 = 12", "12", True),  # last-number fallback
    ("It is 12, or maybe 13", "12", False),
    ("1,234,567", "1234567", True),
    ("123456789012345678901235", "123456789012345678901234", False),  # integers exact however large
    ("1.2345678901234568e23", "123456789012345678901234", False),
    ("0.3333333", "1/3", True),
    ("The answer is Paris.", "paris", True),
    ("\\boxed{\\text{Paris}}", "Paris", True),
    ("no idea", "5", False),
])
def test_grade_answer(response, expected, ok):
    assert grade_answer(response, expected) is ok


def test_extract_boxed_nested_and_unbalanced():
    assert extract_boxed("a \\boxed{1} b \\boxed{\\frac{a}{b^{2}}}") == "\\frac{a}{b^{2}}"
    assert extract_boxed("\\boxed{12") is None
    assert extract_answer("x \\boxed{12") == "x \\boxed{12"


# --- the episode loop ------------------------------------------------------------------------------------------------

def _env(**kw) -> ToolEnv:
    tasks = [{"question": "What is 3^200 mod 1000?", "answer": pow(3, 200, 1000), "id": "p", "type": "modpow"},
             {"question": "What is 2^10?", "answer": 1024}]
    return ToolEnv(tasks, [power], **kw)


def test_correct_tool_using_episode_is_rewarded():
    env = _env()
    obs, info = env.reset(seed=0, options={"task_id": "p"})
    assert obs == "What is 3^200 mod 1000?" and info["task"] == "p" and info["task_type"] == "modpow"
    assert info["role"] == "user" and info["tools"] == [power.schema()] and "boxed" in info["system"]
    obs, r, term, trunc, info = env.step('<tool_call>{"name": "power", "arguments": {"base": 3, "exponent": 200, "modulus": 1000}}</tool_call>')
    assert (obs, r, term, trunc) == (str(pow(3, 200, 1000)), 0.0, False, False)
    assert info == {"role": "tool", "tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0, "tool_malformed": 0,
                    "invalid_action": False, "tool_calls_by_name": {"power": 1}, "tool_errors_by_name": {}}
    obs, r, term, trunc, info = env.step(f"\\boxed{{{pow(3, 200, 1000)}}}")
    assert (r, term, trunc, info["success"], info["tool_call_before_answer"]) == (1.0, True, False, True, True)
    assert info["episode_totals"] == {"turns": 2, "tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0,
                                      "tool_malformed": 0, "tool_calls_by_name": {"power": 1}, "tool_errors_by_name": {}}
    with pytest.raises(RuntimeError, match="reset"):
        env.step("again")


def test_errors_are_observed_and_counted_in_one_tool_message():
    env = _env()
    env.reset(seed=0, options={"task_index": 1})
    obs, r, term, trunc, info = env.step(
        '<tool_call>{"name": "power", "arguments": {"base": 2, "exponent": 10}}</tool_call>'
        '<tool_call>{oops}</tool_call><tool_call>{"name": "nope", "arguments": {}}</tool_call>')
    # well-formed calls (power, nope) count as calls; the broken block is its own counter (behaviour changed on purpose:
    # issue 12 -- malformed blocks used to count as calls and inflate the tool-call rate)
    assert (info["tool_calls"], info["tool_errors"], info["tool_malformed"], info["invalid_action"]) == (2, 1, 1, True)
    assert info["tool_calls_by_name"] == {"power": 1, "(unknown)": 1}
    assert info["tool_errors_by_name"] == {"(unknown)": 1}
    assert obs.index("[1] power:\n1024") < obs.index("[2] invalid:\nError: the tool call is not valid JSON") < obs.index("[3] nope:\nError: unknown tool")
    assert not term and not trunc


def test_wrong_answer_without_tools_and_turn_limit():
    env = _env(max_turns=2)
    env.reset(seed=0, options={"task_index": 1})
    _, r, term, _, info = env.step("I think \\boxed{1000}")
    assert (r, term, info["success"], info["tool_call_before_answer"]) == (0.0, True, False, False)
    env.reset(seed=1, options={"task_index": 1})
    call = '<tool_call>{"name": "power", "arguments": {"base": 2}}</tool_call>'
    assert env.step(call)[3] is False
    _, r, term, trunc, info = env.step(call)
    assert (r, term, trunc, info["success"], info["finish_reason"]) == (0.0, False, True, False, "max_turns")


def test_seeded_task_choice_and_option_errors():
    env = _env()
    assert [env.reset(seed=s)[1]["task"] for s in range(8)] == [env.reset(seed=s)[1]["task"] for s in range(8)]
    with pytest.raises(KeyError):
        env.reset(options={"task_id": "missing"})
    with pytest.raises(IndexError):
        env.reset(options={"task_index": 5})


def test_custom_grader_and_long_output_is_clipped():
    def blob(n: int) -> str:
        """Return n characters."""
        return "a" * (n - 3) + "END"

    env = ToolEnv([{"question": "q", "answer": "x"}], [blob], grader=lambda resp, task: 0.5 if "x" in resp else 0.0,
                  max_tool_output_chars=100)
    env.reset(seed=0)
    obs = env.step('<tool_call>{"name": "blob", "arguments": {"n": 10000}}</tool_call>')[0]
    assert len(obs) < 200 and obs.endswith("END") and "characters cut" in obs
    _, r, term, _, info = env.step("x")
    assert r == 0.5 and term and info["success"] is False


def test_duplicate_tool_names_rejected():
    with pytest.raises(ValueError, match="two tools"):
        ToolEnv([{"question": "q", "answer": "a"}], [power, power])


@pytest.mark.filterwarnings("ignore:.*alternative render modes")  # a bare env has no spec to re-make it from
def test_check_env():
    check_env(_env())


@settings(max_examples=100, deadline=None)
@given(st.text())
def test_step_never_raises_on_any_text(action):
    env = _env()
    env.reset(seed=0)
    obs, r, term, trunc, info = env.step(action)
    assert isinstance(obs, str) and isinstance(r, float)


def test_episode_totals_on_the_last_step_and_non_string_actions():
    env = _env(max_turns=3)
    env.reset(seed=0, options={"task_index": 1})
    env.step('<tool_call>{"name": "power", "arguments": {"base": 2, "exponent": 10}}</tool_call><tool_call>[1]</tool_call>')
    env.step('<tool_call>{"name": "power", "arguments": {"base": "2", "exponent": 10}}</tool_call>')
    _, _, term, trunc, info = env.step('<tool_call>{"name": "power", "arguments": {"base": 2, "exponent": 3}}</tool_call>')
    assert (term, trunc, info["finish_reason"]) == (False, True, "max_turns")
    assert info["episode_totals"] == {"turns": 3, "tool_calls": 3, "tool_errors": 1, "tool_timeouts": 0,
                                      "tool_malformed": 1, "tool_calls_by_name": {"power": 3},
                                      "tool_errors_by_name": {"power": 1}}
    env.reset(seed=0)
    for bad in (None, b"bytes", ["list"]):
        with pytest.raises(TypeError, match=r"ToolEnv.step\(action\) expects the assistant's message as a str, got"):
            env.step(bad)
    _, _, term, _, _ = env.step("\\boxed{0}")  # the episode is still usable after the rejected calls
    assert term


def test_schema_is_transformers_get_json_schema_normalised():
    # The function -> schema mapping is get_json_schema's (what chat templates use for tools=[fn]); the only
    # differences are deliberate: Optional as a "null" type (not OpenAPI "nullable"), defaults kept, no "return".
    from transformers.utils import get_json_schema

    lib = get_json_schema(power.fn)["function"]
    ours = power.schema()["function"]
    assert lib["parameters"]["properties"]["modulus"] == {"type": "integer", "nullable": True,
                                                          "description": "Reduce modulo this, if given."}
    assert ours["parameters"]["properties"]["modulus"] == {"type": ["integer", "null"], "default": None,
                                                           "description": "Reduce modulo this, if given."}
    for name in ("base", "exponent"):
        expected = dict(lib["parameters"]["properties"][name])
        if name == "exponent":
            expected["default"] = 2
        assert ours["parameters"]["properties"][name] == expected
    assert ours["parameters"]["required"] == lib["parameters"]["required"] and "return" not in ours


def test_arguments_are_validated_by_jsonschema_with_clear_messages():
    def g(a: Optional[list[int]] = None, b: Union[list[int], dict[str, int], None] = None, d: int = 0) -> str:
        """G."""
        return repr((a, b, d))

    t = Tool.from_function(g)
    ok = execute(ToolCall("g", {"a": None, "b": {"k": 1}, "d": 3.0}), {"g": t})
    assert not ok.error and ok.content == "(None, {'k': 1}, 3)"  # an integral float is an integer in JSON Schema
    bad = execute(ToolCall("g", {"a": [1, "x"], "d": 3.5}), {"g": t})
    assert bad.error and "argument 'a': item 1: expected integer, got string" in bad.content
    assert "argument 'd': expected integer, got number" in bad.content
    assert "Signature: g(a: array | null (optional), b: array | object | null (optional)" in bad.content
