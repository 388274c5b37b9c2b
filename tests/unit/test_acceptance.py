"""Stage 06: metrics against independent formulas, held-out prompt selection, online clients against local
HTTP stand-ins, and the whole stage on a tiny run directory."""

import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle_lib import acceptance, params, specdec, store

torch.set_num_threads(1)


# --- metrics --------------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60))
def test_stats_against_numpy_and_peer_formula(accepted):
    k = 4
    s = acceptance.acceptance_stats(accepted, k)
    a = np.array(accepted)
    assert s["tau"] == pytest.approx(np.mean(a + 1))
    for i in range(1, k + 1):
        assert s[f"acc_{i}"] == pytest.approx(np.mean(a >= i))
        if (a >= i - 1).any():
            assert s[f"cond_acc_{i}"] == pytest.approx((a >= i).sum() / (a >= i - 1).sum())
    # the peers' simulated acceptance: 1 + sum_k prod_{j<=k} cond_acc_j
    prod, sim = 1.0, 1.0
    for i in range(1, k + 1):
        c = s[f"cond_acc_{i}"]
        prod *= 0.0 if c != c else c
        sim += prod
    assert sim == pytest.approx(s["tau"])
    assert [s[f"a={j}"] for j in range(k + 1)] == np.bincount(a, minlength=k + 1).tolist()


def test_tables_pool_steps_and_speedups():
    gens = []
    for m, acc, secs in [("none", [0, 0, 0, 0], 4.0), ("eagle3", [3, 1], 2.0)]:
        for ds in ["x", "y"]:
            gens.append(
                {
                    "method": m,
                    "dataset": ds,
                    "id": ds,
                    "accepted": acc,
                    "output_ids": [1] * 5,
                    "total_s": secs,
                    "lossless": True,
                }
            )
    tau, pos, hist = acceptance.tables(gens, 3, cost_ratio=0.1)
    e = tau[(tau.method == "eagle3") & (tau.dataset == "all")].iloc[0]
    assert e.tau == pytest.approx(3.0) and e.steps == 4 and e.prompts == 2
    assert e.measured_speedup == pytest.approx(2.0)  # 4 s vs 2 s for the same 5 tokens
    assert e.est_speedup == pytest.approx(3.0 / 1.3)  # tau / (1 + ratio * k)
    assert tau[tau.method == "none"].tau.eq(1.0).all()
    assert len(pos) == 3 * len(tau) and list(hist.columns[-4:]) == ["a=0", "a=1", "a=2", "a=3"]


# --- held-out prompts -------------------------------------------------------------------------------------
def test_a_prompt_ids():
    rec = {"input_ids": list(range(10)), "loss_mask": [0, 0, 1, 1, 0, 0, 0, 1, 1, 0]}
    assert acceptance.a_prompt_ids(rec, "first_turn") == [0, 1]
    assert acceptance.a_prompt_ids(rec, "last_turn") == [0, 1, 2, 3, 4, 5, 6]
    assert acceptance.a_prompt_ids({"input_ids": [1, 2], "loss_mask": [0, 0]}, "last_turn") is None


def write_run(run_dir, n=400, vocab=200, seed=0):
    rng = random.Random(seed)
    a, b = [], []
    for i in range(n):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(4, 40))]
        mask = [0] * (len(ids) // 2) + [1] * (len(ids) - len(ids) // 2)
        a.append({"id": f"a{i}", "source": "s", "input_ids": ids, "loss_mask": mask})
        b.append({"id": f"b{i}", "source": "s", "messages": [], "prompt_ids": ids[: rng.randrange(2, 30)]})
    store.append_jsonl(run_dir / "data" / "A" / "chat" / "records.jsonl", a)
    store.append_jsonl(run_dir / "data" / "B" / "tools" / "prompts.jsonl", b)
    return a, b


def test_heldout_prompts_select_only_heldout(tmp_path):
    a, b = write_run(tmp_path)
    p = acceptance.Params(max_prompts_per_dataset=5, max_prompt_tokens=20)
    got, tally = acceptance.heldout_prompts(tmp_path, 10.0, p)
    exp_b = [r for r in b if store.is_heldout(r["id"], 10.0) and len(r["prompt_ids"]) <= 20][:5]
    assert [x.id for x in got["tools"]] == [r["id"] for r in exp_b]
    assert [x.prompt_ids for x in got["tools"]] == [r["prompt_ids"] for r in exp_b]
    for x in got["chat"]:
        rec = next(r for r in a if r["id"] == x.id)
        assert store.is_heldout(x.id, 10.0) and x.prompt_ids == rec["input_ids"][: rec["loss_mask"].index(1)]
    assert tally["read"] == 800 and tally["kept"] == 10
    store.check_tally(tally)


# --- online clients ---------------------------------------------------------------------------------------
class StandIn(BaseHTTPRequestHandler):
    """SGLang /generate (meta_info with completion_tokens, spec_verify_ct) and vLLM /v1/completions + /metrics."""

    counters = {"drafts": 0, "accepted": 0}
    sglang_meta = True

    def log_message(self, *a):
        pass

    def _send(self, body, ctype="application/json"):
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        c = self.counters
        if self.path == "/metrics":
            self._send(
                "# HELP x\n"
                f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {c["drafts"]}.0\n'
                f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {3 * c["drafts"]}.0\n'
                f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {c["accepted"]}.0\n'
                f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="0"}} {c["accepted"]}.0\n',
                "text/plain",
            )
        else:
            self._send({"data": [{"id": "served"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ids = body.get("prompt") or body.get("input_ids")
        out = [(t + 1) % 50 for t in ids[-4:]]  # deterministic "greedy" output
        if self.path == "/v1/completions":
            assert body["temperature"] == 0.0 and body["model"] == "served"
            StandIn.counters["drafts"] += 2
            StandIn.counters["accepted"] += 3
            self._send({"choices": [{"token_ids": out, "text": ""}]})
        else:
            meta = {"completion_tokens": 8, "prompt_tokens": len(ids)}
            if self.sglang_meta:
                meta["spec_verify_ct"] = 3
            self._send({"text": "", "output_ids": out, "meta_info": meta})


@pytest.fixture
def server():
    StandIn.counters = {"drafts": 0, "accepted": 0}
    StandIn.sglang_meta = True
    srv = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


PROMPTS = {
    "x": [specdec.Prompt(f"x{i}", "x", [i, i + 1, i + 2]) for i in range(3)],
    "y": [specdec.Prompt("y0", "y", [7, 8])],
}


def test_vllm_client_tau_from_counter_deltas(server):
    StandIn.counters = {"drafts": 100, "accepted": 40}  # earlier traffic must not count
    res = specdec.online_vllm(server, "", PROMPTS, max_new_tokens=8, num_steps=3, concurrency=2)
    assert res["x"]["drafts"] == 6 and res["x"]["tau"] == pytest.approx(1 + 9 / 6)
    assert res["y"]["tau"] == pytest.approx(2.5) and res["y"]["acc"][0] == pytest.approx(1.5)
    assert res["x"]["outputs"]["x1"] == [2, 3, 4]


def test_sglang_client_tau_and_missing_meta(server):
    res = specdec.online_sglang(server, PROMPTS, max_new_tokens=8)
    assert res["x"]["tau"] == pytest.approx(24 / 9) and res["x"]["spec_verify_ct"] == 9
    StandIn.sglang_meta = False
    with pytest.raises(ValueError, match="spec_verify_ct"):
        specdec.online_sglang(server, PROMPTS, max_new_tokens=8)


def test_parse_real_vllm_metrics_lines():
    text = (
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="/t"} 15.0\n'
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="/t"} 1.79e+09\n'
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="/t"} 7.0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/t",position="2"} 1.0\n'
    )
    c = specdec.vllm_spec_counters(text)
    assert c["drafts"] == 15.0 and c["accepted"] == 7.0 and c["pos_2"] == 1.0


# --- the whole stage --------------------------------------------------------------------------------------
def test_run_on_tiny_run_dir(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from eagle_lib.drafter import Eagle3Config, Eagle3Drafter, init_from_target, save_drafter
    from tests.server.tiny import build_world

    world = build_world(tmp_path / "world", layers=8)
    target = AutoModelForCausalLM.from_pretrained(world)
    d = Eagle3Drafter(Eagle3Config.from_target_config(AutoConfig.from_pretrained(world), 64))
    init_from_target(d, target.get_input_embeddings().weight)
    d.set_vocab_map(
        torch.arange(64) * 3 - torch.arange(64),
        torch.isin(torch.arange(d.config.vocab_size), torch.arange(64) * 3),
    )
    run_dir = tmp_path / "run"
    save_drafter(d, run_dir / "drafter" / "final")
    rng = random.Random(0)  # byte-token prompts: the tiny target answers chat prompts with EOS at once
    recs = [
        {"id": f"p{i}", "prompt_ids": [rng.randrange(256) for _ in range(rng.randrange(5, 30))]}
        for i in range(300)
    ]
    recs = [r for r in recs if store.is_heldout(r["id"], 5.0)][:4]
    store.append_jsonl(run_dir / "data" / "B" / "tiny" / "prompts.jsonl", recs)
    shared = params.SharedParams(target=str(world), device="cpu")
    p = acceptance.Params(max_prompts_per_dataset=3, max_new_tokens=12, methods=["none", "ngram", "eagle3"])
    ev = acceptance.run(params.StageConfig("06_eval_acceptance", run_dir, shared, p))
    h = ev.headline
    assert h["lossless"] and h["tau_none"] == 1.0 and h["preflight_ok"] and h["prompts"] == 3
    assert set(ev.tau.method) == {"none", "ngram", "eagle3"} and "tiny" in set(ev.tau.dataset)
    for f in [
        "tau.csv",
        "positions.csv",
        "accepted_hist.csv",
        "preflight.json",
        "meta.json",
        "generations.jsonl",
    ]:
        assert (run_dir / "eval" / f).exists(), f
    meta = store.read_json(run_dir / "eval" / "meta.json")
    assert meta["kept"] == 3 and meta["dropped"] == {"over_cap": 1}
    assert (run_dir / "eval" / "export" / "speculators" / "config.json").exists()
    assert len(store.read_jsonl(run_dir / "eval" / "generations.jsonl")) == 9
