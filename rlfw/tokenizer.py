"""Tokenizers: an HF tokenizer from the checkpoint folder, or the project's own tiny one.

The tiny tokenizer is character-level over a fixed alphabet and is built in code, so the embedded
default needs no download. It is a real ``PreTrainedTokenizerFast``: it saves beside a checkpoint and
loads back through ``transformers.AutoTokenizer`` like any other.
"""

from __future__ import annotations

import os
import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
TINY_ALPHABET = string.digits + string.ascii_lowercase + string.ascii_uppercase + " +-*/=()<>,.:;?!'\"#\n"


class TokenizerError(ValueError):
    """A tokenizer that cannot serve the model; the message says why and what to do."""


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: 4 special tokens, then one id per character of :data:`TINY_ALPHABET`."""
    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *TINY_ALPHABET))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )


def load_tokenizer(path: str | os.PathLike[str], vocab_size: int) -> PreTrainedTokenizerBase:
    """The HF tokenizer saved in a checkpoint folder, checked against the model's embedding size."""
    folder = Path(path)
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        raise TokenizerError(
            f"no tokenizer files in {folder} (tokenizer.json / tokenizer_config.json); save the checkpoint's "
            "tokenizer beside its weights, or use model.tokenizer=tiny for the built-in character tokenizer"
        )
    from transformers import AutoTokenizer  # 3 s of imports a run on the built-in tokenizer never needs

    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    check_vocab(tok, vocab_size)
    return tok


def check_vocab(tok: PreTrainedTokenizerBase, vocab_size: int) -> None:
    """Refuse a tokenizer that can emit ids the embedding table does not have."""
    if len(tok) > vocab_size:
        raise TokenizerError(
            f"tokenizer has {len(tok)} tokens but the model's embedding has vocab_size={vocab_size}; "
            "ids past the embedding would index out of range. Use the tokenizer the checkpoint was trained "
            "with, or a model config with vocab_size >= len(tokenizer)"
        )
