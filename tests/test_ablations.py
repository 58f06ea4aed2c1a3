"""``benchmarks/ablations.py``: a 2-update smoke of every variant (real model, learner, sandbox, held-out evaluation),
resuming from saved results and running in parts, and the report's verdicts following its tests on saved results."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def _ablations():
    spec = importlib.util.spec_from_file_location("ablations", REPO / "benchmarks" / "ablations.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ablations"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


ABL = _ablations()
REP = ABL.report


@pytest.fixture(scope="module")
def ablation_root(tmp_path_factory):
    return tmp_path_factory.mktemp("ablations")


@pytest.mark.parametrize("variant", list(ABL.VARIANTS))
def test_ablation_variant_two_update_smoke(variant, ablation_root):
    out = ablation_root / f"{variant}.md"
    assert ABL.main(["--smoke", "--only", variant, "--root", str(ablation_root), "--out", str(out)]) == 0
    res = json.loads((ablation_root / "results" / f"{variant}-seed0.json").read_text())
    assert res["train"]["updates"] == 2 and res["train"]["accounting_balance"] == 0
    assert res["heldout"]["episodes"] == 4  # the final weights on held-out questions, not training batches
    cfg = yaml.safe_load((ablation_root / "runs" / f"{variant}-seed0" / "config.yaml").read_text())
    assert cfg["eval"]["splits"] == ["heldout"] and cfg["env"]["demo_easy_fraction"] == 0.3
    if variant == "grpo":
        assert cfg["algo"]["loss"] == {"type": "grpo", "clip_eps": 0.2} and cfg["loop"]["group_size"] == 4
    if variant.endswith("_lag"):
        assert cfg["loop"]["fixed_lag"] == 1 and cfg["loop"]["mode"] == "sync_grpo"
        # at most one version behind (a smoke's batches may all fail, and equal rewards make no step: no new version;
        # the exact lag is tests/test_loop.py's)
        assert res["train"]["lag_max"] <= 1
    loss = cfg["algo"]["loss"]
    assert loss.get("no_trust", False) == (variant == "no_trust_lag") and loss.get("no_is", False) == (variant == "no_is_lag")
    if variant.startswith("q0."):
        assert loss["negative_token_fraction"] == float(variant[1:])
    text = out.read_text()
    assert "SMOKE RUN" in text and f"| {variant} | 1 |" in text and "commit " in text


def test_ablations_resume_skip_finished_runs_and_run_in_parts(ablation_root, capsys):
    args = ["--smoke", "--only", "flashreinforce", "--root", str(ablation_root), "--out", str(ablation_root / "r.md")]
    assert ABL.main(args) == 0
    saved = (ablation_root / "results" / "flashreinforce-seed0.json").stat().st_mtime
    assert ABL.main(args) == 0
    assert (ablation_root / "results" / "flashreinforce-seed0.json").stat().st_mtime == saved
    assert "0 runs to do" in capsys.readouterr().out
    parts = [ABL.pending_jobs(ABL.parse_args(["--root", "x", "--seeds", "0", "1", "2", "--parts", f"{i}/2"]),
                              ablation_root / "nothing-here") for i in (1, 2)]
    assert sorted(parts[0] + parts[1]) == sorted((v, s) for v in ABL.VARIANTS for s in (0, 1, 2))
    assert not set(parts[0]) & set(parts[1])


def _result(variant: str, seed: int, success: float, tool: float, length: float) -> dict:
    return {"variant": variant, "seed": seed, "wall_s": 1.0, "heldout": {"success_rate": success, "tool_call_rate": tool,
            "policy_tokens_mean": length}, "train": {"updates": 30, "lag_mean": 8.0, "accounting_balance": 0}}


def test_ablation_verdicts_come_from_the_tests(tmp_path):
    """Saved results with a planted effect in each direction; the written report's verdicts follow Holm-adjusted
    Welch tests: a large effect the paper's way reproduces, one the other way is refuted, a noisy null with a
    spread too wide to detect the paper's effect stays unresolved."""
    import random

    rng = random.Random(0)
    (tmp_path / "results").mkdir()
    (tmp_path / "warm_start.json").write_text(json.dumps({"success_rate": 0.3, "tool_call_rate": 0.3,
                                                          "policy_tokens_mean": 20.0}))
    planted = {"flashreinforce": (0.5, 0.6, 20), "grpo": (0.5, 0.2, 20), "token_mean": (0.5, 0.6, 20),
               "flashreinforce_lag": (0.4, 0.6, 20), "no_is_lag": (0.6, 0.6, 20), "no_trust_lag": (0.4, 0.6, 20)}
    for v, (succ, tool, length) in planted.items():
        for seed in range(8):
            noise = 0.2 if v == "no_trust_lag" else 0.01
            r = _result(v, seed, succ + rng.gauss(0, noise), tool + rng.gauss(0, 0.01), length + rng.gauss(0, 1))
            (tmp_path / "results" / f"{v}-seed{seed}.json").write_text(json.dumps(r))
    settings = {"alpha": 0.05, "easy": 0.3, "updates": 30, "batch": 16, "lag": 8, "eval_episodes": 128,
                "variants": list(ABL.VARIANTS), "seeds": list(range(8))}
    text = REP.write(tmp_path, tmp_path / "results.md", settings=settings, command="test", smoke=False)
    results, warm = REP.load(tmp_path)
    tested = REP.run_tests(results, warm, 0.05)
    assert tested["grpo_tool_calls"]["verdict"] == "reproduces" and tested["grpo_tool_calls"]["p_holm"] < 1e-6
    assert tested["is_under_lag"]["verdict"].startswith("refuted (significant")
    assert tested["trust_gate_under_lag"]["verdict"] == "unresolved at this budget"
    assert tested["trust_gate_under_lag"]["runs_needed"] > 8 and tested["trust_gate_under_lag"]["mde"] > REP.PAPER_GAP
    assert "failure_filter_q0.9" not in tested and "| failure_filter_q0.9 |" in text  # no q0.9 runs: not tested
    assert "- **reproduce**: grpo_tool_calls" in text and "[0." in text  # mean [95% CI] cells
    assert "in progress: 48 of its 64 runs" in text  # 6 of 8 variants planted: the report says it is partial
    png = (tmp_path / "results.png").read_bytes()  # the figure next to the table, linked from it
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000 and "](results.png)" in text
    ps = [t["p"] for t in tested.values()]
    assert [t["p_holm"] for t in tested.values()] == pytest.approx(REP.holm(ps))


def test_the_figure_script_writes_the_ablation_table_from_saved_results(tmp_path):
    """`scripts/figures.py ablations --no-run` runs nothing: it reads the saved results under its run root and writes
    the stamped report where it is told."""
    import subprocess

    root = tmp_path / "ablations" / "results"
    root.mkdir(parents=True)
    for v in ("flashreinforce", "grpo"):
        for seed in range(3):
            r = _result(v, seed, 0.5 + 0.01 * seed, 0.7 if v == "flashreinforce" else 0.2 + 0.01 * seed, 20.0)
            (root / f"{v}-seed{seed}.json").write_text(json.dumps(r))
    out = tmp_path / "results.md"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "figures.py"), "ablations", "--no-run", "--runs",
                           str(tmp_path), "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert "--report-only" in text and "commit " in text and "UTC" in text
    assert "| flashreinforce | 3 |" in text and "| grpo | 3 |" in text and "not tested" in text
    assert "in progress: 6 of its 128 runs (8 variants x 16 seeds)" in text
    assert not (tmp_path / "ablations" / "runs").exists()  # nothing was run


def test_a_root_keeps_one_design_and_its_report_describes_the_saved_one(tmp_path, capsys):
    """Runs of another design are refused before anything runs; ``--report-only`` describes the runs by the design
    they were made with, not by this call's defaults; a root with no results writes no report."""
    (tmp_path / "results").mkdir()
    design = {"updates": 40, "batch": 8, "lag": 4, "easy": 0.3, "eval_episodes": 128, "smoke": False}
    (tmp_path / "settings.json").write_text(json.dumps(design))
    out = tmp_path / "results.md"
    assert ABL.main(["--root", str(tmp_path), "--report-only", "--out", str(out)]) == 2  # no results yet
    assert "nothing to report" in capsys.readouterr().err and not out.exists()
    for seed in range(2):
        r = _result("flashreinforce", seed, 0.5, 0.6, 20.0)
        (tmp_path / "results" / f"flashreinforce-seed{seed}.json").write_text(json.dumps(r))
    with pytest.raises(SystemExit, match="another design \\(updates: 40 there, 80 here, batch: 8 there, 16 here"):
        ABL.main(["--root", str(tmp_path), "--seeds", "2"])
    assert not (tmp_path / "sft_model").exists() and len(list((tmp_path / "results").iterdir())) == 2
    assert ABL.main(["--root", str(tmp_path), "--report-only", "--out", str(out)]) == 0
    text = out.read_text()
    assert "40 updates x 8 trajectories" in text and "`loop.fixed_lag=4`" in text and "on 128 held-out" in text
