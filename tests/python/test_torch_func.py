"""torch.func: grad, vjp, per-sample gradients (vmap(grad)) and jacrev through opforge ops equal
torch's own composition; forward-mode transforms (jvp, jacfwd, hessian) raise an error naming the op. The per-op
check of every conformance entry is test_conformance.py::test_torch_func; here the model-level cases."""
import pytest
import torch
import torch.func as tf
import torch.nn.functional as TF

import opforge


def _mlp(ours):
    def f(params, x):
        w1, b1, g, w2 = params
        if ours:
            h = opforge.rms_norm(x, x.shape[-1], g)
            return opforge.linear(opforge.linear(h, w1, b1, "gelu"), w2).square().sum()
        h = TF.rms_norm(x, (x.shape[-1],), g)
        return TF.linear(TF.gelu(TF.linear(h, w1, b1)), w2).square().sum()
    return f


def _params(device):
    torch.manual_seed(0)
    d = torch.float64
    return (torch.randn(16, 8, device=device, dtype=d), torch.randn(16, device=device, dtype=d),
            torch.randn(8, device=device, dtype=d), torch.randn(4, 16, device=device, dtype=d))


def test_per_sample_gradients_equal_torch(device):
    """vmap(grad): the per-sample gradients of privacy (DP-SGD) and influence-function code."""
    params = _params(device)
    x = torch.randn(6, 8, device=device, dtype=torch.float64)
    ours = tf.vmap(tf.grad(_mlp(True)), in_dims=(None, 0))(params, x)
    ref = tf.vmap(tf.grad(_mlp(False)), in_dims=(None, 0))(params, x)
    for a, b in zip(ours, ref):
        assert a.shape[0] == 6
        torch.testing.assert_close(a, b)


def test_grad_and_vjp_equal_torch(device):
    params = _params(device)
    x = torch.randn(3, 8, device=device, dtype=torch.float64)
    for a, b in zip(tf.grad(_mlp(True))(params, x), tf.grad(_mlp(False))(params, x)):
        torch.testing.assert_close(a, b)
    out, fn = tf.vjp(lambda x: opforge.swiglu(x, x.flip(-1)), x)
    out_r, fn_r = tf.vjp(lambda x: TF.silu(x) * x.flip(-1), x)
    torch.testing.assert_close(out, out_r)
    torch.testing.assert_close(fn(torch.ones_like(out))[0], fn_r(torch.ones_like(out))[0])


def test_jacrev_equals_torch(device):
    x = torch.randn(3, 5, device=device, dtype=torch.float64)
    w = torch.randn(5, device=device, dtype=torch.float64)
    torch.testing.assert_close(tf.jacrev(lambda x: opforge.rms_norm(x, 5, w))(x),
                               tf.jacrev(lambda x: TF.rms_norm(x, (5,), w))(x))


def test_hessian_of_double_differentiable_ops_by_reverse_mode(device):
    """jacrev(jacrev(...)): second derivatives where double backward exists (elementwise, swiglu, linear)."""
    x = torch.randn(4, device=device, dtype=torch.float64)
    w = torch.randn(3, 4, device=device, dtype=torch.float64)
    f = lambda x: opforge.sigmoid(opforge.linear(x, w, None, "gelu")).sum()  # noqa: E731
    g = lambda x: torch.sigmoid(TF.gelu(TF.linear(x, w))).sum()  # noqa: E731
    torch.testing.assert_close(tf.jacrev(tf.jacrev(f))(x), tf.jacrev(tf.jacrev(g))(x))


def test_second_derivative_of_rms_norm_raises_naming_the_op(device):
    x = torch.randn(2, 4, device=device, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="opforge::rms_norm_backward: double backward is not supported"):
        tf.jacrev(tf.jacrev(lambda x: opforge.rms_norm(x, 4).square().sum()))(x)


@pytest.mark.parametrize("transform", ["jvp", "jacfwd"])
def test_forward_mode_raises_naming_the_op(device, transform):
    x = torch.randn(3, 4, device=device)
    for name, fn in (("sigmoid", opforge.sigmoid), ("rms_norm", lambda x: opforge.rms_norm(x, 4)),
                     ("linear", lambda x: opforge.linear(x, x.T.contiguous()))):
        with pytest.raises(NotImplementedError, match=rf"opforge::{name}: forward-mode AD is not supported"):
            if transform == "jvp":
                tf.jvp(fn, (x,), (torch.ones_like(x),))
            else:
                tf.jacfwd(fn)(x)
