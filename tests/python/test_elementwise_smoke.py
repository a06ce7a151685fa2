"""Quick end-to-end check that the library loads and an op runs (the full suite is test_elementwise.py)."""
import torch

import opforge
from opforge.testing import assert_matches_reference, sigmoid_reference


def test_sigmoid_matches_reference(device):
    x = torch.randn(37, 83, device=device)
    assert_matches_reference(opforge.sigmoid(x), sigmoid_reference(x), torch.sigmoid(x))
