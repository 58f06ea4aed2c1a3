"""Preflight of the cluster a plan needs (agentenv.run.capacity): GPUs, CPUs, per-GPU memory and the vLLM range,
computed from the config alone (the 7B weights need not be present: its architecture is known)."""

import re
from pathlib import Path

from agentenv.core.config import load_config
from agentenv.run.capacity import ARCHS, VLLM_TESTED, param_count
from agentenv.run.plan import launch_plan, problems


def _plan(*overrides):
    return launch_plan(load_config("python_tool", [], list(overrides)))


def test_parameter_counts_match_the_published_sizes():
    # Qwen2.5 model cards: 0.49 B, 1.54 B, 3.09 B, 7.61 B, 14.7 B, 32.5 B, 72.7 B
    want = {"0.5b": 0.49, "1.5b": 1.54, "3b": 3.09, "7b": 7.61, "14b": 14.7, "32b": 32.5, "72b": 72.7}
    for size, b in want.items():
        assert abs(param_count(ARCHS[f"qwen2.5-{size}"]) / 1e9 - b) / b < 0.01, size


def test_the_paper_preset_fits_a_declared_8_gpu_node():
    plan = _plan("launch.ray_num_gpus=8", "launch.gpu_memory_gb=80")
    p = plan.placement
    assert p["cluster"] == {"gpus": 8, "gpu_memory_gb": 80, "cpus": 8, "source": "declared"}
    assert p["learner"] == {"ranks": 4, "gpus_per_rank": 1, "where": "ray actors"}
    assert p["engines"] == {"count": 4, "gpus_each": 1} and p["gpus_needed"] == 8 and not p["colocated"]
    bad = [c for c in plan.checks if not c.ok]
    assert all(c.what not in ("gpus", "gpu placement", "cpus") and not c.what.startswith("gpu memory")
               for c in bad), bad  # only the absent weights remain


def test_colocated_7b_on_one_80gb_gpu_is_refused_with_the_arithmetic():
    plan = _plan("launch.ray_num_gpus=1", "launch.gpus=1", "launch.learner_world_size=1", "launch.vllm_engines=1",
                 "launch.gpu_memory_gb=80")
    assert plan.placement["colocated"]
    [msg] = [p for p in problems(plan) if p.startswith("gpu memory")]
    assert "30.5 GB fp32 master + 60.9 GB AdamW + 30.5 GB grads + 15.2 GB bfloat16 copy" in msg
    peak = float(re.search(r"peak ([\d.]+) GB", msg).group(1))
    assert peak > 140 and "> 80 GB" in msg and "learner_world_size" in msg


def test_too_few_gpus_or_cpus_are_refused():
    plan = _plan("launch.ray_num_gpus=6")
    assert any(p.startswith("gpu placement: the plan needs 8 GPUs (4 learner ranks x 1 + 4 engines x 1")
               for p in problems(plan))
    plan = _plan("launch.ray_num_gpus=8", "launch.ray_num_cpus=2")
    assert any(p.startswith("cpus: the plan needs 8 Ray CPUs") for p in problems(plan))


def test_a_learner_rank_too_big_for_its_gpu_is_refused():
    plan = _plan("launch.ray_num_gpus=8", "launch.gpu_memory_gb=24")
    assert any(p.startswith("gpu memory (learner)") and "> 24 GB" in p for p in problems(plan))


def test_the_tested_vllm_range_is_the_one_pyproject_pins():
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert f'vllm = ["vllm{VLLM_TESTED}"]' in pyproject
