"""One token sequence per trajectory, grown by chat-template deltas; the history is never re-tokenized.

:class:`ChatSequence` owns the four aligned per-token lists of a trajectory (see :mod:`agentenv.core.trajectory`):

* ``start(messages, tools)`` renders the prompt with the tokenizer's own chat template (with the generation prompt)
  and tokenizes it once.
* ``add_sampled(generation)`` appends the sampler's tokens verbatim (mask True, their behaviour log-probs, their
  policy version) and records the assistant message as the decoded text of those tokens.
* ``add_message(role, content)`` appends ONLY the template delta of a new user / tool message (plus the template's
  glue after the assistant's turn and the next generation prompt), mask False.

**Unforgeable structure.** Message contents (env observations, tool output, task questions, system prompts, tool
schemas) are untrusted text. Before rendering, every occurrence of a control string of the tokenizer (the content of
every added token: ``<|im_end|>``, ``<|endoftext|>``, ``<tool_call>``, ...) in a content is replaced by a marker that
carries a per-sequence random nonce; the template renders the marked contents; the rendered text is tokenized piece
by piece: text between markers normally (so only the template's own glue can yield control tokens), each marker as
the PLAIN tokenization of the string it stands for (the tokenizer's normalizer, pre-tokenizer and model, with no
added-token matching; never the shared ``split_special_tokens`` flag, which would race other episode threads). A
forged ``<|im_end|>`` in a tool result is therefore a few ordinary tokens, never the end-of-turn id. Assumption (true
of every template we know): template glue never starts or ends in the middle of a control string, so no control
string spans glue and content.

**Deltas.** A delta is computed from the real history: the template is rendered with and without the new message
and the earlier rendering must be an exact prefix of the later one ("append-only"). A cheaper "local" delta, cut
from a fixed short history with the content substituted for a sentinel, is used only where it provably matches:
(1) the template renders every message content verbatim -- checked once per sequence and role with adversarial
probes (leading / trailing whitespace and newlines, tabs, unicode that NFC-normalises, text that looks like a control
token, Jinja syntax); a template that trims, escapes or rewrites contents never gets the shortcut; (2) adding a
message of that role to each of :data:`PROBE_HISTORIES` (reasoning blocks, edge newlines, tool turns, several user
turns) leaves the earlier rendering untouched and appends exactly the fixed tail -- a template that strips earlier
reasoning or moves a block never gets the shortcut; and (3) the first ``VERIFY_TURNS`` real deltas of that role in
the episode equalled the local delta (any mismatch disables it for good). These are checks on probes, not a proof
about arbitrary Jinja; the property test in ``tests/test_chat_templates.py`` holds them to four template families.

**Stop tokens.** A sampled turn may end on any stop id (vLLM stops on every ``generation_config`` eos id, e.g.
``<|endoftext|>`` where the template closes turns with ``<|im_end|>``). The sampled stop token is kept verbatim; if its
text is not the start of the template's own assistant closing text, the next delta begins with that closing text
(e.g. ``<|im_end|>\\n``), so the turn is always closed the way the template closes it.

**Rewrites.** If a template is not append-only (it rewrites earlier turns, e.g. strips reasoning from old assistant
messages, or trims a sampled turn's trailing whitespace), ``on_rewrite="error"`` raises :class:`TemplateNotAppendOnly`;
``on_rewrite="segment"`` appends the local delta, records its offset in ``segments`` and carries on, so that the
tokens stay exactly what the model was conditioned on.
"""

from __future__ import annotations

import re
import secrets
from typing import Any, Literal, NamedTuple

from agentenv.core.policy import Generation


VERIFY_TURNS = 2  # turns per role whose delta is checked against the full history before trusting local deltas

# Contents a verbatim template must render unchanged (beyond these, a control-string marker is always probed).
VERBATIM_PROBES = (
    "  leading and trailing spaces  ",
    "\n\nnewlines around\n\n",
    "\ttab\t",
    "e\u0301 \ufb01 \u212b",  # combining accent, ligature, Angstrom sign: each changes under NFC / NFKC
    "{{ not jinja }} {% raw %}",
    "&lt;b&gt; <b>",
)


def _m(role: str, content: str) -> dict:
    return {"role": role, "content": content}


# Histories (each ending with an assistant turn) on which a template must append a new message without touching what
# it rendered before, for the short-history shortcut to be allowed.
PROBE_HISTORIES = (
    [_m("user", "x"), _m("assistant", "y")],
    [_m("user", "x"), _m("assistant", "<think>\nplan\n</think>\n\nanswer")],
    [_m("system", "s"), _m("user", "x"), _m("assistant", "\n\nlead"), _m("tool", "t"),
     _m("assistant", "<think>p</think>z  ")],
    [_m("user", "x"), _m("assistant", "<think>a</think>y"), _m("user", "z"), _m("assistant", "<think>p</think>w")],
)
_ASSISTANT_SENTINEL = "\u2063AGENTENV-ASSISTANT\u2063"
_MESSAGE_SENTINEL = "\u2063AGENTENV-MESSAGE\u2063"


class TemplateNotAppendOnly(RuntimeError):
    """The chat template re-renders earlier turns when a message is added (see the module docstring)."""


class Delta(NamedTuple):
    """What adding one message appends: its token ids, how they were derived, and the (marked) text they encode."""

    ids: list[int]
    how: str  # "checked" | "local" | "segment"
    text: str


def control_strings(tokenizer) -> list[str]:
    """Every added token's content (special or not), longest first: strings env text must never turn into."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    strings = {t.content for t in decoder.values() if getattr(t, "content", "")}
    strings |= {s for s in getattr(tokenizer, "all_special_tokens", []) if s}
    return sorted(strings, key=lambda s: (-len(s), s))


def _model_ids(tokenizer, text: str) -> list[int]:
    """``text`` through the fast tokenizer's normalizer, pre-tokenizer and model only, skipping added-token
    matching: the ids of ``text`` as ordinary text."""
    bt = getattr(tokenizer, "backend_tokenizer", None)
    if bt is None:
        raise ValueError("plain-text encoding of control strings needs a fast (tokenizers-backed) tokenizer")
    if bt.normalizer is not None:
        text = bt.normalizer.normalize_str(text)
    pieces = bt.pre_tokenizer.pre_tokenize_str(text) if bt.pre_tokenizer is not None else [(text, None)]
    return [t.id for piece, _ in pieces for t in bt.model.tokenize(piece)]


class ChatSequence:
    def __init__(self, tokenizer, *, on_rewrite: Literal["error", "segment"] = "error"):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("tokenizer has no chat_template; agentenv renders turns with the model's own template")
        if on_rewrite not in ("error", "segment"):
            raise ValueError(f"on_rewrite must be 'error' or 'segment', got {on_rewrite!r}")
        self.tok = tokenizer
        self.on_rewrite = on_rewrite
        self.token_ids: list[int] = []
        self.action_mask: list[bool] = []
        self.behavior_logprobs: list[float] = []
        self.policy_version: list[int] = []
        self.segments: list[int] = [0]
        self.messages: list[dict] = []
        self.tools: list[dict] | None = None
        self._parts: list[str] = []  # the (marked) template text the sequence stands for, in pieces
        self._verified: dict[str, int] = {}
        self._probed: dict[str, bool] = {}  # shortcut checks on probes, per role, computed once
        self._tails: dict[str, str] = {}
        self._close: str | None = None
        self._closed = 0  # characters of the assistant closing text the last sampled turn already covers
        self._init_markers()

    # --- escaping and encoding -----------------------------------------------------------------------------------
    def _init_markers(self) -> None:
        controls = control_strings(self.tok)
        nonce = secrets.token_hex(8)
        self._controls = controls
        self._marker = {s: f"\ue000{nonce}:{i}\ue001" for i, s in enumerate(controls)}
        self._control_re = re.compile("|".join(map(re.escape, controls))) if controls else None
        self._marker_re = re.compile(f"\ue000{nonce}:(\\d+)\ue001")
        added_ids = set(getattr(self.tok, "added_tokens_decoder", {}) or {})
        self._plain: list[list[int]] = []
        for s in controls:
            # Not ``tok(s, split_special_tokens=True)``: on a fast tokenizer that sets a flag on the Rust tokenizer
            # every thread shares, and an episode thread encoding its glue meanwhile got ``<|im_start|>`` as plain
            # text. The model's own pipeline gives the same ids without touching shared state (and, unlike the flag,
            # also skips non-special added tokens); a slow tokenizer takes the flag per call.
            if getattr(self.tok, "backend_tokenizer", None) is not None:
                ids = _model_ids(self.tok, s)
            else:
                ids = self.tok(s, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            if added_ids & set(ids):
                raise ValueError(f"the tokenizer cannot encode the control string {s!r} as plain text")
            self._plain.append(ids)

    def escape(self, text: str) -> str:
        """``text`` with every control string replaced by its marker (what the template gets to render)."""
        if self._control_re is None or not isinstance(text, str):
            return text
        return self._control_re.sub(lambda m: self._marker[m.group(0)], text)

    def _escape_obj(self, obj: Any) -> Any:
        if isinstance(obj, str):
            return self.escape(obj)
        if isinstance(obj, dict):
            return {k: self._escape_obj(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._escape_obj(v) for v in obj]
        return obj

    def encode(self, marked: str) -> list[int]:
        """Token ids of rendered (marked) text: glue tokenized normally, each marker as its plain-text tokens."""
        pieces = self._marker_re.split(marked)
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:
                ids += self._plain[int(piece)]
            elif piece:
                ids += self.tok(piece, add_special_tokens=False)["input_ids"]
        return ids

    def encode_content(self, text: str) -> list[int]:
        """Plain-text tokens of untrusted text (control strings stay text)."""
        return self.encode(self.escape(text))

    # --- rendering ------------------------------------------------------------------------------------------------
    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        marked = [{**m, "content": self.escape(m["content"])} if isinstance(m.get("content"), str) else dict(m)
                  for m in messages]
        tools = self._escape_obj(self.tools) if self.tools else None
        return self.tok.apply_chat_template(marked, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)

    def _append(self, ids: list[int], sampled: bool, logprobs: list[float] | None = None, version: int = -1) -> None:
        self.token_ids += ids
        self.action_mask += [sampled] * len(ids)
        self.behavior_logprobs += list(logprobs) if sampled else [0.0] * len(ids)
        self.policy_version += [version if sampled else -1] * len(ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    # --- building -------------------------------------------------------------------------------------------------
    def start(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        if self.token_ids:
            raise RuntimeError("ChatSequence.start called twice")
        self.tools = tools or None
        self.messages = [dict(m) for m in messages]
        prompt = self._render(self.messages, generation_prompt=True)
        self._parts = [prompt]
        self._append(self.encode(prompt), sampled=False)
        return self.token_ids

    def add_sampled(self, gen: Generation) -> str:
        """Append a sampled assistant turn verbatim; returns its text (the stop token removed)."""
        ids = list(gen.token_ids)
        self._append(ids, sampled=True, logprobs=gen.logprobs, version=gen.policy_version)
        stopped = gen.stop_reason == "stop" and bool(ids)
        content = self.tok.decode(ids[:-1] if stopped else ids, skip_special_tokens=False)
        self.messages.append({"role": "assistant", "content": content})
        part = self.escape(content)
        self._closed = 0
        if stopped:
            stop_text = self.tok.decode(ids[-1:], skip_special_tokens=False)
            if stop_text and self._assistant_close().startswith(stop_text):
                part += stop_text  # the sampled stop token IS the template's closing text (or its start)
                self._closed = len(stop_text)
            # otherwise the stop token lies outside the template's text; the next delta opens with the closing text
        self._parts.append(part)
        return content

    def delta_for(self, role: str, content: str) -> Delta:
        """The tokens that adding this message (and the next generation prompt) would append, and how they were
        derived: ``"checked"`` (rendered against the real history), ``"local"`` (cut from a fixed short history;
        only where the module docstring's two conditions hold) or ``"segment"``. Does not mutate the sequence."""
        if not self.messages or self.messages[-1]["role"] != "assistant":
            raise ValueError("a user / tool message is added after a sampled assistant turn")
        if self._local_ok(role):
            text = self._local_delta(role, content)
            return Delta(self.encode(text), "local", text)
        new = self.messages + [{"role": role, "content": content}]
        full = self._render(new, generation_prompt=True)
        before = self._render(self.messages, generation_prompt=False)
        covered = "".join(self._parts)
        if before.startswith(covered) and full.startswith(before):
            text = full[len(covered):]
            return Delta(self.encode(text), "checked", text)
        if self.on_rewrite == "error":
            raise TemplateNotAppendOnly(
                "the chat template re-renders earlier turns differently once a new message is added, so its output is "
                "not append-only for this conversation; agentenv will not re-tokenize history. Use "
                "on_rewrite='segment' to append per-message deltas and record a segment boundary instead."
            )
        text = self._local_delta(role, content)
        return Delta(self.encode(text), "segment", text)

    def add_message(self, role: str, content: str, delta: Delta | None = None) -> list[int]:
        """Append a user / tool message and the next generation prompt. Returns the appended token ids."""
        if role not in ("user", "tool"):
            raise ValueError(f"observation role must be 'user' or 'tool', got {role!r}")
        delta = delta if delta is not None else self.delta_for(role, content)
        if delta.how == "checked":
            # Count turns where the local delta reproduced the real one; any mismatch disables it for good.
            try:
                same = self._local_delta(role, content) == delta.text
            except TemplateNotAppendOnly:
                same = False
            self._verified[role] = self._verified.get(role, 0) + 1 if same else -(1 << 30)
        elif delta.how == "segment":
            self.segments.append(len(self.token_ids))
        self._parts.append(delta.text)
        self._append(list(delta.ids), sampled=False)
        self.messages.append({"role": role, "content": content})
        self._closed = 0
        return list(delta.ids)

    # --- the local (short-history) delta --------------------------------------------------------------------------
    def _tail(self, role: str) -> str:
        """Everything the template renders after an assistant turn's content when a ``role`` message (the message
        sentinel) and the generation prompt follow, for a fixed user / assistant history. A template that drops the
        earlier assistant content is cut at the last assistant closing text (or eos) before the message instead."""
        if role not in self._tails:
            history = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _ASSISTANT_SENTINEL},
                       {"role": role, "content": _MESSAGE_SENTINEL}]
            try:
                full = self._render_raw(history, generation_prompt=True)
            except Exception as e:  # noqa: BLE001 -- e.g. a template that insists on its own history shape
                raise TemplateNotAppendOnly(f"the chat template cannot render the short history: {e}") from e
            at, msg = full.find(_ASSISTANT_SENTINEL), full.find(_MESSAGE_SENTINEL)
            if msg < 0 or full.count(_MESSAGE_SENTINEL) != 1:
                raise TemplateNotAppendOnly("cannot locate a per-message delta in this chat template's output")
            if 0 <= at < msg and full.count(_ASSISTANT_SENTINEL) == 1:
                self._tails[role] = full[at + len(_ASSISTANT_SENTINEL):]
            else:
                close = self._assistant_close() or (self.tok.eos_token or "")
                cut = full.rfind(close, 0, msg) if close else -1
                if cut < 0:
                    raise TemplateNotAppendOnly("cannot locate a per-message delta in this chat template's output")
                self._tails[role] = full[cut:]
        return self._tails[role]

    def _assistant_close(self) -> str:
        """The template's text after the content of a final assistant turn (e.g. ``<|im_end|>\\n``)."""
        if self._close is None:
            try:
                full = self._render_raw([{"role": "user", "content": "x"},
                                         {"role": "assistant", "content": _ASSISTANT_SENTINEL}], generation_prompt=False)
            except Exception:  # noqa: BLE001 -- no closing text known: stop tokens then count as outside the template
                full = ""
            at = full.find(_ASSISTANT_SENTINEL)
            self._close = full[at + len(_ASSISTANT_SENTINEL):] if at >= 0 and full.count(_ASSISTANT_SENTINEL) == 1 else ""
        return self._close

    def _render_raw(self, messages: list[dict], generation_prompt: bool) -> str:
        """Render already-marked messages (the sentinels and probes here) with the sequence's tools."""
        return self.tok.apply_chat_template(messages, tools=self._escape_obj(self.tools) if self.tools else None,
                                            tokenize=False, add_generation_prompt=generation_prompt)

    def _local_delta(self, role: str, content: str) -> str:
        return self._tail(role).replace(_MESSAGE_SENTINEL, self.escape(content))[self._closed:]

    def _local_ok(self, role: str) -> bool:
        return self._verified.get(role, 0) >= VERIFY_TURNS and self._renders_verbatim(role) \
            and self._appends_per_message(role)

    def _appends_per_message(self, role: str) -> bool:
        """Does adding a ``role`` message leave the rendering of any history untouched and append exactly the fixed
        tail? Checked on :data:`PROBE_HISTORIES` (reasoning blocks, edge newlines, tool turns, several user turns):
        a template that strips earlier reasoning or moves a block (e.g. a tool list before the last user message)
        fails here and never gets the shortcut."""
        def check() -> bool:
            close = self._assistant_close()
            tail = self._tail(role).replace(_MESSAGE_SENTINEL, "probe")
            for history in PROBE_HISTORIES:
                before = self._render_raw(history, generation_prompt=False)
                full = self._render_raw(history + [{"role": role, "content": "probe"}], generation_prompt=True)
                if not before.endswith(close) or full != before[:len(before) - len(close)] + tail:
                    return False
            return True

        return self._probe("history:" + role, check)

    def _renders_verbatim(self, role: str) -> bool:
        """Does the template put a ``role`` message's content into its output unchanged? Checked with
        :data:`VERBATIM_PROBES` plus a control-string marker, against the same fixed history the local delta uses."""
        def check() -> bool:
            probes = list(VERBATIM_PROBES) + ([self._controls[0] + " x " + self._controls[-1]] if self._controls else [])
            history = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _ASSISTANT_SENTINEL}]
            for probe in probes:
                full = self._render_raw(history + [{"role": role, "content": self.escape(probe)}], True)
                at = full.find(_ASSISTANT_SENTINEL)
                if at < 0 or full[at + len(_ASSISTANT_SENTINEL):] != \
                        self._tail(role).replace(_MESSAGE_SENTINEL, self.escape(probe)):
                    return False
            return True

        return self._probe(role, check)

    def _probe(self, key: str, check) -> bool:
        """``check()`` once per key, remembered; a template that fails on a probe gets no shortcut."""
        if key not in self._probed:
            try:
                self._probed[key] = bool(check())
            except Exception:  # noqa: BLE001 -- any template failure on a probe means: render against the history
                self._probed[key] = False
        return self._probed[key]
