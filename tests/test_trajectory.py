"""Trajectory record: validation and the versioned JSONL round trip."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentenv.core.trajectory import SCHEMA_VERSION, Trajectory, read_jsonl, write_jsonl


def make(n_prompt=3, sampled=(-0.5, -1.0), obs=2):
    ids = list(range(n_prompt + len(sampled) + obs))
    mask = [False] * n_prompt + [True] * len(sampled) + [False] * obs
    lps = [0.0] * n_prompt + list(sampled) + [0.0] * obs
    ver = [-1] * n_prompt + [2] * len(sampled) + [-1] * obs
    return Trajectory(env="agentenv/GuessNumber-v0", task="t", model="tiny", token_ids=ids, action_mask=mask,
                      behavior_logprobs=lps, policy_version=ver, reward=1.0, success=True, finish_reason="done",
                      num_turns=1, messages=[{"role": "user", "content": "héllo ✓"}],
                      sampling={"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 8})


def test_round_trip(tmp_path):
    trajs = [make(), make(sampled=(-0.1,))]
    path = tmp_path / "t.jsonl"
    assert write_jsonl(path, trajs) == 2
    back = read_jsonl(path)
    assert [t.to_dict() for t in back] == [t.to_dict() for t in trajs]
    line = json.loads(path.read_text().splitlines()[0])
    assert line["schema_version"] == SCHEMA_VERSION
    for key in ("token_ids", "action_mask", "behavior_logprobs", "policy_version", "env", "task", "reward", "success",
                "finish_reason", "num_turns", "num_tool_calls", "messages", "model", "model_path", "sampling"):
        assert key in line
    assert back[0].versions == [2] and back[0].num_policy_tokens == 2


def test_newer_or_missing_schema_is_a_clear_error(tmp_path):
    d = make().to_dict()
    for bad, msg in ((dict(d, schema_version=SCHEMA_VERSION + 1), "newer than this agentenv"),
                     ({k: v for k, v in d.items() if k != "schema_version"}, "no schema_version"),
                     (dict(d, surprise=1), "unknown fields")):
        p = tmp_path / "bad.jsonl"
        p.write_text(json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match=msg):
            read_jsonl(p)
    p.write_text("{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: not valid JSON"):
        read_jsonl(p)


def test_validate_catches_contract_breaks():
    make().validate()
    t = make(); t.behavior_logprobs[0] = -0.3
    with pytest.raises(ValueError, match="must be 0.0 on a non-sampled"):
        t.validate()
    t = make(); t.behavior_logprobs[3] = 0.5
    with pytest.raises(ValueError, match="finite and <= 0"):
        t.validate()
    t = make(); t.action_mask.pop()
    with pytest.raises(ValueError, match="action_mask has"):
        t.validate()
    t = make(); t.finish_reason = "bored"
    with pytest.raises(ValueError, match="finish_reason"):
        t.validate()


@settings(max_examples=30, deadline=None)
@given(lps=st.lists(st.floats(max_value=0.0, allow_nan=False, allow_infinity=False, width=64), min_size=1, max_size=20),
       reward=st.floats(-10, 10, allow_nan=False))
def test_property_round_trip_is_exact(tmp_path_factory, lps, reward):
    t = make(sampled=tuple(lps)); t.reward = reward
    p = tmp_path_factory.mktemp("rt") / "x.jsonl"
    write_jsonl(p, [t])
    (back,) = read_jsonl(p)
    assert back.behavior_logprobs == t.behavior_logprobs and back.reward == reward
    back.validate()


def test_schema_1_records_upgrade_with_empty_tool_counters():
    d = Trajectory(token_ids=[1], action_mask=[False], behavior_logprobs=[0.0], policy_version=[-1],
                   num_tool_calls=4).to_dict()
    for k in ("num_tool_malformed", "tool_calls_by_name", "tool_errors_by_name"):
        del d[k]
    d["schema_version"] = 1
    t = Trajectory.from_dict(d)
    assert (t.num_tool_calls, t.num_tool_malformed, t.tool_calls_by_name) == (4, 0, {})
    assert t.meta["upgraded_from"] == 1 and t.to_dict()["schema_version"] == SCHEMA_VERSION == 2
    for reason in ("template_error", "generation_budget"):
        Trajectory(finish_reason=reason).validate()
