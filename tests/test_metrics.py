"""Batch metrics, the JSONL/TensorBoard logger, the collapse alarm and the plots, on real Trajectory objects."""

import json
import logging

from agentenv.core.metrics import MetricsLogger, batch_metrics, format_line, read_metrics, update_record
from agentenv.run.plot import ascii_curve, plot_runs
from agentenv.core.trajectory import Trajectory


def traj(calls=0, errors=0, timeouts=0, success=False, ttype="a", truncated=False, n_policy=3):
    return Trajectory(token_ids=[1] * (n_policy + 2), action_mask=[False, False] + [True] * n_policy,
                      behavior_logprobs=[0.0, 0.0] + [-0.1] * n_policy, policy_version=[-1, -1] + [0] * n_policy,
                      num_tool_calls=calls, num_tool_errors=errors, num_tool_timeouts=timeouts, success=success,
                      reward=float(success), task_type=ttype, truncated=truncated, num_turns=calls + 1)


def test_batch_metrics_values():
    m = batch_metrics([traj(2, 1, 1, True, "a"), traj(0, 0, 0, False, "b", truncated=True), traj(1, 0, 0, True, "a"),
                       traj()])
    assert m["success_rate"] == 0.5 and m["reward_mean"] == 0.5
    assert m["tool_calls_mean"] == 0.75 and m["tool_call_rate"] == 0.5
    assert m["tool_error_rate"] == 1 / 3 and m["tool_timeout_rate"] == 1 / 3
    assert m["truncation_rate"] == 0.25 and m["policy_tokens_mean"] == 3
    assert m["success_a"] == 2 / 3 and m["success_b"] == 0.0


def test_update_record_is_built_once_with_plain_names_and_one_lag():
    batch = [traj(1, success=True), traj()]
    learner = {"loss": -0.5, "grad_norm": 0.2, "acceptance_rate": 0.5, "admitted": [True, False], "reward_mean": 9.0,
               "policy_lag_mean": 99.0, "step": 4, "num_admitted": 1}
    rec = update_record(update=4, policy_version=4, mode="async", batch=batch, lags=[(1.0, 2), (0.0, 0)],
                        learner_stats=learner, counters={"started": 2, "accounting_balance": 0},
                        timings={"time_learner_s": 1.5})
    assert rec["update"] == 4 and rec["batch_size"] == 2 and rec["tool_call_rate"] == 0.5
    assert rec["reward_mean"] == 0.5  # the batch's, not a second copy from the learner
    assert rec["lag_mean"] == 0.5 and rec["lag_max"] == 2 and "policy_lag_mean" not in rec
    assert rec["loss"] == -0.5 and rec["grad_norm"] == 0.2 and rec["acceptance_rate"] == 0.5
    assert "admitted" not in rec and rec["num_admitted"] == 1
    assert rec["started"] == 2 and rec["time_learner_s"] == 1.5
    assert not any(k.startswith(("learner_batch_", "batch_")) for k in rec if k != "batch_size")


def test_tool_metrics_count_well_formed_calls_and_per_tool():
    # The review's run: 22 "calls" of which 14 were broken JSON. Malformed blocks are their own metric now.
    a = traj(calls=3, errors=1)
    a.num_tool_malformed, a.tool_calls_by_name, a.tool_errors_by_name = 10, {"python": 2, "search": 1}, {"python": 1}
    b = traj(calls=0)
    b.num_tool_malformed = 4  # only broken blocks: not a tool-using trajectory
    c = traj(calls=5)
    c.tool_calls_by_name = {"python": 5}
    m = batch_metrics([a, b, c])
    assert m["tool_calls_mean"] == 8 / 3 and m["tool_call_rate"] == 2 / 3 and m["tool_malformed_mean"] == 14 / 3
    assert m["tool_error_rate"] == 1 / 8
    assert (m["tool_calls/python"], m["tool_calls/search"], m["tool_errors/python"]) == (7 / 3, 1 / 3, 1 / 3)
    assert "tool_errors/search" not in m and m["template_error_rate"] == 0.0


def test_logger_jsonl_tensorboard_line_and_collapse_alarm(tmp_path, caplog):
    lines = []
    lg = MetricsLogger(tmp_path, collapse_window=10, collapse_ratio=0.3, echo=lines.append)
    shares = [0.2, 0.6, 0.8, 0.8, 0.7, 0.1, 0.05, 0.0, 0.0]
    with caplog.at_level(logging.WARNING, logger="agentenv.core.metrics"):
        for i, s in enumerate(shares, 1):
            lg.log_update({"update": i, "elapsed_s": float(i), "tool_call_rate": s,
                           "tokens": 100, "success_rate": 0.5, "acceptance_rate": 1.0})
    lg.log_eval(9, "valid", {"success_rate": 0.5})
    lg.close()
    recs = read_metrics(tmp_path)
    assert [r["update"] for r in recs] == list(range(1, 10))
    assert recs[-1]["tokens_per_s"] == 900 / 9
    alarms = [r["tool_collapse_alarm"] for r in recs]
    assert alarms[:6] == [0] * 6 and alarms[-1] == 1
    assert sum("TOOL-CALL COLLAPSE" in r.message for r in caplog.records) == 1  # warned once, not every update
    assert lines[0].startswith("[update 1] ") and "tool_call_rate=0.200" in lines[0]
    assert "ALARM=tool_collapse" in lines[-2]
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())
    assert json.loads((tmp_path / "eval.jsonl").read_text())["split"] == "valid"


def test_malformed_call_alarm_fires_once_on_a_format_break_and_rearms(tmp_path, caplog):
    """The demo's collapse on CI, as its metrics showed it: malformed blocks per trajectory 0.03-0.125 while it learned,
    then 0.28, 0.88, 1.4 in three updates. Noise at the learning level never fires it."""
    lines = []
    lg = MetricsLogger(tmp_path, tensorboard=False, echo=lines.append)
    malformed = [0.0, 0.06, 0.03, 0.125, 0.09, 0.0, 0.125, 0.28, 0.88, 1.4, 1.8, 0.0, 0.0, 0.0, 0.5, 0.6, 0.4]
    with caplog.at_level(logging.WARNING, logger="agentenv.core.metrics"):
        for i, x in enumerate(malformed, 1):
            lg.log_update({"update": i, "tool_malformed_mean": x, "tool_call_rate": 0.5})
    lg.close()
    alarms = [r["malformed_call_alarm"] for r in read_metrics(tmp_path)]
    assert alarms == [0] * 8 + [1, 1, 1, 1, 1, 0, 0, 1, 1]  # 0.125, 0.28, 0.88 average 0.43; re-armed after recovery
    assert sum("TOOL-CALL FORMAT BREAKING" in r.message for r in caplog.records) == 2  # once per episode of it
    assert "ALARM=malformed_calls" in lines[8] and "ALARM" not in lines[7]


def test_plot_overlays_runs(tmp_path):
    for name, k in (("a", 1.0), ("b", 0.5)):
        lg = MetricsLogger(tmp_path / name, tensorboard=False, echo=None)
        for i in range(1, 8):
            lg.log_update({"update": i, "elapsed_s": 1.0, "success_rate": k * i / 8, "tool_call_rate": k,
                           "lag_mean": 1.0, "lag_max": 2, "acceptance_rate": 1.0, "policy_tokens_mean": 9})
        lg.close()
    out = plot_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "cmp.png")
    assert out.stat().st_size > 10_000
    assert len(ascii_curve([0, 0.5, 1.0])) == 3


def test_format_line_is_greppable():
    s = format_line({"update": 5, "success_rate": 0.25, "lr": 1e-6})
    assert s == "[update 5] success=0.250 lr=1e-06"
