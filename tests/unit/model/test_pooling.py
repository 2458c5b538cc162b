"""Pooling against sentence-transformers' own Pooling module: every mode, concatenations, prompt
tokens left out of pooling, half precision."""

import pytest
import torch

from embedserve.handler.model.description import POOLING_MODES
from embedserve.handler.model.inputs import ModelInput, TokenRole, plain_inputs
from embedserve.handler.model.pooling import l2_normalize, pool

POOLED, PROMPT = TokenRole.POOLED, TokenRole.PROMPT

ST_NAMES = {"last_token": "lasttoken"}


@pytest.fixture
def batch():
    torch.manual_seed(0)
    hidden = torch.randn(4, 7, 16)
    lengths = [7, 3, 1, 5]
    mask = torch.zeros(4, 7, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, :length] = POOLED
    return hidden, mask


def sentence_transformers_pooling(hidden, mask, modes, prompt_length=0):
    """sentence-transformers' Pooling on the same right-padded batch (one prompt length for all rows,
    as it supports)."""
    from sentence_transformers.sentence_transformer.modules.pooling import Pooling

    module = Pooling(hidden.shape[-1], pooling_mode=tuple(ST_NAMES.get(m, m) for m in modes),
                     include_prompt=prompt_length == 0)
    features = {"token_embeddings": hidden, "attention_mask": (mask > 0).long()}
    if prompt_length:
        features["prompt_length"] = prompt_length
    return module(features)["sentence_embedding"]


@pytest.mark.parametrize("modes", [(mode,) for mode in POOLING_MODES] + [("cls", "mean"), ("max", "mean", "last_token")])
def test_pooling_matches_sentence_transformers(batch, modes):
    hidden, mask = batch
    got = pool(hidden, mask, modes)
    assert got.dtype == torch.float32 and got.shape == (4, 16 * len(modes))
    torch.testing.assert_close(got, sentence_transformers_pooling(hidden, mask, modes), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", POOLING_MODES)
def test_prompt_tokens_are_left_out_as_sentence_transformers_does(batch, mode):
    hidden, mask = batch
    mask = mask.clone()
    mask[[0, 1, 3], :2] = PROMPT  # rows long enough to hold a 2-token prompt
    rows = [0, 1, 3]
    got = pool(hidden[rows], mask[rows], (mode,))
    want = sentence_transformers_pooling(hidden[rows], mask[rows], (mode,), prompt_length=2)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if mode != "last_token":  # the last token is never part of the prompt
        assert not torch.allclose(got, pool(hidden[rows], (mask[rows] > 0).long(), (mode,)))


@pytest.mark.parametrize("mode", POOLING_MODES)
def test_half_precision_states_pool_in_float32(batch, mode):
    hidden, mask = batch
    got = pool(hidden.to(torch.bfloat16), mask, (mode,))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, pool(hidden, mask, (mode,)), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("mode", POOLING_MODES)
def test_padding_does_not_leak_in(batch, mode):
    hidden, mask = batch
    noisy = hidden.clone()
    noisy[mask == 0] = 1e6  # whatever sits in padded positions must not leak in
    torch.testing.assert_close(pool(noisy, mask, (mode,)), pool(hidden, mask, (mode,)))


def test_unknown_mode_is_an_error(batch):
    hidden, mask = batch
    with pytest.raises(ValueError, match="unknown pooling"):
        pool(hidden, mask, ("median",))


def test_l2_normalize_gives_unit_rows():
    vectors = torch.randn(5, 8, dtype=torch.float64) * 10
    norms = l2_normalize(vectors).norm(dim=-1)
    torch.testing.assert_close(norms, torch.ones(5, dtype=torch.float64))


def test_pad_right_pads_to_the_multiple_and_marks_the_prompt():
    from embedserve.handler.backends.padded import PaddedBackend

    backend = PaddedBackend(None, modes=("mean",), head=None, pad_id=3, pad_multiple=4, device=torch.device("cpu"),
                            facts={})
    ids, mask, _ = backend.prepare([ModelInput([7, 8, 9, 10, 11], 2), ModelInput((5,), 4), ModelInput([6, 6])])
    assert ids.dtype == mask.dtype == torch.long
    assert ids.tolist() == [[7, 8, 9, 10, 11, 3, 3, 3], [5, 3, 3, 3, 3, 3, 3, 3], [6, 6, 3, 3, 3, 3, 3, 3]]
    assert mask.tolist() == [[PROMPT, PROMPT, POOLED, POOLED, POOLED, 0, 0, 0],
                             [PROMPT, 0, 0, 0, 0, 0, 0, 0],  # a prompt longer than its row marks the row only
                             [POOLED, POOLED, 0, 0, 0, 0, 0, 0]]
    _, plain, _ = backend.prepare(plain_inputs([[7, 8], [5]]))
    assert plain.tolist() == [[POOLED, POOLED, 0, 0], [POOLED, 0, 0, 0]]
