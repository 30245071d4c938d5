"""Tiny random BERT models and a word-level tokenizer built on the fly, for CPU tests of the example scripts.

Nothing is downloaded: the vocabulary comes from the words the test data uses, so every token is known and
offsets (needed by question answering) are exact. Layer widths are multiples of 64 so that every pattern the
tests use (2:4, 2:8, 64:2:8) fits the weights.
"""

from __future__ import annotations

import re
from pathlib import Path

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def words_of(texts) -> list[str]:
    vocab = set()
    for text in texts:
        vocab.update(re.findall(r"\w+|[^\w\s]", text.lower()))
    return sorted(vocab)


def build_tokenizer(words, out_dir: str | Path):
    """A fast BERT-like tokenizer (lower case, [CLS] a [SEP] b [SEP], token type ids, offsets) saved to out_dir."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + [w for w in words if w not in SPECIALS])}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=128,
    )
    fast.save_pretrained(out_dir)
    return fast


def build_tiny_bert(out_dir: str | Path, texts, *, seed: int = 0) -> Path:
    """Save a 2-layer, 64-wide random ``BertModel`` and its tokenizer into ``out_dir``; returns the path."""
    import torch
    from transformers import BertConfig, BertModel

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(words_of(texts), out_dir)
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
    )
    BertModel(config).save_pretrained(out_dir)
    return out_dir
