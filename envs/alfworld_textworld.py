"""textworld made fit for many ALFWorld envs in one process: one lock around every call into it (its parsers and
fast-downward's translator are module-global, not thread-safe), and memos that load a game once and step it ~9x
faster with byte-identical observations (tests/test_alfworld.py checks them against a process without them).

Contract: every call into textworld holds :data:`_TEXTWORLD_LOCK`; ``_PLANS[0]`` (written under the lock) says
whether the game being loaded will ever plan (False: its "optimized" translation is the plain one);
:func:`_install_translation_memo` and :func:`_install_parse_memos` patch textworld once per process.
:mod:`agentenv.envs.alfworld` (the env) re-exports these names.
"""

from __future__ import annotations

import threading
from functools import lru_cache


# textworld is not thread-safe: its grammar and PDDL parsers are module-global tatsu parser objects, and
# fast-downward's translator writes module-global options and sys.argv. The runtime steps envs on several threads, so
# every call into textworld goes through this one lock (that work holds the GIL anyway: little throughput is lost).
_TEXTWORLD_LOCK = threading.RLock()


# Whether the game being loaded will ever plan. textworld translates every game twice: the plain SAS it plays, and
# an "optimized" one (pruned facts and operators) that only its planner (``PddlState.replan``) reads. An env that
# requests no plan (no expert, no walkthrough, no policy_commands) sets this around its load and reset, and the
# optimized call is answered with the plain translation: a valid SAS that is loaded and never searched. It halves the
# cost of a game's first load, which a run over the 1,098 train games pays on most episodes. Only read and written
# while ``_TEXTWORLD_LOCK`` is held, so one flag serves every thread.
_PLANS = [True]


@lru_cache(maxsize=1)
def _install_translation_memo() -> None:
    """Replace ``fast_downward.pddl2sas`` (process-wide, once) by a memoized version.

    Why: the PDDL-to-SAS translation is ~90% of a reset and textworld runs it four times per new game (twice in
    ``load``, twice in ``reset``) on the same inputs; its result is only read afterwards, so reusing it is exact.
    It keeps the last 512 translations (~1.2 MB each; one per game that will not plan, see ``_PLANS``, two per game
    that will): a reset of a kept game takes ~0.06 s instead of ~0.35 s, and the CPU demo's 128 train and 90 eval
    games all stay.
    Its callers here hold ``_TEXTWORLD_LOCK``; the memo takes it too for any other caller."""
    import fast_downward

    original = fast_downward.pddl2sas

    @lru_cache(maxsize=512)  # two entries per game when it plans (plain and optimized), one when it does not
    def _translate(domain: str, problem: str, verbose: bool, optimize: bool):
        return original(domain, problem, verbose=verbose, optimize=optimize)

    def pddl2sas(domain: str, problem: str, verbose: bool = False, optimize: bool = False):
        with _TEXTWORLD_LOCK:
            return _translate(domain, problem, verbose, optimize and _PLANS[0])

    fast_downward.pddl2sas = pddl2sas


@lru_cache(maxsize=1)
def _install_parse_memos() -> None:
    """Memoize textworld's two tatsu parsers (process-wide, once): text generation's grammar symbols and the logic's
    conjunctive queries; copy text generation's contexts shallowly; and build a game's logic once.

    Why: every step re-parses the same few hundred template and query strings (~45% of a step). Parsing is a pure
    function of the string. Text generation mutates the symbols it gets (it sets their context), so each call returns
    a deep copy of the memoized parse -- the same objects a fresh parse would give, at a fraction of the cost. A
    query's ``Rule`` is only read (``State.all_assignments`` copies the mapping it is given), so the one parsed rule
    is shared.

    And make text generation's context copy shallow. ``textgen.copy_context`` deep-copies a context's ``variables``
    (placeholder name -> the game's ``EntityInfo``) and ``mapping`` (placeholder -> variable) ~30 times per generated
    sentence; ~75% of a step went there. Derivation only adds keys to the copied dicts (``query`` updates them) and
    reads the values (``{o.name}`` templates); the ``EntityInfo`` objects are the ones the context's shared
    ``entity_infos`` already holds, and placeholders and variables are hashable value objects. A copy of the two dicts
    is therefore what a deep copy gives for every read the grammar makes. Together: a step ~45 -> ~5 ms, a reset of
    a game played before ~65 -> ~35 ms, observations byte-identical
    (``test_parse_memos_leave_every_observation_unchanged``)."""
    import copy

    import textworld.envs.pddl.logic as pddl_logic
    import textworld.envs.pddl.textgen as textgen
    import textworld.logic as logic

    def memoized(parse):
        @lru_cache(maxsize=8192)
        def cached(text: str, rule_name: str):
            return parse(text, rule_name=rule_name)

        def parse_copy(text, rule_name, **kwargs):
            if kwargs.get("trace"):  # TW_CSG_TRACE debugging wants to see the parse itself
                return parse(text, rule_name=rule_name, **kwargs)
            return copy.deepcopy(cached(text, rule_name))

        return parse_copy

    textgen._parse_and_convert = memoized(textgen._parse_and_convert)
    original_query = logic.Rule.parse_conjunctive_query.__func__
    cached_query = lru_cache(maxsize=8192)(lambda expr: original_query(logic.Rule, expr))
    logic.Rule.parse_conjunctive_query = classmethod(lambda cls, expr: cached_query(expr))

    def copy_context(context: dict) -> dict:
        return {"state": context["state"], "facts": context["facts"], "variables": dict(context["variables"]),
                "mapping": dict(context["mapping"]), "entity_infos": context["entity_infos"]}

    textgen.copy_context = copy_context  # the module global its symbols and grammar call

    # A game's logic (its action templates and text grammar, parsed from the game file) is rebuilt by every load,
    # ~25 ms of a ~60 ms reset of a game the env did not just play. It is only read once built (a state adds the
    # domain's types to it, which it already has after the first), so one per (domain, grammar) is shared.
    original_logic = pddl_logic.GameLogic
    shared_logic = lru_cache(maxsize=512)(lambda domain, grammar: original_logic(domain=domain, grammar=grammar))
    pddl_logic.GameLogic = lambda domain, grammar: shared_logic(domain, grammar)
