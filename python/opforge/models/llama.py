"""A small Llama-style decoder-only language model, buildable from opforge ops or from torch.nn.

Both backends have the same modules, parameter names and shapes, so one `state_dict` loads into
either and the two train the same function from the same weights; only the kernels differ:

| piece | backend="opforge" | backend="torch" |
| --- | --- | --- |
| q/k/v projections | one GEMM (`qkv_proj`, `opforge.linear`) | one GEMM (`qkv_proj`, `F.linear`) |
| o_proj, down_proj | `opforge.nn.Linear` | `torch.nn.Linear` |
| norms | `opforge.nn.FusedAddRMSNorm` (residual add and norm in one op) | `x + residual`, `torch.nn.RMSNorm` |
| MLP | one gate/up GEMM (`gate_up_proj`), `opforge.swiglu` on its views | one gate/up GEMM, `F.silu(g) * u` |
| RoPE | `opforge.rope` on the q/k views (rotate-half torch ops if not built) | rotate-half RoPE (torch ops) |
| loss | `opforge.linear_cross_entropy` (logits never materialised) | `F.cross_entropy` of fp32 logits |
| attention | `F.scaled_dot_product_attention(is_causal=True)` | the same |
| embedding | `torch.nn.Embedding` | the same |

q/k/v and gate/up are stored fused (one weight each) in both backends, so their state_dicts stay identical.
`Llama(..., fp8="tensorwise" | "rowwise")` (backend="opforge") computes the four projections of every block
(qkv_proj, o_proj, gate_up_proj, down_proj) with `opforge.fp8_linear`; the state_dict is the same.

Source: Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models"; Su et al. 2021,
"RoFormer" (rotary position embedding); Hugging Face transformers' `modeling_llama.py` (module names).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as TF
from torch import Tensor

__all__ = ["LlamaConfig", "Llama", "BACKENDS", "FusedGatedMLP"]

BACKENDS = ("opforge", "torch")


@dataclass
class LlamaConfig:
    """Shape of a `Llama` model.

    Args:
        vocab_size: int. V, the number of token ids (256 for byte-level text). Default: 256.
        d_model: int. D, the hidden size. Default: 128.
        n_layers: int. The number of decoder blocks. Default: 4.
        n_heads: int. Attention heads; D must be divisible by it, with an even head dim D / n_heads. Default: 4.
        n_kv_heads: int or None. Key/value heads (grouped-query attention), dividing n_heads. Default: None,
            meaning n_heads.
        d_ff: int or None. F, the gated MLP's hidden size. Default: None, meaning 8/3·D rounded up to a multiple of
            64 (Llama's rule).
        max_seq_len: int. The longest sequence the RoPE tables cover, in tokens. Default: 2048.
        rope_theta: float. The RoPE base. Default: 10000.0.
        eps: float. RMSNorm epsilon, added to the mean square. Default: 1e-5.
        init_std: float. Standard deviation of the normal initialisation of embeddings and linear weights.
            Default: 0.02.

    Raises:
        ValueError: d_model not divisible by n_heads, n_heads not by n_kv_heads, or an odd head dim.
    """

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: Optional[int] = None
    d_ff: Optional[int] = None
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.d_ff is None:
            self.d_ff = 64 * math.ceil(8 * self.d_model / 3 / 64)
        if self.d_model % self.n_heads != 0:
            raise ValueError(f"LlamaConfig: expected d_model divisible by n_heads, but got {self.d_model} and {self.n_heads}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"LlamaConfig: expected n_heads divisible by n_kv_heads, but got {self.n_heads} and {self.n_kv_heads}")
        if (self.d_model // self.n_heads) % 2 != 0:
            raise ValueError(f"LlamaConfig: expected an even head dim for RoPE, but got {self.d_model // self.n_heads}")

    @property
    def head_dim(self) -> int:
        """H = d_model / n_heads, the size of one attention head."""
        return self.d_model // self.n_heads

    def num_parameters(self) -> int:
        """The number of parameters of the model this config builds.

        Returns:
            int: embedding, blocks, final norm and lm_head.
        """
        D, F, V, hd = self.d_model, self.d_ff, self.vocab_size, self.head_dim
        attn = D * D * 2 + 2 * D * self.n_kv_heads * hd
        block = attn + 3 * D * F + 2 * D
        return V * D * 2 + self.n_layers * block + D

    def to_dict(self) -> dict:
        """The fields as a dict (for JSON records).

        Returns:
            dict of field name to value.
        """
        return asdict(self)


def _check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"opforge.models.llama: expected backend in {BACKENDS}, but got {backend!r}")
    return backend


def _fp8_kw(backend: str, fp8: Optional[str]) -> dict:
    """The `fp8` keyword of an FP8 projection (`{}` for None); ValueError for a bad value or backend="torch"."""
    if fp8 is None:
        return {}
    from ..functional import FP8_GRANULARITIES
    if fp8 not in FP8_GRANULARITIES:
        raise ValueError(f"opforge.models.llama: expected fp8 to be None, 'tensorwise' or 'rowwise', but got {fp8!r}")
    if backend != "opforge":
        raise ValueError(f"opforge.models.llama: fp8={fp8!r} needs backend='opforge' (its projections are "
                         f"opforge.nn.Linear(..., fp8=...)), but got backend={backend!r}")
    return {"fp8": fp8}


def _linear(backend: str, in_features: int, out_features: int, bias: bool = False, **kw) -> torch.nn.Linear:
    if backend == "opforge":
        from .. import nn as onn
        return onn.Linear(in_features, out_features, bias=bias, **kw)
    return torch.nn.Linear(in_features, out_features, bias=bias, **kw)


def rope_tables(seq_len: int, head_dim: int, theta: float = 10000.0, device=None) -> Tuple[Tensor, Tensor]:
    """cos, sin of the RoPE angles t·θ^(−2i/head_dim), in the rotate-half layout of Hugging Face's Llama.

    Args:
        seq_len: int. T, the positions 0..T−1.
        head_dim: int. H, even.
        theta: float. The base. Default: 10000.0.
        device: torch.device or None. Where the tables are made. Default: None.

    Returns:
        (cos, sin), each `(T, H)` float32 (the H/2 frequencies repeated), computed in float64.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    t = torch.arange(seq_len, dtype=torch.float64, device=device)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float(), emb.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x·cos + rotate_half(x)·sin, with rotate_half(x) = cat(−x₂, x₁) over the last dim.

    Args:
        x: `(B, heads, T, H)` floating. Queries or keys.
        cos: `(T, H)` floating, cast to x's dtype.
        sin: `(T, H)` floating, cast to x's dtype.

    Returns:
        `(B, heads, T, H)` in x's dtype.
    """
    cos = cos.to(x.dtype)
    sin = sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _rope_op():
    """opforge.rope when this build has it, else None."""
    if hasattr(torch.ops.opforge, "rope"):
        from .. import functional as OF
        return getattr(OF, "rope", None)
    return None


def _lce_op():
    """opforge.linear_cross_entropy when this build has it, else None."""
    if hasattr(torch.ops.opforge, "linear_cross_entropy"):
        from .. import functional as OF
        return getattr(OF, "linear_cross_entropy", None)
    return None


class Attention(torch.nn.Module):
    """y = o_proj(softmax(q·kᵀ/√H + mask)·v): causal multi-head (or grouped-query) self-attention with RoPE.

    [q, k, v] = qkv_proj(x) (one GEMM; q, k, v are column views of its output), q and k rotated by RoPE
    (`opforge.rope` with backend="opforge" when built); the softmax product is
    `torch.nn.functional.scaled_dot_product_attention(is_causal=True)` (flash or memory-efficient kernels where the
    device has them).

    Args:
        config: LlamaConfig. The model's shape.
        backend: str. `"opforge"` or `"torch"`: which Linear and RoPE the attention uses.
        device: torch.device or None. Factory keyword argument for the parameters. Default: None.
        dtype: torch.dtype or None. Factory keyword argument for the parameters. Default: None.
        fp8: str or None. `"tensorwise"` or `"rowwise"`: qkv_proj and o_proj are `opforge.nn.Linear(..., fp8=fp8)`
            (FP8 GEMMs, backend="opforge" only). Default: None (the parameters' dtype).

    Parameters: `qkv_proj.weight` `((heads + 2·kv_heads)·H, D)`, `o_proj.weight` `(D, heads·H)`.

    Shape: x `(B, T, D)`, cos/sin `(T, H)` -> `(B, T, D)`.
    """

    def __init__(self, config: LlamaConfig, backend: str, device=None, dtype=None, fp8: Optional[str] = None):
        super().__init__()
        kw = {"device": device, "dtype": dtype, **_fp8_kw(backend, fp8)}
        D, hd = config.d_model, config.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, hd
        self.backend = backend
        self.sizes = (config.n_heads * hd, config.n_kv_heads * hd, config.n_kv_heads * hd)
        self.qkv_proj = _linear(backend, D, sum(self.sizes), **kw)  # [q; k; v] rows: one GEMM
        self.o_proj = _linear(backend, config.n_heads * hd, D, **kw)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """The attention of x.

        Args:
            x: `(B, T, D)` floating. The normed hidden states.
            cos: `(T, H)` float32. RoPE table.
            sin: `(T, H)` float32. RoPE table.

        Returns:
            `(B, T, D)` in x's dtype.
        """
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)  # column views of the fused GEMM's output
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.backend == "opforge" and _rope_op() is not None:
            q, k = _rope_op()(q, k, cos.unsqueeze(0), sin.unsqueeze(0))
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv_heads != self.n_heads:
            rep = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        y = TF.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class FusedGatedMLP(torch.nn.Module):
    """y = down_proj(silu(g) · u), [g, u] = gate_up_proj(x): the SwiGLU MLP with gate and up as one GEMM.

    Args:
        hidden_size: int. D.
        intermediate_size: int. F.
        backend: str. `"opforge"` (`opforge.nn.Linear`, `opforge.swiglu` on the two column views of the fused
            output) or `"torch"` (`torch.nn.Linear`, `F.silu(g) * u`).
        bias: bool. Biases on the projections. Default: False.
        device: torch.device or None. Factory keyword argument for the parameters. Default: None.
        dtype: torch.dtype or None. Factory keyword argument for the parameters. Default: None.
        fp8: str or None. `"tensorwise"` or `"rowwise"`: gate_up_proj and down_proj are
            `opforge.nn.Linear(..., fp8=fp8)` (FP8 GEMMs, backend="opforge" only). Default: None (the parameters'
            dtype).

    Parameters: `gate_up_proj.weight` `(2F, D)` (gate rows first, then up), `down_proj.weight` `(D, F)`.

    Shape: `(*, D)` -> `(*, D)`.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, backend: str, bias: bool = False, device=None,
                 dtype=None, fp8: Optional[str] = None):
        super().__init__()
        kw = {"device": device, "dtype": dtype, **_fp8_kw(backend, fp8)}
        self.backend = backend
        self.intermediate_size = intermediate_size
        self.gate_up_proj = _linear(backend, hidden_size, 2 * intermediate_size, bias=bias, **kw)
        self.down_proj = _linear(backend, intermediate_size, hidden_size, bias=bias, **kw)

    def forward(self, x: Tensor) -> Tensor:
        """down_proj(silu(g) · u) of x.

        Args:
            x: `(*, D)` floating. The normed hidden states.

        Returns:
            `(*, D)` in x's dtype.
        """
        g, u = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        if self.backend == "opforge":
            from .. import functional as OF
            return self.down_proj(OF.swiglu(g, u))
        return self.down_proj(TF.silu(g) * u)


class AddRMSNorm(torch.nn.RMSNorm):
    """(rms_norm(x + residual), x + residual) from torch ops: the torch.nn twin of `opforge.nn.FusedAddRMSNorm`.

    A `torch.nn.RMSNorm` (same constructor, `weight` `(D,)` and state_dict) whose forward also takes the residual
    stream.

    Shape: x, residual `(*, D)` -> (output, residual_out), each `(*, D)`. `residual=None` means no add.
    """

    def forward(self, x: Tensor, residual: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """(rms_norm(x + residual), x + residual).

        Args:
            x: `(*, D)` floating. The new values.
            residual: `(*, D)` floating or None. The residual stream; None: no add. Default: None.

        Returns:
            (output, residual_out), each `(*, D)`.
        """
        if residual is not None:
            x = x + residual
        return super().forward(x), x


def _add_and_norm(norm: torch.nn.Module, x: Tensor, residual: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """(norm(x + residual), x + residual); residual=None (the first block) skips the add."""
    if residual is not None:
        return norm(x, residual)
    if isinstance(norm, AddRMSNorm):
        return norm(x)
    from .. import functional as OF
    return OF.rms_norm(x, norm.normalized_shape, norm.weight, norm.eps), x


def _add_norm(backend: str, config: LlamaConfig, **kw) -> torch.nn.Module:
    if backend == "opforge":
        from .. import nn as onn
        return onn.FusedAddRMSNorm(config.d_model, eps=config.eps, **kw)
    return AddRMSNorm(config.d_model, eps=config.eps, **kw)


class Block(torch.nn.Module):
    """One pre-norm decoder block: h = x + attn(norm(x)); out = h + mlp(norm(h)).

    The residual adds are folded into the next norm (vLLM's layout): `forward(x, residual)` receives
    the previous block's MLP output and the running residual stream, and returns its own MLP output
    and the updated stream, so every add+norm pair is one `opforge.functional.fused_add_rms_norm`
    with backend="opforge".

    Args:
        config: LlamaConfig. The model's shape.
        backend: str. `"opforge"` or `"torch"`.
        device: torch.device or None. Factory keyword argument for the parameters. Default: None.
        dtype: torch.dtype or None. Factory keyword argument for the parameters. Default: None.
        fp8: str or None. FP8 projections of the attention and the MLP (see `Attention`). Default: None.

    Shape: x, residual `(B, T, D)` -> (mlp_out, residual), each `(B, T, D)`; residual=None for the first block.
    """

    def __init__(self, config: LlamaConfig, backend: str, device=None, dtype=None, fp8: Optional[str] = None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.attn_norm = _add_norm(backend, config, **kw)
        self.attn = Attention(config, backend, fp8=fp8, **kw)
        self.mlp_norm = _add_norm(backend, config, **kw)
        self.mlp = FusedGatedMLP(config.d_model, config.d_ff, backend, fp8=fp8, **kw)

    def forward(self, x: Tensor, residual: Optional[Tensor], cos: Tensor, sin: Tensor) -> Tuple[Tensor, Tensor]:
        """(mlp_out, residual) of this block.

        Args:
            x: `(B, T, D)` floating. The previous block's MLP output (the embeddings for the first block).
            residual: `(B, T, D)` floating or None. The residual stream; None for the first block.
            cos: `(T, H)` float32. RoPE table.
            sin: `(T, H)` float32. RoPE table.

        Returns:
            (mlp_out, residual), each `(B, T, D)`.
        """
        h, residual = _add_and_norm(self.attn_norm, x, residual)
        a = self.attn(h, cos, sin)
        h, residual = self.mlp_norm(a, residual)
        return self.mlp(h), residual


class Llama(torch.nn.Module):
    """logits = lm_head(norm(blocks(embed(tokens)))): a Llama-style decoder-only language model.

    Args:
        config: LlamaConfig. The model's shape.
        backend: str. `"opforge"` (`opforge.nn.Linear`, FusedAddRMSNorm, swiglu, rope, linear_cross_entropy) or
            `"torch"` (`torch.nn.Linear`, `torch.nn.RMSNorm`, `F.silu(g)·u`, rotate-half RoPE, `F.cross_entropy`).
            Default: `"opforge"`.
        device: torch.device or None. Factory keyword argument for the parameters. Default: None.
        dtype: torch.dtype or None. Factory keyword argument for the parameters (all parameters share one
            dtype; activations run in it). Default: None.
        fp8: str or None. `"tensorwise"` or `"rowwise"`: every decoder block's projections (qkv_proj, o_proj,
            gate_up_proj, down_proj) are `opforge.nn.Linear(..., fp8=fp8)`, whose three GEMMs run in FP8
            (`opforge.functional.fp8_linear`, current scaling); the embedding, the norms, lm_head and the loss keep
            the parameters' dtype. backend="opforge" only; the parameters and the state_dict are unchanged.
            Default: None.

    Parameters (identical names and shapes for both backends): `embed.weight` `(V, D)`;
    `layers.{i}.attn_norm.weight` `(D,)`; `layers.{i}.attn.qkv_proj.weight` `(D + 2·kv_heads·H, D)` (q, k, v
    rows); `layers.{i}.attn.o_proj.weight` `(D, D)`; `layers.{i}.mlp_norm.weight` `(D,)`;
    `layers.{i}.mlp.gate_up_proj.weight` `(2F, D)` (gate, up rows); `layers.{i}.mlp.down_proj.weight` `(D, F)`;
    `norm.weight` `(D,)`; `lm_head.weight` `(V, D)`. No biases.

    Shape: tokens `(B, T)` int64 with T ≤ config.max_seq_len -> logits `(B, T, V)` in the parameters' dtype.

    Raises:
        ValueError: unknown backend; fp8 other than None, "tensorwise" or "rowwise", or fp8 with backend="torch";
            T > config.max_seq_len (in forward).

    Numerics: RoPE tables in float32, cast to the activation dtype; norms accumulate in float32.
    Initialisation: embeddings and linear weights ~ N(0, init_std²), output projections (o_proj,
    down_proj) scaled by 1/√(2·n_layers) (GPT-2's rule), norm weights 1. Deterministic given the
    torch RNG state, and the same for both backends.

    Source: Touvron et al. 2023 (LLaMA); Hugging Face transformers' LlamaForCausalLM.
    """

    def __init__(self, config: LlamaConfig, backend: str = "opforge", device=None, dtype=None,
                 fp8: Optional[str] = None):
        super().__init__()
        self.config = config
        self.backend = _check_backend(backend)
        _fp8_kw(backend, fp8)
        self.fp8 = fp8
        kw = {"device": device, "dtype": dtype}
        self.embed = torch.nn.Embedding(config.vocab_size, config.d_model, **kw)
        self.layers = torch.nn.ModuleList(Block(config, backend, fp8=fp8, **kw) for _ in range(config.n_layers))
        self.norm = _add_norm(backend, config, **kw)
        self.lm_head = _linear(backend, config.d_model, config.vocab_size, **kw)
        cos, sin = rope_tables(config.max_seq_len, config.head_dim, config.rope_theta, device=device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-initialise every parameter (see the class docstring) from the torch RNG."""
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, out_std)
            else:
                p.normal_(0.0, std)

    def hidden(self, tokens: Tensor) -> Tensor:
        """The final normed hidden states, which lm_head maps to logits.

        Args:
            tokens: `(B, T)` int64. Token ids, T ≤ config.max_seq_len.

        Returns:
            `(B, T, D)` in the parameters' dtype.

        Raises:
            ValueError: T > config.max_seq_len.
        """
        T = tokens.shape[-1]
        if T > self.config.max_seq_len:
            raise ValueError(f"Llama: expected at most {self.config.max_seq_len} tokens, but got {T}")
        x = self.embed(tokens)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        residual: Optional[Tensor] = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin)
        h, _ = _add_and_norm(self.norm, x, residual)
        return h

    def forward(self, tokens: Tensor) -> Tensor:
        """logits = lm_head(hidden(tokens)).

        Args:
            tokens: `(B, T)` int64. Token ids, T ≤ config.max_seq_len.

        Returns:
            `(B, T, V)` in the parameters' dtype.
        """
        return self.lm_head(self.hidden(tokens))

    def loss(self, tokens: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy in float32.

        backend="opforge": `opforge.linear_cross_entropy` of the hidden states and lm_head's weight (the `(B·T, V)`
        logits are never materialised) when the build has it; otherwise, and for backend="torch",
        `F.cross_entropy` of the float32 logits.

        Args:
            tokens: `(B, T)` int64. The inputs.
            targets: `(B, T)` int64. The next token of each position.

        Returns:
            `()` float32.
        """
        lce = _lce_op() if self.backend == "opforge" else None
        if lce is not None:
            h = self.hidden(tokens)
            return lce(h.reshape(-1, h.shape[-1]), self.lm_head.weight, targets.reshape(-1)).float()
        logits = self(tokens)
        return TF.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    @torch.no_grad()
    def generate(self, prompt: Tensor, max_new_tokens: int, temperature: float = 0.8, top_k: Optional[int] = 20,
                 generator: Optional[torch.Generator] = None) -> Tensor:
        """Samples max_new_tokens tokens after prompt (recomputes the window of the last max_seq_len tokens each time).

        Args:
            prompt: `(P,)` int64. The start of the text.
            max_new_tokens: int. How many tokens to add.
            temperature: float. Divides the logits (at least 1e-6). Default: 0.8.
            top_k: int or None. Sample among the k most likely tokens; None: all. Default: 20.
            generator: torch.Generator or None. The RNG of the sampling. Default: None.

        Returns:
            `(P + max_new_tokens,)` int64: prompt, then the sample.
        """
        seq = prompt.clone()
        for _ in range(max_new_tokens):
            window = seq[-self.config.max_seq_len:].unsqueeze(0)
            logits = self(window)[0, -1].float() / max(temperature, 1e-6)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(seq.device)
            seq = torch.cat([seq, nxt])
        return seq
