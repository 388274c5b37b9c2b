"""Preflight: a good export passes; each known serving mistake fails with a message naming it."""

import json
import shlex
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle_lib.drafter import export
from eagle_lib.serving import commands, live, preflight, verdict
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


def test_commands_for_keyed_multimodal_mla_servers_run_in_a_shell(exports):
    """Kimi's servers demand --api-key, vLLM serves the K2.5 wrapper language-model-only, the hub commit is
    pinned; on CPU an MLA target needs VLLM_MLA_DISABLE=1, native rope and the vLLM venv's module. A real shell
    expands the key from the variable (the key never appears in the command)."""
    import subprocess

    cmds = commands.launch_commands("/t", "/d", "sglang", api_key_env="EAGLE_TEST_KEY", multimodal=True,
                                     cpu=True, mla=True, revision="abc123")  # fmt: skip
    env = {"EAGLE_TEST_KEY": "s3cret", "PATH": "/usr/bin:/bin"}
    for name, cmd in cmds.items():
        assert "s3cret" not in cmd
        out = subprocess.run(["bash", "-c", f"printf '%s\\n' {cmd.split(' .venv-vllm')[-1]}"],
                             env=env, capture_output=True, text=True, check=True).stdout.splitlines()  # fmt: skip
        assert out[out.index("--api-key") + 1] == "s3cret" and out[out.index("--revision") + 1] == "abc123", (
            name
        )
    vllm = shlex.split(cmds["vllm"])
    assert vllm[0] == "VLLM_MLA_DISABLE=1" and vllm[1].startswith("PYTHONPATH=eagle_lib/engines/")
    assert vllm[2:5] == [".venv-vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert vllm[vllm.index("--dtype") + 1] == "float32"
    assert "--language-model-only" in vllm and "--trust-remote-code" not in vllm
    assert json.loads(vllm[vllm.index("--compilation-config") + 1])["custom_ops"] == [
        "all",
        "-rotary_embedding",
    ]
    gpu = shlex.split(commands.launch_commands("/t", "/d", "speculators", multimodal=True)["vllm"])
    assert gpu[:3] == ["vllm", "serve", "/t"] and "--compilation-config" not in gpu and "--api-key" not in gpu


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


def test_last_layer_fails_for_sglang_only(exports):
    """SGLang's llama.py captures the input of layer id + 1 inside its layer loop: id L-1 is never captured,
    while vLLM captures after every layer (the speculators export serves it)."""
    last = TARGET["num_hidden_layers"] - 1
    edit_config(
        exports["sglang"],
        eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 4, last], "use_aux_hidden_state": True},
        eagle_aux_hidden_state_layer_ids=[2, 5, last + 1],
    )
    edit_config(exports["speculators"], eagle_aux_hidden_state_layer_ids=[2, 5, last + 1])
    bad = {
        fmt: failed(preflight.preflight(exports[fmt], "t", target_config=TARGET, trained_aux=[1, 4, last]))
        for fmt in ("sglang", "speculators")
    }
    assert list(bad["sglang"]) == ["aux layers (SGLang)"], bad["sglang"]
    assert f"the last decoder layer ({last})" in bad["sglang"]["aux layers (SGLang)"]
    assert bad["speculators"] == {}


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
    # a flag with no weight of its own (norm_output) against the trained drafter's flags: all off here
    trained = dict.fromkeys(export.NORM_FLAGS, False)
    edit_config(d, norm_before_residual=False, norm_output=True)
    rep = preflight.preflight(d, "t", target_config=TARGET, trained_norms=trained)
    assert "norm_output True (trained False)" in failed(rep)["norm flags = trained"]
    assert preflight.preflight(
        d, "t", target_config=TARGET, trained_norms={**trained, "norm_output": True}
    ).ok
    # a flag whose weights are missing: the engine would run the norm at its initial ones
    edit_config(d, norm_output=False, fc_norm=True)
    rep = preflight.preflight(d, "t", target_config=TARGET, trained_norms={**trained, "fc_norm": True})
    assert "fc_norm.0.weight" in failed(rep)["norm weights = norm flags"]


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
    d = verdict.diagnose(2.1, 1.02)
    assert d["verdict"] == "collapsed" and any("EAGLE3" in c for c in d["causes"])
    assert verdict.diagnose(2.1, 2.05, 0.2)["verdict"] == "agree"
    assert verdict.diagnose(2.1, 1.6, 0.2)["verdict"] == "lower"
    assert verdict.diagnose(None, 1.0)["verdict"] == "collapsed"


# --- live preflight: the running server's own account (local stand-ins in the engines' documented shapes) -----
class LiveStandIn(BaseHTTPRequestHandler):
    """SGLang /server_info (server args + internal_states, its documented shape; /get_server_info on old
    versions) and vLLM /server_info?config_format=json (dev mode), /v1/models, /v1/completions, /metrics."""

    info: dict = {}
    paths: set = set()
    counters = {"drafts": 0.0, "accepted": 0.0, "generated": 0.0}
    per_step = 3

    def log_message(self, *a):
        pass

    def _send(self, body, status=200, ctype="application/json"):
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        path = self.path.split("?")[0]
        c = LiveStandIn.counters
        if path == "/metrics":
            text = (
                f'vllm:spec_decode_num_drafts_total{{engine="0"}} {c["drafts"]}\n'
                f'vllm:spec_decode_num_draft_tokens_total{{engine="0"}} {c["drafts"] * LiveStandIn.per_step}\n'
                f'vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {c["accepted"]}\n'
                f'vllm:generation_tokens_total{{engine="0"}} {c["generated"]}\n'
            )
            return self._send(text, ctype="text/plain")
        if path == "/v1/models":
            return self._send({"data": [{"id": "m"}]})
        if path in LiveStandIn.paths:
            return self._send(LiveStandIn.info)
        self._send({"detail": "Not Found"}, 404)

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        LiveStandIn.counters["drafts"] += 4
        LiveStandIn.counters["accepted"] += LiveStandIn.accept_per_request
        LiveStandIn.counters["generated"] += 1
        self._send({"choices": [{"text": "x", "token_ids": [1]}], "usage": {"completion_tokens": 1}})


@pytest.fixture
def standin():
    LiveStandIn.counters = {"drafts": 0.0, "accepted": 0.0, "generated": 0.0}
    LiveStandIn.accept_per_request, LiveStandIn.per_step = 6.0, 3
    srv = ThreadingHTTPServer(("127.0.0.1", 0), LiveStandIn)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def sglang_info(algo="EAGLE3", path="/d", steps=3, topk=1, tokens=4, accept=2.4):
    return {"model_path": "/t", "speculative_algorithm": algo, "speculative_draft_model_path": path,
            "speculative_num_steps": steps, "speculative_eagle_topk": topk, "speculative_num_draft_tokens": tokens,
            "internal_states": [{"avg_spec_accept_length": accept, "last_gen_throughput": 10.0}], "version": "0.5"}  # fmt: skip


def live_failed(checks):
    return {c.name: c.message for c in checks if not c.ok}


@pytest.mark.parametrize("endpoint", ["/server_info", "/get_server_info"])
def test_live_sglang_good_and_eagle_instead_of_eagle3(standin, endpoint):
    LiveStandIn.paths, LiveStandIn.info = {endpoint}, sglang_info()
    assert not live_failed(live.check_server("sglang", standin, "/d", 3))
    LiveStandIn.info = sglang_info(algo="EAGLE", path="/other", accept=1.01)
    bad = live_failed(live.check_server("sglang", standin, "/d", 3))
    assert "acceptance ~1.0" in bad["sglang speculative_algorithm (live)"]
    assert "/other" in bad["sglang speculative_draft_model_path (live)"] and "~ 1.0" in bad["live tau"]


def test_live_vllm_reads_spec_config_and_probes_metrics(standin):
    spec = {"method": "eagle", "model": "/other", "num_speculative_tokens": 3}
    LiveStandIn.paths, LiveStandIn.info = {"/server_info"}, {"vllm_config": {"speculative_config": spec}}
    LiveStandIn.accept_per_request = 0.0  # the probes accept nothing: tau 1.0
    bad = live_failed(live.check_server("vllm", standin, "/d", 3))
    assert "EAGLE-1" in bad["vllm method (live)"] and "/other" in bad["vllm draft model (live)"]
    assert "tau 1.00 ~ 1.0 (3 probe requests)" in bad["live tau"]
    LiveStandIn.paths, LiveStandIn.accept_per_request = set(), 6.0  # /server_info not served (no dev mode)
    checks = live.check_server("vllm", standin, "/d", 3)
    warn = {c.name: c for c in checks}["vllm /server_info"]
    assert warn.severity == "warning" and "VLLM_SERVER_DEV_MODE=1" in warn.message
    assert {c.name: c for c in checks}["live tau"].message == "tau 2.50 (3 probe requests)"


def test_client_errors_name_the_url(standin):
    from eagle_lib.engines import client

    with pytest.raises(client.ServerError, match=r"GET http://127.0.0.1:\d+/nope: HTTP 404") as e:
        client.get_json(standin + "/nope")
    assert e.value.status == 404
    with pytest.raises(client.ServerError, match=r"/metrics: the answer is not JSON"):
        client.get_json(standin + "/metrics")
    with pytest.raises(client.ServerError, match=r"POST http://127.0.0.1:1/x: cannot connect"):
        client.post_json("http://127.0.0.1:1/x", {"a": 1}, timeout=5)
    assert client.get_json(standin + "/v1/models")["data"][0]["id"] == "m"
