"""The trajectory contract against hostile text and four template families of our own writing.

Templates mimic the families ``agentenv list`` names: the Qwen2.5 tool template (tool results grouped into one user
turn), a Llama-3-style template that TRIMS contents, a Qwen3-style template that strips reasoning from earlier
assistant turns, and a Mistral-style template (no generation prompt, ``</s>`` closes the assistant, tools listed
before the last user message). They run on the project's small BPE tokenizer with the families' control tokens
added as special tokens.

Property: for random multi-turn conversations with adversarial contents (every control string, whitespace and
newline edges, unicode that normalises, Jinja syntax), the trajectory's tokens decode to exactly the template's
incremental rendering (the sampled stop token kept where it is not the template's own closing text), and its
control-token ids are exactly the template glue's -- or the sequence recorded a segment boundary at a point where
the template really rewrote the history. Never a silent divergence.
"""

import copy
import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentenv.core.chat import ChatSequence, TemplateNotAppendOnly, control_strings
from agentenv.core.policy import Generation

TOOLS = [{"type": "function", "function": {"name": "python", "description": "Run <|im_end|> Python code.",
                                           "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                                                          "required": ["code"]}}}]

QWEN25 = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are Qwen, a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nReturn <tool_call>\\n{\"name\": ..., \"arguments\": ...}\\n</tool_call><|im_end|>\\n' }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA3 = (
    "{{- '<|begin_of_text|>' }}"
    "{%- if tools %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\nTools:' }}"
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}{{- '<|eot_id|>' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- set role = 'ipython' if m['role'] == 'tool' else m['role'] %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

QWEN3 = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set content = m.content %}"
    "{%- if loop.index0 < ns.last_user %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

MISTRAL = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{{- '<s>' }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}{{- '[SYSTEM_PROMPT]' + m.content + '[/SYSTEM_PROMPT]' }}"
    "{%- elif m.role == 'user' %}"
    "{%- if tools and loop.index0 == ns.last_user %}{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{{- '[INST]' + m.content + '[/INST]' }}"
    "{%- elif m.role == 'assistant' %}{{- m.content + '</s>' }}"
    "{%- elif m.role == 'tool' %}{{- '[TOOL_RESULTS]' + m.content + '[/TOOL_RESULTS]' }}"
    "{%- endif %}{%- endfor %}"
)

FAMILIES = {
    # name: (template, extra special tokens, stop tokens a sampler may end a turn with)
    "qwen2.5": (QWEN25, [], ["<|im_end|>", "<|endoftext|>"]),
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               ["<|eot_id|>", "<|endoftext|>"]),
    "qwen3": (QWEN3, [], ["<|im_end|>", "<|endoftext|>"]),
    "mistral": (MISTRAL, ["<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                          "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"],
                ["</s>", "<|endoftext|>"]),
}


@functools.lru_cache(maxsize=None)
def family_tokenizer(name):
    from agentenv.samplers.tiny import small_tokenizer

    template, extra, _ = FAMILIES[name]
    tok = copy.deepcopy(small_tokenizer())
    if extra:
        tok.add_tokens(extra, special_tokens=True)
    tok.chat_template = template
    return tok


def control_ids(tok):
    return {i for i in tok.added_tokens_decoder}


def count_controls(tok, text):
    """Occurrences of control strings in rendered text, scanning left to right, longest match first."""
    controls = control_strings(tok)
    n, i = 0, 0
    while i < len(text):
        hit = next((c for c in controls if text.startswith(c, i)), None)
        n, i = (n + 1, i + len(hit)) if hit else (n, i + 1)
    return n


def _adversarial(tok):
    atoms = st.sampled_from(control_strings(tok) + ["  ", "\n", "\n\n", "\t", "e\u0301", "\ufb01", "\u212b", "{{ x }}",
                                                    "{% raw %}", "<|", "|>", "</think>", "\u2063"])
    return st.lists(st.one_of(atoms, st.text(max_size=6)), max_size=6).map("".join)


def _assistant_text():
    atoms = st.sampled_from(["<think>plan</think>", "\n", " ", "answer", "\\boxed{4}", "é"])
    return st.lists(st.one_of(atoms, st.text(st.characters(codec="ascii", exclude_characters="<>|"), max_size=5)),
                    max_size=5).map("".join)


def render(tok, messages, generation_prompt, tools=TOOLS):
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)


def text_without(tok, ids, drop):
    """The sequence's text with the sampled non-closing stop tokens (positions ``drop``) left out."""
    return tok.decode([t for i, t in enumerate(ids) if i not in drop])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_never_diverges_silently(family):
    tok = family_tokenizer(family)
    stops = [tok.convert_tokens_to_ids(s) for s in FAMILIES[family][2]]
    adv = _adversarial(tok)

    @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
    @given(system=adv, question=adv, turns=st.lists(
        st.tuples(_assistant_text(), st.sampled_from(stops), st.sampled_from(["user", "tool"]), adv),
        min_size=1, max_size=4))
    def run(system, question, turns):
        check_conversation(tok, family, system, question, turns)

    run()


def check_conversation(tok, family, system, question, turns):
    seq = ChatSequence(tok, on_rewrite="segment")
    seq.start([{"role": "system", "content": system}, {"role": "user", "content": question}], TOOLS)
    close = seq._assistant_close()
    drop: set[int] = set()  # positions of sampled stop tokens that are not the template's closing text
    diverged = False
    for text, stop, role, obs in turns:
        ids = tok(text, add_special_tokens=False)["input_ids"] + [stop]
        before_ids = list(seq.token_ids)
        seq.add_sampled(Generation(ids, [-0.5] * len(ids), "stop", policy_version=1))
        if not close.startswith(tok.decode([stop])):
            drop.add(len(seq.token_ids) - 1)
        delta = seq.delta_for(role, obs)
        held = text_without(tok, seq.token_ids, drop)
        history = render(tok, seq.messages, False)
        seq.add_message(role, obs, delta)
        assert seq.token_ids[:len(before_ids)] == before_ids
        want = render(tok, seq.messages, True)
        if delta.how == "segment":
            # a boundary is recorded only where the template really is not append-only here
            assert not (history.startswith(held) and want.startswith(history)), "needless segment boundary"
            diverged = True
        elif not diverged:
            assert text_without(tok, seq.token_ids, drop) == want, f"{family}: tokens diverge from the rendering"
        if family == "llama3":
            assert delta.how != "local", "a trimming template must never get the short-history shortcut"
    assert len(seq.token_ids) == len(seq.action_mask) == len(seq.behavior_logprobs) == len(seq.policy_version)
    if diverged:
        return  # after a boundary the tokens are per-message deltas (e.g. Mistral repeats its tool list): recorded
    # Control ids outside the sampled turns come only from template glue: as many as a rendering of the same
    # conversation with harmless contents has, less the closing tokens the sampler itself produced.
    neutral_tools = [{"type": "function", "function": {"name": "python", "description": "d", "parameters": {}}}]
    glue_only = render(tok, [{"role": m["role"], "content": "c"} for m in seq.messages], True, neutral_tools)
    ctl = control_ids(tok)
    glue_controls = sum(1 for t, m in zip(seq.token_ids, seq.action_mask) if not m and t in ctl)
    sampled_closes = len(turns) - len(drop)
    assert glue_controls == count_controls(tok, glue_only) - sampled_closes


def test_trimming_template_deltas_are_checked_against_the_real_history():
    # The review's reproducer: contents with edge whitespace under a `| trim` template. The old shortcut (trusted
    # after 2 verified turns) appended untrimmed text at turn 3.
    tok = family_tokenizer("llama3")
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    seq = ChatSequence(tok)
    seq.start([{"role": "user", "content": "go"}])
    for i, obs in enumerate(["a", "b", "  padded\n\n", "\n x \n"]):
        ids = tok(f"step {i}", add_special_tokens=False)["input_ids"] + [eot]
        seq.add_sampled(Generation(ids, [-1.0] * len(ids), "stop"))
        d = seq.delta_for("user", obs)
        assert d.how == "checked"
        seq.add_message("user", obs, d)
    full = tok.apply_chat_template(seq.messages, tokenize=False, add_generation_prompt=True)
    assert tok.decode(seq.token_ids) == full


def test_turn_ending_on_another_stop_id_is_closed_by_the_next_delta(qwen_tok):
    # vLLM stops on every generation_config eos id; a turn ending on <|endoftext|> still gets <|im_end|> before the
    # next message, both while deltas are checked and once the short-history shortcut is in use.
    seq = ChatSequence(qwen_tok)
    seq.start([{"role": "user", "content": "hi"}])
    eot = qwen_tok.convert_tokens_to_ids("<|endoftext|>")
    hows = []
    for i in range(6):
        ids = qwen_tok(f"turn {i}", add_special_tokens=False)["input_ids"] + [eot if i % 2 else qwen_tok.eos_token_id]
        seq.add_sampled(Generation(ids, [-1.0] * len(ids), "stop"))
        d = seq.delta_for("user", f"obs {i}")
        hows.append(d.how)
        new = seq.add_message("user", f"obs {i}", d)
        text = qwen_tok.decode(new)
        if i % 2:
            assert text.startswith("<|im_end|>\n<|im_start|>user\n"), text
        else:
            assert text.startswith("\n<|im_start|>user\n"), text
    assert "local" in hows
    assert qwen_tok.decode(seq.token_ids).count("<|endoftext|><|im_end|>") == 3


def test_reasoning_stripping_template_records_a_segment_or_raises():
    tok = family_tokenizer("qwen3")
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    for mode in ("error", "segment"):
        seq = ChatSequence(tok, on_rewrite=mode)
        seq.start([{"role": "user", "content": "q"}])
        ids = tok("<think>plan</think>answer", add_special_tokens=False)["input_ids"] + [stop]
        seq.add_sampled(Generation(ids, [-1.0] * len(ids), "stop"))
        assert seq.delta_for("tool", "out").how == "checked"  # tool results do not strip: append-only
        if mode == "error":
            with pytest.raises(TemplateNotAppendOnly):
                seq.delta_for("user", "next")
        else:
            n = len(seq)
            seq.add_message("user", "next")
            assert seq.segments == [0, n]


def test_reasoning_stripping_is_never_hidden_by_the_shortcut():
    # Found by the property test: two plain user turns verified the shortcut, then a turn with reasoning was
    # stripped by the template on the next user message while the short-history delta did not see it.
    tok = family_tokenizer("qwen3")
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    seq = ChatSequence(tok, on_rewrite="segment")
    seq.start([{"role": "user", "content": "q"}])
    hows = []
    for text in ("a", "b", "<think>plan</think>c", "d"):
        ids = tok(text, add_special_tokens=False)["input_ids"] + [stop]
        seq.add_sampled(Generation(ids, [-1.0] * len(ids), "stop"))
        d = seq.delta_for("user", "next")
        hows.append(d.how)
        seq.add_message("user", "next", d)
    # once the history was rewritten, every later delta is a recorded per-message segment too
    assert hows == ["checked", "checked", "segment", "segment"] and len(seq.segments) == 3
