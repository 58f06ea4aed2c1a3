"""Every result table the README and docs/ state is regenerated, from a fresh clone, by ``scripts/figures.py
--no-run`` out of the data shipped beside it in ``docs/data/`` -- so a hand edit, a report whose numbers drifted from
its code, or a table whose data is missing fails here."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIGURES = [("demo", "docs/demo.md", ["--no-readme"]), ("ablations", "docs/results.md", []),
           ("alfworld", "docs/alfworld_confirm.md", []), ("stability", "docs/demo_stability.md", [])]


def figures(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "figures.py"), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


@pytest.mark.parametrize("figure,doc,extra", FIGURES, ids=[f[0] for f in FIGURES])
def test_each_committed_table_is_what_its_shipped_data_gives(figure, doc, extra, tmp_path):
    out = tmp_path / Path(doc).name
    data = sorted((REPO / "docs" / "data" / figure).rglob("*"))
    assert data, f"docs/data/{figure} is missing: {doc} has nothing to be regenerated from"
    before = {f: f.stat().st_mtime_ns for f in [*data, REPO / doc, REPO / "README.md"]}
    proc = figures(figure, "--no-run", "--out", str(out), *extra)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    committed, regenerated = table_rows((REPO / doc).read_text()), table_rows(out.read_text())
    assert committed, f"{doc} has no table"
    assert regenerated == committed, f"{doc} differs from what docs/data/{figure} gives: regenerate it with " \
                                     f"scripts/figures.py {figure}"
    assert {f: f.stat().st_mtime_ns for f in before} == before  # --out elsewhere: the docs and their data untouched


def test_the_readme_demo_table_is_the_docs_one():
    readme = (REPO / "README.md").read_text()
    block = re.search(r"<!-- figures:demo.*?-->(.*?)<!-- /figures:demo -->", readme, re.S)
    assert block, "the README lost its figures:demo block"
    assert table_rows(block.group(1)) == table_rows((REPO / "docs" / "demo.md").read_text())


@pytest.mark.parametrize("figure", ["ablations", "alfworld", "stability"])
def test_a_study_root_without_results_is_refused_and_nothing_is_written(figure, tmp_path):
    out = tmp_path / "report.md"
    proc = figures(figure, "--no-run", "--runs", str(tmp_path / "empty"), "--out", str(out))
    assert proc.returncode == 2
    assert "nothing to report" in proc.stderr and "left as it is" in proc.stderr
    assert not out.exists() and not out.with_suffix(".png").exists()
    assert not (tmp_path / "empty").exists()  # reading made no directories
