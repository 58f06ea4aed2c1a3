"""Reading trajectory JSONL after a crash: the writer flushes whole lines, so only the last line can be cut short;
that line is skipped with a warning and every earlier one is kept. Corruption anywhere else stays an error."""

import json

import pytest

from agentenv.core.trajectory import JsonlWriter, TruncatedLineWarning, Trajectory, read_jsonl


def _traj(i: int) -> Trajectory:
    return Trajectory(token_ids=[1, 2, 3], action_mask=[False, True, True], behavior_logprobs=[0.0, -0.5, -0.1],
                      policy_version=[-1, 0, 0], reward=float(i), task=f"t{i}")


def _write(path, n: int) -> str:
    with JsonlWriter(path) as w:
        for i in range(n):
            w.write(_traj(i))
    return path.read_text(encoding="utf-8")


@pytest.mark.parametrize("cut", [1, 17, -2])
def test_a_truncated_last_line_is_skipped_with_a_warning(tmp_path, cut):
    p = tmp_path / "trajectories.jsonl"
    text = _write(p, 3)
    last_start = text.rstrip("\n").rfind("\n") + 1
    p.write_text(text[:last_start + cut if cut > 0 else len(text) + cut], encoding="utf-8")  # crash mid-line
    with pytest.warns(TruncatedLineWarning, match=r"trajectories.jsonl:3: the last line is cut short"):
        back = read_jsonl(p)
    assert [t.task for t in back] == ["t0", "t1"] and back[1].reward == 1.0


def test_a_last_line_cut_inside_a_multibyte_character_is_skipped(tmp_path):
    p = tmp_path / "t.jsonl"
    t = _traj(0)
    t.task = "é" * 50
    with JsonlWriter(p) as w:
        w.write(_traj(1))
        w.write(t)
    data = p.read_bytes()
    cut = data.rindex("é".encode()) + 1  # half of a two-byte character
    p.write_bytes(data[:cut])
    with pytest.warns(TruncatedLineWarning):
        assert [x.task for x in read_jsonl(p)] == ["t1"]


def test_a_complete_file_reads_without_a_warning(tmp_path, recwarn):
    p = tmp_path / "t.jsonl"
    _write(p, 2)
    assert [t.task for t in read_jsonl(p)] == ["t0", "t1"] and not recwarn.list


def test_a_bad_line_before_the_end_is_still_an_error(tmp_path):
    p = tmp_path / "t.jsonl"
    lines = _write(p, 3).splitlines(keepends=True)
    p.write_text(lines[0] + lines[1][:10] + "\n" + lines[2], encoding="utf-8")
    with pytest.raises(ValueError, match="t.jsonl:2: not valid JSON"):
        read_jsonl(p)
    p.write_text(lines[0] + json.dumps({"schema_version": 10**6}), encoding="utf-8")  # complete JSON, no newline
    with pytest.raises(ValueError, match="t.jsonl:2"):
        read_jsonl(p)
