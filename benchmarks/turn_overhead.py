"""Per-turn runtime overhead at turn 1 vs turn 50 of a long episode (history grows; cost per turn must not).

The runtime's own work per turn -- appending sampled tokens, rendering and tokenizing the observation delta,
bookkeeping -- is timed with a constant-time sampler (replies with fixed real token ids) and a constant-time env, so
neither generation nor env cost hides it. Real Qwen2.5 tokenizer and chat template, tool schemas in the prompt.

    python benchmarks/turn_overhead.py [--turns 50] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

from agentenv.core.chat import ChatSequence
from agentenv.core.policy import Generation
from agentenv.samplers.tiny import qwen_tokenizer

TOOLS = [{"type": "function", "function": {"name": "python", "description": "Run Python code and return stdout.",
                                           "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                                                          "required": ["code"]}}}]


def episode(tok, turns: int) -> list[float]:
    reply = tok('<tool_call>\n{"name": "python", "arguments": {"code": "print(sum(range(10)))"}}\n</tool_call>',
                add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    observation = "45\n" + "output line\n" * 20
    seq = ChatSequence(tok)
    seq.start([{"role": "system", "content": "You solve tasks."}, {"role": "user", "content": "Compute things."}], TOOLS)
    per_turn = []
    for _ in range(turns):
        t0 = time.perf_counter()
        gen = Generation(list(reply), [-0.1] * len(reply), "stop", 0)
        seq.add_sampled(gen)
        seq.add_message("tool", observation)
        _ = list(seq.token_ids)  # the runtime hands the sampler the prompt ids each turn
        per_turn.append(time.perf_counter() - t0)
    per_turn.append(len(seq))  # last element: sequence length at the end
    return per_turn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    tok = qwen_tokenizer()
    runs = [episode(tok, args.turns) for _ in range(args.repeats)]
    length = runs[0].pop()
    for r in runs[1:]:
        r.pop()
    first = statistics.median(r[0] for r in runs)
    last = statistics.median(r[-1] for r in runs)
    steady = statistics.median(r[args.turns // 2] for r in runs)
    print(f"turn 1: {first * 1e3:.3f} ms  turn {args.turns // 2}: {steady * 1e3:.3f} ms  turn {args.turns}: {last * 1e3:.3f} ms"
          f"  (median of {args.repeats} episodes; {length} tokens at the end)")
    print(f"turn {args.turns} / turn 1 overhead ratio: {last / first:.2f}")


if __name__ == "__main__":
    main()
