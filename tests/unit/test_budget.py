"""The run budget (`eagle_lib.drafter.budget`) against hand-computed values: the drafter's parameter count from
the EAGLE-3 layer's shapes written out, bytes from their dtypes, hours from rates chosen to give round numbers,
and `pipeline validate` printing it (or saying why it cannot)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import DeepseekV3Config

from eagle_lib import params, pipeline, store
from eagle_lib.drafter import budget

# Kimi-K2.5's text shapes: hidden 7168, 61 layers, vocab 163840 (shared reference); 64 heads and a dense
# intermediate of 18432 as in Kimi-K2's published config
KIMI = DeepseekV3Config(hidden_size=7168, num_hidden_layers=61, vocab_size=163840, num_attention_heads=64,
                        num_key_value_heads=64, intermediate_size=18432, kv_lora_rank=512, q_lora_rank=1536,
                        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, torch_dtype="bfloat16")  # fmt: skip


@pytest.fixture(scope="module")
def kimi_run():
    return params.load_params("params/kimi_k25.yaml")


def test_kimi_drafter_size_and_bytes_per_rank_by_hand(kimi_run):
    p05 = kimi_run.stage("05_train_eagle3")
    h, i, vd, v = 7168, 18432, 32000, 163840
    # fc 3H->H; q, k, v from 2H (embedding + hidden) to 64 heads x 112; o back to H; MLP 3 x H x I; 4 norms; lm_head
    trainable = 3 * h * h + 3 * (2 * h * 64 * 112) + 64 * 112 * h + 3 * h * i + 4 * h + vd * h
    assert trainable == 1_139_568_640  # "~1.1B trainable" (the Kimi params' comment)
    mem, counts = budget.memory_per_rank(KIMI, p05)
    assert counts == {"trainable": trainable, "frozen": v * h}
    assert mem["trainable (fp32 master + grads + AdamW)"] == trainable * 16 // 8  # FSDP over 8 ranks
    assert mem["frozen embedding (bf16 under bf16 precision, else fp32)"] == v * h * 2 // 8  # bf16, sharded
    assert mem["target final norm + lm_head (checkpoint dtype, whole)"] == (v * h + h) * 2  # bf16, as stored
    # one 32K row, k = 7, chunked attention, loss_chunk 4096, checkpoint_steps (fp32 bytes, by hand):
    t, k, c, heads = 32768, 7, 4096, 64
    layers = k * t * 4 * h + t * (
        12 * h + 3 * i
    )  # input/output/keys/values kept a step + one step recomputed
    target = t * h + c * (v + vd)  # the last hidden, one chunk's logits and draft-vocab log-probs
    head = k * t * h + c * 3 * vd  # the checkpointed head's input rows a step, one chunk's logits/grad
    attn = k * t * (h + heads) + 4 * heads * 256 * 256  # output + log-sum-exp a step, block transients
    assert mem["activations, one micro-batch (formula)"] == 4 * (layers + target + head + attn)
    assert mem["total"] < 141e9 * 0.9  # an H200 (141 GB) per rank, with a tenth to spare


def test_a_frozen_draft_lm_head_leaves_the_optimizer_and_keeps_its_fp32_weights(kimi_run):
    p05 = kimi_run.stage("05_train_eagle3").model_copy(update={"freeze_lm_head": True})
    h, vd, v = 7168, 32000, 163840
    base, base_counts = budget.memory_per_rank(KIMI, kimi_run.stage("05_train_eagle3"))
    mem, counts = budget.memory_per_rank(KIMI, p05)
    assert counts == {"trainable": base_counts["trainable"] - vd * h, "frozen": v * h + vd * h}
    assert mem["frozen draft lm_head (fp32 weights only)"] == vd * h * 4 // 8  # fp32, sharded over 8 ranks
    assert mem["frozen embedding (bf16 under bf16 precision, else fp32)"] == v * h * 2 // 8
    # fp32 master + grads + 2 AdamW states = 16 bytes a weight leave; 4 stay
    assert base["total"] - mem["total"] == vd * h * (16 - 4) // 8


def test_kimi_hidden_bytes_and_the_buffer_split_across_ranks(kimi_run):
    hb = budget.hidden_bytes(KIMI, kimi_run.stage("05_train_eagle3"), 228_000_000)
    assert hb["bytes_per_token"] == 4 * 7168 * 2 == 57_344  # ids 2, 30, 58, 61 in bf16: "~57 KB/token"
    assert hb["buffer_per_rank"] == 200 * 2**30 / 8  # max_buffer_gb is the run's: 25 GiB a rank
    assert hb["dump_bytes"] == 228_000_000 * 57_344  # ~11.9 TiB never written


def test_hours_from_rates_that_give_round_numbers(kimi_run):
    """The Kimi params' own counts: 69,000 first-turn prompts (max_prompts), the 14,000 each_turn conversations
    at 2 turns, 2,500 A records at 2 turns (turns: each), 250 + 2,350 tokens a sequence."""
    rates = {"decode_per_server": 2_350.0, "prefill_per_producer": 10_000.0, "train_per_rank": 1_250.0}
    b = budget.estimate(kimi_run, KIMI, rates)
    answers = (14_000 + 10_000 + 14_000 + 3_000 + 14_000) + 2 * (5_000 + 4_500 + 4_500)  # = 83,000
    assert b.tokens["generated"] == answers * 2_350
    assert b.tokens["trained"] == (answers + 2 * 2_500) * 2_600  # 88,000 sequences: 228.8M tokens
    assert b.time["03"]["hours"] == pytest.approx(answers * 2_350 / (2_350 * 4) / 3600)  # 4 servers
    assert b.time["03"]["gpus"] == 32  # 4 serving nodes x 8
    # 05: 2 epochs over 95% (held-out 5%); 8 ranks at 1,250; 3 producers (one a group of 3 ranks) at 10,000
    passes = 2 * 88_000 * 2_600 * 0.95
    assert b.time["05"]["hours"] == pytest.approx(passes / (1_250 * 8) / 3600)
    assert b.time["05"]["gpus"] == 8 + 3 * 8 == 32
    slow = budget.estimate(kimi_run, KIMI, rates | {"prefill_per_producer": 1_000.0})
    assert slow.time["05"]["hours"] == pytest.approx(passes / (1_000 * 3) / 3600)
    assert "producers set the pace" in slow.time["05"]["how"]
    # 07: one trainer process (not 05's GPUs) beside one TP-8 producer, its arms' share of 05's passes
    share = budget.arms_share(kimi_run.stage("07_data_value"), 11)
    assert b.time["07"]["gpus"] == 1 + 8
    assert b.time["07"]["hours"] == pytest.approx(share * passes / 1_250 / 3600)
    assert budget.measured_rates(
        {"hidden": {"trainer_tokens_per_s": 7.0, "producer_tokens_per_s": None}}
    ) == {"train_per_rank": 7.0}


def test_counts_follow_max_prompts_turns_and_max_new_tokens(tmp_path):
    """The old budget always took the seeds' 228M tokens: here the counts move with the params' caps."""
    text = Path("params/kimi_k25.yaml").read_text()
    base = budget.counts(params.load_params("params/kimi_k25.yaml"))
    f = tmp_path / "k.yaml"
    f.write_text(
        text.replace("max_prompts: 14000}", "max_prompts: 28000}", 1).replace("turns: 2.0", "turns: 3.0")
    )
    more = {c["name"]: c for c in budget.counts(params.load_params(f))}
    base = {c["name"]: c for c in base}
    assert more["mot"]["sequences"] == 2 * base["mot"]["sequences"] == 28_000
    assert more["glaive"]["sequences"] == 3 * 5_000 and more["kimi_native_chat"]["sequences"] == 3 * 1_200
    assert more["swe_agent"] == base["swe_agent"]
    short = text.replace("max_new_tokens: 16384", "max_new_tokens: 1000")  # the cap bounds the mean answer
    f.write_text(short)
    (c,) = [c for c in budget.counts(params.load_params(f)) if c["name"] == "mot"]
    assert c["generated"] == 14_000 * 1_000 and c["trained"] == 14_000 * (250 + 1_000)


def test_measured_counts_and_rates_from_a_run_dir(kimi_run, tmp_path):
    """A run's 02 meta (kept prompts), 03 meta (answers, mean answer; decode rate) and 05 summary replace the
    assumptions, and say so."""
    store.write_json(tmp_path / "data/B/mot/meta.json", {"kept": 900})
    store.write_json(
        tmp_path / "infer/mot/meta.json", {"kept": 900, "generated": 900, "mean_output_tokens": 4_000}
    )
    store.write_json(
        tmp_path / "infer/meta.json", {"generated_tokens": 7_200_000, "generate_seconds": 3_600.0}
    )
    store.write_json(tmp_path / "drafter/summary.json", {"hidden": {"trainer_tokens_per_s": 9_000.0,
                                                                    "producer_tokens_per_s": 30_000.0}})  # fmt: skip
    b = budget.estimate(kimi_run, KIMI, run_dir=tmp_path)
    (mot,) = [c for c in b.counts if c["name"] == "mot"]
    assert mot["sequences"] == 900 and mot["generated"] == 900 * 4_000 and "measured" in mot["how"]
    assert b.rates == {"decode_per_server": 7_200_000 / 3_600 / 4, "prefill_per_producer": 30_000.0,
                       "train_per_rank": 9_000.0}  # fmt: skip
    assert all(v.startswith("measured") for v in b.rate_sources.values())
    assert budget.estimate(kimi_run, KIMI).rate_sources["decode_per_server"] == "params: budget section"


def test_a_layout_that_does_not_fit_the_cluster_is_refused(tmp_path, capsys):
    """05 with one TP-8 producer per rank (8 ranks) needs 72 GPUs: refused on 4 x 8, as 16 ranks on an 8-GPU
    node; the Kimi params' layout (3 ranks a producer) fits."""
    text = Path("params/kimi_k25.yaml").read_text()
    f = tmp_path / "k.yaml"
    for edit, why in [
        (("ranks_per_producer: 3", "ranks_per_producer: 1"), "05 needs 9 nodes (72 GPUs"),
        (("nproc_per_node: 8  #", "nproc_per_node: 16  #"), "nproc_per_node 16 > 8 GPUs a node"),
    ]:
        f.write_text(text.replace(*edit))
        assert pipeline.main(["validate", str(f), "--budget"]) == 2
        err = capsys.readouterr().err
        assert "does not fit cluster 4 nodes x 8 GPUs" in err and why in err, err
    layout, bad = budget.layout(params.load_params("params/kimi_k25.yaml"))
    assert bad == [] and layout["05"]["gpus"] == 32 and layout["05"]["nodes"] == 4


def test_07_work_share_counts_every_arm():
    from eagle_lib import value

    p = value.Params(fractions=[0.25, 0.5, 1.0], lodo_fraction=0.5, lodo_units={"a": ["x"], "b": ["y"]},
                     regen_fraction=0.5, multiturn=False)  # fmt: skip
    # curve 0.25 + 0.5 (1.0 reuses 05's drafter) + a second seed at the two smallest (0.25 + 0.5);
    # lodo (2 units + all) x 0.5; regen 2 arms x 0.5
    assert budget.arms_share(p, 11) == pytest.approx(0.75 + 0.75 + 1.5 + 1.0)
    p = p.model_copy(update={"noise_seeds": 2, "noise_fractions": [0.25]})
    assert budget.arms_share(p, 11) == pytest.approx(0.75 + 2 * 0.25 + 1.5 + 1.0)


def test_validate_prints_the_budget_or_why_not(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as here: the hub is out of reach
    cfg = tmp_path / "config.json"
    KIMI.to_json_file(cfg)
    assert pipeline.main(["validate", "params/kimi_k25.yaml", "--budget", "--target-config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "1,139,568,640 trainable" in out and "57,344 B" in out and "GPU-hours" in out
    assert "params: budget section" in out  # the rates are labelled by their source
    for stage in ("03", "05", "06", "07"):
        assert f"{stage} wall time" in out
    assert "83,000" not in out and "88,000 sequences" in out and "cluster                " in out
    assert (
        pipeline.main(["validate", "params/kimi_k25.yaml", "--budget"]) == 0
    )  # no hub here: it says why, and passes
    assert "budget: the target's config is not readable here" in capsys.readouterr().out
