"""models: the aux-layer id conventions against a real forward pass (hooks on the decoder layers), the text-config
guard, and params validation without torch."""

import subprocess
import sys

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
