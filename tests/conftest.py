"""Shared fixtures: the real Qwen2.5 tokenizer and the tiny model, built once per session (offline)."""

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def qwen_tok():
    from agentenv.tiny import qwen_tokenizer

    return qwen_tokenizer()


@pytest.fixture(scope="session")
def tiny_policy():
    from agentenv.models import load_hf_policy

    return load_hf_policy("tiny", seed=0, device="cpu")
