"""The course's shared models: a tiny GPT and an MLP, plus deterministic synthetic data.

Every lesson trains one of these two models, so each technique (data, pipeline,
tensor parallelism, ZeRO, checkpointing) is applied to the same plain
``nn.Module``. The models know nothing about parallelism: no process groups, no
ranks. A lesson wraps or shards them; it never edits them.

Example::

    from dtcourse.models import GPT, GPTConfig, token_batch, lm_loss
    model = GPT(GPTConfig(), seed=0); idx, targets = token_batch(GPTConfig(), 8)
    lm_loss(model(idx), targets).backward()

Design choices a lesson relies on:

* **Deterministic from a seed.** ``GPT(config, seed)`` and ``MLP(sizes, seed)``
  build the same weights on every rank and every run, and they do so inside
  ``torch.random.fork_rng`` so the caller's global RNG is left where it was.
  The data helpers use their own ``torch.Generator`` for the same reason.
* **The GPT is GPT-2's layout, small** (Radford et al. 2019, "Language Models are
  Unsupervised Multitask Learners"): token + learned position embeddings,
  pre-LayerNorm blocks of causal self-attention and a 4x GELU MLP, a final
  LayerNorm and a linear LM head.
* **The LM head is untied** from the token embedding (GPT-2 ties them). Untied,
  every parameter belongs to exactly one module, so a pipeline stage or a
  tensor-parallel shard owns its weights outright and needs no extra gradient
  all-reduce between the first and the last stage. It costs vocab_size x d_model
  extra parameters, a few percent at the default size.
* **Attention is written out** (``q @ k^T``, mask, softmax, ``@ v``) instead of
  calling ``scaled_dot_product_attention``, so what autograd saves for backward
  is visible in the code and can be counted exactly (``dtcourse.memory``).
* **Dropout defaults to 0**, and at 0 no dropout module is built at all, so no
  mask is ever allocated or saved.
* **Mixture of experts is a variant of the same GPT** (``moe.py``, lesson 11):
  ``GPTConfig(n_expert=E)`` replaces every block's MLP by an ``MoE`` layer of E
  expert MLPs and a router (top_k, capacity_factor, moe_groups, and the
  auxiliary losses' coefficients are its settings). Its auxiliary losses train
  through the layer's output, so ``lm_loss`` alone still trains the model.
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtcourse.models.moe import MoE, check_moe

__all__ = ["GPTConfig", "GPT", "MLP", "MoE", "token_batch", "regression_batch", "classification_batch",
           "lm_loss", "DDP_GPT", "CURVE_GPT", "RECOMPUTE_GPT"]


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the body with the CPU RNG seeded to ``seed``, then restore the caller's RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


# --------------------------------------------------------------------------- #
# GPT
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class GPTConfig:
    """Shape of the GPT. The defaults make a 137k-parameter model that steps in milliseconds on CPU."""

    vocab_size: int = 256
    block_size: int = 64      # longest sequence the position embedding covers
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    dropout: float = 0.0
    n_expert: int = 0                      # 0: dense MLPs; E > 0: every block's MLP is an MoE of E experts
    top_k: int = 1                         # experts per token (MoE only)
    capacity_factor: float | None = 1.25   # None: dropless (MoE only)
    moe_groups: int = 1                    # GShard's groups: the capacity applies per group of sequences
    moe_aux_loss: float = 0.01             # alpha, the Switch load-balancing loss's coefficient
    moe_z_loss: float = 1e-3               # beta, the router z-loss's coefficient

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig: {name} must be a positive integer, got {value!r}.")
        if self.d_model % self.n_head:
            divisors = [h for h in range(1, self.d_model + 1) if self.d_model % h == 0 and h <= 16]
            raise ValueError(f"GPTConfig: n_head {self.n_head} does not divide d_model {self.d_model}; "
                             f"choose n_head in {divisors} or change d_model to a multiple of "
                             f"{self.n_head}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout is a probability in [0, 1), got {self.dropout!r}.")
        if self.n_expert:
            check_moe(self.n_expert, self.top_k, self.capacity_factor)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


# --------------------------------------------------------------------------- #
# The lessons' model sizes, in one place
# --------------------------------------------------------------------------- #
# Lesson 02 (DDP timelines and benchmark): 867k parameters (3.3 MiB of float32 gradients), big
# enough that all-reducing them shows on a timeline, small enough that a step on one CPU thread
# takes tens of milliseconds.
DDP_GPT = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, d_model=128)
# Lesson 04 (loss curves): small enough that a real fp16 step stays cheap on a CPU without fp16
# arithmetic units, where fp16 runs about 8x slower than fp32 (measured on the course's CI
# machine, an AMD EPYC with AVX but no AVX-512: 131 ms against 16 ms for a forward and backward
# of GPTConfig() at batch 16).
CURVE_GPT = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, d_model=32)
# Lesson 05 (recomputation policies): a·s/h = 8 (GPT-3's is 16), so the attention scores are a
# third of what a layer keeps.
RECOMPUTE_GPT = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=8, d_model=128)


def _dropout(p: float) -> nn.Module:
    # At p == 0 build nothing: an nn.Dropout(0.0) would be a no-op anyway, but
    # Identity makes "no mask is saved" true by construction.
    return nn.Dropout(p) if p > 0 else nn.Identity()


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t attends to positions <= t."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model)   # q, k, v in one matmul
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.attn_drop = _dropout(cfg.dropout)
        self.resid_drop = _dropout(cfg.dropout)
        # True where a query would see a later key. Stored already inverted (not
        # computed as ~tril in forward) so masked_fill saves a view of this buffer
        # for backward instead of a fresh (T, T) tensor.
        future = torch.triu(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool), diagonal=1)
        self.register_buffer("future_mask", future.view(1, 1, cfg.block_size, cfg.block_size),
                             persistent=False)                  # (1, 1, block, block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.c_attn(x)                                     # (B, T, 3C): q, k, v side by side
        return self.resid_drop(self.c_proj(self.core(qkv)))     # (B, T, C)

    def core(self, qkv: torch.Tensor) -> torch.Tensor:
        """Everything between the two projections: scores, mask, softmax, dropout, and the mix of v.

        Kept as its own method so selective recomputation (dtcourse.checkpointing)
        can recompute exactly this part.
        """
        B, T, C3 = qkv.shape
        C = C3 // 3
        hs = C // self.n_head
        q, k, v = qkv.split(C, dim=2)                            # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)        # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)        # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)        # (B, nh, T, hs)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, nh, T, T)
        att = att.masked_fill(self.future_mask[:, :, :T, :T], float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))             # (B, nh, T, T)
        y = att @ v                                              # (B, nh, T, hs)
        return y.transpose(1, 2).contiguous().view(B, T, C)      # (B, T, C), heads side by side


class Block(nn.Module):
    """One pre-LayerNorm transformer layer: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        if cfg.n_expert:      # lesson 11: E expert MLPs behind a router (the dropout is the dense MLP's only)
            self.mlp = MoE(cfg.d_model, cfg.n_expert, cfg.top_k, cfg.capacity_factor, cfg.moe_aux_loss,
                           cfg.moe_z_loss, cfg.moe_groups)
            return
        self.mlp = nn.Sequential(OrderedDict(
            c_fc=nn.Linear(cfg.d_model, 4 * cfg.d_model),
            gelu=nn.GELU(),
            c_proj=nn.Linear(4 * cfg.d_model, cfg.d_model),
            drop=_dropout(cfg.dropout),
        ))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT-2-style decoder. ``forward(idx)`` maps token ids (B, T) to logits (B, T, vocab_size)."""

    def __init__(self, config: GPTConfig = GPTConfig(), seed: int = 0):
        super().__init__()
        self.config = config
        with seeded(seed):
            self.wte = nn.Embedding(config.vocab_size, config.d_model)
            self.wpe = nn.Embedding(config.block_size, config.d_model)
            self.drop = _dropout(config.dropout)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
            self.ln_f = nn.LayerNorm(config.d_model)
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
            self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2's scheme: N(0, 0.02) weights, zero biases, and the two projections
        # that feed the residual stream scaled by 1/sqrt(2 * n_layer) so the
        # stream's variance does not grow with depth.
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                continue        # LayerNorm weights stay 1; their biases and Linear biases stay 0
            std = residual_std if name.endswith("c_proj.weight") else 0.02
            nn.init.normal_(p, mean=0.0, std=std)
        for m in self.modules():
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def aux_loss(self) -> torch.Tensor:
        """The MoE layers' auxiliary losses of the last forward, summed (0 for a dense GPT); for reporting.

        Any block MLP with an ``aux_loss`` counts, so an expert-parallel layer (``dtcourse.moe``) does too."""
        return sum((b.mlp.aux_loss for b in self.blocks if hasattr(b.mlp, "aux_loss")), torch.zeros(()))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"GPT: sequence length {T} exceeds block_size {self.config.block_size}; "
                             "use shorter sequences or a GPTConfig with a larger block_size.")
        pos = torch.arange(T, device=idx.device)                  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))              # (B, T, C)
        for block in self.blocks:
            x = block(x)                                          # (B, T, C)
        return self.lm_head(self.ln_f(x))                         # (B, T, vocab_size)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits (B, T, V) against target ids (B, T)."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))  # (B*T, V) vs (B*T,)


# --------------------------------------------------------------------------- #
# MLP
# --------------------------------------------------------------------------- #
class MLP(nn.Module):
    """Linear layers of the given widths with ReLU between them; ``MLP((16, 64, 64, 4))`` has 3 layers."""

    def __init__(self, sizes: Sequence[int] = (32, 128, 128, 8), seed: int = 0):
        super().__init__()
        sizes = tuple(sizes)
        if len(sizes) < 2 or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes):
            raise ValueError(f"MLP: sizes must be at least two positive integers (input width, ..., "
                             f"output width), got {sizes!r}.")
        self.sizes = sizes
        layers: list[nn.Module] = []
        with seeded(seed):
            for i, (d_in, d_out) in enumerate(zip(sizes[:-1], sizes[1:])):
                layers.append(nn.Linear(d_in, d_out))
                if i < len(sizes) - 2:
                    layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)                                        # (B, sizes[0]) -> (B, sizes[-1])


# --------------------------------------------------------------------------- #
# Synthetic data
# --------------------------------------------------------------------------- #
def token_batch(config: GPTConfig, batch_size: int, seq_len: int | None = None,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (B, T) and next-token targets (B, T) that a GPT can learn.

    Each row counts up from a random start by a random stride, modulo
    vocab_size: after two tokens the rest of the row is predictable, so the loss
    of a working training loop falls well below log(vocab_size).
    """
    T = config.block_size if seq_len is None else seq_len
    if not 1 <= T <= config.block_size:
        raise ValueError(f"token_batch: seq_len must be in [1, block_size={config.block_size}], got {T}.")
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(config.vocab_size, (batch_size, 1), generator=g)
    stride = torch.randint(1, max(2, config.vocab_size // 4), (batch_size, 1), generator=g)
    seq = (start + stride * torch.arange(T + 1)) % config.vocab_size   # (B, T+1)
    # clone, not contiguous(): with B == 1 both slices already count as
    # contiguous and would stay views of one storage.
    return seq[:, :-1].clone(), seq[:, 1:].clone()                      # (B, T), (B, T)


def _teacher(d_in: int, d_out: int) -> torch.Tensor:
    # One fixed "true" weight per shape, whatever the batch seed: batches with
    # different seeds are different samples of the same problem.
    g = torch.Generator().manual_seed(1234 + 7919 * d_in + d_out)
    return torch.randn(d_in, d_out, generator=g) / math.sqrt(d_in)


def regression_batch(batch_size: int, in_features: int = 32, out_features: int = 8,
                     seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs x (B, in) and targets y = x @ W + 0.01 noise (B, out), for an MSE loss."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, in_features, generator=g)
    noise = 0.01 * torch.randn(batch_size, out_features, generator=g)
    return x, x @ _teacher(in_features, out_features) + noise


def classification_batch(batch_size: int, in_features: int = 32, n_classes: int = 8,
                         seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs x (B, in) and integer labels (B,) = argmax of a fixed linear teacher, for cross-entropy."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, in_features, generator=g)
    return x, (x @ _teacher(in_features, n_classes)).argmax(dim=1)
