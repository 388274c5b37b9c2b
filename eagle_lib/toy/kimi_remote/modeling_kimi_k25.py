"""The mini-Kimi world's model class, loaded as remote code like Kimi-K2.5's: the language model lives under
``language_model`` (weights ``language_model.model.layers.N...``, ``language_model.lm_head.weight``), as in the
real multimodal checkpoint; text-only, so forward is the DeepseekV3 language model's.
Written into the world's target directory by ``eagle_lib.toy.mini_kimi``; imports only transformers.
"""

from __future__ import annotations

from transformers import DeepseekV3ForCausalLM, GenerationMixin, PreTrainedModel

from .configuration_kimi_k25 import KimiK25Config


class KimiK25ForConditionalGeneration(PreTrainedModel, GenerationMixin):
    config_class = KimiK25Config
    base_model_prefix = ""
    _no_split_modules = ["DeepseekV3DecoderLayer"]
    _supports_sdpa = True
    _supports_attention_backend = True

    def __init__(self, config: KimiK25Config):
        super().__init__(config)
        self.language_model = DeepseekV3ForCausalLM(config.text_config)
        self.post_init()

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.language_model.set_input_embeddings(value)

    def get_output_embeddings(self):
        return self.language_model.get_output_embeddings()

    def forward(self, *args, **kwargs):
        return self.language_model(*args, **kwargs)
