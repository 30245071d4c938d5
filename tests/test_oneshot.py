"""``hf_sparse.oneshot`` with activation-aware scores on tiny models of every supported family, the block-by-block
calibration pass, and ``hf-sparse prune``."""

import warnings

import pytest
import torch
from conftest import random_ids, tiny_config
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

import hf_sparse
from hf_sparse import SparsityConfig
from hf_sparse.masks import compute_mask
from hf_sparse.modeling import logical_weight

FAMILIES = ["bert", "roberta", "distilbert", "gpt2", "llama"]


def _calibration(batches: int = 4, length: int = 16):
    return [
        {"input_ids": random_ids(4, length, seed=s), "labels": torch.zeros(4, dtype=torch.long)}
        for s in range(batches)
    ]


def _relative_error(family: str, score: str, pattern: str = "2:4") -> float:
    torch.manual_seed(0)
    model = AutoModel.from_config(tiny_config(family)).eval()
    held_out = random_ids(4, 16, seed=99)
    with torch.no_grad():
        dense = model(input_ids=held_out).last_hidden_state
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny configs' token ids outside the vocabulary
        pruner = hf_sparse.oneshot(model, SparsityConfig(pattern=pattern, score=score), _calibration(), progress=False)
    for layer in pruner.layers:
        mask = pruner.masks[layer.name]
        assert torch.equal(layer.weight != 0, mask) or not (layer.weight[~mask] != 0).any()
        assert mask.reshape(mask.shape[0], -1, 4).sum(-1).eq(2).all()
    with torch.no_grad():
        sparse = model(input_ids=held_out).last_hidden_state
    return float((sparse - dense).norm() / dense.norm())


@pytest.mark.parametrize("family", FAMILIES)
def test_oneshot_sparsegpt_beats_magnitude_on_every_family(family):
    """GPT-2 runs Conv1D (stored transposed), Llama rotary embeddings passed to each block as keyword arguments."""
    sparsegpt = _relative_error(family, "sparsegpt")
    magnitude = _relative_error(family, "magnitude")
    assert sparsegpt < 0.9 * magnitude, (sparsegpt, magnitude)


def test_oneshot_wanda_vnm_and_unstructured():
    for pattern, sparsity in (("64:2:8", 0.75), ("unstructured:0.6", 0.6)):
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_config(tiny_config("bert"))
        pruner = hf_sparse.oneshot(
            model, SparsityConfig(pattern=pattern, score="wanda"), _calibration(), progress=False
        )
        assert pruner.metrics()["sparsity"] == pytest.approx(sparsity, abs=0.01)
        assert pruner.config.schedule == "oneshot" and model.training  # the train/eval mode is put back


def test_each_block_is_calibrated_on_the_outputs_of_the_pruned_blocks_before_it():
    """Wanda does not move weights, so the inputs a block-1 layer was ranked on are those it sees in the final
    pruned model (block 0 already pruned), not those of the dense model."""
    torch.manual_seed(0)
    model = AutoModel.from_config(tiny_config("bert")).eval()
    layer = model.encoder.layer[1].attention.self.query
    weight = logical_weight(layer).detach().clone()
    calibration = _calibration()

    def input_norms():
        sums = []
        handle = layer.register_forward_pre_hook(lambda m, args: sums.append(args[0].reshape(-1, 64).square().sum(0)))
        with torch.no_grad():
            for batch in calibration:
                model(input_ids=batch["input_ids"])
        handle.remove()
        return torch.stack(sums).sum(0)

    dense_norms = input_norms()
    pruner = hf_sparse.oneshot(model, SparsityConfig(pattern="2:4", score="wanda"), calibration, progress=False)
    pruned_norms = input_norms()
    mask = pruner.masks["encoder.layer.1.attention.self.query"]
    assert torch.equal(mask, compute_mask(weight.abs() * pruned_norms.sqrt(), hf_sparse.NM(2, 4)))
    assert not torch.equal(mask, compute_mask(weight.abs() * dense_norms.sqrt(), hf_sparse.NM(2, 4)))


def test_padding_tokens_are_left_out_of_the_statistics():
    """One padded batch of two sequences must give the masks of the two sequences run unpadded, one by one."""
    ids = random_ids(2, 10, seed=4)
    padded = {"input_ids": ids.clone(), "attention_mask": torch.ones(2, 10, dtype=torch.long)}
    padded["attention_mask"][1, 6:] = 0
    padded["input_ids"][1, 6:] = 0
    separate = [{"input_ids": ids[:1]}, {"input_ids": ids[1:, :6]}]
    masks = []
    for calibration in ([padded], separate):
        torch.manual_seed(0)
        model = AutoModel.from_config(tiny_config("bert"))
        pruner = hf_sparse.oneshot(model, SparsityConfig(pattern="2:4", score="wanda"), calibration, progress=False)
        masks.append(dict(pruner.masks))
    assert all(torch.equal(masks[0][name], masks[1][name]) for name in masks[0])


def test_transposable_sparsegpt_and_checkpoint_round_trip(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("gpt2"))
    config = SparsityConfig(pattern="2:4", score="sparsegpt", transposable=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pruner = hf_sparse.oneshot(model, config, _calibration(), progress=False)
    for layer in pruner.layers:
        mask = pruner.masks[layer.name]
        assert mask.reshape(mask.shape[0], -1, 4).sum(-1).eq(2).all()
        assert mask.T.reshape(mask.shape[1], -1, 4).sum(-1).eq(2).all()
    ids = random_ids(2, 12, seed=7)
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    hf_sparse.save_pretrained(model, tmp_path, pruner)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_oneshot_errors_say_what_to_do():
    model = AutoModel.from_config(tiny_config("bert"))
    with pytest.raises(ValueError, match="needs calibration batches"):
        hf_sparse.oneshot(model, SparsityConfig(pattern="2:4", score="sparsegpt"))
    with pytest.raises(ValueError, match="training gradients"):
        hf_sparse.oneshot(model, SparsityConfig(pattern="2:4", score="obs"))
    with pytest.raises(ValueError, match="no tensor that BertModel.forward takes"):
        hf_sparse.oneshot(model, SparsityConfig(pattern="2:4", score="wanda"), [{"text": torch.ones(2)}])
    with pytest.raises(ValueError, match="global_unstructured=True with score='wanda'"):
        SparsityConfig(pattern="unstructured:0.5", score="wanda", global_unstructured=True)
    with pytest.raises(ValueError, match="calibration_batches=0"):
        SparsityConfig(calibration_batches=0)
    # magnitude needs no calibration
    pruner = hf_sparse.oneshot(model, SparsityConfig(pattern="2:4", score="magnitude"), progress=False)
    assert pruner.metrics()["sparsity"] == pytest.approx(0.5)
