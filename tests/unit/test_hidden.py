"""Hidden-state sources: online hooks vs output_hidden_states, packing, offline dumps and width errors."""

import pytest
import torch
from safetensors.torch import save_file

from eagle_lib.data.batches import Sequence, make_batch
from eagle_lib.hidden_states import hidden
from tests.support import eagle_tiny

torch.set_num_threads(1)
AUX = [1, 3, 4]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return eagle_tiny.load_target(tmp_path_factory.mktemp("tiny"))


def seqs(n, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        Sequence(f"s{i}", torch.randint(0, eagle_tiny.VOCAB, (t,), generator=g).tolist(), [1] * t)
        for i, t in zip(range(n), lens, strict=True)
    ]


def reference(model, ids):
    """HF hidden_states[i + 1] is the output of decoder layer i."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in AUX], -1)[0], out.logits[0]


def test_online_matches_output_hidden_states_and_packs(target):
    _, model = target
    s = seqs(3, [9, 5, 7])
    src = hidden.OnlineHidden(model, AUX)
    batch = make_batch(s, [[0, 1], [2]])  # row 0 packs two sequences
    aux, logits = src(batch)
    assert aux.shape == (2, 14, 3 * 64) and logits.shape == (2, 14, eagle_tiny.VOCAB)
    for row, start, i in [(0, 0, 0), (0, 9, 1), (1, 0, 2)]:
        n = len(s[i].input_ids)
        ref_aux, ref_logits = reference(model, s[i].input_ids)
        torch.testing.assert_close(aux[row, start : start + n], ref_aux, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logits[row, start : start + n], ref_logits, rtol=1e-4, atol=1e-4)
    src.close()
    with pytest.raises(ValueError, match="outside"):
        hidden.OnlineHidden(model, [1, 3, 8])


def last_layer_outputs(model, ids):
    """Output of the last decoder layer (pre final norm), captured independently by a hook."""
    got = {}
    h = model.model.layers[-1].register_forward_hook(
        lambda m, i, o: got.setdefault("x", o[0] if isinstance(o, tuple) else o)
    )
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    h.remove()
    return got["x"][0]


def write_dumps(model, dump_dir, sequences, layers=4):
    dump_dir.mkdir(parents=True, exist_ok=True)
    for i, s in enumerate(sequences):
        aux, _ = reference(model, s.input_ids)
        last = last_layer_outputs(model, s.input_ids)
        hs = torch.cat([aux.view(-1, 3, 64), last[:, None]], 1)[:, :layers]  # (T, layers, H)
        save_file(
            {"token_ids": torch.tensor(s.input_ids), "hidden_states": hs.to(torch.bfloat16).contiguous()},
            str(dump_dir / f"hs_{i}.safetensors"),
        )


def test_offline_dumps_give_the_target_features_and_logits(target, tmp_path):
    path, model = target
    s = seqs(3, [8, 6, 5], seed=1)
    write_dumps(model, tmp_path / "dumps", s[:2])
    from transformers import AutoConfig

    head = hidden.load_target_head(str(path), AutoConfig.from_pretrained(path))
    src = hidden.OfflineHidden(tmp_path / "dumps", head, 64)
    assert src.has(s[0].input_ids) and not src.has(s[2].input_ids)
    batch = make_batch(s[:2], [[1, 0]])
    aux, logits = src(batch)
    for start, i in [(0, 1), (6, 0)]:
        n = len(s[i].input_ids)
        ref_aux, ref_logits = reference(model, s[i].input_ids)
        torch.testing.assert_close(aux[0, start : start + n], ref_aux, rtol=2e-2, atol=2e-2)  # bf16 dump
        torch.testing.assert_close(logits[0, start : start + n], ref_logits, rtol=5e-2, atol=5e-2)
    with pytest.raises(KeyError, match="no dump"):
        src(make_batch(s, [[2]]))
    src.lazy_logits = True  # 05 with loss_chunk: a HeadTarget that makes the same logits row by row
    _, lazy = src(batch)
    assert isinstance(lazy, hidden.HeadTarget) and lazy.shape == logits.shape
    bi, ti = torch.tensor([0, 0, 0]), torch.tensor([0, 7, 13])
    torch.testing.assert_close(lazy.rows(bi, ti), logits[bi, ti])
    cols = torch.tensor([5, 0, 17, 3])  # only those lm_head rows (the draft vocab's): the same logits
    torch.testing.assert_close(lazy.rows(bi, ti, cols), logits[bi, ti][:, cols])


def test_kept_source_argmax_is_made_once_per_sequence_and_equals_the_logits(target):
    """07's kept source gives a lazy target its whole-vocab argmax, each sequence's made once: another packing
    of the same sequences (a later arm) reads the cache and still equals the argmax of the full logits."""
    from types import SimpleNamespace

    from eagle_lib.drafter import longseq
    from eagle_lib.hidden_states.kept_source import KeptSource

    torch.manual_seed(0)
    v, h = 50, 16
    head = hidden.TargetHead(torch.rand(h) + 0.5, torch.randn(v, h), 1e-6)
    s = seqs(3, [9, 5, 7])
    fake = SimpleNamespace(head=head, recipe={"loss_chunk": 4}, argmax={}, argmax_tokens=0)
    b1, b2 = make_batch(s, [[0, 1], [2]]), make_batch(s, [[2, 0], [1]])
    last1, last2 = torch.randn(*b1.input_ids.shape, h), torch.randn(*b2.input_ids.shape, h)
    last2[0, :7], last2[0, 7:16], last2[1, :5] = last1[1, :7], last1[0, :9], last1[0, 9:14]  # same sequences
    for batch, last in ((b1, last1), (b2, last2)):
        arg = KeptSource._argmax(fake, batch, last)
        ref = longseq.target_argmax(hidden.HeadTarget(last, head), 3)  # made here from the full logits
        real = batch.doc_ids >= 0
        assert torch.equal(arg[real], ref[real]) and fake.argmax_tokens == 21  # the second batch: all cached
        assert longseq.target_argmax(hidden.HeadTarget(last, head, arg), 3) is arg


@pytest.mark.parametrize("layers,match", [(1, "EAGLE3"), (3, "not the last layer")])
def test_offline_width_errors_name_the_cause(target, tmp_path, layers, match):
    path, model = target
    write_dumps(model, tmp_path / "d", seqs(1, [5]), layers=layers)
    from transformers import AutoConfig

    head = hidden.load_target_head(str(path), AutoConfig.from_pretrained(path))
    with pytest.raises(ValueError, match=match):
        hidden.OfflineHidden(tmp_path / "d", head, 64)


def test_width_error_message():
    assert "EAGLE3" in hidden.width_error(7168, 7168, "x")
    assert "21504" in hidden.width_error(7168, 7168, "x")


def test_load_target_tensors_reads_only_named_tensors(target):
    path, model = target
    t = hidden.load_target_tensors(
        str(path), {"lm": ["lm_head.weight"], "emb": ["model.embed_tokens.weight"]}
    )
    assert torch.equal(t["lm"], model.lm_head.weight) and torch.equal(
        t["emb"], model.model.embed_tokens.weight
    )
    with pytest.raises(KeyError, match="nothing.weight"):
        hidden.load_target_tensors(str(path), {"x": ["nothing.weight"]})


@pytest.mark.parametrize(
    ("raised", "want"),
    [("remote404", None), ("gated", "GatedRepoError"), ("dns", "ConnectionError"), ("offline", "cannot be reached"),
     ("timeout", "TimeoutError")],
)  # fmt: skip
def test_hub_failures_are_named_not_read_as_a_missing_file(monkeypatch, raised, want):
    """Only the hub's own 404 for the file means 'absent'; an expired token, a gated repo, DNS, a timeout or an
    offline cache miss used to read as 'no model.safetensors'."""
    import huggingface_hub
    from huggingface_hub import errors

    def fail(*a, **k):
        resp = type("R", (), {"status_code": 404, "headers": {}, "request": None})()
        raise {
            "remote404": lambda: errors.RemoteEntryNotFoundError("404 Client Error", response=resp),
            "gated": lambda: errors.GatedRepoError("401 Client Error: gated", response=resp),
            "dns": lambda: ConnectionError("Name or service not known"),
            "offline": lambda: errors.LocalEntryNotFoundError("offline mode"),
            "timeout": lambda: TimeoutError("read timed out"),
        }[raised]()

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fail)
    if want is None:
        with pytest.raises(FileNotFoundError, match=r"org/model: no model.safetensors"):
            hidden.load_target_tensors("org/model", {"x": ["x"]})
    else:
        with pytest.raises(hidden.HubError, match=want):
            hidden.load_target_tensors("org/model", {"x": ["x"]})


def test_hub_shard_downloads_are_at_the_pinned_revision(target, monkeypatch):
    """The head and embedding of a hub target come from the commit whose config and remote code ran (the old
    loader downloaded `main`'s shards whatever the pin)."""
    import huggingface_hub

    path, model = target
    calls = []

    def download(repo, filename, revision=None, **kw):
        calls.append((repo, filename, revision))
        if not (path / filename).exists():  # the hub's 404 for a file the repo does not have
            resp = type("R", (), {"status_code": 404, "headers": {}, "request": None})()
            raise huggingface_hub.errors.RemoteEntryNotFoundError("404 Client Error", response=resp)
        return str(path / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    pin = "0123456789abcdef0123456789abcdef01234567"
    head = hidden.load_target_head("org/model", model.config, pin)
    emb = hidden.load_target_embedding("org/model", pin)
    assert torch.equal(head.lm_head, model.lm_head.weight) and torch.equal(
        emb, model.model.embed_tokens.weight
    )
    assert calls and all(r == ("org/model", r[1], pin) for r in calls), calls


def test_a_target_with_tied_embeddings_gives_its_head_from_the_embedding(tmp_path):
    """SmolLM2 (and Llama-3.2-1B, Qwen2.5-0.5B) tie lm_head to the input embedding: the checkpoint holds the
    matrix once, as model.embed_tokens.weight. The head must be that matrix (the model's own logits), not a
    KeyError; an untied checkpoint without lm_head.weight still fails, naming the tensor."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "tied")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "tied" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # what transformers writes for a tied model
    head = hidden.load_target_head(str(tmp_path / "tied"), cfg)
    ids = torch.tensor([[3, 17, 42, 5]])
    got = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda m, i, o: got.update(x=o[0] if isinstance(o, tuple) else o)
    )
    with torch.no_grad():
        out = model(ids)
        hook.remove()
        logits = head(got["x"])  # the last decoder layer's output (pre-norm) through the final norm + head
    torch.testing.assert_close(logits, out.logits, rtol=1e-5, atol=1e-5)
    untied = LlamaConfig(**{**cfg.to_dict(), "tie_word_embeddings": False})
    with pytest.raises(KeyError, match="no tensor for lm_head"):
        hidden.load_target_head(str(tmp_path / "tied"), untied)
