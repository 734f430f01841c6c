"""dtcourse.memory and lesson 00's lab: measured bytes of a training step equal the formulas, kind by kind.

Also the step's trace under HeldBytes (what it holds op by op, and its peak), the figures, and the
lesson's predict-then-check problems. Everything is a few small steps on CPU.
"""

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dtcourse.lab import memory as lab
from dtcourse.lab.memory import plot_step_memory, plot_step_trace, trace_step
from dtcourse.lab.memory import table as memory_table
from dtcourse.lab.problems import Answer
from dtcourse.lab.widgets import COLUMN_IN
from dtcourse.memory import (PHASES, SavedTensors, StepMemory, gpt_activation_bytes, gpt_layer_activation_bytes,
                             korthikanti_layer_bytes, measure_step, mlp_activation_bytes, predict_adam_step,
                             predict_step)
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


OPTIMIZERS = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1),
              "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
              "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


@pytest.mark.parametrize("mixed", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_every_optimizer_and_recipe_equals_its_prediction(optimizer, mixed):
    model, batch, loss_fn = _mlp_case()
    measured = measure_step(model, batch, loss_fn, OPTIMIZERS[optimizer], mixed_dtype=mixed)
    recipe = "adam" if optimizer == "adamw" else optimizer          # AdamW keeps Adam's state
    predicted = predict_step(model, measured.activations, optimizer=recipe, mixed=mixed is not None)
    assert measured == predicted                                     # every kind, master weights included
    n_params = sum(p.numel() for p in model.parameters())
    assert measured.master_weights == (4 * n_params if mixed else 0)
    if optimizer == "sgd_momentum":
        assert measured.optimizer_states - measured.master_weights == 4 * n_params   # one momentum buffer


def test_predict_step_refuses_an_optimizer_it_does_not_know():
    with pytest.raises(ValueError, match="optimizer must be one of"):
        predict_step(MLP((3, 2)), optimizer="lion")


def test_measure_step_marks_every_phase_in_order():
    model, batch, loss_fn = _mlp_case()
    seen = []
    measure_step(model, batch, loss_fn, mark=seen.append)
    assert tuple(seen) == PHASES


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
    assert m.as_dict() == dict(params=1, grads=2, optimizer_states=3, activations=4, master_weights=0)


def _fp32_and_mixed_cases():
    model, batch, loss_fn = _mlp_case()
    cases = {}
    for name, mixed in (("fp32", None), ("bf16 mixed", torch.bfloat16)):
        dtype = mixed or torch.float32
        measured = measure_step(model, batch, loss_fn, mixed_dtype=mixed)
        predicted = predict_adam_step(model, mlp_activation_bytes(model.sizes, 9, "mse", dtype),
                                      mixed=mixed is not None)
        cases[name] = (measured, predicted)
    return cases


def test_figure_stacks_the_measured_kinds_and_marks_the_predicted_tops():
    cases = _fp32_and_mixed_cases()
    fig = plot_step_memory(cases, unit="KiB", title="a title")
    ax, = fig.axes
    assert fig.get_figwidth() <= COLUMN_IN and ax.get_title() == "a title"
    labels = [c.get_label() for c in ax.containers]
    assert labels == ["parameters", "gradients", "fp32 master weights", "optimizer states", "activations"]
    kinds = {"parameters": lambda m: m.params, "gradients": lambda m: m.grads,
             "fp32 master weights": lambda m: m.master_weights,
             "optimizer states": lambda m: m.optimizer_states - m.master_weights,
             "activations": lambda m: m.activations}
    bottoms = [0, 0]
    for container in ax.containers:
        for i, (bar, (measured, _)) in enumerate(zip(container, cases.values())):
            # heights are bytes / 1024: exact in floating point, so compare exactly
            assert bar.get_height() * 1024 == kinds[container.get_label()](measured)
            assert bar.get_y() * 1024 == bottoms[i]
            bottoms[i] += bar.get_height() * 1024
    assert bottoms == [measured.total for measured, _ in cases.values()]
    markers, = [line for line in ax.lines if line.get_label().startswith("predicted")]
    fp32_predicted, mixed_predicted = (predicted for _, predicted in cases.values())
    # fp32 has no master weights, so no marker for them: 4 markers, then 5
    assert list(markers.get_xdata()) == [0] * 4 + [1] * 5
    tops = [y * 1024 for y in markers.get_ydata()]
    assert tops[3] == fp32_predicted.total and tops[-1] == mixed_predicted.total
    assert tops[6] == mixed_predicted.params + mixed_predicted.grads + mixed_predicted.master_weights
    with pytest.raises(ValueError, match="unit must be one of"):
        plot_step_memory(cases, unit="kB")


def test_figure_leaves_out_a_kind_no_case_has():
    fp32_only = {"fp32": _fp32_and_mixed_cases()["fp32"]}
    ax, = plot_step_memory(fp32_only).axes
    assert "fp32 master weights" not in [c.get_label() for c in ax.containers]


# --------------------------------------------------------------------------- #
# The step op by op (HeldBytes): what it holds when each phase ends, and its peak
# --------------------------------------------------------------------------- #
def test_trace_shows_optimizer_states_appear_in_the_first_step_and_the_fp32_grad_copy():
    model, batch, loss_fn = _mlp_case((64, 96, 32), 4)
    n = sum(p.numel() for p in model.parameters())
    fp32 = trace_step(model, batch, loss_fn)
    assert fp32.at_end("model") == 4 * n                        # copying the model is the first allocation
    assert fp32.at_end("backward") == 8 * n                     # weights and grads; m, v not yet
    assert fp32.at_end("end") == 16 * n                         # Adam's `step` tensors are not made by ops
    assert fp32.counted == measure_step(model, batch, loss_fn)  # the same step as the tensor count
    mixed = trace_step(model, batch, loss_fn, mixed_dtype=torch.bfloat16)
    assert mixed.at_end("master") == (2 + 4) * n
    batch16 = 2 * 4 * (64 + 32)                                 # the batch, cast to bf16 inside the step
    assert mixed.at_end("batch") == (2 + 4) * n + batch16
    assert mixed.at_end("upcast") == (2 + 2 + 4 + 4) * n + batch16   # + fp32 copies of the grads
    assert mixed.at_end("step") == 20 * n + batch16             # + m and v
    # Adam's update makes temporaries, at most two of the largest parameter at a time (single-tensor Adam)
    assert 20 * n + batch16 < mixed.phase_peak("step") <= 20 * n + batch16 + 2 * 4 * 96 * 64
    assert mixed.at_end("end") == 16 * n + batch16
    assert mixed.peak == max(mixed.held) == max(mixed.phase_peak(phase) for phase in PHASES)


def test_the_peak_of_an_activation_heavy_step_is_below_the_sum_of_the_kinds():
    s, b = SMALL.block_size, 8
    trace = trace_step(GPT(SMALL), token_batch(SMALL, b), lm_loss)
    c = trace.counted
    # At the end of the forward: the weights, the activations and the 4-byte loss, less the int64 token
    # ids and targets, which are saved but were made before the step (outside HeldBytes).
    assert trace.at_end("forward") == c.params + c.activations - 2 * 8 * s * b + 4
    assert trace.at_end("forward") < trace.peak < c.total     # backward's temporaries, but never all four kinds
    assert trace.phase_peak("backward") == trace.peak


def test_trace_figure_draws_each_trace_with_its_phases():
    model, batch, loss_fn = _mlp_case()
    traces = {"fp32": trace_step(model, batch, loss_fn),
              "bf16": trace_step(model, batch, loss_fn, mixed_dtype=torch.bfloat16)}
    fig = plot_step_trace(traces, unit="B")
    assert fig.get_figwidth() <= COLUMN_IN and len(fig.axes) == 2
    for ax, (name, trace) in zip(fig.axes, traces.items()):
        assert ax.get_title().startswith(name) and f"peak {trace.peak:,} B" in ax.get_title()
        held, = [line for line in ax.lines if line.get_label() == "held, measured"]
        assert list(held.get_ydata()) == list(trace.held)
    with pytest.raises(ValueError, match="unit must be one of"):
        plot_step_trace(traces, unit="kB")


def test_fused_attention_saves_no_square_matrix():
    saved = lab.attention_saved(SMALL, batch_size=3)
    s, a = SMALL.block_size, SMALL.n_head
    written = [shape for shape, _ in saved["written out"]]
    assert (3, a, s, s) in written
    assert all(shape[-2:] != (s, s) for shape, _ in saved["scaled_dot_product_attention"])
    assert (3, a, s) in [shape for shape, _ in saved["scaled_dot_product_attention"]]   # a log-sum-exp per row


# --------------------------------------------------------------------------- #
# The lesson's problems: each measurement agrees with its formula, and the numbers the lesson quotes
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("problem, quoted", [
    (lab.problem_sgd_momentum_step, 7_702_020),
    (lab.problem_model_states, 4_206_608),
    (lab.problem_attention_scores, 1_048_576),
    (lab.problem_before_first_step, 1_643_520),
])
def test_problems_agree_with_their_formulas_and_the_worked_answers(problem, quoted):
    answer = problem()
    assert answer.agrees and answer.measured == answer.formula == quoted, answer
    # a formula a little off would not pass: by one 4-byte step counter, or by 5%
    for wrong in (answer.formula + 4, answer.formula * 1.05):
        assert not Answer(answer.measured, wrong, answer.unit, answer.rtol, answer.why).agrees


def test_problems_measure_what_they_ask_on_other_sizes():
    assert lab.problem_attention_scores(SMALL, batch_size=3).measured == 2 * 2 * 16 * 16 * 3 * 4
    answer = lab.problem_model_states(sizes=(5, 7, 3), mixed_dtype=torch.float16)
    assert answer.agrees and answer.measured == 16 * (5 * 7 + 7 + 7 * 3 + 3) + 4 * 4


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
    # The allocator also holds the loss until backward; autograd does not save it. MSE's 0-dim loss keeps a
    # storage the size of its inputs (the test below), 1 MiB in fp32 here.
    loss_storage = _mse_loss_storage(256, 1024, mixed or torch.float32)
    assert loss_storage == 256 * 1024 * (mixed or torch.float32).itemsize
    for kind in StepMemory.KINDS:
        extra = loss_storage if kind == "activations" else 0
        assert getattr(allocated, kind) == pytest.approx(getattr(counted, kind) + extra, rel=1e-2), kind


def _mse_loss_storage(rows: int, cols: int, dtype: torch.dtype) -> int:
    out = torch.zeros(rows, cols, dtype=dtype, requires_grad=True)
    return F.mse_loss(out, torch.ones(rows, cols, dtype=dtype)).untyped_storage().nbytes()


def test_mse_loss_returns_a_scalar_that_keeps_a_storage_the_size_of_its_inputs():
    """Why the GPU's allocator read 1 MiB more activations than autograd saves (2026-11-26/27, H200 and H100):
    F.mse_loss allocates its output with the inputs' shape and returns it as a 0-dim view, so the loss, alive
    from the forward until after backward, holds that whole storage. Cross-entropy's loss does not."""
    for dtype in (torch.float32, torch.bfloat16):
        assert _mse_loss_storage(8, 5, dtype) == 8 * 5 * dtype.itemsize
    logits = torch.zeros(8, 5, requires_grad=True)
    assert F.cross_entropy(logits, torch.zeros(8, dtype=torch.long)).untyped_storage().nbytes() == 4


def test_table_lists_every_kind_for_every_column():
    m = StepMemory(params=1000, grads=2, optimizer_states=3, activations=4)
    lines = memory_table({"a": m, "b": m}).splitlines()
    assert lines[0].split() == ["a", "b"]
    assert lines[1].split() == ["params", "1,000", "1,000"]
    assert [line.split()[0] for line in lines[1:]] == [*StepMemory.KINDS, "model_states", "total"]


def test_table_shows_the_master_weights_inside_the_optimizer_states():
    mixed = StepMemory(params=2, grads=2, optimizer_states=12, activations=1, master_weights=4)
    lines = memory_table({"fp32": StepMemory(4, 4, 8, 1), "mixed": mixed}).splitlines()
    assert lines[3].split() == ["optimizer_states", "8", "12"]
    assert lines[4].split() == ["of", "which", "master", "0", "4"]
