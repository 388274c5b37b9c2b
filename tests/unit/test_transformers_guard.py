"""transformers 5.4-5.11 bypass kimi_k25's remote tokenizer and shift its special ids (transformers #45356, fixed by
#45359): every load of a kimi_k25 target's tokenizer or config refuses those releases (issue 42, item 9). The
version table is the issue's range, written out here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import transformers

from eagle_lib import models, params

REFUSED = ["5.4.0", "5.4.2", "5.8.0", "5.11.0", "5.11.3", "5.10.0.dev0", "5.7.0rc1"]
ALLOWED = ["4.57.3", "5.0.0", "5.3.9", "5.12.0", "5.25.0", "6.0.0", "not-a-version"]


@pytest.mark.parametrize("version", REFUSED + ALLOWED)
def test_the_affected_releases_for_kimi_k25_only(version):
    why = models.transformers_problem("kimi_k25", version)
    assert (why is not None) == (version in REFUSED), version
    if why:
        assert "45356" in why and version in why and ">= 5.12" in why
    assert models.transformers_problem("deepseek_v3", version) is None  # Kimi's text model type: unaffected


def _kimi_config(monkeypatch, model_type: str = "kimi_k25") -> list:
    """AutoConfig answering with a config of `model_type` (as Kimi-K2.5's remote config class would); records calls."""
    calls: list = []

    def from_pretrained(path, **kw):
        calls.append((path, kw))
        return SimpleNamespace(model_type=model_type)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", from_pretrained)
    return calls


def test_loading_a_kimi_tokenizer_on_an_affected_release_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(transformers, "__version__", "5.8.0")
    calls = _kimi_config(monkeypatch)
    shared = params.SharedParams(target=str(tmp_path), trust_remote_code=True)
    with pytest.raises(models.TransformersVersionError, match=r"transformers 5\.8\.0 .*kimi_k25.*45356"):
        models.load_tokenizer(shared)
    assert calls and calls[0][1]["trust_remote_code"] is True
    with pytest.raises(models.TransformersVersionError):
        models.load_config(str(tmp_path), True)


def test_unaffected_releases_and_other_targets_load(tmp_path, monkeypatch):
    _kimi_config(monkeypatch)
    monkeypatch.setattr(transformers, "__version__", "5.12.1")
    assert models.load_config(str(tmp_path), True).model_type == "kimi_k25"
    monkeypatch.setattr(transformers, "__version__", "5.8.0")
    _kimi_config(monkeypatch, "llama")
    assert models.load_config(str(tmp_path)).model_type == "llama"
