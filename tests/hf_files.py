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


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""ChatML's chat template, as Qwen's models have it."""


def save_chat_tokenizer(directory: Path, alphabet: str) -> None:
    """A character-level fast tokenizer of ``alphabet`` with ChatML's special tokens (``<|im_end|>`` its
    end-of-sequence token) and chat template, for ``AutoTokenizer``: every id decodes to text that encodes back to it
    (special tokens included), so any sampled ids can be rendered as a message."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({c: i for i, c in enumerate(["<unk>", *sorted(set(alphabet))])},
                                      unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>",
                                        additional_special_tokens=["<|im_start|>"], clean_up_tokenization_spaces=False)
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(directory)
