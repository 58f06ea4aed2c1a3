"""The command line, run as a user runs it (subprocess) or through main(argv)."""

import json
import subprocess
import sys

import pytest

from agentenv.cli import main
from agentenv.core.metrics import MetricsLogger


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "agentenv.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_help_lists_every_subcommand():
    r = run_cli("--help")
    assert r.returncode == 0
    for cmd in ("demo", "run", "sft", "eval", "plot", "list", "rollout", "sandbox"):
        assert cmd in r.stdout


def test_list_shows_envs_models_presets(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "agentenv/ALFWorld-v0" in out and "qwen2.5-7b" in out and "Qwen/Qwen2.5-7B-Instruct" in out
    assert "alfworld" in out and "variants: no_trust, no_is, token_mean, negative_q09, negative_q02, negative_q00, grpo" in out


def test_dry_run_prints_paper_setting_and_flags_missing_weights(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # no weights anywhere
    rc = main(["run", "--env", "alfworld", "--model", "qwen2.5-7b", "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 1  # a check failed, but everything was printed
    for s in ("name: qwen2.5-7b", "max_turns: 50", "batch_size: 64", "delta: 0.001", "negative_token_fraction: 0.9",
              "max_total_tokens: 16384", "max_generated_tokens: 8192", "every: 40", "samples: 3",
              "# launch plan", "sampler  vllm: 4 engine(s)", "learner  fsdp2 x4", "NOT AVAILABLE", "hf download Qwen/Qwen2.5-7B-Instruct"):
        assert s in out, s


def test_run_without_weights_fails_fast_with_instructions(tmp_path):
    r = run_cli("run", "--env", "alfworld", "--model", "qwen2.5-7b", "--run-dir", str(tmp_path / "r"))
    assert r.returncode == 2
    assert "not available offline" in r.stderr and "--model /path/to/Qwen2.5-7B-Instruct" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "r").exists()  # fails before anything is built: no run directory


def test_bad_override_is_a_clear_error(capsys):
    assert main(["run", "--env", "demo", "--set", "loop.batchsize=3", "--dry-run"]) == 2
    assert "unknown key" in capsys.readouterr().err


def test_dry_run_demo_passes_checks(capsys):
    assert main(["run", "--env", "demo", "--dry-run"]) == 0
    assert "checks passed" in capsys.readouterr().out


def test_plot_command(tmp_path, capsys):
    lg = MetricsLogger(tmp_path, tensorboard=False, echo=None)
    for i in range(1, 4):
        lg.log_update({"update": i, "elapsed_s": 1.0, "success_rate": i / 4})
    lg.close()
    assert main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "curves.png").exists()
    assert main(["plot", str(tmp_path / "nope")]) == 2


def test_end_of_run_eval_is_not_repeated_when_eval_every_just_ran(tmp_path):
    """eval.every=2 over 2 updates with eval.at_end: the final weights are evaluated once, not twice."""
    run = tmp_path / "run"
    assert main(["run", "--env", "guess", "--model", "tiny", "--no-progress", "--run-dir", str(run),
                 "--set", "loop.batch_size=2", "--set", "loop.total_updates=2", "--set", "eval.every=2",
                 "--set", "eval.at_end=true", "--set", "eval.episodes=2", "--set", "rollout.max_new_tokens=8",
                 "--set", "run.plot=false", "--set", "run.tensorboard=false"]) == 0
    evals = json.loads((run / "summary.json").read_text())["evals"]
    assert [e["update"] for e in evals] == [2]


def test_a_weight_average_is_what_the_final_eval_and_final_model_hold(tmp_path, capsys):
    """algo.average_last_updates=2: the plan says so, the end-of-run eval runs again on the mean (eval.every already
    measured update 2's own weights) and is labelled, and final_model is the mean of the two updates' weights."""
    import torch
    from safetensors.torch import load_file

    args = ["run", "--env", "guess", "--model", "tiny", "--no-progress", "--set", "loop.batch_size=2",
            "--set", "loop.total_updates=2", "--set", "eval.every=2", "--set", "eval.at_end=true",
            "--set", "eval.episodes=2", "--set", "rollout.max_new_tokens=8", "--set", "run.plot=false",
            "--set", "run.tensorboard=false", "--set", "algo.average_last_updates=2", "--set", "algo.lr=1e-3",
            "--set", "loop.checkpoint_every=1"]
    assert main(args + ["--dry-run"]) == 0
    assert "final weights = mean over the last 2" in capsys.readouterr().out
    run = tmp_path / "run"
    assert main(args + ["--run-dir", str(run)]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["summary"]["averaged_updates"] == 2
    assert [(e["update"], e.get("weights")) for e in summary["evals"]] == [
        (2, None), (2, "mean of the weights after updates 1-2")]
    weights = [load_file(run / d / "model.safetensors") for d in
               ("checkpoints/step_1/model", "checkpoints/step_2/model", "final_model")]
    for k, v in weights[2].items():
        torch.testing.assert_close(v, (weights[0][k] + weights[1][k]) / 2, rtol=0, atol=1e-6, msg=k)
    # a window longer than the run (a smoke of a preset) averages every update, and the plan says how many
    assert main([*args[:-2], "--set", "algo.average_last_updates=12", "--dry-run"]) == 0
    assert "final weights = mean over the last 2" in capsys.readouterr().out


def test_swapping_the_tiny_model_of_a_cpu_preset_keeps_its_plan():
    """--model with another tiny size resizes a paper preset for the CPU, never a preset already made for it."""
    from agentenv.cli import _config_from_args, build_parser

    demo = _config_from_args(build_parser().parse_args(["run", "--preset", "alfworld_demo"]))
    swapped = _config_from_args(build_parser().parse_args(
        ["run", "--preset", "alfworld_demo", "--model", "tiny-bpe-alfworld:256x4"]))
    assert swapped.model.name == "tiny-bpe-alfworld:256x4"
    assert swapped.rollout.max_new_tokens == demo.rollout.max_new_tokens == 16
    assert swapped.eval == demo.eval and swapped.algo == demo.algo
    paper = _config_from_args(build_parser().parse_args(["run", "--env", "alfworld", "--model", "tiny"]))
    assert paper.rollout.max_new_tokens == 128 and paper.loop.backend == "local" and paper.eval.episodes == 8
    assert paper.variants == ["cpu"]  # the preset's own resizing, recorded with the run
    assert (swapped.variants, demo.variants) == ([], [])


def test_the_launch_plan_is_typed_frozen_and_saved_as_json():
    import dataclasses

    from agentenv.core.config import load_config
    from agentenv.run.plan import launch_plan

    plan = launch_plan(load_config("demo", [], ["algo.loss.no_trust=true"]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.device = "cuda"  # printed, saved and executed: one plan, never edited on the way
    saved = json.loads(json.dumps(plan.to_dict()))
    assert saved["components"] == {"sampler": "hf", "rollout_backend": "local", "vllm_engines": 0,
                                   "learner": {"strategy": "single", "world_size": 1, "master_dtype": "float32",
                                               "compute_dtype": "float32"}}
    assert saved["algorithm"]["loss"]["type"] == "flashreinforce" and saved["algorithm"]["loss"]["delta"] == \
        "inf (no_trust)"
