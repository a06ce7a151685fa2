"""CUDA limits (issue 12): tensors past 2**31 elements and past 65535 rows for every op, and an out-of-memory
inside an op. CUDA only (they skip cleanly without a GPU); the large cases need ~40 GiB of device memory.

Each large case checks the rows around the boundaries (0, 65535, 65536, the last) of the forward and of the
input gradient against the float64 reference computed on those rows alone.
"""
import gc

import pytest
import torch

import opforge
from opforge import testing

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
BIG = 2**31 + 4096  # elements: past int32 indexing


def _rows(m):
    return sorted({0, 65535, 65536, m - 1})


def _check_rows(got, ref_fn, m, what):
    rows = _rows(m)
    ref = ref_fn(rows)
    sub = got.reshape(m, -1)[rows].double()
    err = (sub - ref).abs().max().item()
    scale = ref.abs().max().item() + 1e-6
    assert err <= 2e-2 * scale, f"{what}: max abs error {err} at rows {rows} (scale {scale})"


@cuda
@pytest.mark.parametrize("name", ["sigmoid", "square", "square_add", "swiglu"])
def test_elementwise_past_int32(name):
    n = 8192
    m = BIG // n + 1  # rows > 65535 as well
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    if name == "square_add":
        other = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        y = opforge.square_add(x, other)
        ref = lambda r: testing.square_add_reference(x.detach()[r].double(), other.double())  # noqa: E731
    elif name == "swiglu":
        up = torch.randn(n, device="cuda", dtype=torch.bfloat16).expand(m, n)
        y = opforge.swiglu(x, up)
        ref = lambda r: testing.swiglu_reference(x.detach()[r].double(), up[r].double())  # noqa: E731
    else:
        y = getattr(opforge, name)(x)
        ref = lambda r: getattr(testing, f"{name}_reference")(x.detach()[r].double())  # noqa: E731
    _check_rows(y, ref, m, f"{name} forward")
    y.backward(torch.ones_like(y))
    assert torch.isfinite(x.grad.reshape(m, -1)[_rows(m)]).all()
    del x, y
    gc.collect()
    torch.cuda.empty_cache()


@cuda
@pytest.mark.parametrize("fused", [False, True])
def test_rms_norm_past_int32(fused):
    n = 32768
    m = BIG // n + 1  # 65537 rows
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    if fused:
        r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        y, z = opforge.fused_add_rms_norm(x, r, [n], w)
        ref = lambda rows: testing.rms_norm_reference(  # noqa: E731
            x.detach()[rows].double() + r[rows].double(), [n], w.detach().double())
    else:
        y = opforge.rms_norm(x, [n], w)
        ref = lambda rows: testing.rms_norm_reference(x.detach()[rows].double(), [n], w.detach().double())  # noqa: E731
    _check_rows(y, ref, m, "rms_norm forward")
    y.backward(torch.ones_like(y))
    assert torch.isfinite(x.grad.reshape(m, -1)[_rows(m)]).all() and torch.isfinite(w.grad).all()
    del x, y
    gc.collect()
    torch.cuda.empty_cache()


@cuda
def test_linear_output_past_int32():
    k, n = 64, 4100
    m = BIG // n + 1
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = opforge.linear(x, w, activation="silu")
    _check_rows(y, lambda r: testing.linear_reference(x.detach()[r].double(), w.detach().double(), None, "silu"),
                m, "linear forward")
    y.backward(torch.ones_like(y))
    assert torch.isfinite(x.grad[_rows(m)]).all() and torch.isfinite(w.grad).all()
    del x, y
    gc.collect()
    torch.cuda.empty_cache()


@cuda
def test_out_of_memory_inside_an_op_is_clean():
    """An op whose output cannot be allocated raises torch.OutOfMemoryError, leaks nothing, and the next call works."""
    torch.cuda.empty_cache()
    x = torch.randn(1024, 1024, device="cuda")
    before = torch.cuda.memory_allocated()
    free, total = torch.cuda.mem_get_info()
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 64 * 2**20) / total)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            opforge.linear(x[:1].expand(200_000, 1024), x)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    gc.collect()
    assert torch.cuda.memory_allocated() == before
    torch.testing.assert_close(opforge.sigmoid(x), torch.sigmoid(x))
