"""Pair / KTO / completion collation: layout, labels, KL samples, and padded == packed through a loss."""

from __future__ import annotations

import pytest
import torch

from ludic_fast.data.pair_batching import KTOExample, PreferencePair, collate_completions, collate_kto, collate_pairs
from ludic_fast.losses import preference as P

PAIRS = [PreferencePair([5, 6], [7, 8, 9], [3]), PreferencePair([1], [2, 2], [4, 4, 4, 4])]


def test_pair_layout_interleaves_chosen_and_rejected():
    b = collate_pairs(PAIRS, pad_token_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9], [5, 6, 3, 0, 0], [1, 2, 2, 0, 0], [1, 4, 4, 4, 4]]
    assert b["action_mask"].tolist()[1] == [0, 0, 1, 0, 0]
    assert b["attention_mask"].tolist()[2] == [1, 1, 1, 0, 0]
    packed = collate_pairs(PAIRS, layout="packed")
    assert packed["cu_seqlens"].tolist() == [0, 5, 8, 11, 16]
    assert collate_pairs(PAIRS, max_length=3)["input_ids"].shape == (4, 3)


def test_padded_and_packed_give_one_loss():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(10, 4, generator=g)
    emb = torch.randn(10, 4, generator=g)
    ref = torch.randn(4, generator=g) - 5
    losses = []
    for layout in ("padded", "packed"):
        b = collate_pairs(PAIRS, layout=layout)
        b["ref_seq_logps"] = ref
        losses.append(P.DPOLoss()(b, hidden=emb[b["input_ids"]], weight=W)[0])
    assert torch.allclose(losses[0], losses[1], atol=1e-6)


def test_kto_labels_and_kl_samples():
    ex = [KTOExample([1], [2, 3], True), KTOExample([4], [5], False)]
    b = collate_kto(ex)
    assert b["kto_label"].tolist() == [1, 0, -1, -1]
    assert b["input_ids"].tolist()[2][:2] == [1, 5] and b["input_ids"].tolist()[3][:3] == [4, 2, 3]
    assert collate_kto(ex, kl_samples=False)["kto_label"].tolist() == [1, 0]


def test_validation():
    with pytest.raises(ValueError, match="at least one pair"):
        collate_pairs([])
    with pytest.raises(ValueError, match="completion"):
        collate_pairs([PreferencePair([1], [], [2])])
    with pytest.raises(ValueError, match="layout"):
        collate_pairs(PAIRS, layout="ragged")
    with pytest.raises(ValueError, match="one length"):
        collate_completions([[1]], [])
    with pytest.raises(ValueError, match="max_length"):
        collate_pairs(PAIRS, max_length=1)
