"""Tokenizers: the built-in character tokenizer roundtrips; HF tokenizers load from the checkpoint folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfw.model import PRESETS
from rlfw.tokenizer import SPECIAL_TOKENS, TokenizerError, build_tiny_tokenizer, load_tokenizer


def test_tiny_tokenizer_roundtrips_and_fits_the_tiny_models() -> None:
    tok = build_tiny_tokenizer()
    text = "12+34=46"
    ids = tok(text).input_ids
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(list(range(4))) == list(SPECIAL_TOKENS)
    assert len(tok) <= min(args.vocab_size for args in PRESETS.values())
    assert tok.eos_token_id == PRESETS["tiny_dense"].eos_token_id


def test_saved_tokenizer_loads_back_from_the_folder(tmp_path: Path) -> None:
    build_tiny_tokenizer().save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path, vocab_size=96)
    assert tok("a+b").input_ids == build_tiny_tokenizer()("a+b").input_ids


def test_tokenizer_larger_than_the_embedding_is_refused(tmp_path: Path) -> None:
    build_tiny_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(TokenizerError, match=r"tokenizer has 86 tokens but .* vocab_size=64"):
        load_tokenizer(tmp_path, vocab_size=64)


def test_folder_without_tokenizer_is_named(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"no tokenizer files in .*model\.tokenizer=tiny"):
        load_tokenizer(tmp_path, vocab_size=96)
