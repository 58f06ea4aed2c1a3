"""``benchmarks/alfworld_confirm.py``: the confirmatory study's whole code path in a smoke on the shipped games (real
SFT, RL, permuted-reward RL, continued SFT, evaluations on valid_seen / valid_unseen / dev), resumption from the saved
units, parts that wait for another part's warm start, the report's rows, and ``scripts/figures.py alfworld``
delegating to it."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentenv.run.report import nested_paired_test

pytest.importorskip("alfworld", reason="alfworld is not installed (pip install 'agentenv[alfworld]')")

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.alfworld


def _confirm():
    spec = importlib.util.spec_from_file_location("alfworld_confirm", REPO / "benchmarks" / "alfworld_confirm.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["alfworld_confirm"] = mod
    spec.loader.exec_module(mod)
    return mod


CONFIRM = _confirm()
UNITS = ["sft-k1", "warm-k1", "rl-k1-s1", "perm-k1-s1", "csft-k1"]


def test_a_part_whose_warm_start_is_not_saved_waits_and_runs_nothing(tmp_path, capsys):
    assert CONFIRM.main(["run", "--smoke", "--parts", "2/2", "--root", str(tmp_path)]) == 0
    cap = capsys.readouterr()
    assert "this part runs 2" in cap.out and "warm-k1, perm-k1-s1; run again" in cap.out  # 2nd, 4th of 5 units left
    assert not list((tmp_path / "results").iterdir())
    assert "nothing to report" in cap.err  # no empty report that would replace a real one
    assert not (tmp_path / "alfworld_confirm.md").exists()


def test_smoke_saves_every_unit_resumes_without_rerunning_and_reports_every_arm(tmp_path, capsys):
    out = tmp_path / "report.md"
    assert CONFIRM.main(["run", "--smoke", "--root", str(tmp_path), "--out", str(out)]) == 0
    res = {u: json.loads((tmp_path / "results" / f"{u}.json").read_text()) for u in UNITS}
    assert sorted(p.stem for p in (tmp_path / "results").iterdir()) == sorted(UNITS)
    for u in UNITS[1:]:
        evals = res[u]["evals"]
        assert set(evals) == {"valid_seen", "valid_unseen", "valid_seen_other", "valid_unseen_other", "dev"}
        assert all(ev["episodes"] == 2 and len(ev["task_successes"]) == 2 for ev in evals.values())
        # the smoke trains pick_and_place; the shipped games' other type is played by the "_other" evaluation
        assert set(evals["valid_seen"]["episodes_by_type"]) == set(evals["dev"]["episodes_by_type"]) == {
            "pick_and_place"}
        assert set(evals["valid_seen_other"]["episodes_by_type"]) == {"look_at_obj_in_light"}
    assert res["rl-k1-s1"]["train"] == {**res["rl-k1-s1"]["train"], "updates": 2, "rewards_permuted": False}
    assert res["perm-k1-s1"]["train"]["rewards_permuted"] is True
    assert res["csft-k1"]["train"]["steps"] == 2 and res["csft-k1"]["train"]["sequences"] == 4  # 2 updates x batch 2
    assert res["csft-k1"]["model"] != res["sft-k1"]["model"] and Path(res["csft-k1"]["model"], "config.json").exists()
    capsys.readouterr()
    stamps = {u: (tmp_path / "results" / f"{u}.json").stat().st_mtime_ns for u in UNITS}
    assert CONFIRM.main(["run", "--smoke", "--root", str(tmp_path), "--out", str(out)]) == 0
    assert "0 units left" in capsys.readouterr().out  # nothing reruns
    assert stamps == {u: (tmp_path / "results" / f"{u}.json").stat().st_mtime_ns for u in UNITS}
    text = out.read_text()
    assert "SMOKE RUN" in text and "Partial" not in text and "commit " in text
    # the result: RL against its warm start and both controls on both held-out splits, tested, Holm across the six
    assert "**Result**:" in text and "Holm-adjusted across the 6 comparisons" in text
    assert all(text.count(f"| {s} | RL vs ") == 3 for s in ("valid_seen", "valid_unseen"))
    hours = sum(r["wall_s"] for r in res.values()) / 3600  # the cost table: every unit timed, none left
    assert "| perm | 1 of 1 |" in text and f"Spent {hours:.1f} h; the units left take nothing more." in text
    for label in ("RL (FlashREINFORCE) vs its warm start | 1 x 1", "RL, permuted rewards vs its warm start | 1 x 1",
                  "continued SFT, equal compute vs its warm start | 1 x 1",
                  "RL vs permuted rewards (same warm start and seed) | 1 x 1",
                  "RL vs continued SFT (same warm start) | 1 x 1"):
        # one row per table: valid_seen and valid_unseen (the preset's types, then all six), dev
        assert text.count(label) == 5, label
    assert text.count("over 4 games") >= 2 and text.count("over 2 games") >= 3  # the six-type rows join both evals
    for t in ("pick_and_place", "pick_clean_then_place", "pick_heat_then_place", "pick_cool_then_place",
              "look_at_obj_in_light", "pick_two_obj_and_place"):
        assert text.count(f"| {t} |") == 3, t  # every task type, in every split's table (zeros and all)
    # `scripts/figures.py alfworld --no-run` delegates to the study's report: saved results only, nothing run
    figs = tmp_path / "figs" / "alfworld"
    shutil.copytree(tmp_path / "results", figs / "results")
    shutil.copy(tmp_path / "settings.json", figs / "settings.json")
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "figures.py"), "alfworld", "--no-run", "--runs",
                           str(tmp_path / "figs"), "--out", str(tmp_path / "again.md")], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "again.md").read_text().split("\n")[3:] == text.split("\n")[3:]
    assert not (figs / "work").exists()


def test_max_hours_stops_before_a_unit_its_kind_says_would_overrun_and_other_settings_are_refused(tmp_path, capsys):
    root = str(tmp_path)
    assert CONFIRM.main(["run", "--smoke", "--root", root, "--parts", "1/2"]) == 0  # sft-k1, rl-k1-s1, csft-k1
    rl = json.loads((tmp_path / "results" / "rl-k1-s1.json").read_text())
    capsys.readouterr()
    # perm-k1-s1 is next; the saved RL run says it takes rl["wall_s"]: half of that is too little
    assert CONFIRM.main(["run", "--smoke", "--root", root, "--max-hours", str(rl["wall_s"] / 7200)]) == 0
    out = capsys.readouterr().out
    assert "stopping before warm-k1" not in out and "stopping before perm-k1-s1" in out, out
    assert sorted(p.stem for p in (tmp_path / "results").iterdir()) == ["csft-k1", "rl-k1-s1", "sft-k1", "warm-k1"]
    # a root whose study ran with other settings (here: another machine's part, 4 plays per game) is not mixed into
    settings = json.loads((tmp_path / "settings.json").read_text())
    (tmp_path / "settings.json").write_text(json.dumps({**settings, "samples": 4}))
    with pytest.raises(SystemExit, match="other settings \\(samples: 4 there, 1 here\\)"):
        CONFIRM.main(["run", "--smoke", "--root", root])
    assert len(list((tmp_path / "results").iterdir())) == 4


def _report():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import alfworld_confirm_report

    return alfworld_confirm_report


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_the_rows_baseline_and_arm_columns_differ_by_exactly_the_change(data):
    """However unequal the runs per warm start and the plays per game (the six-type rows join 4 plays per preset game
    with 1 per other game), arm - baseline in a row is its change: the columns are weighted as the change is."""
    report = _report()
    games = data.draw(st.integers(2, 6))
    plays = data.draw(st.lists(st.integers(1, 8), min_size=games, max_size=games))

    def counts():
        return {f"g{i}": [data.draw(st.integers(0, n)), n] for i, n in enumerate(plays)}

    groups = [[(counts(), counts()) for _ in range(data.draw(st.integers(1, 3)))]
              for _ in range(data.draw(st.integers(1, 3)))]
    row = report.change_row("arm", groups)
    before, after = (float(x) for x in row.split(" | ")[2:4])
    change = float(row.split("**")[1])
    assert after - before == pytest.approx(change, abs=1.5e-3)  # each printed to 3 decimals


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_rl_vs_a_control_from_a_remade_warm_start_compares_changes_and_is_direct_from_the_same_start(data):
    """A control run from a remade warm start (``rewarm-k1``) enters RL vs control as its change from that start,
    carried onto RL's start: the comparison is (RL - warm) - (control - rewarm), game by game. From the same start it
    is RL - control, as before."""
    report = _report()
    games = data.draw(st.integers(2, 6))
    plays = data.draw(st.lists(st.integers(1, 8), min_size=games, max_size=games))

    def unit(name, kind, seed=None, baseline=None):
        ts = {f"g{i}": [data.draw(st.integers(0, n)), n] for i, n in enumerate(plays)}
        return {"unit": name, "kind": kind, "k": 1, "seed": seed, "evals": {"valid_seen": {"task_successes": ts}},
                **({"warm_start": {"baseline": baseline, "heldout_nll_drift": 0.01}} if baseline else {})}

    res = {u["unit"]: u for u in (unit("warm-k1", "warm"), unit("rewarm-k1", "rewarm", baseline="rewarm-k1"),
                                  unit("rl-k1-s1", "rl", 1), unit("perm-k1-s1", "perm", 1, "rewarm-k1"))}
    rate = {n: np.array([s / p for s, p in u["evals"]["valid_seen"]["task_successes"].values()])
            for n, u in res.items()}
    t = nested_paired_test(report.arm_groups(res, "rl", "valid_seen", "perm"), resamples=200)
    want = ((rate["rl-k1-s1"] - rate["warm-k1"]) - (rate["perm-k1-s1"] - rate["rewarm-k1"])).mean()
    assert t["change"] == pytest.approx(want) and t["after"] - t["before"] == pytest.approx(want)
    assert "rewarm-k1" in "".join(report.remade_lines(res))
    # the control's own change is paired with the remade start's evaluation
    t = nested_paired_test(report.arm_groups(res, "perm", "valid_seen"), resamples=200)
    assert t["change"] == pytest.approx((rate["perm-k1-s1"] - rate["rewarm-k1"]).mean())
    del res["perm-k1-s1"]["warm_start"]  # from the original start: the direct comparison
    ((before, _),), = report.arm_groups(res, "rl", "valid_seen", "perm")
    assert before == report.counts(res["perm-k1-s1"], "valid_seen")


def test_a_warm_start_whose_model_is_gone_is_remade_and_paired_with_its_own_evaluation_if_it_differs(tmp_path, capsys):
    root, results, work = str(tmp_path), tmp_path / "results", tmp_path / "work"
    assert CONFIRM.main(["run", "--smoke", "--root", root, "--parts", "1/5"]) == 0  # sft-k1 only
    saved = json.loads((results / "sft-k1.json").read_text())
    shutil.rmtree(work / "sft-k1")  # as on another machine, or after the work directory was lost
    assert CONFIRM.main(["run", "--smoke", "--root", root, "--parts", "1/4"]) == 0  # warm-k1, on the remade model
    warm = json.loads((results / "warm-k1.json").read_text())
    assert warm["warm_start"]["heldout_nll_drift"] <= CONFIRM.SAME_NLL and warm["warm_start"]["baseline"] == "warm-k1"
    assert json.loads((results / "sft-k1.json").read_text()) == saved  # the record of the original is kept
    assert "running its SFT again" in capsys.readouterr().out
    # a remake that is not the original (here: a saved held-out NLL it cannot match, as across machines) is another
    # warm start of the same recipe: it is evaluated as rewarm-k1 before the first arm from it, which pairs with that
    shutil.rmtree(work / "sft-k1")
    saved["sft"]["heldout"][-1]["all"]["nll"] += 0.5
    (results / "sft-k1.json").write_text(json.dumps(saved))
    assert CONFIRM.main(["run", "--smoke", "--root", root, "--parts", "1/3"]) == 0  # rl-k1-s1
    rl, rewarm = (json.loads((results / f"{u}.json").read_text()) for u in ("rl-k1-s1", "rewarm-k1"))
    assert rl["warm_start"]["baseline"] == "rewarm-k1" and rl["warm_start"]["heldout_nll_drift"] > 0.4
    assert rewarm["kind"] == "rewarm" and set(rewarm["evals"]) == set(warm["evals"])
    report = CONFIRM.report
    assert report.baseline_of(report.load(tmp_path), rl) is not None
    # remade once more, it must be the first remake: rewarm-k1 and rl-k1-s1 were made from that one
    shutil.rmtree(work / "sft-k1")
    rewarm["warm_start"]["sft"]["heldout"][-1]["all"]["nll"] += 0.5
    (results / "rewarm-k1.json").write_text(json.dumps(rewarm))
    with pytest.raises(SystemExit, match="remade again differs from its first remake"):
        CONFIRM.main(["run", "--smoke", "--root", root, "--parts", "1/2"])  # perm-k1-s1 needs it
    assert not (work / "sft-k1").exists() and not (work / "perm-k1-s1").exists()
    assert sorted(p.stem for p in results.iterdir()) == ["rewarm-k1", "rl-k1-s1", "sft-k1", "warm-k1"]
