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


def _a_records(n: int) -> list[dict]:
    """A-stage records with non-ASCII text (records are written with ensure_ascii=False)."""
    return [{"id": f"ü{i}-中文🙂", "source": "tëst", "input_ids": [i, 2, 3], "loss_mask": [0, 1, 1],
             "nested": {"k": [1, {"x": "é"}]}, "n_tokens": 3, "n_trainable": 2} for i in range(n)]  # fmt: skip


def _scanner_view(path) -> tuple[int, int]:
    """(records, torn) as 04's byte scanner counts them: the other reader that must agree."""
    from eagle_lib.length_study.scan import Lengths, scan_file

    out = scan_file(path, Lengths(kind="A", name="t"), None, set())
    return out.read - out.torn - out.duplicates, out.torn


def test_every_torn_tail_is_skipped_and_truncated_by_the_next_append(tmp_path):
    """Cut the last record at EVERY byte (inside multi-byte characters, right after an inner } or ]): both
    readers agree, and the next append leaves no torn line in the middle and loses nothing."""
    recs = _a_records(3)
    whole = "".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n" for r in recs).encode()
    last_start = whole.rindex(b"\n", 0, len(whole) - 1) + 1
    cuts = range(last_start + 1, len(whole))
    assert any(whole[c - 1 : c] in (b"}", b"]") for c in cuts)  # torn tails ending in } and ] are among them
    assert any((whole[c] & 0xC0) == 0x80 for c in cuts)  # and cuts inside a UTF-8 character
    for cut in cuts:
        p = tmp_path / f"cut{cut}.jsonl"
        p.write_bytes(whole[:cut])
        complete = cut == len(whole) - 1  # only the newline is missing: a whole record
        got = read_jsonl(p)
        assert got == (recs if complete else recs[:2]), cut
        assert _scanner_view(p) == ((3, 0) if complete else (2, 1)), cut
        append_jsonl(p, [dict(recs[0], id="new-é")])
        assert [r["id"] for r in read_jsonl(p)] == [r["id"] for r in got] + ["new-é"], cut
        assert _scanner_view(p) == (len(got) + 1, 0), cut  # nothing torn left, nothing in the middle
        assert p.read_bytes().endswith(b"\n") and p.read_bytes().count(b"\n") == len(got) + 1


def test_legacy_terminated_fragment_in_the_middle_is_skipped_by_both_readers(tmp_path):
    """Files written before the truncating writer: a fragment that opens an object and was terminated."""
    p = tmp_path / "old.jsonl"
    a, c = (json.dumps(r, ensure_ascii=False) for r in _a_records(2))
    p.write_text(f'{a}\n{{"id": "b", "x": [1, 2\n{c}\n', encoding="utf-8")
    assert [r["id"] for r in read_jsonl(p)] == ["ü0-中文🙂", "ü1-中文🙂"]
    assert _scanner_view(p) == (2, 1)


def test_fragment_ending_in_brace_in_the_middle_is_corruption_for_both_readers(tmp_path):
    """What the old writer produced from a tail torn after an inner }: now an error in both, never silent."""
    from eagle_lib.length_study.scan import Lengths, scan_file

    p = tmp_path / "bad.jsonl"
    a, c = (json.dumps(r, ensure_ascii=False) for r in _a_records(2))
    p.write_text(f'{a}\n{{"id": "b", "n": {{"k": 1}}\n{c}\n', encoding="utf-8")
    with pytest.raises(RecordError, match="line 2"):
        read_jsonl(p)
    with pytest.raises(RecordError, match="line 2"):
        scan_file(p, Lengths(kind="A", name="t"), None, set())


def test_append_to_a_file_that_is_only_a_torn_line(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_bytes('{"id": "ü'.encode()[:-1])  # cut inside the two-byte ü
    assert read_jsonl(p) == []
    append_jsonl(p, [{"id": "a"}])
    assert p.read_bytes() == b'{"id":"a"}\n'


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
