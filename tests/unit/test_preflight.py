"""Preflight: a good export passes; each known serving mistake fails with a message naming it."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle_lib.serving import export, preflight
from tests.support import models as tiny

V = tiny.EXPORT_VOCAB
make_drafter = tiny.export_drafter

TARGET = {"hidden_size": 64, "num_hidden_layers": 10, "vocab_size": V, "max_position_embeddings": 4096}


@pytest.fixture
def exports(tmp_path):
    return export.export_all(make_drafter(), tmp_path, "org/target", ["LlamaForCausalLM"])


def failed(rep):
    return {c.name: c.message for c in rep.checks if not c.ok and c.severity == "error"}


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def edit_tensor(path, key, fn):
    f = str(path / "model.safetensors")
    t = load_file(f)
    t[key] = fn(t[key])
    save_file(t, f)


@pytest.mark.parametrize("fmt", export.FORMATS)
def test_good_export_passes_and_prints_commands(exports, fmt):
    rep = preflight.preflight(exports[fmt], "org/target", target_config=TARGET)
    assert rep.ok, rep.text()
    assert '"method": "eagle3"' in rep.commands["vllm"] and str(exports[fmt]) in rep.commands["vllm"]
    if fmt == "sglang":
        cmd = rep.commands["sglang"]
        for flag in [
            "--speculative-algorithm EAGLE3",
            "--speculative-num-steps 3",
            "--speculative-eagle-topk 1",
            "--speculative-num-draft-tokens 4",
            "--model-path org/target",
        ]:
            assert flag in cmd


def test_eagle_instead_of_eagle3_fails(exports):
    d = exports["sglang"]
    cmd = (
        f"python -m sglang.launch_server --model-path org/target --speculative-algorithm EAGLE "
        f"--speculative-draft-model-path {d} --speculative-num-steps 3 --speculative-eagle-topk 1 "
        f"--speculative-num-draft-tokens 4"
    )
    rep = preflight.preflight(d, "org/target", sglang_cmd=cmd, target_config=TARGET)
    assert not rep.ok and "acceptance ~1.0" in failed(rep)["sglang --speculative-algorithm"]
    rep = preflight.preflight(
        d,
        "org/target",
        vllm_spec={"method": "eagle", "model": str(d), "num_speculative_tokens": 3},
        target_config=TARGET,
    )
    assert "vllm method" in failed(rep)


def test_sglang_pointed_at_speculators_export_fails(exports):
    d = exports["speculators"]
    cmd = f"python -m sglang.launch_server --speculative-algorithm EAGLE3 --speculative-draft-model-path {d}"
    assert "sglang format" in failed(preflight.preflight(d, "t", sglang_cmd=cmd, target_config=TARGET))


def test_one_layer_wide_fc_fails(exports):
    d = exports["sglang"]
    edit_tensor(d, "fc.weight", lambda w: w[:, :64].contiguous())
    msg = failed(preflight.preflight(d, "t", target_config=TARGET))["fc input = 3 x target hidden"]
    assert "one layer wide" in msg


def test_wrong_target_fails(exports):
    other = dict(TARGET, hidden_size=128, vocab_size=V * 2)
    bad = failed(preflight.preflight(exports["speculators"], "t", target_config=other))
    assert {"target_hidden_size", "vocab_size", "fc input = 3 x target hidden"} <= set(bad)


def test_d2t_out_of_range_and_unsorted_fail(exports):
    d = exports["sglang"]
    edit_tensor(d, "d2t", lambda x: x + V)
    bad = failed(preflight.preflight(d, "t", target_config=TARGET))
    assert "d2t range" in bad and "t2d agrees with d2t" in bad
    edit_tensor(d, "d2t", lambda x: (x - V).flip(0))
    assert "d2t increasing" in failed(preflight.preflight(d, "t", target_config=TARGET))


def test_aux_layers_beyond_target_fail(exports):
    d = exports["sglang"]
    edit_config(
        d,
        eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 4, 12], "use_aux_hidden_state": True},
        eagle_aux_hidden_state_layer_ids=[2, 5, 13],
    )
    assert "aux layers" in failed(preflight.preflight(d, "t", target_config=TARGET))


def test_sglang_ids_without_vllm_ids_warn(exports):
    d = exports["sglang"]
    edit_config(d, eagle_aux_hidden_state_layer_ids=None)
    rep = preflight.preflight(d, "t", target_config=TARGET)
    warn = [c for c in rep.checks if c.name == "aux layers (vLLM)"]
    assert rep.ok and warn and not warn[0].ok and "one layer earlier" in warn[0].message


def test_aux_ids_not_the_trained_layers_fail(exports):
    """vLLM ids written without the +1 make vLLM read other layers than the drafter was trained on."""
    d = exports["speculators"]
    rep = preflight.preflight(d, "t", target_config=TARGET, trained_aux=[1, 4, 6])
    assert rep.ok
    edit_config(d, eagle_aux_hidden_state_layer_ids=[1, 4, 6])
    rep = preflight.preflight(d, "t", target_config=TARGET, trained_aux=[1, 4, 6])
    assert "trained on [1, 4, 6]" in failed(rep)["aux layers = trained"]


def test_missing_or_set_norm_flag_fails(exports):
    d = exports["speculators"]
    edit_config(d, norm_before_residual=None)
    assert (
        "assumes norm_before_residual=True"
        in failed(preflight.preflight(d, "t", target_config=TARGET))["norm flags"]
    )
    edit_config(d, norm_before_residual=False, norm_output=True)
    assert "['norm_output'] set" in failed(preflight.preflight(d, "t", target_config=TARGET))["norm flags"]


def test_vocab_map_reference():
    """check_vocab_map against direct construction: a valid map passes, a duplicate id fails."""
    ids = torch.tensor([0, 3, 4, 9])
    t2d = torch.zeros(12, dtype=torch.bool)
    t2d[ids] = True
    assert all(c.ok for c in preflight.check_vocab_map(ids - torch.arange(4), t2d, 4, 12))
    dup = torch.tensor([0, 3, 3, 9])
    bad = {c.name for c in preflight.check_vocab_map(dup - torch.arange(4), t2d, 4, 12) if not c.ok}
    assert bad == {"d2t increasing", "t2d agrees with d2t"}


def test_cli_exit_codes(exports, tmp_path, capsys):
    cfg = tmp_path / "target.json"
    cfg.write_text(json.dumps(TARGET))
    assert preflight.main([str(exports["sglang"]), "--target", str(cfg)]) == 0
    assert "sglang launch" in capsys.readouterr().out
    assert (
        preflight.main(
            [str(exports["sglang"]), "--target", str(cfg), "--sglang-cmd", "x --speculative-algorithm EAGLE"]
        )
        == 1
    )


def test_diagnose_collapse_lists_causes():
    d = preflight.diagnose(2.1, 1.02)
    assert d["verdict"] == "collapsed" and any("EAGLE3" in c for c in d["causes"])
    assert preflight.diagnose(2.1, 2.05, 0.2)["verdict"] == "agree"
    assert preflight.diagnose(2.1, 1.6, 0.2)["verdict"] == "lower"
    assert preflight.diagnose(None, 1.0)["verdict"] == "collapsed"
