import json

import pytest

from eagle_lib.store import (
    RecordError,
    append_jsonl,
    check_tally,
    is_heldout,
    iter_jsonl,
    read_jsonl,
    stable_hash,
)


def test_append_and_read_roundtrip(tmp_path):
    p = tmp_path / "r.jsonl"
    assert append_jsonl(p, [{"id": "a", "x": [1, 2]}, {"id": "b"}]) == 2
    append_jsonl(p, [{"id": "c"}])
    assert [r["id"] for r in read_jsonl(p)] == ["a", "b", "c"]


def test_torn_last_line_is_skipped_then_terminated_by_next_append(tmp_path):
    p = tmp_path / "r.jsonl"
    append_jsonl(p, [{"id": "a"}])
    with open(p, "ab") as f:  # a crash mid-write leaves half a line
        f.write(b'{"id": "b", "x": [1, 2')
    assert [r["id"] for r in iter_jsonl(p)] == ["a"]
    append_jsonl(p, [{"id": "b"}])
    assert [r["id"] for r in read_jsonl(p)] == ["a", "b"]
    assert p.read_text().count("\n") == 3  # the fragment stays on its own line


def test_corrupt_middle_line_names_file_and_line(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"id": "a"}\nnot json}\n{"id": "c"}\n')
    with pytest.raises(RecordError, match=r"r\.jsonl: line 2"):
        read_jsonl(p)
    p.write_text('{"id": "a"}\n[1, 2]\n')
    with pytest.raises(RecordError, match="line 2: expected a JSON object"):
        read_jsonl(p)


def test_torn_tail_not_tolerated_when_asked(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"id": "a"}\n{"id"')
    with pytest.raises(RecordError):
        list(iter_jsonl(p, tolerate_torn_tail=False))


def test_missing_file_reads_empty(tmp_path):
    assert read_jsonl(tmp_path / "none.jsonl") == []


def test_check_tally():
    check_tally({"read": 10, "kept": 6, "dropped": {"dup": 2, "long": 1}, "rejected": 1})
    with pytest.raises(AssertionError, match="read=10"):
        check_tally({"read": 10, "kept": 6, "dropped": {"dup": 2}, "rejected": 1})


def test_heldout_split_is_deterministic_and_sized():
    ids = [f"s{i}" for i in range(20000)]
    held = [i for i in ids if is_heldout(i, 5.0)]
    assert held == [i for i in ids if is_heldout(i, 5.0)]
    assert 0.04 < len(held) / len(ids) < 0.06
    assert not any(is_heldout(i, 0.0) for i in ids[:1000])
    assert all(is_heldout(i, 100.0) for i in ids[:1000])


def test_stable_hash_ignores_key_order():
    assert stable_hash({"a": 1, "b": [1, 2]}) == stable_hash(json.loads('{"b": [1, 2], "a": 1}'))
    assert stable_hash({"a": 1}) != stable_hash({"a": 2})
