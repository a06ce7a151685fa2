"""Shared fixtures: devices (CUDA cases skip cleanly without a GPU), dtypes and seeded RNG."""
import pytest
import torch

import opforge  # noqa: F401  (loads the library once for the whole session)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
ALL_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]
FLOAT_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
LOW_PRECISION = [torch.float16, torch.bfloat16]
ODD_SIZES = [1, 7, 83, 769, 3584, 5120, 8200]


@pytest.fixture(params=ALL_DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
