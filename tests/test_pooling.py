import pytest
import torch

from handler.pooling import l2_normalize, pool


@pytest.fixture
def batch():
    torch.manual_seed(0)
    hidden = torch.randn(4, 7, 16)
    lengths = [7, 3, 1, 5]
    mask = torch.zeros(4, 7, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    return hidden, mask, lengths


def reference(hidden, lengths, mode):
    """Loop-based float64 reference over the real tokens only."""
    rows = []
    for row, length in enumerate(lengths):
        tokens = hidden[row, :length].double()
        rows.append({"mean": tokens.mean(0), "cls": tokens[0], "last_token": tokens[-1]}[mode])
    return torch.stack(rows)


@pytest.mark.parametrize("mode", ["mean", "cls", "last_token"])
def test_pooling_matches_float64_reference(batch, mode):
    hidden, mask, lengths = batch
    got = pool(hidden, mask, mode)
    assert got.dtype == torch.float32 and got.shape == (4, 16)
    torch.testing.assert_close(got.double(), reference(hidden, lengths, mode), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["mean", "cls", "last_token"])
def test_half_precision_states_pool_in_float32(batch, mode):
    hidden, mask, lengths = batch
    got = pool(hidden.to(torch.bfloat16), mask, mode)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference(hidden, lengths, mode), rtol=2e-2, atol=2e-2)


def test_padding_does_not_change_mean(batch):
    hidden, mask, _ = batch
    noisy = hidden.clone()
    noisy[mask == 0] = 1e6  # whatever sits in padded positions must not leak in
    torch.testing.assert_close(pool(noisy, mask, "mean"), pool(hidden, mask, "mean"))


def test_unknown_mode_is_an_error(batch):
    hidden, mask, _ = batch
    with pytest.raises(ValueError, match="unknown pooling"):
        pool(hidden, mask, "max")


def test_l2_normalize_gives_unit_rows():
    vectors = torch.randn(5, 8, dtype=torch.float64) * 10
    norms = l2_normalize(vectors).norm(dim=-1)
    torch.testing.assert_close(norms, torch.ones(5, dtype=torch.float64))
