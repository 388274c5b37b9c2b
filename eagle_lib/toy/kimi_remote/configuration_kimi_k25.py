"""The mini-Kimi world's config class, loaded as remote code like Kimi-K2.5's: a multimodal wrapper
(``model_type: kimi_k25``) around a DeepseekV3 ``text_config``. The mini world is text-only (``vision_config``
None): its checkpoint has no vision tower, only the wrapper's ``language_model.*`` weight names.
Written into the world's target directory by ``eagle_lib.toy.mini_kimi``; imports only transformers.
"""

from __future__ import annotations

from transformers import DeepseekV3Config, PretrainedConfig


class KimiK25Config(PretrainedConfig):
    model_type = "kimi_k25"
    sub_configs = {"text_config": DeepseekV3Config}

    def __init__(self, text_config=None, vision_config=None, media_placeholder_token_id=163605, **kwargs):
        if isinstance(text_config, dict):
            text_config = DeepseekV3Config(**text_config)
        self.text_config = text_config if text_config is not None else DeepseekV3Config()
        self.vision_config = vision_config
        self.media_placeholder_token_id = media_placeholder_token_id
        super().__init__(**kwargs)

    def get_text_config(self, *args, **kwargs):
        return self.text_config
