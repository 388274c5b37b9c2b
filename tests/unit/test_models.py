"""models: the aux-layer id conventions against a real forward pass (hooks on the decoder layers), the text-config
guard, and params validation without torch."""

import subprocess
import sys

import pytest
import torch

from eagle_lib import models
from tests.support import models as tiny


def test_layer_ids_name_the_decoder_outputs_in_hf_hidden_states():
    model = tiny.llama(0, num_hidden_layers=5)
    outputs = {}
    hooks = [
        layer.register_forward_hook(
            lambda _m, _i, out, k=k: outputs.__setitem__(k, out[0] if isinstance(out, tuple) else out)
        )
        for k, layer in enumerate(model.model.layers)
    ]
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        hs = model(input_ids=ids, output_hidden_states=True).hidden_states
    for h in hooks:
        h.remove()
    aux = [1, 2, 3]
    for layer, idx in zip(aux, models.layer_ids(aux, "hf"), strict=True):
        assert torch.equal(hs[idx], outputs[layer])  # the reference: what decoder layer `layer` returned
    assert models.layer_ids(aux, "vllm") == models.layer_ids(aux, "hf") == [2, 3, 4]
    assert models.layer_ids(aux, "sglang") == aux == models.aux_layers_from([2, 3, 4], "vllm")
    assert models.aux_layers_from(models.layer_ids([1, 29, 57], "vllm"), "vllm") == [1, 29, 57]


def test_text_config_unwraps_a_multimodal_config():
    from transformers import LlavaConfig

    cfg = LlavaConfig(text_config=tiny.llama_config(hidden_size=96, num_attention_heads=3).to_dict())
    assert models.text_config(cfg).hidden_size == 96
    assert models.text_config(tiny.llama_config()).hidden_size == 64


def test_pipeline_validate_does_not_import_torch():
    code = (
        "import sys; from eagle_lib.pipeline import main\n"
        "rc = main(['validate', 'params/toy.yaml', 'params/ci.yaml', 'params/kimi_k25.yaml'])\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules)\n"
        "print('HEAVY', heavy); sys.exit(rc or (1 if heavy else 0))\n"
    )
    from eagle_lib.pipeline import REPO_ROOT

    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_hub_code_runs_only_at_a_pinned_commit(tmp_path):
    from eagle_lib.params import SharedParams

    hub = SharedParams(target="org/remote-model", trust_remote_code=True)
    with pytest.raises(
        models.RemoteCodeError, match=r"org/remote-model: trust_remote_code .* shared.revision"
    ):
        models.hub_kwargs(hub)
    with pytest.raises(models.RemoteCodeError, match="'main' is a branch or tag"):
        models.hub_kwargs(hub.model_copy(update={"revision": "main"}))
    assert models.hub_kwargs(hub.model_copy(update={"revision": COMMIT})) == {
        "trust_remote_code": True, "revision": COMMIT}  # fmt: skip
    assert models.hub_kwargs(hub.model_copy(update={"allow_unpinned_remote_code": True}))["revision"] is None
    assert (
        models.hub_kwargs(SharedParams(target="org/model"))["revision"] is None
    )  # no remote code: no pin needed
    local = tmp_path / "model"
    local.mkdir()  # a local directory runs the code on disk: nothing moves under it
    assert models.hub_kwargs(SharedParams(target=str(local), trust_remote_code=True))["revision"] is None
    tok = hub.model_copy(
        update={"revision": COMMIT, "tokenizer": "org/remote-tok"}
    )  # its own repo, its own pin
    with pytest.raises(models.RemoteCodeError, match="org/remote-tok"):
        models.hub_kwargs(tok, tokenizer=True)


def test_the_pinned_revision_reaches_every_loader(monkeypatch):
    from transformers import AutoConfig, AutoTokenizer

    from eagle_lib.hidden_states import engine_hidden
    from eagle_lib.params import SharedParams

    calls = []
    monkeypatch.setattr(AutoConfig, "from_pretrained", lambda *a, **kw: calls.append(("config", a, kw)))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **kw: calls.append(("tokenizer", a, kw)))
    shared = SharedParams(target="org/remote-model", trust_remote_code=True, revision=COMMIT)
    models.load_config(shared.target, **models.hub_kwargs(shared))
    models.load_tokenizer(shared)
    assert [(k, kw["revision"], kw["trust_remote_code"]) for k, _, kw in calls] == [
        ("config", COMMIT, True), ("tokenizer", COMMIT, True)]  # fmt: skip

    class Text:
        num_hidden_layers, hidden_size = 4, 8

    p = {"hidden_dtype": "float32", "tensor_parallel_size": 1, "max_buffer_gb": 1.0, "start_producers": True}
    assert engine_hidden.producer_config(p, shared, Text, [1, 2], 64, True)["revision"] == COMMIT


def test_a_run_with_unpinned_hub_code_is_refused_before_any_stage(tmp_path):
    import yaml

    from eagle_lib import pipeline
    from eagle_lib.params import ParamsError

    f = tmp_path / "remote.yaml"
    f.write_text(yaml.safe_dump({"run_name": "remote", "shared": {"target": "org/remote-model",
                                                                   "trust_remote_code": True}}))  # fmt: skip
    with pytest.raises(ParamsError, match="remote.yaml: org/remote-model: trust_remote_code"):
        pipeline.run_pipeline(f, root=tmp_path)
    assert not (tmp_path / "outputs").exists()
