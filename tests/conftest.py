"""Shared fixtures: tiny random models of every supported family, and the GPU marker's skip."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    BertConfig,
    DistilBertConfig,
    GPT2Config,
    LlamaConfig,
    RobertaConfig,
)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# hidden 64 / FFN 128: every targeted layer tiles 2:4, 2:8, 64:2:8 and transposable 2:4.
TINY_CONFIGS = {
    "bert": lambda: BertConfig(
        vocab_size=99,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
        num_labels=3,
    ),
    "roberta": lambda: RobertaConfig(
        vocab_size=99,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=70,
        num_labels=3,
        pad_token_id=1,
    ),
    "distilbert": lambda: DistilBertConfig(
        vocab_size=99,
        dim=64,
        n_layers=2,
        n_heads=2,
        hidden_dim=128,
        max_position_embeddings=64,
        num_labels=3,
    ),
    "gpt2": lambda: GPT2Config(
        vocab_size=99, n_embd=64, n_layer=2, n_head=2, n_positions=64, num_labels=3, pad_token_id=0
    ),
    "llama": lambda: LlamaConfig(
        vocab_size=99,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
        num_labels=3,
        pad_token_id=0,
    ),
}


def tiny_config(family: str):
    return TINY_CONFIGS[family]()


@pytest.fixture
def bert_config():
    return tiny_config("bert")


def random_ids(batch: int = 3, length: int = 12, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, 99, (batch, length), generator=generator)


class ToyClassification(torch.utils.data.Dataset):
    """Labels a model can learn: whether the first token id is above the middle of the vocabulary."""

    def __init__(self, size: int = 64, length: int = 12, num_labels: int = 3) -> None:
        self.ids = random_ids(size, length, seed=1)
        self.labels = (self.ids[:, 0] * num_labels) // 100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": int(self.labels[i])}
