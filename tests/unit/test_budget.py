"""The run budget (`eagle_lib.drafter.budget`) against hand-computed values: the drafter's parameter count from
the EAGLE-3 layer's shapes written out, bytes from their dtypes, hours from rates chosen to give round numbers,
and `pipeline validate` printing it (or saying why it cannot)."""

from __future__ import annotations

import pytest
from transformers import DeepseekV3Config

from eagle_lib import params, pipeline
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


def test_kimi_hidden_bytes_and_the_buffer_split_across_ranks(kimi_run):
    hb = budget.hidden_bytes(KIMI, kimi_run.stage("05_train_eagle3"), 228_000_000)
    assert hb["bytes_per_token"] == 4 * 7168 * 2 == 57_344  # ids 2, 30, 58, 61 in bf16: "~57 KB/token"
    assert hb["buffer_per_rank"] == 200 * 2**30 / 8  # max_buffer_gb is the run's: 25 GiB a rank
    assert hb["dump_bytes"] == 228_000_000 * 57_344  # ~11.9 TiB never written


def test_hours_from_rates_that_give_round_numbers(kimi_run):
    scale = {"samples": 1, "tokens": 36_000_000}
    rates = {"decode_per_server": 2_500.0, "prefill_per_producer": 10_000.0, "train_per_rank": 1_250.0}
    b = budget.estimate(kimi_run, KIMI, scale, rates)
    assert b.time["03"]["hours"] == pytest.approx(1.0)  # 36M / (2,500 x 4 servers) = 3,600 s
    assert b.time["03"]["gpu_hours"] == pytest.approx(32.0)  # 4 nodes x TP 8
    # 05: 2 epochs = 72M passes; trainers 72M / (1,250 x 8) = 2 h; producers 72M / (10,000 x 8) = 0.25 h
    assert b.time["05"]["hours"] == pytest.approx(2.0) and b.time["05"]["gpus"] == 8 + 8 * 8
    slow = budget.estimate(kimi_run, KIMI, scale, rates | {"prefill_per_producer": 1_000.0})
    assert (
        slow.time["05"]["hours"] == pytest.approx(2.5) and "producers set the pace" in slow.time["05"]["how"]
    )
    assert budget.measured_rates(
        {"hidden": {"trainer_tokens_per_s": 7.0, "producer_tokens_per_s": None}}
    ) == {"train_per_rank": 7.0}


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
    assert "assumed" in out  # the rates are labelled as such
    assert (
        pipeline.main(["validate", "params/kimi_k25.yaml", "--budget"]) == 0
    )  # no hub here: it says why, and passes
    assert "budget: the target's config is not readable here" in capsys.readouterr().out
