"""07's tau named as what it is and calibrated against 06 (issue 42, item 10): with tau_source ttt it is a
teacher-forced argmax chain on the run's sampled text, not 06's served tau nor on target_tau's scale. References
are computed by hand from the numbers written into the fixtures."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from eagle_lib import value
from eagle_lib.data_value import tau_scale
from eagle_lib.serving.heldout_tau import Sums


def test_kind_names_the_teacher_forced_chain_and_its_sampled_text():
    ttt = tau_scale.kind(value.Params(tau_source="ttt", num_steps=3), [{"temperature": 1.0, "top_p": 0.95}])
    for words in ("teacher-forced argmax-chain tau", "3 argmax drafts", "T=1, top_p 0.95",
                  "not comparable with 06's served tau nor with target_tau"):  # fmt: skip
        assert words in ttt, words
    assert "offline speculative decoding" in tau_scale.kind(value.Params(tau_source="decode"), [])


def test_calibrate_pairs_each_06_source_and_temperature_by_hand():
    tau07 = {"a": 1.5, "b": 2.0, "c": 1.2}
    six = pd.DataFrame(
        [("vllm served", 0.0, "a", 2.0), ("vllm served", 0.0, "b", 3.0), ("vllm served", 0.0, "all", 2.4),
         ("vllm served", 0.0, "mt_bench", 2.2), ("vllm served", 1.0, "a", 1.5), ("vllm served", 1.0, "b", 2.0),
         ("offline decode", 0.0, "a", 1.75)],
        columns=["source", "temperature", "dataset", "tau_06", ],
    )  # fmt: skip
    table, by = tau_scale.calibrate(tau07, six, target_tau=3.0)
    t0 = by["vllm served T=0"]  # a, b in both: 06 mean 2.5, 07 mean 1.75, gains over 1: 1.5 / 0.75
    assert t0["datasets"] == ["a", "b"] and t0["tau_06"] == 2.5 and t0["tau_07"] == 1.75
    assert t0["ratio"] == pytest.approx(2.0) and t0["target_tau_on_07_scale"] == pytest.approx(2.0)  # 1 + 2/2
    t1 = by["vllm served T=1"]  # 1.75 vs 1.75: the same scale
    assert t1["ratio"] == pytest.approx(1.0) and t1["target_tau_on_07_scale"] == pytest.approx(3.0)
    off = by["offline decode T=0"]  # only a: (1.75 - 1) / (1.5 - 1)
    assert off["datasets"] == ["a"] and off["ratio"] == pytest.approx(1.5)
    row = table[(table.source == "vllm served") & (table.temperature == 0.0) & (table.dataset == "b")].iloc[0]
    assert (row.tau_06, row.tau_07, row["diff"], row.ratio) == (3.0, 2.0, 1.0, 2.0)
    assert set(table.dataset) == {"a", "b", "common"}  # 06's 'all' and eval sets 07 never measured: left out


def _run(tmp_path: Path, online: bool = True) -> Path:
    run = tmp_path / "run"
    (run / "drafter" / "final").mkdir(parents=True)
    (run / "infer" / "chat").mkdir(parents=True)
    (run / "infer" / "chat" / "meta.json").write_text(json.dumps({"sampling": {"temperature": 1.0, "top_p": 0.95,
                                                                                "max_new_tokens": 8}}))  # fmt: skip
    if online:
        (run / "eval").mkdir()
        (run / "eval" / "meta.json").write_text(json.dumps({"drafter_dir": str(run / "drafter" / "final")}))
        pd.DataFrame([(0.0, "chat", "vllm", 2.2), (0.0, "mt_bench", "vllm", 2.0), (0.0, "all", "vllm", 2.1)],
                     columns=["temperature", "dataset", "engine", "online_tau"]).to_csv(run / "eval" / "online.csv",
                                                                                         index=False)  # fmt: skip
        (run / "eval" / "tau.csv").write_text("\n")  # offline: false writes an empty table
    return run


def _study(datasets, num, den):
    sums = Sums(["1"], datasets, np.array([num], float), np.array([den], float))
    return SimpleNamespace(decoder=SimpleNamespace(sums=sums), arms={"1": {"drafter": "05's final drafter"}},
                           total=1000)  # fmt: skip


def test_headline_labels_and_calibrates_against_the_runs_06(tmp_path):
    run = _run(tmp_path)
    st = _study(["chat", "chat", "code"], [4.0, 2.0, 3.0], [3.0, 2.0, 2.0])  # 07: chat 6/5 = 1.2, code 1.5
    curve = SimpleNamespace(tokens_for=lambda t: {"x": 4.0 if t > 1.5 else 2.0, "p_reach": 0.5})
    p = value.Params(tau_source="ttt", target_tau=3.0)
    table, h = tau_scale.headline(run, st, p, curve)
    assert "T=1, top_p 0.95" in h["tau_kind"] and h["tau_source"] == "ttt"
    cal = h["tau_calibration"]
    assert cal["same_drafter"] is True
    t0 = cal["by"]["vllm served T=0"]  # chat only: (2.2 - 1) / (1.2 - 1) = 6, target 3.0 -> 1 + 2 / 6
    assert t0["datasets"] == ["chat"] and t0["ratio"] == pytest.approx(6.0)
    assert t0["target_tau_on_07_scale"] == pytest.approx(1 + 2 / 6)
    assert h["tokens_for_target_on_06_scale"]["vllm served T=0"]["tokens"] == pytest.approx(2000.0)
    assert "2.20 in 06 vs 1.20 in 07" in cal["text"] and len(table) == 2


def test_headline_says_why_it_is_not_calibrated(tmp_path):
    run = _run(tmp_path, online=False)
    st = _study(["chat"], [3.0], [2.0])
    _, h = tau_scale.headline(run, st, value.Params(tau_source="ttt"), None)
    assert h["tau_calibration"]["text"] == "07's tau not calibrated against 06: no 06 measurement of this run"
    assert "teacher-forced" in h["tau_kind"] and "tokens_for_target_on_06_scale" not in h
    assert math.isclose(st.decoder.sums.tau("1"), 1.5)
