"""``benchmarks/demo_stability.py``: the whole code path in a smoke (the demo's real SFT, then RL per arm with the
arm's overrides reaching the run's config, held-out evaluation), resumption, the design guard, and the report's
tests deciding either way on results of known shape."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import demo_stability as STAB  # noqa: E402
import demo_stability_report as REPORT  # noqa: E402


def test_smoke_trains_every_arm_from_one_warm_start_resumes_and_refuses_another_design(tmp_path, capsys):
    out = tmp_path / "report.md"
    assert STAB.main(["--smoke", "--root", str(tmp_path), "--out", str(out)]) == 0
    units = sorted(p.stem for p in (tmp_path / "results").iterdir())
    assert units == ["clip0.3-k0-s1", "eps1e-5-k0-s1", "preset-k0-s1", "sft-k0"]
    sft = json.loads((tmp_path / "results" / "sft-k0.json").read_text())
    for arm, sets in STAB.ARMS.items():
        r = json.loads((tmp_path / "results" / f"{arm}-k0-s1.json").read_text())
        assert r["heldout"]["episodes"] == 4 and r["train"]["updates"] == 2 and isinstance(r["failed"], bool)
        cfg = yaml.safe_load((tmp_path / "work" / f"{arm}-k0-s1" / "run" / "config.yaml").read_text())
        assert cfg["model"]["name"] == sft["model"] and cfg["algo"]["lr"] == 2e-4 and not cfg["sft"]["enabled"]
        assert cfg["algo"]["max_grad_norm"] == (0.3 if arm == "clip0.3" else 1.0)
        assert cfg["algo"]["eps"] == (1e-5 if arm == "eps1e-5" else 1e-6)
    text = out.read_text()
    assert "SMOKE RUN" in text and "Partial" not in text and "commit " in text
    assert text.index("| preset |") < text.index("| clip0.3 |") < text.index("| eps1e-5 |")
    assert "| clip0.3 vs preset |" in text and "| eps1e-5 vs preset |" in text
    capsys.readouterr()
    assert STAB.main(["--smoke", "--root", str(tmp_path), "--out", str(out)]) == 0
    assert "0 units left" in capsys.readouterr().out  # nothing reruns
    with pytest.raises(SystemExit, match=r"another design \(lr: 0.0002 there, 0.0001 here\)"):
        STAB.main(["--smoke", "--root", str(tmp_path), "--lr", "1e-4"])


def _runs(arm: str, outcomes: list[tuple[float, bool]]) -> dict[str, dict]:
    return {f"{arm}-k{i}-s1": {"unit": f"{arm}-k{i}-s1", "kind": "rl", "arm": arm, "k": i, "seed": 1, "wall_s": 200.0,
                               "overrides": STAB.ARMS[arm], "failed": failed,
                               "heldout": {"success_rate": s, "tool_call_rate": s, "episodes": 128},
                               "train": {"updates": 80, "format_broke": failed, "peak_malformed": 0.1 + failed,
                                         "fewest_admitted": 2 if failed else 30, "peak_seq_kl": 0.01,
                                         "batch_size": 32}}
            for i, (s, failed) in enumerate(outcomes)}


def test_the_report_finds_an_arm_that_fails_less_and_not_one_that_fails_as_often():
    settings = {"warm_starts": 12, "seeds": 1, "lr": 2e-4, "arms": ["preset", "clip0.3", "eps1e-5"]}
    res = {**_runs("preset", [(0.1, True)] * 7 + [(0.8, False)] * 5),
           **_runs("clip0.3", [(0.85, False)] * 12),  # 7 of 12 failed -> 0 of 12
           **_runs("eps1e-5", [(0.1, True)] * 6 + [(0.8, False)] * 6)}
    text = "\n".join(REPORT.report_lines(res, settings))
    assert "Partial: 36 of 48 units saved" in text  # the 12 warm starts' SFT units are not among these results
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if " vs preset |" in line}
    assert rows["| clip0.3 vs preset"].endswith("**fails less** |")
    assert rows["| eps1e-5 vs preset"].endswith("no difference detected |")
    assert "| preset | (the preset) | 12 | 7 of 12 [" in text and "fewest admitted" in text


def test_the_most_failures_that_still_pass_is_the_permutation_tests_boundary():
    base = [1.0] * 6 + [0.0] * 2
    f = REPORT.most_failures_that_pass(base, 8, 0.05)
    assert f is not None and f < 6
    from agentenv.core.stats import permutation_p

    assert permutation_p(base, [1.0] * f + [0.0] * (8 - f)) <= 0.05
    assert permutation_p(base, [1.0] * (f + 1) + [0.0] * (7 - f)) > 0.05
    # half of 8 runs failing cannot be told from none failing at 8 runs (p 0.077): the report says "none would"
    assert REPORT.most_failures_that_pass([1.0] * 4 + [0.0] * 4, 8, 0.05) is None
