"""A text-level policy served by any OpenAI-compatible chat-completions endpoint (vLLM, SGLang, OpenAI, ...).

Contract:

* :class:`EndpointPolicy` is a :class:`agentenv.core.policy.TextPolicy` (``act(messages, info) -> str``): the runtime
  plays it like a scripted expert, so the env, its tool counters and the trajectory's ``messages`` are exactly those
  of a local model's episode, with empty token fields and ``sampling["backend"] == "endpoint"``.
* **Evaluation only.** A chat-completions server returns text, not the token ids and behaviour log-probs
  FlashREINFORCE trains on; :meth:`EndpointPolicy.load_weights` (what a trainer calls to publish weights) raises
  :class:`EndpointTrainingRefused` saying so, and the learner refuses token-less trajectories anyway.
* Request: the runtime's chat history converted to the OpenAI format (:func:`to_openai_messages`): an assistant
  turn holding ``<tool_call>`` blocks is sent as structured ``tool_calls`` (ids ``call_<turn>_<i>``), the env's
  tool message is split back into one ``tool`` message per call; the env's tool schemas go in ``tools``. Sampling:
  ``temperature``, ``top_p``, ``max_tokens`` (and ``top_k`` only when set: it is not an OpenAI parameter).
* Reply -> action (:func:`reply_to_action`): the message ``content`` followed by one Hermes
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block per structured tool call (arguments that are
  not a JSON object are passed through raw, so the env counts the call as malformed, as it would a local model's).
  A server without a tool parser leaves the model's ``<tool_call>`` blocks in ``content``; they reach the env as
  written. Either way the env parses the same text a local model would have produced. A reply cut at
  ``max_tokens`` (``finish_reason: "length"``) ends the episode as ``max_new_tokens``, ungraded, as a local
  model's unfinished turn does (:class:`agentenv.core.policy.CutText`).
* Errors: connection errors, timeouts, HTTP 408 / 409 / 429 and 5xx are retried ``retries`` times with exponential
  backoff (``backoff_s`` x 2^k, capped at ``max_backoff_s``; a ``Retry-After`` header within the cap is honoured);
  then, and for any other HTTP error (a refused request: bad model name, bad key, tools not supported), it raises
  :class:`EndpointError` with one line naming the status and the server's message. A refusal is remembered
  (``refused``): later calls fail at once, so a run stops instead of hammering the server.
* :meth:`EndpointPolicy.check` is the pre-flight: ``GET /models`` (a server without it is fine; a model it does not
  list is an error naming the ones it does) and one ``max_tokens=1`` chat request with the env's first prompt and
  tools, so an unreachable or refusing endpoint fails before any output is written.

HTTP goes through ``httpx`` (optional extra ``agentenv[endpoint]``; imported on first use with a clear message).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from agentenv.envs.tools import parse_tool_calls
from agentenv.core.policy import CutText

RETRY_STATUS = {408, 409, 429}  # plus every 5xx


class EndpointError(RuntimeError):
    """The endpoint could not be reached or refused the request; the message is one line."""


class EndpointTrainingRefused(TypeError):
    """A trainer tried to use an endpoint policy (it has no token ids or behaviour log-probs to learn from)."""


def base_url(url: str) -> str:
    """``http://host:port`` -> ``http://host:port/v1`` (the usual OpenAI-compatible root); a URL with a path is
    taken as the root itself (e.g. ``https://api.example.com/openai/v1``)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise EndpointError(f"--endpoint {url!r} is not an http(s) URL (e.g. http://127.0.0.1:8000/v1)")
    url = url.rstrip("/")
    return url + "/v1" if parts.path in ("", "/") else url


def _split_results(content: str, names: list[str]) -> list[str]:
    """The env's tool message for ``len(names)`` calls back into one text per call. The env joins several results
    as ``[i] name:\\n<text>`` separated by blank lines (:class:`agentenv.envs.tool_env.ToolEnv`); headers are found
    in order, so a result containing a header-like line of another number cannot shift the split."""
    if len(names) == 1:
        return [content]
    starts, pos = [], 0
    for i, name in enumerate(names, 1):
        header = f"[{i}] {name}:\n"
        at = content.find(header, pos) if i == 1 else content.find("\n\n" + header, pos)
        if at < 0 or (i == 1 and at != 0):
            return [content] + ["(the result is in the first tool message)"] * (len(names) - 1)
        body = at + len(header) + (0 if i == 1 else 2)
        starts.append((at, body))
        pos = body
    ends = [a for a, _ in starts[1:]] + [len(content)]
    return [content[body:end] for (_, body), end in zip(starts, ends)]


def to_openai_messages(messages: list[dict]) -> list[dict]:
    """The runtime's text history as OpenAI chat messages (see the module docstring)."""
    out: list[dict] = []
    pending: list[tuple[str, str]] = []  # (call id, tool name) of the last assistant turn's calls
    for turn, m in enumerate(messages):
        role, content = m["role"], m.get("content") or ""
        if role == "assistant":
            calls = parse_tool_calls(content)
            pending = []
            if calls and all(c.error is None for c in calls):
                text = re.sub(r"<tool_call>.*?(</tool_call>|$)", "", content, flags=re.S).strip()
                tool_calls = []
                for i, c in enumerate(calls):
                    cid = f"call_{turn}_{i}"
                    pending.append((cid, c.name))
                    tool_calls.append({"id": cid, "type": "function",
                                       "function": {"name": c.name, "arguments": json.dumps(c.arguments)}})
                out.append({"role": "assistant", "content": text or None, "tool_calls": tool_calls})
            else:  # no call, or a malformed block: the text as the model wrote it
                out.append({"role": "assistant", "content": content})
        elif role == "tool":
            if pending:
                for (cid, _), text in zip(pending, _split_results(content, [n for _, n in pending])):
                    out.append({"role": "tool", "tool_call_id": cid, "content": text})
                pending = []
            else:  # results of malformed blocks: no call id to answer, so the server sees them as a user turn
                out.append({"role": "user", "content": content})
        else:
            out.append({"role": role, "content": content})
    return out


def reply_to_action(message: dict, finish_reason: str | None = None) -> str:
    """The env action for one chat-completions reply message (see the module docstring); a reply the server cut
    at ``max_tokens`` (``finish_reason == "length"``) is a :class:`~agentenv.core.policy.CutText`."""
    parts = [message.get("content") or ""]
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                parsed = json.loads(args) if args.strip() else {}
                args_text = json.dumps(parsed) if isinstance(parsed, dict) else args
            except json.JSONDecodeError:
                args_text = args  # left invalid on purpose: the env reports a malformed call
        else:
            args_text = json.dumps(args if args is not None else {})
        parts.append(f'<tool_call>\n{{"name": {json.dumps(fn.get("name", ""))}, "arguments": {args_text}}}\n</tool_call>')
    text = "\n".join(p for p in parts if p)
    return CutText(text) if finish_reason == "length" else text


def _httpx():
    try:
        import httpx
    except ImportError:
        raise EndpointError("the endpoint client needs httpx: pip install 'agentenv[endpoint]'") from None
    return httpx


def _server_message(resp) -> str:
    """The error text of a failed response, on one line."""
    try:
        body = resp.json()
        err = body.get("error", body) if isinstance(body, dict) else body
        msg = err.get("message", err) if isinstance(err, dict) else err
    except ValueError:
        msg = resp.text
    return " ".join(str(msg).split())[:300] or resp.reason_phrase


class EndpointPolicy:
    """See the module docstring. Thread-safe: one pooled HTTP client serves every episode thread."""

    backend = "endpoint"
    model_path = None

    def __init__(self, url: str, model: str, *, api_key: str | None = None, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, max_tokens: int = 256, timeout_s: float = 120.0,
                 retries: int = 3, backoff_s: float = 0.5, max_backoff_s: float = 8.0):
        if retries < 0 or backoff_s < 0 or max_backoff_s < 0:
            raise ValueError("retries, backoff_s and max_backoff_s must be >= 0")
        httpx = _httpx()
        self.url, self.name = base_url(url), model
        self.sampling = {"temperature": temperature, "top_p": top_p, "max_tokens": max_tokens}
        if top_k:
            self.sampling["top_k"] = top_k  # vLLM / SGLang extension; OpenAI itself has no top_k
        self.retries, self.backoff_s, self.max_backoff_s = retries, backoff_s, max_backoff_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s,
                                    limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))
        if logging.getLogger("httpx").level == logging.NOTSET:  # httpx logs every request at INFO
            logging.getLogger("httpx").setLevel(logging.WARNING)
        self._lock = threading.Lock()
        self.refused: EndpointError | None = None
        self.requests = self.retried = 0
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0}

    # --- HTTP with bounded retries ----------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        httpx = _httpx()
        if self.refused is not None:
            raise self.refused
        where = f"{method} {self.url}{path}"
        for attempt in range(self.retries + 1):
            wait = min(self.max_backoff_s, self.backoff_s * 2 ** attempt) * (0.5 + random.random() / 2)
            try:
                resp = self._client.request(method, path, json=body)
            except httpx.TransportError as e:  # connection refused / reset, DNS, timeouts
                problem = f"cannot reach {where}: {type(e).__name__}: {e or 'no detail'}"
            else:
                if resp.status_code < 400:
                    try:
                        return resp.json()
                    except ValueError:
                        problem = f"{where} answered {resp.status_code} with a body that is not JSON"
                elif resp.status_code in RETRY_STATUS or resp.status_code >= 500:
                    problem = f"{where} answered {resp.status_code}: {_server_message(resp)}"
                    after = resp.headers.get("retry-after", "")
                    if after.replace(".", "", 1).isdigit() and float(after) <= self.max_backoff_s:
                        wait = float(after)
                else:
                    err = EndpointError(f"the endpoint refused the request ({where} -> {resp.status_code}): "
                                        f"{_server_message(resp)}")
                    with self._lock:
                        self.refused = err
                    raise err
            if attempt == self.retries:
                break
            with self._lock:
                self.retried += 1
            time.sleep(wait)
        raise EndpointError(f"{problem} (after {self.retries + 1} attempts)")

    def complete(self, messages: list[dict], tools: list[dict] | None, **overrides) -> tuple[dict, str | None]:
        """One chat completion: the reply message (``content`` and/or ``tool_calls``) and its ``finish_reason``."""
        body: dict[str, Any] = {"model": self.name, "messages": messages, **self.sampling, **overrides}
        if tools:
            body["tools"] = tools
        data = self._request("POST", "/chat/completions", body)
        with self._lock:
            self.requests += 1
            for k in self.usage:
                self.usage[k] += int((data.get("usage") or {}).get(k) or 0)
        try:
            return data["choices"][0]["message"], data["choices"][0].get("finish_reason")
        except (KeyError, IndexError, TypeError):
            raise EndpointError(f"{self.url}/chat/completions answered without choices[0].message: "
                                f"{json.dumps(data)[:200]}") from None

    # --- the TextPolicy interface -----------------------------------------------------------------------------------
    def act(self, messages: list[dict], info: dict) -> str:
        return reply_to_action(*self.complete(to_openai_messages(messages), info.get("tools")))

    def check(self, messages: list[dict], tools: list[dict] | None) -> None:
        """The pre-flight (see the module docstring); raises :class:`EndpointError`."""
        try:
            listed = self._request("GET", "/models")
        except EndpointError as e:
            if "cannot reach" in str(e):
                raise
            self.refused, listed = None, None  # no /models route: the chat request below decides
        served = [m.get("id") for m in (listed or {}).get("data") or [] if isinstance(m, dict)]
        if served and self.name not in served:
            raise EndpointError(f"model {self.name!r} is not served at {self.url}; it serves: {', '.join(served)}")
        self.complete(to_openai_messages(messages), tools, max_tokens=1)

    def load_weights(self, *args, **kwargs):
        raise EndpointTrainingRefused(
            "an OpenAI-compatible endpoint is for evaluation only: it returns text, not the token ids and behaviour "
            "log-probs FlashREINFORCE trains on; train with --model (a local checkpoint, the hf or vllm backend)")

    def close(self) -> None:
        self._client.close()


def api_key_from_env(var: str | None) -> str | None:
    """The key in environment variable ``var`` (never on the command line, where ``ps`` shows it)."""
    if not var:
        return None
    key = os.environ.get(var)
    if not key:
        raise EndpointError(f"--api-key-env {var}: that environment variable is not set or empty")
    return key
