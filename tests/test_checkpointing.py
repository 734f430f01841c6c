"""dtcourse.checkpointing: the gradients of the plain run and of torch's checkpoint, bit for bit; the
memory it keeps, measured against the prediction; clear errors.

Every parity check is exact (``torch.equal``): a recomputation runs the same ops on the same
inputs with the same RNG state, so on CPU it reproduces every value to the bit, and the
backward that consumes them is the very graph of the plain run. Float64 is used where the
comparison is with torch's checkpoint, float32 elsewhere; neither needs a tolerance.
"""

import dataclasses
import math

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import checkpoint_sequential as torch_checkpoint_sequential

from dtcourse.lab import checkpointing as lab
from dtcourse.lab.widgets import COLUMN_IN
from dtcourse.checkpointing import (Checkpointed, CheckpointedSequential, SelectiveAttention,
                                    apply_full_recomputation, apply_selective_recomputation, checkpoint,
                                    checkpoint_sequential, segment_bounds)
from dtcourse.memory import HeldBytes, SavedTensors
from dtcourse.models import GPT, GPTConfig, lm_loss, token_batch

TINY_GPT = GPTConfig(vocab_size=32, block_size=16, n_layer=3, n_head=4, d_model=32, dropout=0.1)


def dropout_stack(n_layers=6, width=8, p=0.3):
    """Linear, Dropout, Tanh per layer, in float64: a recomputation that drew a new mask would show."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.Dropout(p), nn.Tanh())
                           for _ in range(n_layers))).double()


def run(model, forward, x, seed=1):
    """Outputs, every gradient (parameters, then x) and the RNG state after backward."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(x.requires_grad)
    torch.manual_seed(seed)
    y = forward(x)
    (y.square().sum() + y.sum()).backward()
    grads = [p.grad.clone() for p in model.parameters()] + ([x.grad] if x.requires_grad else [])
    return [y.detach(), *grads], torch.get_rng_state()


def assert_same(a, b):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert torch.equal(u, v), f"tensor {i} differs by up to {(u - v).abs().max().item():.3g}"


# --------------------------------------------------------------------------- #
# Parity: the plain run and torch.utils.checkpoint
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("segments", [1, 2, 3, 4, 5, 6])
def test_checkpoint_sequential_matches_plain_and_torch_with_dropout(segments):
    model, x = dropout_stack(), torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    plain, rng_plain = run(model, model, x)
    ours, rng_ours = run(model, lambda x: checkpoint_sequential(model, segments, x), x)
    assert_same(plain, ours)
    assert torch.equal(rng_plain, rng_ours)     # the recomputation leaves the global RNG where it was
    if 6 % segments == 0:                       # where torch cuts the same segments
        theirs, _ = run(model, lambda x: torch_checkpoint_sequential(model, segments, x, use_reentrant=False),
                        x)
        assert_same(theirs, ours)


def test_without_rng_replay_dropout_draws_a_new_mask():
    model, x = dropout_stack(), torch.randn(5, 8, dtype=torch.float64)
    plain, _ = run(model, model, x)
    ours, _ = run(model, lambda x: checkpoint_sequential(model, 3, x, preserve_rng_state=False), x)
    assert torch.equal(plain[0], ours[0])       # the forward is the same ...
    assert not all(torch.equal(a, b) for a, b in zip(plain[1:], ours[1:]))   # ... backward's masks are not


def test_checkpoint_matches_torch_for_several_outputs_kwargs_and_non_tensors():
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)

    def fn(a, b, scale, *, shift):
        h = torch.nn.functional.dropout(a @ w, 0.5) + b.sin()
        return h * scale + shift, h.exp(), "label"

    a = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 4, dtype=torch.float64)               # no gradient needed for b
    runs = {"plain": fn, "ours": lambda *args, **kw: checkpoint(fn, *args, **kw),
            "torch": lambda *args, **kw: torch_checkpoint(fn, *args, use_reentrant=False, **kw)}
    results = {}
    for name, call in runs.items():
        w.grad = a.grad = None
        torch.manual_seed(3)
        out = call(a, b, 2.0, shift=1.0)
        assert out[2] == "label"
        (out[0].sum() + out[1].sum()).backward()
        results[name] = [out[0].detach(), out[1].detach(), w.grad.clone(), a.grad.clone()]
    assert_same(results["plain"], results["ours"])
    assert_same(results["torch"], results["ours"])


@pytest.mark.parametrize("apply", [apply_full_recomputation, apply_selective_recomputation])
def test_gpt_policies_match_the_plain_gpt_with_dropout(apply):
    idx, targets = token_batch(TINY_GPT, 3)

    def grads(model):
        torch.manual_seed(5)
        loss = lm_loss(model(idx), targets)
        loss.backward()
        return [loss.detach()] + [p.grad for p in model.parameters()]

    assert_same(grads(GPT(TINY_GPT).double()), grads(apply(GPT(TINY_GPT).double())))


def test_selective_keeps_the_state_dict_and_full_wraps_it():
    plain = GPT(TINY_GPT).state_dict()
    selective = apply_selective_recomputation(GPT(TINY_GPT))
    assert isinstance(selective.blocks[0].attn, SelectiveAttention)
    assert selective.state_dict().keys() == plain.keys()
    full = apply_full_recomputation(GPT(TINY_GPT))
    assert isinstance(full.blocks[0], Checkpointed)
    assert "blocks.0.module.attn.c_attn.weight" in full.state_dict()


def test_inputs_without_grad_still_give_parameter_gradients_and_autograd_grad_works():
    model, x = dropout_stack(4), torch.randn(5, 8, dtype=torch.float64)       # x needs no gradient
    plain, _ = run(model, model, x)
    ours, _ = run(model, lambda x: checkpoint_sequential(model, 4, x), x)
    assert_same(plain, ours)
    torch.manual_seed(1)
    y = checkpoint_sequential(model, 2, x)
    got = torch.autograd.grad((y.square().sum() + y.sum()), list(model.parameters()))
    assert_same(plain[1:], list(got))


def test_retain_graph_recomputes_for_each_backward_and_nesting_works():
    model, x = dropout_stack(4), torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(1)
    y = model(x)
    y.sum().backward(retain_graph=True)
    y.sum().backward()
    twice = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    inner = lambda h: checkpoint_sequential(model[1:], 2, h)           # noqa: E731
    y = checkpoint(lambda h: inner(model[0](h)), x)                    # a checkpoint inside a checkpoint
    y.sum().backward(retain_graph=True)
    y.sum().backward()
    assert_same(twice, [p.grad for p in model.parameters()])


def test_autocast_is_replayed():
    model, x = dropout_stack(3).float(), torch.randn(4, 8)
    results = []
    for forward in (model, lambda h: checkpoint_sequential(model, 3, h)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(run(model, forward, x)[0])
    assert results[0][0].dtype == torch.bfloat16
    assert_same(*results)


def test_no_grad_just_runs():
    model, x = dropout_stack(2), torch.randn(2, 8, dtype=torch.float64)
    with torch.no_grad():
        torch.manual_seed(0)
        y = checkpoint_sequential(model, 2, x)
        torch.manual_seed(0)
        assert torch.equal(y, model(x)) and y.grad_fn is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dropout_is_replayed():
    model, x = dropout_stack().cuda(), torch.randn(5, 8, dtype=torch.float64, device="cuda")
    assert_same(run(model, model, x)[0], run(model, lambda x: checkpoint_sequential(model, 3, x), x)[0])


# --------------------------------------------------------------------------- #
# Segments, containers and errors
# --------------------------------------------------------------------------- #
def test_segment_bounds():
    assert segment_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert segment_bounds(4, 1) == [(0, 4)]
    assert segment_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    for n in range(1, 12):
        for k in range(1, n + 1):
            sizes = [end - start for start, end in segment_bounds(n, k)]
            assert sum(sizes) == n and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("segments, error, message", [
    (0, ValueError, r"segments must be between 1 and the number of layers \(6\), got 0"),
    (7, ValueError, r"segments must be between 1 and the number of layers \(6\), got 7"),
    (-1, ValueError, r"got -1"),
    (2.0, TypeError, r"segments must be an int, got float 2.0"),
    (True, TypeError, r"segments must be an int, got bool True"),
])
def test_bad_segment_counts(segments, error, message):
    model, x = dropout_stack(), torch.randn(2, 8, dtype=torch.float64)
    with pytest.raises(error, match=message):
        checkpoint_sequential(model, segments, x)
    with pytest.raises(error, match=message):
        CheckpointedSequential(*model, segments=segments)
    with pytest.raises(ValueError, match="at least one layer"):
        checkpoint_sequential([], 1, x)


def test_checkpointed_sequential_is_a_drop_in_sequential():
    model, x = dropout_stack(), torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    wrapped = CheckpointedSequential(*model, segments=3)
    assert wrapped.state_dict().keys() == model.state_dict().keys() and "segments=3" in repr(wrapped)
    assert type(wrapped[1:3]) is nn.Sequential and wrapped[1] is model[1]     # slices are plain stacks
    assert_same(run(model, model, x)[0], run(model, wrapped, x)[0])


def test_policies_refuse_to_stack_and_want_a_gpt():
    with pytest.raises(ValueError, match="applied twice"):
        apply_full_recomputation(apply_full_recomputation(GPT(TINY_GPT)))
    with pytest.raises(ValueError, match="one recomputation policy per model"):
        apply_selective_recomputation(apply_full_recomputation(GPT(TINY_GPT)))
    with pytest.raises(TypeError, match="expected a models.GPT"):
        apply_full_recomputation(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="wraps a models.CausalSelfAttention"):
        SelectiveAttention(nn.Linear(2, 2))


def test_modifying_an_input_in_place_after_the_forward_is_an_error():
    x = torch.randn(3, 4, requires_grad=True)
    h = x * 2
    y = checkpoint(torch.exp, h)
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match=r"input\(s\) \[0\] of exp were modified in place"):
        y.sum().backward()


def test_a_function_that_changes_between_runs_is_an_error():
    calls = []

    def moody(x):
        calls.append(1)
        return x.exp() if len(calls) == 1 else x.exp().sin()

    y = checkpoint(moody, torch.randn(3, requires_grad=True))
    with pytest.raises(RuntimeError, match=r"recomputing moody saved 2 tensors for backward where the "
                                           r"forward saved 1, first differing at tensor 1 "
                                           r"\(\(3,\) float32 against nothing\)"):
        y.sum().backward()


# --------------------------------------------------------------------------- #
# Memory: what a checkpoint keeps
# --------------------------------------------------------------------------- #
def test_saved_tensors_sees_only_the_plain_last_segment():
    layers, x = lab.mlp_layers(6, 16), torch.randn(4, 16)
    with SavedTensors(layers) as saved:
        checkpoint_sequential(layers, 3, x)
    # the last segment, layers 4 and 5: its input (saved by layer 4's Linear) and layer 4's
    # ReLU output; the checkpointed segments' tensors are hidden behind their own hooks.
    assert saved.nbytes == 2 * 4 * 16 * 4


def test_held_bytes_match_the_segment_prediction():
    points = lab.measure_segments(n_layers=6, width=16, batch=4, repeats=1)
    assert [p.segments for p in points] == [1, 2, 3, 4, 5, 6]
    for p in points:
        last = segment_bounds(6, p.segments)[-1]
        assert p.held_after_forward == p.predicted_held, p
        assert p.recomputed_layers == last[0]            # every layer before the last segment, once
        assert p.peak >= p.held_after_forward and len(p.trace) > p.forward_ops > 0
    assert min(points, key=lambda p: p.held_after_forward).segments in (2, 3)   # √6 ≈ 2.4
    assert lab.predicted_segment_units(16, 4) == 7 and lab.predicted_segment_units(16, 1) == 16


def test_held_bytes_match_the_policy_prediction():
    config = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=4, d_model=16)
    points = {p.policy: p for p in lab.measure_policies(config, batch=2, repeats=1)}
    for p in points.values():
        assert p.held_after_forward == p.predicted_held, p
    s, b, h, a = 16, 2, 16, 4
    assert points["none"].held_after_forward - points["selective"].held_after_forward == 2 * 4 * a * s * s * b
    assert points["full"].held_after_forward == 2 * 4 * s * b * h
    assert points["none"].predicted_overhead == 0 < points["selective"].predicted_overhead \
        < points["full"].predicted_overhead < 1 / 3
    with pytest.raises(ValueError, match="policy must be one of"):
        lab.predicted_policy_bytes(config, 2, 16, "some")


def test_figures_and_widget_draw_the_measurements():
    points = lab.measure_segments(n_layers=4, width=8, batch=2, repeats=1)
    fig = lab.plot_segments(points)
    left, right = fig.axes
    predicted, measured, peak = left.lines[:3]
    assert list(measured.get_ydata()) == [p.held_after_forward / 1024 for p in points]
    assert list(predicted.get_ydata()) == [p.predicted_held / 1024 for p in points]
    assert list(right.lines[1].get_ydata()) == [p.step_ms for p in points]
    policies = lab.measure_policies(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2,
                                                       d_model=8), batch=1, repeats=1)
    bars = lab.plot_policies(policies).axes[0].containers[0]
    assert [b.get_height() for b in bars] == [p.held_after_forward / 2**20 for p in policies]
    box = lab.trace_widget(points)
    assert box.view.segments == 2                                       # √4
    first = box.image.value
    box.slider.value = 4
    assert box.view.segments == 4 and box.image.value != first
    assert list(box.view.curves[4].get_ydata()) == [b / 1024 for b in points[3].trace]
    with pytest.raises(ValueError, match="no measured run with segments=9"):
        box.view.show(9)


def test_figures_fit_the_column_with_titled_panels_and_readable_legends():
    points = lab.measure_segments(n_layers=4, width=8, batch=2, repeats=1)
    policies = lab.measure_policies(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, d_model=8),
                                    batch=1, repeats=1)
    figures = [lab.plot_segments(points), lab.plot_policies(policies), lab.TraceView(points).figure]
    titles = [ax.get_title() for fig in figures for ax in fig.axes]
    assert all(titles) and len(set(titles)) == len(titles), titles
    for fig in figures:
        assert fig.get_figwidth() <= COLUMN_IN
        for ax in fig.axes:
            legend = ax.get_legend()
            assert legend is None or all(t.get_fontsize() >= 8 for t in legend.get_texts())


# --------------------------------------------------------------------------- #
# Fused attention and save_on_cpu
# --------------------------------------------------------------------------- #
def test_fused_attention_saves_no_score_matrix():
    config = GPTConfig(vocab_size=32, block_size=32, n_layer=1, n_head=4, d_model=16)
    saved = lab.attention_saved(config, batch=2)
    scores = 2 * 4 * 32 * 32                                    # (B, a, s, s)
    explicit = [math.prod(shape) for shape, _ in saved["explicit"]]
    fused = [math.prod(shape) for shape, _ in saved["fused"]]
    assert explicit.count(scores) == 2                          # softmax's output, and att @ v's copy of it
    assert max(fused) == 2 * 32 * 16 and len(fused) == 5        # q, k, v, output, and a log-sum-exp per row
    assert sorted(fused)[0] == 2 * 4 * 32


def test_save_on_cpu_counts_every_save_and_copies_nothing_on_cpu():
    off = lab.measure_save_on_cpu(n_layers=3, width=8, batch=4)
    unit, weight = 4 * 8 * 4, 8 * 8 * 4
    assert off.packed == 5 * unit + 2 * weight                  # x; 2 ReLU outputs saved twice; 2 weights
    assert off.copied == 0 and off.held_offloaded == off.held_plain == 3 * unit


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_save_on_cpu_frees_the_activations_on_a_gpu():
    off = lab.measure_save_on_cpu(n_layers=4, width=256, batch=64, device="cuda")
    unit, weight = 64 * 256 * 4, 256 * 256 * 4
    assert off.copied == off.packed == 7 * unit + 3 * weight
    assert off.held_plain - off.held_offloaded == 3 * unit     # the ReLU outputs; the output stays


# --------------------------------------------------------------------------- #
# Problems: each measured answer agrees with the lesson's formula; a wrong formula would not
# --------------------------------------------------------------------------- #
def _agrees_only_with(answer, wrong_formula):
    assert answer.agrees, answer
    assert not dataclasses.replace(answer, formula=wrong_formula).agrees


def test_problem_held_after_forward():
    answer = lab.problem_held_after_forward(n_layers=10, segments=3, width=16, batch=4)
    assert answer.measured == 5 * 16 * 4 * 4 / 1024
    _agrees_only_with(answer, (3 - 1 + math.ceil(10 / 3)) * 16 * 4 * 4 / 1024)   # the last segment as the longest


def test_problem_best_segments():
    answer = lab.problem_best_segments(n_layers=16, ratio=3, width=8, batch=32)
    assert answer.measured == 8
    _agrees_only_with(answer, round(math.sqrt(16)))                                # the √n rule, which assumes L = b


def test_problem_selective_flops():
    config = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, d_model=16)
    answer = lab.problem_selective_flops(config, batch=2)
    _agrees_only_with(answer, 2 * 2 * 2 * 16 * 16 * 16)                           # q·kᵀ alone, without ·v


def test_problem_save_on_cpu_bytes():
    answer = lab.problem_save_on_cpu_bytes(n_layers=3, width=8, batch=4)
    assert answer.measured * 1024 == 5 * 4 * 8 * 4 + 2 * 8 * 8 * 4
    _agrees_only_with(answer, (3 * 4 * 8 * 4 + 2 * 8 * 8 * 4) / 1024)             # each storage copied once


def test_wide_layers_hold_what_the_problem_says():
    layers, x = lab.wide_layers(8, 8, ratio=2), torch.randn(16, 8)
    unit = 16 * 8 * 4
    for k in (1, 2, 4, 8):
        with HeldBytes() as held:
            y = checkpoint_sequential(layers, k, x)
            assert held.now == ((k - 1) + (8 // k) * (1 + 2)) * unit, k
        del y
