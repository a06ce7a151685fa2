"""Processes: DataLoader workers started by fork, spawn and forkserver call opforge ops (the library
loaded again, or inherited, in each worker) and return the values the parent computes."""
import multiprocessing

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import opforge


class OpsDataset(Dataset):
    """Item i: every op applied to a seeded tensor (forward and backward), computed in the worker."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(5, 16, generator=g).requires_grad_()
        W = torch.randn(8, 16, generator=g)
        y = opforge.linear(opforge.rms_norm(x, 16), W, None, "gelu")
        y = opforge.square_add(opforge.sigmoid(opforge.swiglu(y, y)), opforge.square(W[:, 0]))
        out, res = opforge.fused_add_rms_norm(y, y, 8)
        (out.sum() + res.sum()).backward()
        return out.detach(), x.grad


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_dataloader_workers(method):
    if method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"{method} is not available on this platform")
    ds = OpsDataset()
    expected = [ds[i] for i in range(len(ds))]
    loader = DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context=method)
    got = list(loader)
    assert len(got) == len(expected)
    for (o, g), (eo, eg) in zip(got, expected):
        assert torch.equal(o, eo) and torch.equal(g, eg)
