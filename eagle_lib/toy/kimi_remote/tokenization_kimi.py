"""The mini-Kimi world's tokenizer, loaded as remote code (``trust_remote_code=True``) like Kimi-K2.5's own.

A slow (Python) tokenizer over a tiktoken BPE: ``tiktoken.model`` holds one ``base64(token bytes) rank`` line per
regular token (ids 0 .. V-257), the 256 special slots from V-256 are added tokens listed in
tokenizer_config.json. Token strings are the token's bytes in the byte-to-printable-unicode mapping of byte-level
BPEs, so ``convert_ids_to_tokens`` / ``convert_tokens_to_string`` round-trip any byte sequence. The pre-split
pattern is ``PAT_STR``. This file is written into the world's target directory by ``eagle_lib.toy.mini_kimi``;
it imports only transformers and tiktoken, as a hub repo's code must.
"""

from __future__ import annotations

import base64
import os
from shutil import copyfile

import tiktoken
from transformers import PreTrainedTokenizer

VOCAB_FILE = "tiktoken.model"
# words with an optional leading non-letter, numbers in groups of 1-3, punctuation runs, newlines, spaces
PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def byte_to_char() -> dict[int, str]:
    """Each byte -> one printable character: printable Latin-1 bytes map to themselves, the rest to 256+."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1)]
    keep += list(range(ord("\u00ae"), ord("\u00ff") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def load_ranks(path: str) -> dict[bytes, int]:
    """``base64 rank`` lines -> {token bytes: rank}."""
    ranks = {}
    with open(path, "rb") as fh:
        for line in fh:
            if line.strip():
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
    return ranks


class TikTokenTokenizer(PreTrainedTokenizer):
    """Byte-level BPE via tiktoken; specials come from the saved ``added_tokens_decoder``."""

    vocab_files_names = {"vocab_file": VOCAB_FILE}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, **kwargs):
        self.vocab_file = vocab_file
        ranks = load_ranks(vocab_file)
        self.n_regular = len(ranks)
        self.model = tiktoken.Encoding(name="mini_kimi", pat_str=PAT_STR, mergeable_ranks=ranks,
                                       special_tokens={})  # fmt: skip
        self.b2c = byte_to_char()
        self.c2b = {c: b for b, c in self.b2c.items()}
        self.decoder = {rank: self._chars(tok) for tok, rank in ranks.items()}
        self.encoder = {s: i for i, s in self.decoder.items()}
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(**kwargs)

    def _chars(self, raw: bytes) -> str:
        return "".join(self.b2c[b] for b in raw)

    @property
    def vocab_size(self) -> int:
        return self.n_regular

    def get_vocab(self) -> dict[str, int]:
        return {**self.encoder, **self._added_tokens_encoder}

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return [self.decoder[i] for i in self.model.encode_ordinary(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self.encoder.get(token, self.encoder.get(self.unk_token, 0) if self.unk_token else 0)

    def _convert_id_to_token(self, index: int) -> str:
        return self.decoder.get(index, "")

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        out, raw = [], bytearray()
        for t in tokens:
            if t in self._added_tokens_encoder:  # a special token: its text as it is
                out.append(raw.decode("utf-8", errors="replace"))
                raw = bytearray()
                out.append(t)
            else:
                raw.extend(self.c2b[c] for c in t)
        out.append(raw.decode("utf-8", errors="replace"))
        return "".join(out)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        name = (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILE
        out = os.path.join(save_directory, name)
        if os.path.abspath(self.vocab_file) != os.path.abspath(out):
            copyfile(self.vocab_file, out)
        return (out,)
