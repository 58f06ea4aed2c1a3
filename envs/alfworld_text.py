"""What the ALFWorld agent reads and writes: the system prompts, the admissible-command list, and how a reply
becomes a command (pure text, no textworld).

Contract: :func:`parse_action` takes the command in a reply's last ``<action>...</action>`` tag (lower-cased,
whitespace collapsed, trailing period dropped). :func:`resolve_command` returns ``(command, None)`` for an admissible
reply, else ``(None, why)``; with ``nearest`` a tagged command that is not admissible is read as
:func:`nearest_command`: the admissible command closest in spelling with the same verb and object, never another
object. :func:`_format_commands` writes the list (``compact``: without the commands every state admits).
:mod:`agentenv.envs.alfworld` (the env) re-exports these names.
"""

from __future__ import annotations

import difflib
import re

_ACTION_TAG = re.compile(r"<action>(.*?)</action>", re.DOTALL | re.IGNORECASE)

SYSTEM_PROMPT_TEMPLATE = """\
You are an agent in a household (ALFWorld). Each message tells you what you observe and ends with the list of \
admissible actions. Reply with exactly one of those actions, copied from the list, inside an action tag, for example:
<action>go to desk 1</action>
You may reason before the tag; only the last <action>...</action> in your reply is used. Case and extra spaces do \
not matter. A reply without the tag, or with an action that is not in the list, is invalid: nothing happens, it \
costs a turn, and {budget}. You have {max_turns} turns. The episode ends as soon as the task is done."""


# nearest_match=True: a command that is not admissible is read as the admissible command closest to it in spelling
# (difflib's ratio), as LLM planners map free text onto a game's actions (e.g. Huang et al. 2022), but only among the
# commands that do the same thing to the same object: read by spelling alone, "take book 1 from drawer 2" at a drawer
# holding a watch became "take watch 1 from drawer 2", which plays an object the agent never named and makes the
# reward depend on the matcher. The agent is told which command was played. The CPU demo uses it because its tiny
# model often gets a receptacle's number wrong while naming the right object.
NEAREST_SYSTEM_PROMPT_TEMPLATE = """\
You are an agent in a household (ALFWorld). Each message tells you what you observe and ends with the list of \
admissible actions. Reply with exactly one of those actions, copied from the list, inside an action tag, for example:
<action>go to desk 1</action>
You may reason before the tag; only the last <action>...</action> in your reply is used. Case and extra spaces do \
not matter. An action that is not in the list is read as the listed action closest to it in spelling that does \
the same to the same object, and you are told which one was played; an action on an object that no listed action \
names is invalid. A reply without the tag is invalid: nothing happens, it costs a turn, and {budget}. You \
have {max_turns} turns. The episode ends as soon as the task is done."""


# compact_list=True: a prompt as short as the list (every token of it is paid in every trajectory, ~25% of a short
# episode with the long prompts above).
COMPACT_SYSTEM_PROMPT_TEMPLATE = """\
You are an agent in a household (ALFWorld). Reply with one action in a tag, e.g. <action>go to desk 1</action>; you \
may think first, the last tag counts. You can go to any receptacle in the room, look and inventory; each message \
lists the other admissible actions. {matching} A reply without a tag is invalid and costs a turn; {budget}. You have \
{max_turns} turns."""
COMPACT_MATCHING = {True: "An action that is not admissible is read as the closest admissible one on the same object, "
                          "and you are told; with no such one it is invalid.",
                    False: "An action that is not admissible is invalid and costs a turn."}


# The goal as ALFWorld states it in a game's opening text (one line); restate_goal=True repeats it every turn.
_GOAL_LINE = re.compile(r"^Your task is to: .*$", re.MULTILINE)


def parse_action(text: str) -> str | None:
    """The command in the last ``<action>...</action>`` tag, lower-cased with whitespace collapsed and a trailing
    period dropped; ``None`` when there is no tag or it is empty."""
    tags = _ACTION_TAG.findall(text)
    if not tags:
        return None
    command = " ".join(tags[-1].split()).lower().rstrip(".").strip()
    return command or None


# compact_list=True: the commands every state of every game admits are not listed one by one. `go to R` is admissible
# for every receptacle R of the room but the one the agent stands at (the opening text names them all), and these
# three never change the game. Listing them costs ~5 tokens per receptacle per turn, ~70% of a turn's observation.
ALWAYS_ADMISSIBLE = ("help", "inventory", "look")
GO_TO_LINE = "go to <any receptacle in the room>"


def _format_commands(commands: list[str], compact: bool = False) -> str:
    if compact:
        commands = [GO_TO_LINE] + [c for c in commands if not c.startswith("go to ") and c not in ALWAYS_ADMISSIBLE]
    return "Admissible actions:\n" + "\n".join(commands)


def _verb_and_object(command: str) -> tuple[str, str]:
    """``("take", "book")`` for "take book 1 from desk 2", ``("go to", "desk")`` for "go to desk 1": what a command
    does and to what, without the numbers and places that :func:`nearest_command` may approximate."""
    words = command.split()
    if words[:2] == ["go", "to"]:
        return "go to", words[2] if len(words) > 2 else ""
    return (words[0] if words else ""), (words[1] if len(words) > 1 else "")


def nearest_command(command: str, commands: list[str]) -> str | None:
    """The admissible command closest to ``command`` in spelling (difflib ratio; the first listed wins a tie) among
    those with the same verb and the same object: "take book 3 from shelf 1" may be read as "take book 1 from
    desk 2", never as "take watch 1 from shelf 1". Taking, moving or using another object than the one named cannot be
    undone within a short episode, so a command whose object is not at hand has no nearest one (``None``: invalid).
    ``help`` is never chosen: it changes nothing."""
    verb_object = _verb_and_object(command.lower())
    candidates = [c for c in commands if c != "help" and _verb_and_object(c.lower()) == verb_object]
    if not candidates:
        return None
    ratio = lambda c: difflib.SequenceMatcher(None, command, c, autojunk=False).ratio()  # noqa: E731
    return max(candidates, key=ratio)


def resolve_command(reply: str, commands: list[str], nearest: bool = False) -> tuple[str | None, str | None]:
    """``(command, None)`` for an admissible reply, else ``(None, why)``: the observation text for an invalid one.
    With ``nearest``, a tagged
    command that is not admissible resolves to :func:`nearest_command` (the caller compares it with
    :func:`parse_action` to tell the agent)."""
    command = parse_action(reply)
    if command is None:
        return None, "Invalid action: your reply has no <action>...</action> tag. Nothing happens."
    if command not in commands:
        if nearest:
            if (near := nearest_command(command, commands)) is not None:
                return near, None
            verb, obj = _verb_and_object(command)
            return None, (f'Invalid action: "{command}" is not one of the admissible actions, and none of them is '
                          f'"{verb} {obj} ...". Nothing happens.')
        return None, f'Invalid action: "{command}" is not one of the admissible actions. Nothing happens.'
    return command, None
