"""The toy world: raw datasets in real public schemas, a Kimi-like tokenizer and a small trained Llama target.

Built deterministically from ``RECIPE`` (seed, sizes, model shape, training steps) and cached under
``cache_root()/toy-<toy_key(recipe)>/``; ``resolve("toy://target")`` etc. map toy URIs to local paths.
Run ``python -m eagle_lib.toy build`` to build it ahead of time. The second world, ``toy://kimi``
(`eagle_lib.toy.mini_kimi`), is a small target shaped like Kimi-K2.5 trained on the same conversations.
"""

from eagle_lib.toy.uris import resolve
from eagle_lib.toy.world import RECIPE, TOY_NAMES, TOY_VERSION, build, cache_root, toy_key, world_dir

__all__ = ["RECIPE", "TOY_NAMES", "TOY_VERSION", "build", "cache_root", "resolve", "toy_key", "world_dir"]
