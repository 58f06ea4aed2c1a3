"""One token sequence per trajectory, grown by chat-template deltas; the history is never re-tokenized.

:class:`ChatSequence` owns the four aligned per-token lists of a trajectory (see :mod:`agentenv.trajectory`):

* ``start(messages, tools)`` renders the prompt with the tokenizer's own chat template (with the generation prompt)
  and tokenizes it once.
* ``add_sampled(generation)`` appends the sampler's tokens verbatim (mask True, their behaviour log-probs, their
  policy version) and records the assistant message as the decoded text of those tokens.
* ``add_message(role, content)`` appends ONLY the template delta of a new user / tool message (plus the template's
  glue after the assistant's end-of-turn token and the next generation prompt), mask False.

Deltas are computed from the real history: the template is rendered with and without the new message and the
earlier rendering must be an exact prefix of the later one ("append-only"). Once the first ``VERIFY_TURNS`` deltas of
a role in an episode equal the delta cut from a fixed two-message history, later deltas of that role are cut from
that short history, so the cost of a turn does not grow with the conversation. If a template is not append-only (it
rewrites earlier turns, e.g. strips reasoning from old assistant messages), ``on_rewrite="error"`` raises
:class:`TemplateNotAppendOnly`; ``on_rewrite="segment"`` appends the delta the template gives for a new message after
a fixed dummy history, records the offset in ``segments`` and carries on, so that the tokens stay exactly what the
model was conditioned on.
"""

from __future__ import annotations

from typing import Literal

from agentenv.policy import Generation


VERIFY_TURNS = 2  # turns per role whose delta is checked against the full history before trusting local deltas


class TemplateNotAppendOnly(RuntimeError):
    """The chat template re-renders earlier turns when a message is added (see the module docstring)."""


class ChatSequence:
    def __init__(self, tokenizer, *, on_rewrite: Literal["error", "segment"] = "error"):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("tokenizer has no chat_template; agentenv renders turns with the model's own template")
        self.tok = tokenizer
        self.on_rewrite = on_rewrite
        self.token_ids: list[int] = []
        self.action_mask: list[bool] = []
        self.behavior_logprobs: list[float] = []
        self.policy_version: list[int] = []
        self.segments: list[int] = [0]
        self.messages: list[dict] = []
        self.tools: list[dict] | None = None
        self._parts: list[str] = []  # the text the token sequence stands for, in pieces (joined only when checked)
        self._verified: dict[str, int] = {}

    # --- rendering ------------------------------------------------------------------------------------------------
    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

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
        self._append(self._encode(prompt), sampled=False)
        return self.token_ids

    def add_sampled(self, gen: Generation) -> str:
        """Append a sampled assistant turn verbatim; returns its text (end-of-turn token removed)."""
        ids = list(gen.token_ids)
        self._append(ids, sampled=True, logprobs=gen.logprobs, version=gen.policy_version)
        body = ids[:-1] if gen.stop_reason == "stop" and ids else ids
        content = self.tok.decode(body, skip_special_tokens=False)
        self.messages.append({"role": "assistant", "content": content})
        self._parts.append(self.tok.decode(ids, skip_special_tokens=False))
        return content

    def delta_for(self, role: str, content: str) -> tuple[list[int], str]:
        """The tokens that adding this message (and the next generation prompt) would append, and how they were
        derived: ``"checked"`` (rendered against the real history), ``"local"`` (cut from a fixed short history,
        after the first :data:`VERIFY_TURNS` turns of this role proved both give the same text, so per-turn cost
        does not grow with the history) or ``"segment"``. Does not mutate the sequence."""
        if self._verified.get(role, 0) >= VERIFY_TURNS:
            return self._encode(self._dummy_delta(role, content)), "local"
        new = self.messages + [{"role": role, "content": content}]
        full = self._render(new, generation_prompt=True)
        before = self._render(self.messages, generation_prompt=False)
        covered = "".join(self._parts)
        if before.startswith(covered) and full.startswith(before):
            return self._encode(full[len(covered):]), "checked"
        if self.on_rewrite == "error":
            raise TemplateNotAppendOnly(
                "the chat template re-renders earlier turns differently once a new message is added, so its output is "
                "not append-only for this model; agentenv will not re-tokenize history. Use on_rewrite='segment' to "
                "append per-message deltas and record a segment boundary instead."
            )
        return self._encode(self._dummy_delta(role, content)), "segment"

    def add_message(self, role: str, content: str, delta: tuple[list[int], str] | None = None) -> list[int]:
        """Append a user / tool message and the next generation prompt. Returns the appended token ids."""
        if role not in ("user", "tool"):
            raise ValueError(f"observation role must be 'user' or 'tool', got {role!r}")
        ids, how = delta if delta is not None else self.delta_for(role, content)
        text = self.tok.decode(ids, skip_special_tokens=False)
        if how == "checked":
            # Count turns where the short-history delta reproduced the real one; any mismatch disables it for good.
            try:
                same = self._dummy_delta(role, content) == text
            except TemplateNotAppendOnly:
                same = False
            self._verified[role] = self._verified.get(role, 0) + 1 if same else -(1 << 30)
        elif how == "segment":
            self.segments.append(len(self.token_ids))
        self._parts.append(text)
        self._append(ids, sampled=False)
        self.messages.append({"role": role, "content": content})
        return ids

    def _dummy_delta(self, role: str, content: str) -> str:
        """Delta for a message after an assistant turn, cut from the template's rendering of a fixed history.

        The new message is rendered with a sentinel body after a dummy user/assistant exchange; the delta is
        everything after the assistant's end-of-turn text that precedes it (the template's glue, the new block and
        the generation prompt), with the sentinel replaced by the real content.
        """
        sentinel = "\u2063AGENTENV-SENTINEL\u2063"
        history = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                   {"role": role, "content": sentinel}]
        full = self._render(history, generation_prompt=True)
        eos = self.tok.eos_token or ""
        at = full.find(sentinel)
        cut = full.rfind(eos, 0, at) if eos and at >= 0 else -1
        if at < 0 or cut < 0 or full.count(sentinel) != 1:
            raise TemplateNotAppendOnly("cannot locate a per-message delta in this chat template's output")
        return full[cut + len(eos):].replace(sentinel, content)
