"""``agentenv eval --endpoint``: the README's shop env played against a real HTTP server on 127.0.0.1.

The server (:class:`ScriptedServer`, stdlib ``http.server`` on a free loopback port) answers chat completions the way
an OpenAI-compatible server does: it checks what a real server checks about the request (the model name, that every
``tool`` message answers a call id of the assistant turn before it) and replies with a scripted tool-using player --
two structured ``tool_calls`` (or ``<tool_call>`` blocks in ``content``, as a server without a tool parser returns
them), then the price x stock it read from the tool results. It can fail its first requests (503 / 429) or refuse
every one (400). The CLI runs in-process through :func:`agentenv.cli.main`.
"""

from __future__ import annotations

import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from agentenv.cli import main

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
SECTION = README.split("## Writing a new tool environment", 1)[1].split("\n## ", 1)[0]
SHOP_ENV = next(b for b in re.findall(r"```python\n(.*?)```", SECTION, re.S) if b.startswith("# shop_env.py"))


class ScriptedServer:
    def __init__(self, mode: str = "structured", fail_first: int = 0, fail_status: int = 503, refuse: bool = False,
                 served: str = "shop-player"):
        self.mode, self.fail_first, self.fail_status, self.refuse, self.served = mode, fail_first, fail_status, refuse, served
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # keep pytest output clean
                pass

            def _send(self, status: int, body: dict, headers: dict | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    return self._send(200, {"object": "list", "data": [{"id": outer.served, "object": "model"}]})
                self._send(404, {"error": {"message": "not found"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, reply, headers = outer.answer(body)
                self._send(status, reply, headers)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

    def answer(self, body: dict):
        with self.lock:
            self.requests.append(body)
            n = len(self.requests)
        if self.refuse:
            return 400, {"error": {"message": "\"auto\" tool choice requires --enable-auto-tool-choice", "code": 400}}, {}
        if n <= self.fail_first:
            return self.fail_status, {"error": {"message": "busy"}}, {"Retry-After": "0"}
        if body["model"] != self.served:
            return 404, {"error": {"message": f"The model `{body['model']}` does not exist."}}, {}
        msgs = body["messages"]
        for i, m in enumerate(msgs):  # what an OpenAI server enforces: tool messages answer the previous calls
            if m["role"] == "tool":
                prev = next(p for p in reversed(msgs[:i]) if p["role"] == "assistant")
                if m.get("tool_call_id") not in {c["id"] for c in prev.get("tool_calls") or []}:
                    return 400, {"error": {"message": f"messages[{i}]: tool_call_id does not answer a call"}}, {}
        if self.mode == "cut":  # the right answer, but cut at max_tokens: never graded
            message = {"role": "assistant", "content": "\\boxed{60}"}
            return 200, {"choices": [{"index": 0, "message": message, "finish_reason": "length"}]}, {}
        if msgs[-1]["role"] == "user":
            item = re.search(r"every (\w+) in stock", msgs[-1]["content"]).group(1)
            calls = [{"name": "lookup", "arguments": {"item": item}},
                     {"name": "lookup", "arguments": {"item": item, "field": "stock"}}]
            if self.mode == "text":  # a server without a tool parser: the model's own text
                text = "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)
                message = {"role": "assistant", "content": text}
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [
                    {"id": f"srv{k}", "type": "function",
                     "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                    for k, c in enumerate(calls)]}
        else:
            price, stock = (float(m["content"]) for m in msgs if m["role"] == "tool")
            message = {"role": "assistant", "content": f"That is \\boxed{{{round(price * stock, 2)}}}"}
        return 200, {"id": f"c{n}", "object": "chat.completion", "model": self.served,
                     "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                     "usage": {"prompt_tokens": 10, "completion_tokens": 5}}, {}


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    (tmp_path / "shop_env.py").write_text(SHOP_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run_eval(url: str, *extra: str) -> int:
    return main(["eval", "--env", "shop_env:Shop-v0", "--endpoint", url, "--model", "shop-player", "--run-dir", "ev",
                 "--no-progress", *extra])


@pytest.mark.parametrize("mode", ["structured", "text"])
def test_eval_endpoint_plays_the_env_and_reports_tool_use(user_dir, capsys, mode):
    with ScriptedServer(mode=mode) as srv:
        assert run_eval(srv.url, "--episodes", "4", "--concurrency", "2") == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("[eval endpoint="))
    for want in ("episodes=4", "success_rate=1.000", "tool_call_rate=1.000", "tool_calls/lookup=2.000",
                 "turns_mean=2.000", "errors=0"):
        assert want in line, line
    rows = [json.loads(x) for x in (user_dir / "ev" / "eval.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and sorted(r["meta"]["task"] for r in rows) == [0, 0, 1, 2]  # round after round
    r = rows[0]
    assert r["sampling"]["backend"] == "endpoint" and r["num_tool_calls"] == 2 and r["success"]
    assert [m["role"] for m in r["messages"]] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert r["messages"][2]["content"].count("<tool_call>") == 2  # the env saw the calls as Hermes blocks
    summary = json.loads((user_dir / "ev" / "summary.json").read_text())
    assert summary["evals"][0]["success_rate"] == 1.0 and summary["usage"]["completion_tokens"] > 0
    chat = [b for b in srv.requests if b.get("max_tokens") != 1]
    assert len(chat) == 8  # two turns per episode; the pre-flight's request asked for one token
    assert [t["function"]["name"] for t in chat[0]["tools"]] == ["lookup"]  # the env's schemas as `tools`


def test_transient_failures_are_retried(user_dir, capsys):
    with ScriptedServer(fail_first=2, fail_status=503) as srv:
        assert run_eval(srv.url, "--episodes", "1", "--retries", "2") == 0
    assert json.loads((user_dir / "ev" / "summary.json").read_text())["retried_requests"] == 2
    with ScriptedServer(fail_first=5, fail_status=429) as srv:  # more failures than retries: bounded
        assert run_eval(srv.url, "--episodes", "1", "--retries", "1") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: POST ") and "429" in err[-1] and "after 2 attempts" in err[-1]
    assert len(srv.requests) == 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_endpoint_is_one_error_line_and_no_run_dir(user_dir, capsys):
    assert run_eval(f"http://127.0.0.1:{free_port()}", "--retries", "0") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot reach GET http://127.0.0.1:") and "\n" not in err, err
    assert not (user_dir / "ev").exists()


def test_refused_request_and_unknown_model_stop_before_any_output(user_dir, capsys):
    with ScriptedServer(refuse=True) as srv:
        assert run_eval(srv.url) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the endpoint refused the request") and "--enable-auto-tool-choice" in err
    assert "\n" not in err and len(srv.requests) == 1  # refused once, not retried
    with ScriptedServer(served="other-model") as srv:
        assert run_eval(srv.url) == 2
    err = capsys.readouterr().err
    assert "model 'shop-player' is not served" in err and "it serves: other-model" in err
    assert not (user_dir / "ev").exists()


def test_endpoint_flags_need_an_endpoint(user_dir, capsys):
    assert main(["eval", "--env", "shop_env:Shop-v0", "--model", "tiny", "--episodes", "2"]) == 2
    assert "--episodes apply to --endpoint URL only" in capsys.readouterr().err


def test_endpoint_policy_refuses_training_and_its_trajectories_cannot_be_trained_on(user_dir):
    from agentenv.samplers.endpoint import EndpointPolicy, EndpointTrainingRefused
    from agentenv.core.runtime import RolloutConfig, EpisodeSpec, run_episode
    from agentenv.trainer.batch import collate
    import gymnasium as gym

    with ScriptedServer() as srv:
        policy = EndpointPolicy(srv.url, "shop-player")
        with pytest.raises(EndpointTrainingRefused, match="evaluation only"):
            policy.load_weights({}, 1)
        traj = run_episode(gym.make("shop_env:Shop-v0"), policy, RolloutConfig(), EpisodeSpec(options={"task_index": 2}))
        policy.close()
    assert traj.success and traj.token_ids == [] and traj.tool_calls_by_name == {"lookup": 2}
    with pytest.raises(ValueError, match="text-policy trajectories cannot be trained on"):
        collate([traj], pad_token_id=0)


def test_malformed_structured_arguments_reach_the_env_as_a_malformed_call():
    from agentenv.samplers.endpoint import reply_to_action, to_openai_messages
    from agentenv.envs.tools import parse_tool_calls

    action = reply_to_action({"content": "let me look", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "lookup", "arguments": "{\"item\": \"apple\""}},
        {"id": "b", "type": "function", "function": {"name": "lookup", "arguments": {"item": "bread"}}}]})
    calls = parse_tool_calls(action)
    assert calls[0].error is not None and calls[1].error is None and calls[1].arguments == {"item": "bread"}
    # a well-formed turn goes back to the server as structured calls, with the env's tool message split per call
    good = reply_to_action({"content": None, "tool_calls": [
        {"function": {"name": "lookup", "arguments": "{\"item\": \"apple\"}"}},
        {"function": {"name": "lookup", "arguments": "{\"item\": \"apple\", \"field\": \"stock\"}"}}]})
    msgs = to_openai_messages([{"role": "user", "content": "q"}, {"role": "assistant", "content": good},
                               {"role": "tool", "content": "[1] lookup:\n0.5\n\n[2] lookup:\n120"}])
    assert msgs[1]["content"] is None and [c["id"] for c in msgs[1]["tool_calls"]] == ["call_1_0", "call_1_1"]
    assert [(m["tool_call_id"], m["content"]) for m in msgs[2:]] == [("call_1_0", "0.5"), ("call_1_1", "120")]


def test_a_reply_cut_at_max_tokens_ends_the_episode_ungraded(user_dir):
    from agentenv.samplers.endpoint import EndpointPolicy
    from agentenv.core.runtime import RolloutConfig, EpisodeSpec, run_episode
    import gymnasium as gym

    with ScriptedServer(mode="cut") as srv:
        policy = EndpointPolicy(srv.url, "shop-player")
        traj = run_episode(gym.make("shop_env:Shop-v0"), policy, RolloutConfig(), EpisodeSpec(options={"task_index": 0}))
        policy.close()
    assert (traj.finish_reason, traj.truncated, traj.success, traj.reward) == ("max_new_tokens", True, False, 0.0)
    assert traj.messages[-1] == {"role": "assistant", "content": "\\boxed{60}"}
