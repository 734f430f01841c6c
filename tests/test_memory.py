"""dtcourse.memory: measured bytes of a training step equal the formulas, kind by kind."""

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dtcourse.memory import (SavedTensors, StepMemory, gpt_activation_bytes, gpt_layer_activation_bytes,
                             korthikanti_layer_bytes, measure_step, mlp_activation_bytes, predict_adam_step)
from dtcourse.lab.memory import plot_step_memory
from dtcourse.lab.memory import table as memory_table
from dtcourse.models import GPT, MLP, GPTConfig, classification_batch, lm_loss, regression_batch, token_batch

SMALL = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, d_model=16)


def _mlp_case(sizes=(12, 24, 20, 5), batch=9, loss="mse"):
    batch_fn, loss_fn = ((regression_batch, F.mse_loss) if loss == "mse"
                         else (classification_batch, F.cross_entropy))
    return MLP(sizes), batch_fn(batch, sizes[0], sizes[-1]), loss_fn


# --------------------------------------------------------------------------- #
# Model states: exactly the table, fp32 and mixed
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("mixed", [None, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("which", ["gpt", "mlp"])
def test_model_states_equal_the_16_bytes_per_param_formula(which, mixed):
    if which == "gpt":
        model, batch, loss_fn = GPT(SMALL), token_batch(SMALL, 3), lm_loss
    else:
        model, batch, loss_fn = _mlp_case()
    measured = measure_step(model, batch, loss_fn, mixed_dtype=mixed)
    predicted = predict_adam_step(model, mixed=mixed is not None)
    for kind in ("params", "grads", "optimizer_states"):
        assert getattr(measured, kind) == getattr(predicted, kind), kind
    n_params = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    assert measured.model_states == 16 * n_params + 4 * n_tensors   # 4: Adam's `step` per tensor


def test_other_optimizers_are_measured_too():
    model, batch, loss_fn = _mlp_case()
    n_params = sum(p.numel() for p in model.parameters())
    sgd = measure_step(model, batch, loss_fn, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    assert sgd.optimizer_states == 4 * n_params                      # one momentum buffer
    plain = measure_step(model, batch, loss_fn, lambda p: torch.optim.SGD(p, lr=0.1))
    assert plain.optimizer_states == 0


def test_measuring_leaves_the_callers_model_untouched():
    model, batch, loss_fn = _mlp_case()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    measure_step(model, batch, loss_fn, mixed_dtype=torch.bfloat16)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


# --------------------------------------------------------------------------- #
# Activations: exactly the op-by-op derivations
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
@pytest.mark.parametrize("sizes, batch", [((12, 24, 20, 5), 9), ((7, 3), 4), ((16, 64, 64, 64, 10), 32)])
def test_mlp_activations_equal_the_analytic_count(sizes, batch, loss, dtype):
    model, data, loss_fn = _mlp_case(sizes, batch, loss)
    mixed = None if dtype == torch.float32 else dtype
    measured = measure_step(model, data, loss_fn, mixed_dtype=mixed)
    assert measured.activations == mlp_activation_bytes(sizes, batch, loss, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config, batch, seq_len", [
    (SMALL, 3, 16),
    (SMALL, 5, 7),
    (SMALL, 1, 16),
    (GPTConfig(vocab_size=50, block_size=24, n_layer=3, n_head=4, d_model=32), 2, 24),
    (GPTConfig(n_layer=1, n_head=8), 4, 64),
])
def test_gpt_activations_equal_the_per_layer_derivation(config, batch, seq_len, dtype):
    # Exact on CPU: the derivation accounts for every tensor autograd saves
    # (CUDA differs in one place: bf16 LayerNorm keeps its statistics in fp32).
    mixed = None if dtype == torch.float32 else dtype
    measured = measure_step(GPT(config), token_batch(config, batch, seq_len), lm_loss, mixed_dtype=mixed)
    assert measured.activations == gpt_activation_bytes(config, batch, seq_len, dtype)


def test_one_layer_measured_alone_matches_the_layer_formula():
    from dtcourse.models import Block
    s, b, h, a = 16, 3, 16, 2
    block = Block(SMALL)
    x = torch.randn(b, s, h, requires_grad=True)
    with SavedTensors(block) as saved:
        block(x)
    assert saved.nbytes == gpt_layer_activation_bytes(SMALL, b, s)
    # fp32, no dropout: sbh(64 + 4as/h) + 16sb ...
    assert saved.nbytes == s * b * h * (64 + 4 * a * s / h) + 16 * s * b
    # ... which is Korthikanti et al.'s 16-bit layer less its dropout terms
    # (masks sbh + sbh + as^2b, dropped-out copy 2as^2b), doubled, plus LN statistics.
    reference = korthikanti_layer_bytes(s, b, h, a) - (2 * s * b * h + 3 * a * s * s * b)
    assert saved.nbytes == 2 * reference + 16 * s * b


def test_dropout_is_refused_by_the_derivation():
    with pytest.raises(ValueError, match="dropout=0"):
        gpt_layer_activation_bytes(dataclasses.replace(SMALL, dropout=0.1), 2, 8)


def test_saved_tensors_count_each_storage_once_and_skip_parameters():
    lin = nn.Linear(4, 3)
    x = torch.randn(5, 4, requires_grad=True)
    with SavedTensors(lin) as saved:
        y = x * x                 # saves x twice: one storage
        z = y[:, :2] * y[:, 2:]   # saves two views of y: one storage
        lin(x)                    # saves x again and a view of the weight (a parameter)
        (lin.weight * 2).sum()    # multiplying by a Python number saves nothing
    assert saved.nbytes == x.nbytes + y.nbytes
    assert z.shape == (5, 2)


def test_activations_grow_linearly_with_batch_size():
    sizes = [measure_step(GPT(SMALL), token_batch(SMALL, b), lm_loss).activations for b in (1, 2, 4)]
    per_sample = sizes[1] - sizes[0]
    assert sizes[2] - sizes[1] == 2 * per_sample
    # shared by the whole batch: the int64 positions (8s) and the loss's 0-dim total weight (4)
    assert sizes[0] - per_sample == 8 * SMALL.block_size + 4


# --------------------------------------------------------------------------- #
# API edges and the figure
# --------------------------------------------------------------------------- #
def test_allocator_measurement_needs_cuda():
    model, batch, loss_fn = _mlp_case()
    with pytest.raises(ValueError, match="needs device='cuda'"):
        measure_step(model, batch, loss_fn, by="allocator")
    with pytest.raises(ValueError, match="by must be"):
        measure_step(model, batch, loss_fn, by="guess")


def test_step_memory_totals():
    m = StepMemory(params=1, grads=2, optimizer_states=3, activations=4)
    assert (m.model_states, m.total) == (6, 10)
    assert m.as_dict() == dict(params=1, grads=2, optimizer_states=3, activations=4)


def test_figure_shows_the_measured_and_predicted_numbers():
    model, batch, loss_fn = _mlp_case()
    cases = {}
    for name, mixed in (("fp32", None), ("bf16 mixed", torch.bfloat16)):
        dtype = mixed or torch.float32
        measured = measure_step(model, batch, loss_fn, mixed_dtype=mixed)
        predicted = predict_adam_step(model, mlp_activation_bytes(model.sizes, 9, "mse", dtype),
                                      mixed=mixed is not None)
        cases[name] = (measured, predicted)
    fig = plot_step_memory(cases, unit="KiB")
    axes = fig.axes
    assert len(axes) == 2
    for ax, (name, (measured, predicted)) in zip(axes, cases.items()):
        bars_measured, bars_predicted = ax.containers
        assert bars_measured.get_label() == "measured" and bars_predicted.get_label() == "predicted"
        # heights are bytes / 1024: exact in floating point, so compare exactly
        assert [bar.get_height() * 1024 for bar in bars_measured] == list(measured.as_dict().values())
        assert [bar.get_height() * 1024 for bar in bars_predicted] == list(predicted.as_dict().values())
        assert name in ax.get_title()
    with pytest.raises(ValueError, match="unit must be one of"):
        plot_step_memory(cases, unit="kB")


# --------------------------------------------------------------------------- #
# CUDA: the allocator as a second measurement
# --------------------------------------------------------------------------- #
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mixed", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_allocator_agrees_with_the_tensor_count(mixed):
    # Large tensors, few of them: the caching allocator rounds each block up to
    # 512 bytes, and Adam keeps `step` on the CPU (4 bytes per tensor the
    # allocator never sees), so the two agree to well under 1%, not exactly.
    model, batch, loss_fn = _mlp_case((1024, 2048, 2048, 1024), 256)
    counted = measure_step(model, batch, loss_fn, mixed_dtype=mixed, device="cuda")
    allocated = measure_step(model, batch, loss_fn, mixed_dtype=mixed, device="cuda", by="allocator")
    for kind in StepMemory.KINDS:
        assert getattr(allocated, kind) == pytest.approx(getattr(counted, kind), rel=1e-2), kind


def test_table_lists_every_kind_for_every_column():
    m = StepMemory(params=1000, grads=2, optimizer_states=3, activations=4)
    lines = memory_table({"a": m, "b": m}).splitlines()
    assert lines[0].split() == ["a", "b"]
    assert lines[1].split() == ["params", "1,000", "1,000"]
    assert [line.split()[0] for line in lines[1:]] == [*StepMemory.KINDS, "model_states", "total"]
