"""dtcourse.models: seeded determinism, config checks, shapes, causality, and that the models learn."""

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dtcourse.models import (GPT, MLP, GPTConfig, classification_batch, lm_loss, regression_batch,
                             token_batch)

SMALL = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, d_model=16)


def _same_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("make", [lambda seed: GPT(SMALL, seed=seed), lambda seed: MLP((8, 16, 4), seed=seed)],
                         ids=["gpt", "mlp"])
def test_same_seed_same_model_different_seed_different(make):
    a, b, c = make(0), make(0), make(1)
    assert _same_state(a, b)
    assert not _same_state(a, c)
    x = token_batch(SMALL, 3)[0] if isinstance(a, GPT) else regression_batch(3, 8, 4)[0]
    assert torch.equal(a(x), b(x))            # same weights, same ops: bitwise equal
    assert not torch.equal(a(x), c(x))


def test_building_models_and_data_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    GPT(SMALL, seed=5)
    MLP(seed=5)
    token_batch(SMALL, 4, seed=5)
    regression_batch(4, seed=5)
    classification_batch(4, seed=5)
    assert torch.equal(before, torch.get_rng_state())


def test_data_is_deterministic_and_targets_are_next_tokens():
    idx, targets = token_batch(SMALL, 4, seq_len=10, seed=3)
    idx2, targets2 = token_batch(SMALL, 4, seq_len=10, seed=3)
    assert torch.equal(idx, idx2) and torch.equal(targets, targets2)
    assert idx.shape == targets.shape == (4, 10) and idx.dtype == torch.int64
    assert torch.equal(idx[:, 1:], targets[:, :-1])
    assert int(idx.max()) < SMALL.vocab_size
    assert not torch.equal(idx, token_batch(SMALL, 4, seq_len=10, seed=4)[0])
    x, y = regression_batch(5, 8, 3, seed=1)
    assert x.shape == (5, 8) and y.shape == (5, 3)
    x, y = classification_batch(5, 8, 3, seed=1)
    assert y.shape == (5,) and y.dtype == torch.int64 and int(y.max()) < 3


@pytest.mark.parametrize("kwargs, message", [
    (dict(n_head=3, d_model=64), "n_head 3 does not divide d_model 64"),
    (dict(n_layer=0), "n_layer must be a positive integer"),
    (dict(vocab_size=2.5), "vocab_size must be a positive integer"),
    (dict(dropout=1.0), "dropout is a probability"),
])
def test_config_errors_say_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**kwargs)


def test_config_is_frozen_and_mlp_sizes_are_checked():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SMALL.n_layer = 3
    with pytest.raises(ValueError, match="at least two positive integers"):
        MLP((8,))
    with pytest.raises(ValueError, match="at least two positive integers"):
        MLP((8, 0, 2))


def test_gpt_shapes_and_sequence_length_check():
    model = GPT(SMALL)
    idx, _ = token_batch(SMALL, 3, seq_len=7)
    assert model(idx).shape == (3, 7, SMALL.vocab_size)
    with pytest.raises(ValueError, match="exceeds block_size 16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="seq_len must be in"):
        token_batch(SMALL, 1, seq_len=17)


def test_gpt_is_causal():
    model = GPT(SMALL)
    idx, _ = token_batch(SMALL, 2, seq_len=12)
    changed = idx.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % SMALL.vocab_size
    # Positions before the change see exactly the same inputs, so the same numbers.
    assert torch.equal(model(idx)[:, :8], model(changed)[:, :8])
    assert not torch.equal(model(idx)[:, 8:], model(changed)[:, 8:])


def test_dropout_modules_exist_only_when_asked_for():
    assert not any(isinstance(m, nn.Dropout) for m in GPT(SMALL).modules())
    with_dropout = GPT(dataclasses.replace(SMALL, dropout=0.1))
    assert sum(isinstance(m, nn.Dropout) for m in with_dropout.modules()) == 1 + 3 * SMALL.n_layer


def test_lm_head_is_untied_and_default_size_is_as_documented():
    model = GPT(SMALL)
    assert model.lm_head.weight.data_ptr() != model.wte.weight.data_ptr()
    assert 100_000 < sum(p.numel() for p in GPT().parameters()) < 200_000   # "137k" in GPTConfig


def test_the_models_learn():
    # A handful of Adam steps on one fixed batch must cut the loss clearly: a
    # guard against a broken mask, init or head, not a convergence benchmark.
    gpt = GPT(SMALL, seed=0)
    idx, targets = token_batch(SMALL, 16, seed=0)
    opt = torch.optim.Adam(gpt.parameters(), lr=3e-3)
    first = lm_loss(gpt(idx), targets).item()
    for _ in range(40):
        opt.zero_grad()
        loss = lm_loss(gpt(idx), targets)
        loss.backward()
        opt.step()
    assert loss.item() < 0.7 * first

    mlp = MLP((8, 32, 3), seed=0)
    x, y = regression_batch(64, 8, 3)
    opt = torch.optim.Adam(mlp.parameters(), lr=1e-2)
    first = F.mse_loss(mlp(x), y).item()
    for _ in range(40):
        opt.zero_grad()
        loss = F.mse_loss(mlp(x), y)
        loss.backward()
        opt.step()
    assert loss.item() < 0.3 * first
