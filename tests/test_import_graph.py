"""The package has no import cycles, including hidden ones (imports inside functions count too), and no module in
``trainer/`` grows past ~400 lines (the loop is wiring; each part is one idea)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
import_graph = importlib.util.module_from_spec(spec)
spec.loader.exec_module(import_graph)


def test_no_import_cycles_anywhere():
    g = import_graph.graph()
    assert "agentenv.trainer.loop" in g and "agentenv.trainer.backends" in g["agentenv.trainer.loop"]
    assert import_graph.cycles(g) == []


def test_the_checker_finds_a_cycle_through_a_function_level_import():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_graph.cycles(g) == [["a", "b", "c"]]


def test_trainer_modules_stay_small():
    sizes = {p.name: len(p.read_text().splitlines()) for p in (ROOT / "trainer").glob("*.py")}
    assert max(sizes.values()) <= 420, sizes
