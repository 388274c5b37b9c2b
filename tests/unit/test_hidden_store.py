"""Kept hidden states per sequence (`hidden_store`) and float8 storage, without vLLM.

Producers run in threads with an engine computing the hidden states by transformers
(`tests.support.hf_producer`); every served batch is compared with `hidden.OnlineHidden` on its own copy of
the target. tests/server/test_vllm_hidden.py runs the kept store with real vLLM.
"""

import json

import pytest
import torch
from safetensors.torch import save_file

from eagle_lib import params
from eagle_lib.data import batches
from eagle_lib.data.batches import PAD_TO, Sequence, make_batch, seq_key
from eagle_lib.hidden_states import engine_hidden, hidden, hidden_store, kept_source
from eagle_lib.hidden_states import hidden_buffer as hb
from eagle_lib.train import Params
from tests.support import eagle_tiny, hf_producer

torch.set_num_threads(1)
AUX = [1, 3, 4]  # the default aux layers of an 8-layer target
ACC_BOUND = 0.05


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path, model = eagle_tiny.load_target(tmp_path_factory.mktemp("tiny"))
    return path, model, AutoModelForCausalLM.from_pretrained(path).eval()  # the producers' own copy


def seqs(n, seed, prefix="s"):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 20, (n,), generator=g).tolist()
    return [Sequence(f"{prefix}{i}", torch.randint(0, eagle_tiny.VOCAB, (t,), generator=g).tolist(), [1] * t)
            for i, t in enumerate(lengths)]  # fmt: skip


def plan(ss, per_unit):
    batches = [make_batch(ss, [list(range(i, min(i + per_unit, len(ss))))], PAD_TO)
               for i in range(0, len(ss), per_unit)]  # fmt: skip
    units = [[k for row in b.segments for k, _, _ in row] for b in batches]
    return batches, units, {seq_key(s.input_ids): s.input_ids for s in ss}


def source(path, model, buf, units, tokens, kept, keep=True):
    ids = engine_hidden.layer_ids(AUX, eagle_tiny.LAYERS)
    pcfg = {"target": str(path), "layer_ids": ids, "num_layers": eagle_tiny.LAYERS, "hidden_size": 64,
            "model_dtype": "float32", "storage_dtype": "float32", "tensor_parallel_size": 1, "max_model_len": 64,
            "trust_remote_code": False, "connector": "cpu", "units_per_call": 4, "max_buffer_bytes": 10**8}  # fmt: skip
    head = hidden.load_target_head(str(path), model.config)
    return engine_hidden.VllmHidden(buf, units, tokens, 0, ids, AUX, head, 64, torch.device("cpu"),
                                    producer_cfg=pcfg, keep=keep, kept=kept)  # fmt: skip


def store_of(path, model, root):
    t = hidden.load_target_tensors(str(path), {"e": ["model.embed_tokens.weight"], "h": ["lm_head.weight"]})
    cfg = {"layer_ids": engine_hidden.layer_ids(AUX, 8), "model_dtype": "float32", "storage_dtype": "float32"}
    return hidden_store.HiddenStore(root, hidden_store.identity(str(path), model.config, t["e"], t["h"], cfg))


def check_online(src, model, batches):
    hf_producer.assert_matches_online(src, model, AUX, batches)


def test_kept_sequences_serve_another_plan_and_a_partly_kept_one_makes_only_the_missing(target, tmp_path,
                                                                                      monkeypatch):  # fmt: skip
    path, model, own = target
    started = hf_producer.patch(monkeypatch, own)
    first = seqs(8, 0)
    batches, units, tokens = plan(first, 2)
    src = source(path, model, tmp_path / "b1", units, tokens, store_of(path, model, tmp_path / "root"))
    check_online(src, model, batches)
    assert len(started) == 1 and not started[0].errors
    assert not list((tmp_path / "b1").glob("unit_*"))  # moved into the store
    kept = store_of(path, model, tmp_path / "root")  # a later run: the index read from disk
    assert len(kept) == len(first) and all(k in kept for k in tokens)

    # another plan over the same sequences (other grouping and order, as another seed or more steps give)
    batches, units, tokens = plan(first[::-1], 3)
    src = source(path, model, tmp_path / "b2", units, tokens, kept)
    assert src.procs == [] and all(m == [] for m in src.made)  # nothing to make: no producer starts
    check_online(src, model, batches)
    assert src.summary()["kept_tokens_read"] == sum(len(s.input_ids) for s in first)

    # a partly kept set: only the new sequences are planned for the producer, the rest read from the store
    extra = seqs(3, 1, "x")
    mixed = [first[0], extra[0], first[5], extra[1], extra[2], first[3]]
    batches, units, tokens = plan(mixed, 2)
    src = source(path, model, tmp_path / "b3", units, tokens, kept)
    assert [k for m in src.made for k in m] == [seq_key(s.input_ids) for s in extra]
    made = [json.loads(x) for x in (tmp_path / "b3" / "sequences.jsonl").read_text().splitlines()]
    assert made == [s.input_ids for s in extra]
    check_online(src, model, batches)
    assert len(started) == 2 and not started[1].errors
    s = src.summary()
    assert s["made_tokens_read"] == sum(len(x.input_ids) for x in extra)
    assert s["kept_tokens_read"] == sum(len(x.input_ids) for x in mixed) - s["made_tokens_read"]


def test_a_unit_repeating_sequences_of_an_earlier_unit_is_not_made_when_keeping(
    target, tmp_path, monkeypatch
):
    path, model, own = target
    hf_producer.patch(monkeypatch, own)
    ss = seqs(4, 2)
    b1, u1, tokens = plan(ss, 2)
    batches, units = b1 + b1[::-1], u1 + u1[::-1]  # a second epoch
    src = source(path, model, tmp_path / "b", units, tokens, store_of(path, model, tmp_path / "root"))
    assert [len(m) for m in src.made] == [2, 2, 0, 0]
    check_online(src, model, batches)
    streamed = source(
        path, model, tmp_path / "c", units, tokens, store_of(path, model, tmp_path / "r2"), False
    )
    assert [len(m) for m in streamed.made] == [2, 2, 2, 2]  # not keeping: every epoch is made again
    check_online(streamed, model, batches)


def test_07_kept_source_produces_only_what_is_not_kept(target, tmp_path, monkeypatch):
    path, model, own = target
    started = hf_producer.patch(monkeypatch, own)
    recipe = Params(
        hidden_source="vllm", hidden_dump_dir=str(tmp_path / "hs"), rows_per_batch=2, pack_len=64
    ).model_dump()
    src = kept_source.KeptSource(
        recipe, params.SharedParams(target=str(path)), model.config, torch.device("cpu")
    )
    with pytest.raises(RuntimeError, match="use_root"):
        src.prepare(seqs(2, 0))
    src.use_root(tmp_path / "run", prepare=False)
    a, b = seqs(6, 3), seqs(3, 4, "y")
    src.prepare(a)
    assert src.stats["producer_sessions"] == 1 and src.stats["produced_tokens"] == sum(
        len(s.input_ids) for s in a
    )
    src.prepare(a[:3])  # a nested subset: all kept
    assert src.stats["producer_sessions"] == 1
    src.prepare(a[2:] + b)  # partly kept: only b is made, by the producer started for a (it follows the plan)
    assert src.stats["producer_sessions"] == 1 and started[0].poll() is None
    assert src.stats["produced_tokens"] == sum(len(s.input_ids) for s in a + b)
    assert not any(x.errors for x in started)
    check_online(src, model, plan(a + b, 3)[0])
    src.close()
    assert started[0].poll() == 0 and not list(
        (tmp_path / "hs" / "kept").glob("*/produce/*")
    )  # the sessions' buffers are removed

    run = eagle_tiny.make_run(path.parent)  # a run of this target: 07 first makes every training sequence
    src = kept_source.KeptSource(
        recipe, params.SharedParams(target=str(path)), model.config, torch.device("cpu")
    )
    src.use_root(run)
    train = batches.load_sequences(run, params.SharedParams().heldout_percent, recipe["max_seq_len"])[0]
    assert src.stats["producer_sessions"] == 1 and all(seq_key(s.input_ids) in src.kept for s in train)
    assert src.stats["produced_tokens"] == sum(len(s.input_ids) for s in train)
    src.close()


def test_07_streams_within_the_bound_when_keeping_would_pass_it(target, tmp_path, monkeypatch):
    """Kimi's case at small scale: 07's training sequences take more than max_buffer_gb, so nothing is kept; each
    planned micro-batch is made, read once and deleted (the producer's own peak within the bound), a resumed arm
    skips what it does not ask for, an unplanned call is made on demand, and every call equals transformers'."""
    path, model, own = target
    started = hf_producer.patch(monkeypatch, own)
    run = eagle_tiny.make_run(path.parent)
    train = batches.load_sequences(run, params.SharedParams().heldout_percent, 512)[0]
    per_token = len(engine_hidden.layer_ids(AUX, eagle_tiny.LAYERS)) * 64 * 4  # float32 storage
    total = sum(len(s.input_ids) for s in train) * per_token
    bound_gb = total / 4 / 2**30  # a quarter of what keeping them would take
    recipe = Params(hidden_source="vllm", hidden_dump_dir=str(tmp_path / "hs"), rows_per_batch=1, pack_len=64,
                    max_buffer_gb=bound_gb, hidden_dtype="float32").model_dump()  # fmt: skip
    src = kept_source.KeptSource(
        recipe, params.SharedParams(target=str(path)), model.config, torch.device("cpu")
    )
    src.use_root(run)
    assert src.mode == "stream" and src.stats["produced_tokens"] == 0 and src.stats["producer_sessions"] == 0

    stream = batches.BatchStream(train[:12], 64, 1, 0)
    mbs = [stream.micro_batch(m) for s in range(3) for m in batches.micro_batches(s, 0, 1, 2)]
    src.expect(mbs)
    check_online(src, model, mbs[:2])
    check_online(src, model, mbs[4:])  # a resumed arm: units 2 and 3 are skipped, not waited for
    held = make_batch(train[20:], [[0, 1]], PAD_TO)  # nobody planned it (teacher-forced held-out tau)
    check_online(src, model, [held])
    stats = src.producer_stats()
    assert src.stats["producer_sessions"] == 1 and len(started) == 1 and not started[0].errors
    assert 0 < stats[0]["peak_buffer_bytes"] <= src.bound < total
    assert src.stats["streamed_tokens"] == sum(
        int((b.doc_ids >= 0).sum()) for b in mbs[:2] + mbs[4:] + [held]
    )
    assert not list(src.kept.dir.glob("files/*"))  # nothing kept: the store holds nothing past the bound
    src.close()
    assert src.summary()["peak_buffer_bytes"] == stats[0]["peak_buffer_bytes"] and started[0].poll() == 0


def test_float8_storage_keeps_each_rows_range_within_e4m3_rounding(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 4, 64, generator=g) * torch.logspace(-4, 4, 40)[:, None, None]  # rows 1e-4 .. 1e4
    x[3, 1, 7] = 5e5  # an outlier: its row's scale follows it
    enc = hb.encode(x, "float8_e4m3fn")
    assert enc["hidden_states"].dtype == torch.float8_e4m3fn and enc["scale"].shape == (40, 4)
    y = hb.decode(enc["hidden_states"], enc["scale"])
    scale = x.abs().amax(-1, keepdim=True) / 448  # independent of the code: e4m3 has 3 mantissa bits
    bound = torch.maximum(x.abs() * 2**-4, scale * 2**-10)  # half an ulp (normal), half the subnormal step
    assert bool(((y - x).abs() <= bound * 1.0001).all())
    torch.testing.assert_close(y.abs().amax(-1), x.abs().amax(-1), rtol=1e-6, atol=0)  # the range is kept
    for dtype, size in (("float32", 4), ("bfloat16", 2), ("float8_e4m3fn", 1)):
        path = tmp_path / f"{dtype}.safetensors"
        save_file({**hb.encode(x, dtype), "token_ids": torch.zeros(40, dtype=torch.long),
                   "lengths": torch.tensor([40])}, str(path))  # fmt: skip
        assert 40 * 4 * 64 * size <= path.stat().st_size <= hb.shard_bytes(40, 1, 4, 64, dtype)


@pytest.mark.slow
def test_storage_dtype_effect_on_heldout_acc_is_bounded(tmp_path, monkeypatch):
    """Stage 05 end to end on the tiny world, hidden states stored as float32, bfloat16 and float8: the
    held-out acc of each position moves by at most ACC_BOUND (measured: see the printed line)."""
    import shutil

    from transformers import AutoModelForCausalLM

    from eagle_lib import train

    src = eagle_tiny.make_run(tmp_path)
    hf_producer.patch(monkeypatch, AutoModelForCausalLM.from_pretrained(tmp_path / "target").eval())
    out = {}
    for dtype in ("float32", "bfloat16", "float8_e4m3fn"):
        run = tmp_path / dtype
        shutil.copytree(src / "data", run / "data")
        shutil.copytree(src / "infer", run / "infer")
        cfg = eagle_tiny.stage_config(run, tmp_path / "target", hidden_source="vllm", hidden_dtype=dtype,
                                      max_steps=24, checkpoint_every=24, measure_every=0)  # fmt: skip
        s = train.run(cfg)
        out[dtype] = {"acc": s["heldout"]["acc"], "bytes_per_token": s["hidden"]["bytes_per_token"]}
    print(json.dumps(out))
    ref = out["float32"]
    for dtype in ("bfloat16", "float8_e4m3fn"):
        gap = max(abs(a - b) for a, b in zip(out[dtype]["acc"], ref["acc"], strict=True))
        assert gap <= ACC_BOUND, f"{dtype}: held-out acc {out[dtype]['acc']} vs float32 {ref['acc']}"
    for dtype, payload in (("float32", 1032), ("bfloat16", 520), ("float8_e4m3fn", 280)):
        # 4 layers x 64 values per token + its int64 id (+ a float32 scale per layer for float8); the rest is
        # the per-sequence lengths and the file header, a few bytes per token at these 18-30 token sequences
        assert payload <= out[dtype]["bytes_per_token"] <= payload + 8, (dtype, out[dtype])
