"""Hugging Face model directories written by the tests (``model.source: path`` reads them as a pod would)."""

from __future__ import annotations

from pathlib import Path


def save_tokenizer(directory: Path) -> None:
    """A character-level fast tokenizer with the special tokens the trainer needs, for ``AutoTokenizer``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["<pad>", "<bos>", "<eos>", "<unk>", *"0123456789"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>", bos_token="<bos>",
                            eos_token="<eos>").save_pretrained(directory)
