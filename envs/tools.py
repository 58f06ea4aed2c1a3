"""Declaring tools, parsing Hermes ``<tool_call>`` blocks, and running calls without ever raising.

Contract:

* A tool is a plain Python function with type hints and a docstring. :func:`tool` (decorator) or
  :meth:`Tool.from_function` turns it into a :class:`Tool` whose :meth:`Tool.schema` is the OpenAI function format
  that ``tokenizer.apply_chat_template(..., tools=[...])`` renders::

      {"type": "function", "function": {"name": ..., "description": ..., "parameters": {JSON schema}}}

  The type hints -> JSON schema mapping is :func:`transformers.utils.get_json_schema`, the function chat templates
  themselves use for ``tools=[fn]``, with two deliberate normalisations: ``Optional[T]`` becomes ``"type": [T,
  "null"]`` (standard JSON Schema) instead of the OpenAPI keyword ``"nullable": true``, which JSON Schema validators
  ignore (a ``None`` the hint allows would be rejected); and JSON-serialisable defaults are added (``get_json_schema``
  drops them; the model benefits from seeing them). Its ``"return"`` entry is dropped (chat templates do not show
  it consistently and callers see the result anyway). Docstrings are parsed here (``Args:`` / ``Arguments:`` /
  ``Parameters:``, ``name (type): description``, continuation lines -- forms transformers' parser drops silently) and
  handed to ``get_json_schema`` in its canonical form; a parameter without a description is allowed.
  The description is the docstring's text before its sections; parameter descriptions come from a Google-style
  ``Args:`` section. Supported hints: ``str``, ``int``, ``float``, ``bool``, ``list[T]``, ``dict`` /
  ``dict[str, T]``, ``Literal[...]`` (-> ``enum``), ``Optional[T]`` / ``T | None`` (-> ``"null"`` allowed) and
  unions of supported types. A parameter with a default is optional (its default is shown if JSON-serialisable).
  Anything else -- a missing hint, ``*args`` / ``**kwargs``, positional-only parameters, an unsupported type --
  raises :class:`ToolDefinitionError` at declaration time, naming the function and the parameter.
* :func:`parse_tool_calls` finds every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block in an
  assistant message, in order (a final block the model did not close is still parsed). A block that is not such a
  JSON object becomes a :class:`ToolCall` with ``error`` set; it is never dropped and never raises.
* :func:`execute` runs one call against a ``{name: Tool}`` table and ALWAYS returns a :class:`ToolResult`: malformed
  calls, unknown tools, missing / unexpected / wrongly-typed arguments, exceptions raised by the tool (reported as
  ``Type: message`` only -- no frames, so no host paths reach the model) and unusable return values all become
  ``error=True`` results whose ``content`` tells the policy what went wrong. The developer's side goes to the log
  (logger ``agentenv.envs.tools``), once per tool and problem: the full traceback of an exception, or the function's
  file and line and the fix for a bad return value.
* Return values: a ``str`` is the tool message as is; any other JSON-serialisable value (numbers, bools, None,
  lists, dicts) is sent as its JSON text; anything else (bytes, arbitrary objects) is a tool error naming the type,
  because silently ``str()``-ing it would show the model a repr it cannot use. A tool that needs to report its own
  status (e.g. a sandbox that timed out) returns a :class:`ToolOutput`; raising ``TimeoutError`` also counts as a
  timeout. Arguments are checked strictly against the schema with ``jsonschema`` (``"3"`` is not an ``int``; an
  ``int`` is accepted for a ``float``, and an integral float such as ``3.0`` for an ``int``, as JSON Schema defines
  it) so the policy learns the schema instead of having its mistakes silently repaired; the validator's findings are
  rewritten into short messages that name the argument and end with the tool's signature.

In-process tools are trusted code and run with no time limit; untrusted code belongs in a sandbox
(see :mod:`agentenv.envs.python_tool`).
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Union, get_args, get_origin

import jsonschema
from transformers.utils import get_json_schema

from agentenv.envs.tool_errors import exception_line, report_once, where_defined

__all__ = [
    "Tool", "ToolCall", "ToolOutput", "ToolResult", "ToolDefinitionError",
    "tool", "parse_tool_calls", "has_tool_call", "execute",
]


class ToolDefinitionError(TypeError):
    """A function cannot be turned into a tool (its JSON schema cannot be built)."""


@dataclass(frozen=True)
class ToolOutput:
    """What a tool may return to report its own status along with the text the policy sees."""

    content: str
    error: bool = False
    timeout: bool = False


@dataclass(frozen=True)
class ToolCall:
    """One parsed ``<tool_call>`` block. ``error`` is set when the block is not a usable call."""

    name: str | None
    arguments: Any = field(default_factory=dict)  # should be a dict; anything else is reported when run
    raw: str = ""
    error: str | None = None


@dataclass(frozen=True)
class ToolResult:
    name: str | None
    content: str
    error: bool = False
    timeout: bool = False
    malformed: bool = False  # the block could not be parsed as a call at all


# --- schema from type hints -----------------------------------------------------------------------------------------

_PRIMITIVES: dict[type, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}
_UNION_TYPES = (Union, types.UnionType)


def _check_hint(hint: Any, where: str) -> None:
    """Refuse, with a clear message, a type hint outside the supported subset (``where`` names the parameter);
    the schema itself comes from ``get_json_schema``."""
    if hint in _PRIMITIVES or hint is type(None) or hint in (list, typing.List, dict, typing.Dict):
        return
    origin, args = get_origin(hint), get_args(hint)
    if origin is list:
        return _check_hint(args[0], where)
    if origin is dict:
        if args and args[0] is not str:
            raise ToolDefinitionError(f"{where}: dict keys must be str (JSON object keys), got {args[0]!r}")
        return _check_hint(args[1], where) if args else None
    if origin is Literal:
        kinds = {type(a) for a in args}
        if len(kinds) != 1 or not kinds <= set(_PRIMITIVES):
            raise ToolDefinitionError(f"{where}: Literal values must all be str, or all int/float/bool, got {args!r}")
        return None
    if origin in _UNION_TYPES:
        for a in args:
            _check_hint(a, where)
        return None
    raise ToolDefinitionError(
        f"{where}: unsupported type {hint!r}; use str, int, float, bool, list[...], dict[str, ...], Literal[...] "
        "or Optional[...] of those"
    )


def _library_schema(fn: Callable, fname: str, arg_docs: dict[str, str]) -> dict:
    """The parameters schema ``get_json_schema`` gives for ``fn``, normalised (see the module docstring)."""
    names = list(inspect.signature(fn).parameters)
    placeholder = "\u2063undocumented\u2063"
    shim = functools.wraps(fn)(lambda **kwargs: None)  # same signature and hints, a canonical docstring
    shim.__doc__ = "Tool.\n\nArgs:\n" + "".join(f"    {n}: {arg_docs.get(n) or placeholder}\n" for n in names)
    try:
        params = get_json_schema(shim)["function"]["parameters"]
    except Exception as e:  # noqa: BLE001 -- the library's own exception types vary by version
        raise ToolDefinitionError(f"tool {fname!r}: transformers.utils.get_json_schema refused it ({e})") from e
    for prop in params.get("properties", {}).values():
        if prop.get("description") == placeholder:
            del prop["description"]
        if prop.pop("nullable", False):
            t = prop.get("type")
            if isinstance(t, str):
                prop["type"] = [t, "null"]
            elif isinstance(t, list) and "null" not in t:
                prop["type"] = t + ["null"]
            elif "anyOf" in prop and {"type": "null"} not in prop["anyOf"]:
                prop["anyOf"] = prop["anyOf"] + [{"type": "null"}]
    params.setdefault("required", [])
    return params


_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Returns|Return|Yields|Raises|Examples?|Notes?)\s*:\s*$")
_ARG_LINE = re.compile(r"^\s*(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into (description, {param: description})."""
    lines = inspect.cleandoc(doc).splitlines()
    desc: list[str] = []
    params: dict[str, str] = {}
    section, current, indent = None, None, None
    for line in lines:
        m = _SECTION.match(line)
        if m:
            section, current, indent = m.group(1), None, None
            continue
        if section is None:
            desc.append(line)
        elif section in ("Args", "Arguments", "Parameters") and line.strip():
            lead = len(line) - len(line.lstrip())
            a = _ARG_LINE.match(line)
            if a and (indent is None or lead <= indent):
                indent, current = lead, a.group(1).lstrip("*")
                params[current] = a.group(2).strip()
            elif current is not None:  # continuation line of the current parameter
                params[current] = (params[current] + " " + line.strip()).strip()
    return "\n".join(desc).strip(), params


def _json_default(value: Any) -> tuple[bool, Any]:
    try:
        json.dumps(value)
        return True, value
    except (TypeError, ValueError):
        return False, None


# --- argument checking ----------------------------------------------------------------------------------------------

def _validation_errors(arguments: dict, parameters: dict) -> list[str]:
    """``jsonschema``'s findings for an arguments object, as short messages that name the argument."""
    schema = dict(parameters, additionalProperties=False)
    validator = jsonschema.Draft202012Validator(schema)
    problems = []
    for e in sorted(validator.iter_errors(arguments), key=lambda e: (len(e.path), [str(p) for p in e.path])):
        if e.validator == "required" and not e.path:
            problems += [f"missing required argument {k!r}" for k in e.validator_value if k not in e.instance]
        elif e.validator == "additionalProperties" and not e.path:
            problems += [f"unexpected argument {k!r}" for k in e.instance if k not in parameters["properties"]]
        else:
            arg, *rest = list(e.path)
            where = "".join(f" item {p}:" if isinstance(p, int) else f" key {p!r}:" for p in rest)
            problems.append(f"argument {arg!r}:{where} {_why(e)}")
    return problems


def _why(e: jsonschema.ValidationError) -> str:
    if e.validator == "type":
        t = e.validator_value
        return f"expected {' or '.join(t) if isinstance(t, list) else t}, got {_jtype(e.instance)}"
    if e.validator == "enum":
        return f"must be one of {e.validator_value}, got {e.instance!r}"
    return e.message


def _jtype(value: Any) -> str:
    for t, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"), (dict, "object")):
        if isinstance(value, t):
            return name
    return "null" if value is None else type(value).__name__


# --- the tool -------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    fn: Callable[..., Any]

    @classmethod
    def from_function(cls, fn: Callable[..., Any], *, name: str | None = None, description: str | None = None) -> "Tool":
        if isinstance(fn, Tool):
            return fn
        if not callable(fn):
            raise ToolDefinitionError(f"a tool must be a function, got {type(fn).__name__}")
        fname = name or getattr(fn, "__name__", None)
        if not fname or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_\-]{0,63}", fname):
            raise ToolDefinitionError(f"tool name {fname!r} must be 1-64 letters, digits, '_' or '-'")
        doc_desc, arg_docs = _parse_docstring(fn.__doc__ or "")
        desc = description if description is not None else doc_desc
        if not desc:
            raise ToolDefinitionError(
                f"tool {fname!r} has no description: give the function a docstring (the model reads it to decide "
                "when to call the tool) or pass description="
            )
        try:
            hints = typing.get_type_hints(fn)
        except Exception as e:  # unresolvable forward reference etc.
            raise ToolDefinitionError(f"tool {fname!r}: cannot resolve type hints ({e})") from e
        defaults: dict[str, Any] = {}
        for p in inspect.signature(fn).parameters.values():
            where = f"tool {fname!r}, parameter {p.name!r}"
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise ToolDefinitionError(f"{where}: *args / **kwargs cannot be described by a JSON schema; name each argument")
            if p.kind is p.POSITIONAL_ONLY:
                raise ToolDefinitionError(f"{where}: positional-only parameters cannot be passed by name from JSON")
            if p.name not in hints:
                raise ToolDefinitionError(f"{where}: missing type annotation; add a type hint, e.g. `{p.name}: str` (the "
                                          "JSON schema the model sees is built from type hints)")
            _check_hint(hints[p.name], where)
            if p.default is not p.empty:
                ok, default = _json_default(p.default)
                if ok:
                    defaults[p.name] = default
        unknown_doc = set(arg_docs) - set(inspect.signature(fn).parameters)
        if unknown_doc:
            raise ToolDefinitionError(f"tool {fname!r}: docstring Args lists {sorted(unknown_doc)}, which are not parameters")
        params = _library_schema(fn, fname, arg_docs)
        for k, v in defaults.items():
            params["properties"][k]["default"] = v
        return cls(name=fname, description=desc, parameters=params, fn=fn)

    def schema(self) -> dict:
        """OpenAI function format, as ``apply_chat_template(tools=...)`` expects."""
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def check_arguments(self, arguments: Any) -> str | None:
        """None if ``arguments`` fits the schema, else a message for the policy."""
        if not isinstance(arguments, dict):
            return f"arguments must be a JSON object, got {_jtype(arguments)}"
        props, required = self.parameters["properties"], self.parameters["required"]
        problems = _validation_errors(arguments, self.parameters)
        if problems:
            sig = ", ".join(f"{k}: {_fmt_type(s)}" + ("" if k in required else " (optional)") for k, s in props.items())
            return "; ".join(problems) + f". Signature: {self.name}({sig})"
        return None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)  # still a plain function for Python callers


def _fmt_type(s: dict) -> str:
    if "anyOf" in s:
        return " | ".join(_fmt_type(x) for x in s["anyOf"])
    t = s.get("type", "any")
    return " | ".join(t) if isinstance(t, list) else t


def tool(fn: Callable | None = None, *, name: str | None = None, description: str | None = None):
    """Decorator: ``@tool`` or ``@tool(name=..., description=...)`` turns a function into a :class:`Tool`.
    The result is still callable like the function."""
    if fn is None:
        return lambda f: Tool.from_function(f, name=name, description=description)
    return Tool.from_function(fn, name=name, description=description)


# --- parsing --------------------------------------------------------------------------------------------------------

_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def has_tool_call(text: str) -> bool:
    return "<tool_call>" in text


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>`` block in ``text``, in order. Never raises; bad blocks carry ``error``."""
    calls = []
    for m in _BLOCK.finditer(text):
        raw = m.group(1).strip()
        # Tolerate a markdown fence inside the tags: some models wrap the JSON in ```json ... ```.
        body = re.sub(r"^```(?:json)?\s*|\s*```$", "", raw)
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(None, raw=raw, error=f"the tool call is not valid JSON ({e.msg} at char {e.pos})"))
            continue
        except (ValueError, RecursionError) as e:  # a 5,000-digit number, or nesting deeper than the decoder goes
            calls.append(ToolCall(None, raw=raw, error=f"the tool call's JSON cannot be read ({str(e)[:80]})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall(None, raw=raw, error='a tool call must be a JSON object {"name": <tool name>, "arguments": {...}}'))
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # OpenAI-style arguments encoded as a JSON string
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
                calls.append(ToolCall(obj["name"], raw=raw, error="\"arguments\" is a string that is not a JSON object"))
                continue
        calls.append(ToolCall(obj["name"], args, raw=raw))  # a non-object is reported when the call is run
    return calls


# --- running --------------------------------------------------------------------------------------------------------

def _to_text(value: Any, name: str, fn: Callable | None = None) -> ToolResult:
    if isinstance(value, ToolOutput):
        return ToolResult(name, value.content, error=value.error or value.timeout, timeout=value.timeout)
    if isinstance(value, str):
        return ToolResult(name, value)
    try:
        return ToolResult(name, json.dumps(value, ensure_ascii=False))
    except (TypeError, ValueError):
        kind = type(value).__name__
        fix = "decode it (value.decode())" if isinstance(value, (bytes, bytearray)) else "convert it to str"
        report_once(name, f"returned {kind}", "tool %r (%s) returned a %s, which is not text: a tool must return str "
                     "or a JSON-serialisable value; %s. The model was shown a tool error.", name,
                     where_defined(fn) if fn else "?", kind, fix)
        return ToolResult(name, f"Error: tool {name!r} returned a {kind}, which is not text; tools must return str or "
                          "a JSON-serialisable value (this is a bug in the tool, not in the call)", error=True)


def _as_declared(value: Any, schema: dict) -> Any:
    """JSON has one number type: give a ``float`` parameter a float and an ``int`` one an int (3 -> 3.0, 3.0 -> 3)."""
    t = schema.get("type")
    if t == "number" and type(value) is int:
        return float(value)
    if t == "integer" and type(value) is float:
        return int(value)  # jsonschema accepted it, so it is integral
    return value


def execute(call: ToolCall, tools: dict[str, Tool]) -> ToolResult:
    """Run one call. Never raises (except KeyboardInterrupt / SystemExit): every failure is an error result."""
    if call.error is not None:
        return ToolResult(call.name, f"Error: {call.error}. Expected <tool_call>{{\"name\": ..., \"arguments\": {{...}}}}</tool_call>.", error=True, malformed=True)
    t = tools.get(call.name)
    if t is None:
        return ToolResult(call.name, f"Error: unknown tool {call.name!r}. Available tools: {', '.join(sorted(tools)) or 'none'}.", error=True)
    problem = t.check_arguments(call.arguments)
    if problem is not None:
        return ToolResult(call.name, f"Error calling {call.name!r}: {problem}", error=True)
    # Hints say float; JSON may carry an int. Give the function the type it declared.
    args = {k: _as_declared(v, t.parameters["properties"][k]) for k, v in call.arguments.items()}
    try:
        value = t.fn(**args)
    except TimeoutError as e:
        return ToolResult(call.name, f"Error: tool {call.name!r} timed out" + (f": {e}" if str(e) else ""), error=True, timeout=True)
    except Exception as e:
        report_once(call.name, f"raised {type(e).__name__}", "tool %r (%s) raised %s (shown to the model as a tool "
                     "error without the traceback; logged once per tool and exception type)", call.name, where_defined(t.fn),
                     type(e).__name__, exc=e)
        return ToolResult(call.name, f"Error: tool {call.name!r} raised {exception_line(e, t.fn)}", error=True)
    return _to_text(value, call.name, t.fn)

