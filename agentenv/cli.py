"""The ``agentenv`` command line (also ``python -m agentenv.cli``).

Subcommands: ``demo`` (SFT warm start + FlashREINFORCE on a built-in tool task, on CPU, no download), ``run``
(train from a preset in ``configs/``), ``sft``, ``eval``, ``plot``, ``list``, ``rollout`` and the ``sandbox`` tools.
Subcommands are added by small ``add_*`` functions, one per area, so each stays next to the code it drives
(``rollout`` and ``sandbox`` by their own modules, :mod:`agentenv.run.rollout` and :mod:`agentenv.sandboxes.cli`).
Exit codes: 0 ok, 1 a check failed, 2 bad usage / missing model or data, 130 interrupted.
"""


from __future__ import annotations

import argparse
import logging
import os
import sys


# --- training: run / demo / sft / eval / plot / list ----------------------------------------------------------------
def _add_config_args(p, *, env_required: bool = False) -> None:
    p.add_argument("--preset", default=None, help="preset name in configs/ or a .yaml path (default: the env's preset)")
    p.add_argument("--variant", action="append", default=[], metavar="V",
                   help="apply a preset variant (no_trust, no_is, token_mean, negative_q09, negative_q02, grpo); repeatable")
    p.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE",
                   help="override a config value by dotted key, e.g. --set loop.batch_size=8 --set algo.lr=1e-5; repeatable")
    p.add_argument("--run-dir", default=None, help="run directory (default runs/NAME-TIME)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (logs only)")


CPU_VARIANT = "cpu"  # a GPU preset's own resizing for this CPU (configs/alfworld.yaml), applied for --model tiny


def _cpu_variant(preset: str, model: str | None) -> list[str]:
    """``[CPU_VARIANT]`` when ``--model`` runs on the CPU (tiny, expert) and the preset's own model does not: the
    preset says how it shrinks. A preset made for the CPU (demo, alfworld_demo) keeps its own lengths and eval plan
    when one tiny model is swapped for another."""
    from agentenv.core.config import load_config, preset_variants
    from agentenv.samplers.models import is_tiny

    def on_cpu(name: str) -> bool:
        return is_tiny(name) or name == "expert"

    if not model or not on_cpu(model) or CPU_VARIANT not in preset_variants(str(preset)):
        return []
    return [] if on_cpu(load_config(preset).model.name) else [CPU_VARIANT]


def _config_from_args(args, default_preset: str | None = None):
    """Preset (``--preset``; else the one the env declares; else the default for its kind), then the model
    choice, then ``--variant`` and ``--set``. ``--resume RUN`` starts from ``RUN/config.yaml`` instead."""
    from agentenv.core.config import ConfigError, list_presets, load_config

    env, pre = getattr(args, "env", None), []
    if getattr(args, "resume", None):
        path = os.path.join(args.resume, "config.yaml")
        if not os.path.isfile(path):
            raise ConfigError(f"--resume {args.resume}: no config.yaml there (is it a run directory?)")
        return load_config(path, [], [f"run.dir={args.resume}"] + list(args.overrides))
    preset = args.preset or default_preset
    if env is not None and env in list_presets() and preset is None:
        preset = env  # a preset named like the env (e.g. demo)
    elif env is not None:
        from agentenv.envs import spec

        try:
            env_id = spec.resolve(env)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if preset is None and spec.default_preset(env_id) in ("tool_env", "text_env"):
            pre.append(f"run.name={env_id.replace('/', '_')}")  # a run of a user's env is named after it
        preset = preset or spec.default_preset(env_id)
        pre.append(f"env.id={env}")
    if preset is None:
        raise SystemExit("error: give --env ENV or --preset NAME (see `agentenv list`)")
    model = getattr(args, "model", None)
    if model:
        pre.append(f"model.name={model}")
    if getattr(args, "run_dir", None):
        pre.append(f"run.dir={args.run_dir}")
    return load_config(preset, _cpu_variant(preset, model) + list(args.variant), pre + list(args.overrides))


def _add_run(sub) -> None:
    p = sub.add_parser(
        "run", help="train with FlashREINFORCE from a preset (--dry-run shows the resolved config and launch plan)",
        description="Launch a FlashREINFORCE run. The preset for --env (configs/alfworld.yaml, configs/python_tool.yaml) "
                    "mirrors the paper's settings; --variant and --set change it. Example: agentenv run --env alfworld "
                    "--model qwen2.5-7b --dry-run")
    p.add_argument("--env", default=None, help="an env alias (alfworld, python, guess), a preset (demo), a gymnasium id, "
                   "or MODULE:ENV_ID (imports MODULE, which registers the env); selects the env's preset")
    p.add_argument("--model", default=None, help="tiny, tiny:HxL, tiny-bpe[:HxL], a local checkpoint dir, or an alias like qwen2.5-7b")
    _add_config_args(p)
    p.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue RUN_DIR from its latest checkpoint "
                   "(step counter, schedule, data order); --set may change e.g. loop.total_updates")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and launch plan, check that "
                   "model and data are reachable, train nothing")
    p.add_argument("--eval-only", action="store_true", help="evaluate the model on the preset's eval splits, no training")
    p.set_defaults(func=cmd_run)


def cmd_run(args) -> int:
    from agentenv.core.config import ConfigError
    from agentenv.run.train import LaunchError, dry_run, run

    try:
        cfg = _config_from_args(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        return dry_run(cfg)
    try:
        res = run(cfg, eval_only=args.eval_only, resume=bool(args.resume), progress=not args.no_progress)
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if res.summary.get("stopped_by_user"):
        print(f"interrupted: checkpoint and model saved in {res.run_dir}; continue with "
              f"agentenv run --resume {res.run_dir}", file=sys.stderr)
        return 130
    return 0


# `agentenv demo --env E` -> its CPU demo preset in configs/ (the tool demo is `demo`, the default).
DEMO_PRESETS = {"python": "demo", "python_tool": "demo", "alfworld": "alfworld_demo"}


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="a CPU demo: SFT warm start, then FlashREINFORCE (python tool, or --env alfworld)",
                       description="Warm-start the built-in tiny model by SFT, then train it with FlashREINFORCE and print "
                                   "success before/after and curves.png. No download. Default: the python-tool task "
                                   "(scripted demos, few use the tool; multiplications where the tool pays). "
                                   "--env alfworld: SFT on the expert's plays of ALFWorld train games, RL on train games, "
                                   "evaluation on valid_seen and valid_unseen (the shipped sample, or $ALFWORLD_DATA).")
    p.add_argument("--env", default="python", choices=sorted(DEMO_PRESETS),
                   help="which demo: python (default; preset 'demo') or alfworld (preset 'alfworld_demo')")
    _add_config_args(p)
    p.set_defaults(func=cmd_demo, preset_default="demo")


def cmd_demo(args) -> int:
    from agentenv.core.config import ConfigError
    from agentenv.run.report import run_demo
    from agentenv.run.train import LaunchError

    preset = DEMO_PRESETS[args.env]
    args.env = None  # the demo preset names its env; --env only chose the preset
    try:
        cfg = _config_from_args(args, default_preset=preset)
        return run_demo(cfg, progress=not args.no_progress)
    except (ConfigError, LaunchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _add_sft(sub) -> None:
    p = sub.add_parser("sft", help="supervised fine-tuning on demonstration trajectories (loss on policy tokens only)",
                       description="SFT a model on demonstrations: a trajectories JSONL (e.g. `agentenv rollout --model "
                                   "expert`), or the scripted python-tool demos (--demos scripted). Writes a checkpoint "
                                   "directory usable as --model DIR.")
    p.add_argument("--model", default="tiny:128x4")
    p.add_argument("--demos", default="scripted", help="'scripted', a trajectories JSONL path (.jsonl or .jsonl.xz), "
                                                       "or builtin:NAME for shipped demos (builtin:alfworld_demos)")
    p.add_argument("--env", default=None, help="MODULE:ENV_ID, id or alias: --demos is then a JSONL of chats "
                   "(docs/tool_envs.md), each played in this env to get the tokens RL will see")
    p.add_argument("--num-demos", type=int, default=None,
                   help="scripted: how many to generate (default 1000); a file: use only its first N (default: all)")
    p.add_argument("--tool-fraction", type=float, default=0.25, help="scripted demos: share that call the tool")
    p.add_argument("--all", action="store_true", help="also imitate unsuccessful demos (default: successes only)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--schedule", choices=("constant", "cosine"), default="constant",
                   help="lr after warmup: constant, or cosine decay to a tenth of --lr at the last step")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--context-loss-weight", type=float, default=0.0,
                   help="also predict prompt/observation tokens with this weight (for a model trained from scratch)")
    p.add_argument("--heldout-demos", type=int, default=64, help="demos kept out of training to report a held-out "
                   "NLL per demo kind after each epoch (scripted: fresh held-out questions; 0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.set_defaults(func=cmd_sft)


def cmd_sft(args) -> int:
    from agentenv.run import demo
    from agentenv.samplers.models import ModelNotAvailable
    from agentenv.run.sft import (SFTConfig, demos_path, load_model_and_tokenizer, prepare_demos, save_checkpoint_dir,
                              split_heldout, train_sft)
    from agentenv.core.trajectory import iter_jsonl

    try:
        model, tok, _ = load_model_and_tokenizer(args.model)
        path = demos_path(args.demos) if args.demos != "scripted" else None
    except (ModelNotAvailable, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.env:
        from agentenv.run.env_demos import DemoError, env_demos

        try:
            demos = env_demos(args.env, path, tok, max_tokens=args.max_tokens, only_successful=not args.all,
                              limit=args.num_demos)
            _said_limit(path, args.num_demos)
        except (DemoError, ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        demos, heldout = split_heldout(demos, args.heldout_demos, seed=args.seed)
    elif args.demos == "scripted":
        demos = demo.demo_trajectories(tok, args.num_demos or 1000, args.tool_fraction, seed=args.seed + 1)
        heldout = demo.demo_trajectories(tok, args.heldout_demos, args.tool_fraction, seed=args.seed + 2,
                                         split="heldout")
    else:
        raw = []
        for t in iter_jsonl(path):
            if args.num_demos is not None and len(raw) >= args.num_demos:
                break
            raw.append(t)
        _said_limit(path, args.num_demos)
        demos = prepare_demos(raw, tok, only_successful=not args.all, max_tokens=args.max_tokens)
        demos, heldout = split_heldout(demos, args.heldout_demos, seed=args.seed)
    r = train_sft(model, demos, SFTConfig(epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, seed=args.seed,
                                          context_loss_weight=args.context_loss_weight, schedule=args.schedule),
                  heldout=heldout, echo=print)
    out = save_checkpoint_dir(model, tok, args.out)
    print(f"sft demos={r['demos']} steps={r['steps']} loss per token {r['loss_first']:.3f} (epoch 1) -> "
          f"{r['loss_last']:.3f} (last epoch) "
          f"wall={r['wall_s']:.0f}s -> {out}")
    return 0


def _said_limit(path, limit: int | None) -> None:
    """A file cut short by --num-demos says so (a silent cap once hid 600 of a user's 1,600 demos)."""
    if limit is None:
        return
    import lzma

    with (lzma.open if str(path).endswith(".xz") else open)(path, "rb") as f:
        total = sum(1 for line in f if line.strip())
    if total > limit:
        print(f"sft: using the first {limit} of the {total} demos in {path} (--num-demos {limit})")


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a model/checkpoint on a preset's eval splits",
                       description="Play every task of the preset's eval splits (eval.samples times) and report success, "
                                   "tool-call rate and per-type success. Same as `run --eval-only`. With "
                                   "--endpoint URL: a model served behind an OpenAI-compatible API (vLLM, OpenAI, ...).")
    p.add_argument("--env", default=None, help="an env alias, a preset, a gymnasium id or MODULE:ENV_ID")
    p.add_argument("--model", required=True, help="model dir, tiny, or an alias; with --endpoint the served name")
    _add_config_args(p)
    from agentenv.run.endpoint_eval import add_endpoint_args

    add_endpoint_args(p)
    p.set_defaults(func=cmd_eval)


def cmd_eval(args) -> int:
    from agentenv.run.endpoint_eval import cmd_eval_endpoint, endpoint_only_flags

    if args.endpoint or endpoint_only_flags(args):
        return cmd_eval_endpoint(args, _config_from_args)
    args.dry_run, args.eval_only, args.resume = False, True, None
    return cmd_run(args)


def _add_plot(sub) -> None:
    p = sub.add_parser("plot", help="PNG curves of one or more runs (overlaid)",
                       description="Draw reward/success, tool-call rate, acceptance rate, lag and length curves from "
                                   "RUN_DIR/metrics.jsonl; several runs are overlaid.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", default=None, help="PNG path (default RUN_DIR/curves.png of the first run)")
    p.add_argument("--title", default=None)
    p.set_defaults(func=cmd_plot)


def cmd_plot(args) -> int:
    from agentenv.run.plot import plot_runs

    try:
        out = plot_runs(args.run_dirs, args.out, title=args.title)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _add_list(sub) -> None:
    p = sub.add_parser("list", help="list environments, model aliases and presets (with their variants)")
    p.add_argument("what", nargs="?", choices=["envs", "models", "presets", "all"], default="all")
    p.set_defaults(func=cmd_list)


def cmd_list(args) -> int:
    import gymnasium as gym

    import agentenv  # noqa: F401
    from agentenv.core.config import list_presets, preset_variants, read_yaml
    from agentenv.envs import ENV_ALIASES, EXPERTS, spec
    from agentenv.samplers.models import ALIASES

    if args.what in ("envs", "all"):
        print("environments (alias -> gymnasium id):")
        by_id: dict = {}
        for alias, env_id in ENV_ALIASES.items():
            by_id.setdefault(env_id, []).append(alias)
        for env_id in sorted(k for k in gym.registry if k.startswith("agentenv/")):
            extra = " [--model expert available]" if env_id in EXPERTS else ""
            print(f"  {', '.join(by_id.get(env_id, [])) or '-':22s} {env_id:26s} preset {spec.default_preset(env_id)}"
                  f"{extra}")
        print("  (any gymnasium env: --env MODULE:ENV_ID; without a preset of its own it gets tool_env or text_env)")
    if args.what in ("models", "all"):
        print("models:")
        print("  tiny, tiny:HIDDENxLAYERS  built-in Qwen2-architecture model, real Qwen2.5 tokenizer (no download)")
        print("  expert                    scripted expert policy (envs that have one)")
        print("  /path/to/checkpoint       any local transformers checkpoint directory")
        for alias, hub in sorted(ALIASES.items()):
            print(f"  {alias:25s} {hub}")
    if args.what in ("presets", "all"):
        print("presets (configs/; use --preset NAME or --env NAME, --variant V):")
        for name, path in list_presets().items():
            desc = read_yaml(path).get("description", "")
            vs = preset_variants(str(path))
            print(f"  {name:12s} {desc}")
            if vs:
                print(f"  {'':12s} variants: {', '.join(vs)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentenv", description="agentenv: text environments for LLM agents and a FlashREINFORCE trainer. Start with `agentenv demo`; `agentenv COMMAND -h` explains each command.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_demo(sub)
    _add_run(sub)
    _add_sft(sub)
    _add_eval(sub)
    _add_plot(sub)
    _add_list(sub)
    from agentenv.run.rollout import add_subcommand as add_rollout

    add_rollout(sub)
    try:
        from agentenv.sandboxes.cli import add_subcommands as add_sandbox
    except ImportError:  # pragma: no cover - sandboxes are part of the package
        add_sandbox = None
    if add_sandbox is not None:
        add_sandbox(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from agentenv.run.console import quiet_progress_unless_tty

    quiet_progress_unless_tty()
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from agentenv.run.console import user_error

        line = user_error(e)
        if line is None or args.verbose:  # a bug of ours (or -v): the whole traceback
            raise
        print(f"error: {line}  (-v shows the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
