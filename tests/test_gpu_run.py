"""benchmarks/gpu_run.py's arithmetic (the check itself needs a GPU): the device's peak by its exact name, and the
training FLOPs of what the learner computes."""

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("gpu_run", Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_run.py")
gpu_run = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_run)


@pytest.mark.parametrize("name,peak", [("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0),
                                       ("NVIDIA H100 NVL", 835.0), ("NVIDIA H200", 989.4),
                                       ("NVIDIA A100-SXM4-80GB", 312.0), ("Some Other GPU", None)])
def test_peak_by_exact_device_name(name, peak):
    assert gpu_run.peak_tflops(name) == peak


def test_training_flops_count_the_lm_head_only_on_scored_tokens():
    from agentenv.run.capacity import param_count

    cfg = gpu_run.QWEN25_15B
    n = param_count(cfg)
    d, v = cfg["hidden_size"], cfg["vocab_size"]
    # every token scored, no attention term: 6 N per token (the tied table counted once, as the LM head)
    assert gpu_run.training_flops(cfg, n, 1000, 1000, 0.0) == pytest.approx(6 * n * 1000)
    # only 100 of 1000 tokens scored: the LM head's 6 d V on the other 900 is not done, so not counted
    assert gpu_run.training_flops(cfg, n, 1000, 100, 0.0) == pytest.approx(6 * n * 1000 - 900 * 6 * d * v)
    # causal attention grows with the mean length
    assert gpu_run.training_flops(cfg, n, 1000, 100, 512.0) > gpu_run.training_flops(cfg, n, 1000, 100, 0.0)
