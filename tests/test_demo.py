"""Smoke run of the demo pipeline with tiny sizes: SFT warm start -> real Learner + async loop -> metrics and plot."""

import json

from agentenv.core.config import load_config
from agentenv.run.report import run_demo


def test_demo_two_updates(tmp_path):
    cfg = load_config("demo", [], [
        f"run.dir={tmp_path}", "model.name=tiny-bpe", "sft.num_demos=8", "sft.epochs=1", "sft.batch_size=4",
        "loop.total_updates=2", "loop.batch_size=2", "loop.num_workers=1", "loop.concurrency=2", "eval.episodes=2",
        "env.num_tasks=8", "rollout.max_new_tokens=8", "run.tensorboard=false"])
    lines = []
    assert run_demo(cfg, progress=False, echo=lines.append) == 0
    from agentenv.core.metrics import read_metrics

    recs = read_metrics(tmp_path)  # the update rows (the shutdown summary is an event row)
    assert [r["update"] for r in recs] == [1, 2]
    for key in ("success_rate", "tool_share", "acceptance_rate", "seq_kl_mean", "lag_mean", "grad_norm", "lr",
                "policy_tokens_mean", "traj_per_s", "tokens_per_s", "started", "trained", "accounting_balance"):
        assert key in recs[-1], key
    assert recs[-1]["accounting_balance"] == 0
    assert (tmp_path / "curves.png").exists() and (tmp_path / "config.yaml").exists()
    assert (tmp_path / "sft_model" / "config.json").exists()
    res = json.loads((tmp_path / "demo_result.json").read_text())
    assert res["before"]["episodes"] == 2 and res["after"]["episodes"] == 2
    assert any("warm start (SFT)" in x for x in lines)
