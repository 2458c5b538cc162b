"""SigLIP's text tower pads every pass to its fixed length itself (model/towers.py): what the
planner cut, padded to fewer positions (or past the table by a pad multiple), is re-padded to
exactly the model card's sequence."""

from __future__ import annotations

import torch

from embedserve.handler.model.towers import padded_to

PAD = 0


def test_a_short_pass_is_padded_to_the_fixed_length_with_the_pad_id_and_masked():
    ids = torch.tensor([[5, 6, 7], [5, 9, PAD]])
    attention = torch.tensor([[1, 1, 1], [1, 1, 0]])
    full, mask = padded_to(6, ids, attention, PAD)
    assert full.tolist() == [[5, 6, 7, 0, 0, 0], [5, 9, 0, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]]


def test_padding_of_another_id_is_replaced_by_the_pad_id():
    full, _ = padded_to(4, torch.tensor([[5, 3]]), torch.tensor([[1, 0]]), pad_id=1)
    assert full.tolist() == [[5, 1, 1, 1]]


def test_a_pass_padded_past_the_table_is_cut_to_it():
    """A pad multiple can round a pass of full-length texts past the position table: only padding lies beyond."""
    ids = torch.tensor([[5, 6, 7, 8, PAD, PAD]])
    attention = torch.tensor([[1, 1, 1, 1, 0, 0]])
    full, mask = padded_to(4, ids, attention, PAD)
    assert full.tolist() == [[5, 6, 7, 8]] and mask.tolist() == [[1, 1, 1, 1]]
