"""Compiled autograd: a backward compiled over a graph whose forward ran eagerly (regional
compilation, a Dynamo fallback) works through opforge's nodes as through torch's own modules. The per-op check of
every conformance entry is test_conformance.py::test_compiled_autograd; here a model-level case against torch."""
import torch
from torch._dynamo import compiled_autograd

import opforge


class Block(torch.nn.Module):
    """A pre-norm gated MLP block with every op of opforge, or torch's modules for the same math."""

    def __init__(self, ours: bool, d=32, h=48):
        super().__init__()
        self.ours = ours
        nn = opforge.nn if ours else torch.nn
        self.norm = nn.RMSNorm(d)
        self.gate, self.up, self.down = nn.Linear(d, h), nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x, r):
        if self.ours:
            h, r = opforge.fused_add_rms_norm(x, r, x.shape[-1], self.norm.weight)
            y = self.down(opforge.swiglu(self.gate(h), self.up(h)))
            return opforge.square_add(opforge.sigmoid(y), opforge.square(r[..., 0:1])).sum() + r.sum()
        r = x + r
        h = self.norm(r)
        y = self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))
        return (torch.sigmoid(y).square() + r[..., 0:1].square()).sum() + r.sum()


def _grads(model, x, r, compiled: bool):
    model.zero_grad()
    loss = model(x, r)  # eager forward
    if compiled:
        with compiled_autograd._enable(torch.compile(backend="aot_eager", fullgraph=True)):
            loss.backward()
    else:
        loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def test_compiled_backward_equals_eager(device):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Block(True).to(device)
    x, r = torch.randn(2, 5, 32, device=device), torch.randn(2, 5, 32, device=device)
    eager = _grads(model, x, r, compiled=False)
    for _ in range(2):  # the second backward reuses the compiled graph
        comp = _grads(model, x, r, compiled=True)
        for a, b in zip(comp, eager):
            torch.testing.assert_close(a, b)


def test_opforge_block_under_compiled_autograd_equals_torch_block(device):
    """The same math with torch's modules (eager: torch.nn.Linear and RMSNorm under compiled autograd are torch's
    own business) gives the gradients opforge's nodes give under compiled autograd."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    ours, ref = Block(True).to(device), Block(False).to(device)
    ref.load_state_dict(ours.state_dict())
    x, r = torch.randn(3, 32, device=device), torch.randn(3, 32, device=device)
    for a, b in zip(_grads(ours, x, r, compiled=True), _grads(ref, x, r, compiled=False)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_config_flag_with_compiled_training_step(device):
    """torch._dynamo.config.compiled_autograd = True: the backward inside a compiled step is compiled too."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Block(True).to(device)
    x, r = torch.randn(3, 32, device=device), torch.randn(3, 32, device=device)
    eager = _grads(model, x, r, compiled=False)

    def step(x, r):
        loss = model(x, r)
        loss.backward()
        return loss.detach()

    model.zero_grad()
    with torch._dynamo.config.patch(compiled_autograd=True):
        torch.compile(step, backend="aot_eager")(x, r)
    for p, e in zip(model.parameters(), eager):
        torch.testing.assert_close(p.grad, e)
