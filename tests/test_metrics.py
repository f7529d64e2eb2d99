import math

import pytest
import torch

from gem.train.losses import multitask_bce
from gem.train.metrics import TaskEvaluator, auc, normalized_entropy


def test_auc_hand_computed_cases():
    y = torch.tensor([0, 0, 1, 1])
    assert auc(torch.tensor([0.1, 0.2, 0.8, 0.9]), y) == 1.0
    assert auc(torch.tensor([0.9, 0.8, 0.2, 0.1]), y) == 0.0
    assert auc(torch.tensor([0.5, 0.5, 0.5, 0.5]), y) == 0.5
    # Negatives score 0.1, 0.4; positives 0.35, 0.8. Of the 4 (pos, neg) pairs only 0.35 < 0.4 is lost.
    assert auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), y) == pytest.approx(0.75)
    # A tie between one positive and one negative counts one half: pairs 1 + 0.5 + 1 + 1 = 3.5 of 4.
    assert auc(torch.tensor([0.1, 0.5, 0.5, 0.9]), y) == pytest.approx(0.875)
    assert math.isnan(auc(torch.tensor([0.3, 0.4]), torch.tensor([1, 1])))


def test_auc_matches_pairwise_definition():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 20, (300,), generator=g).float()  # many ties
    labels = torch.randint(0, 2, (300,), generator=g)
    pos, neg = scores[labels == 1], scores[labels == 0]
    diff = pos[:, None] - neg[None, :]
    expected = ((diff > 0).double() + 0.5 * (diff == 0).double()).mean().item()
    assert auc(scores, labels) == pytest.approx(expected, abs=1e-12)


def test_normalized_entropy():
    y = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert normalized_entropy(torch.full((4,), 0.25), y) == pytest.approx(1.0)  # the base rate itself
    # Hand value: log loss of predicting 0.5 everywhere is ln 2; entropy of 0.25 is 0.5623351.
    assert normalized_entropy(torch.full((4,), 0.5), y) == pytest.approx(math.log(2) / 0.5623351446188083)
    assert normalized_entropy(torch.tensor([0.99, 0.01, 0.01, 0.01]), y) < 0.1


def test_masked_loss_ignores_unobserved_labels():
    logits = torch.tensor([[0.0, 5.0], [0.0, -5.0]])
    labels = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # the second task's labels are wrong but masked
    mask = torch.tensor([[True, False], [True, False]])
    loss, per_task = multitask_bce(logits, labels, mask, torch.tensor([1.0, 1.0]))
    assert per_task[1] == 0 and loss.item() == pytest.approx(math.log(2))
    mask[0, 1] = True  # now one wrong, confident prediction counts
    loss2, per_task2 = multitask_bce(logits, labels, mask, torch.tensor([1.0, 0.5]))
    bce = torch.nn.functional.binary_cross_entropy_with_logits(torch.tensor(5.0), torch.tensor(0.0)).item()
    assert per_task2[1].item() == pytest.approx(bce)
    assert loss2.item() == pytest.approx(math.log(2) + 0.5 * bce)


def test_evaluator_uses_only_observed_examples():
    ev = TaskEvaluator(("click", "conversion"))
    ev.update(
        torch.tensor([[2.0, 9.0], [-2.0, -9.0]]),
        torch.tensor([[1.0, 0.0], [0.0, 1.0]]),
        torch.tensor([[True, False], [True, False]]),
    )
    ev.update(
        torch.tensor([[1.0, 1.0], [-1.0, -1.0]]),
        torch.tensor([[1.0, 1.0], [0.0, 0.0]]),
        torch.tensor([[True, True], [True, True]]),
    )
    out = ev.compute()
    assert out["click/auc"] == 1.0 and out["click/count"] == 4
    assert out["conversion/auc"] == 1.0 and out["conversion/count"] == 2
