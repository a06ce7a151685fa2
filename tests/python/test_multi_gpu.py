"""opforge ops on a second GPU: run on the tensors' device, not the current one (device guard: the profiler
sees their kernels on cuda:1 only), and give the same outputs and gradients as on cuda:0; the current device
is unchanged afterwards; inputs on two different GPUs raise an error naming both. Skipped unless this machine
has at least 2 CUDA GPUs (scripts/multi_gpu_check.sh runs it on the 2-GPU machine)."""
import pytest
import torch

import opforge

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2),
                                reason="needs at least 2 CUDA GPUs")

DTYPES = [torch.float32, torch.bfloat16]


def _cases():
    """name -> (function of tensors, list of (shape) of the inputs)."""
    return {
        "linear": (lambda x, w, b: opforge.linear(x, w, b), [(5, 7, 96), (80, 96), (80,)]),
        "rms_norm": (lambda x, w: opforge.rms_norm(x, (96,), w, 1e-5), [(5, 7, 96), (96,)]),
        "fused_add_rms_norm": (lambda x, r, w: torch.cat(opforge.fused_add_rms_norm(x, r, (96,), w, 1e-5), dim=-1),
                               [(5, 7, 96), (5, 7, 96), (96,)]),
        "swiglu": (lambda g, u: opforge.swiglu(g, u), [(5, 7, 96), (5, 7, 96)]),
        "sigmoid": (lambda x: opforge.sigmoid(x), [(5, 7, 96)]),
        "square_add": (lambda x, o: opforge.square_add(x, o), [(5, 7, 96), (96,)]),
    }


def _run(fn, inputs, device):
    ts = [t.to(device).detach().requires_grad_() for t in inputs]
    y = fn(*ts)
    dy = torch.linspace(-1, 1, y.numel(), dtype=torch.float32).reshape(y.shape).to(device=device, dtype=y.dtype)
    y.backward(dy)
    torch.cuda.synchronize(device)
    return y, [t.grad for t in ts]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(_cases()))
def test_op_on_cuda1_runs_on_cuda1_while_current_device_is_0(name, dtype):
    fn, shapes = _cases()[name]
    torch.manual_seed(0)
    inputs = [torch.randn(s, dtype=dtype) for s in shapes]
    torch.cuda.set_device(0)
    y0, g0 = _run(fn, inputs, "cuda:0")
    assert torch.cuda.current_device() == 0
    y1, g1 = _run(fn, inputs, "cuda:1")
    assert torch.cuda.current_device() == 0, "an opforge op changed the current device"
    assert y1.device == torch.device("cuda:1") and all(g.device == torch.device("cuda:1") for g in g1)
    # Same kernels on the same kind of GPU: equal up to (at most) reduction-order rounding.
    torch.testing.assert_close(y1.cpu(), y0.cpu())
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a.cpu(), b.cpu())


@pytest.mark.parametrize("name", list(_cases()))
def test_kernels_of_an_op_on_cuda1_run_on_cuda1(name):
    """Outputs on cuda:1 alone do not prove where the kernels ran (with peer access a kernel on cuda:0 can
    read cuda:1's memory): the profiler records the device of every kernel, copy and memset."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn, shapes = _cases()[name]
    torch.manual_seed(0)
    inputs = [torch.randn(s, device="cuda:1") for s in shapes]
    torch.cuda.set_device(0)
    _run(fn, inputs, "cuda:1")  # warm-up: cuBLAS handles, allocator
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _run(fn, inputs, "cuda:1")
    assert torch.cuda.current_device() == 0
    devices = [(e.name, e.device_index) for e in prof.events() if e.device_type == DeviceType.CUDA]
    assert devices, f"{name}: the profiler saw no CUDA kernel"
    elsewhere = [(n, d) for n, d in devices if d != 1]
    assert not elsewhere, f"{name}: kernels ran on another device than cuda:1: {elsewhere[:5]}"


def test_whole_model_on_cuda1():
    from opforge.models.llama import Llama, LlamaConfig
    torch.cuda.set_device(0)
    cfg = LlamaConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, max_seq_len=32)
    torch.manual_seed(0)
    m0 = Llama(cfg, device="cuda:0")
    m1 = Llama(cfg, device="cuda:1")
    m1.load_state_dict(m0.state_dict())
    tokens = torch.randint(0, 64, (2, 32))
    l0 = m0.loss(tokens.cuda(0), tokens.cuda(0))
    l1 = m1.loss(tokens.cuda(1), tokens.cuda(1))
    l0.backward()
    l1.backward()
    assert torch.cuda.current_device() == 0
    torch.testing.assert_close(l1.cpu(), l0.cpu(), rtol=1e-6, atol=1e-6)
    for (n, p0), p1 in zip(m0.named_parameters(), m1.parameters()):
        torch.testing.assert_close(p1.grad.cpu(), p0.grad.cpu(), rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("name", ["linear", "rms_norm", "fused_add_rms_norm", "swiglu", "square_add"])
def test_inputs_on_two_gpus_raise_naming_both(name):
    fn, shapes = _cases()[name]
    ts = [torch.randn(s, device="cuda:0") for s in shapes]
    ts[-1] = ts[-1].to("cuda:1")
    with pytest.raises(RuntimeError, match=r"cuda:[01].*cuda:[01]") as e:
        fn(*ts)
    assert "cuda:0" in str(e.value) and "cuda:1" in str(e.value)
