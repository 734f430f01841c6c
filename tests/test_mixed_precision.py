"""Mixed precision: the loss scalers against torch.amp.GradScaler, master weights, recipes, figures.

The scalers are fed the same gradient stream as ``torch.amp.GradScaler("cpu")``, with infs
and NaNs injected, and must make the same decisions: the same scale after every update, the
same steps skipped and bit-identical parameters (both multiply the gradients by the same
fp32 reciprocal, so no tolerance is needed). Run just these with
``pytest -q tests/test_mixed_precision.py``; the GPU tests are skipped without CUDA.
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from dtcourse import memory
from dtcourse.lab import mixed_precision as figures
from dtcourse.lab.mixed_precision import Recipe, TrainingRun, train
from dtcourse.mixed_precision import DynamicLossScaler, MasterWeights, StaticLossScaler
from dtcourse.models import CURVE_GPT, GPT, MLP, lm_loss, regression_batch, token_batch

INF, NAN = math.inf, math.nan
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# --------------------------------------------------------------------------- #
# The same decisions as GradScaler
# --------------------------------------------------------------------------- #
def run_stream(scaler, steps: int, inject: dict[int, float] | None = None, loss_mult: float = 1.0,
               unscale_first: bool = False) -> list[tuple]:
    """Train an MLP with SGD under ``scaler``; at step s, gradient [0, 0] is set to inject[s].

    Returns, per step: the scale after update(), whether optimizer.step() ran, the parameters
    and the state dict.
    """
    inject = inject or {}
    model = MLP((4, 8, 3), seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    calls: list[int] = []
    optimizer.register_step_post_hook(lambda *_: calls.append(1))
    record = []
    for step in range(steps):
        x, y = regression_batch(8, 4, 3, seed=step)
        scaler.scale(F.mse_loss(model(x), y) * loss_mult).backward()
        if step in inject:
            model.net[0].weight.grad[0, 0] = inject[step]
        if unscale_first:
            scaler.unscale_(optimizer)                  # where gradient clipping would go
        before = len(calls)
        scaler.step(optimizer)
        scaler.update()
        record.append((scaler.get_scale(), len(calls) > before,
                       [p.detach().clone() for p in model.parameters()], scaler.state_dict()))
        optimizer.zero_grad(set_to_none=True)
    return record


def assert_same_decisions(ours: list[tuple], theirs: list[tuple]) -> None:
    for step, ((s1, ran1, p1, d1), (s2, ran2, p2, d2)) in enumerate(zip(ours, theirs)):
        assert s1 == s2, f"step {step}: scale {s1} vs GradScaler's {s2}"
        assert ran1 == ran2, f"step {step}: optimizer.step() ran={ran1} vs GradScaler's {ran2}"
        assert all(torch.equal(a, b) for a, b in zip(p1, p2)), f"step {step}: parameters differ"
        assert d1 == d2, f"step {step}: state dicts {d1} vs {d2}"
    assert len(ours) == len(theirs)


STREAMS = {
    # name: (scaler keyword arguments, steps, injected gradient values, loss multiplier)
    "clean, grows every 3 steps": (dict(growth_interval=3), 10, {}, 1.0),
    "inf, nan and two infs in a row": (dict(growth_interval=3), 14, {2: INF, 5: NAN, 9: -INF, 10: INF}, 1.0),
    "defaults": ({}, 6, {3: INF}, 1.0),
    "factors that are not powers of two": (dict(init_scale=1000.0, growth_factor=3.3, backoff_factor=0.3,
                                                growth_interval=2), 12, {4: INF, 5: NAN}, 1.0),
    "real overflow from a huge scale": (dict(init_scale=2.0 ** 127, growth_interval=2), 12, {}, 1e3),
    "growth that would overflow fp32": (dict(init_scale=2.0 ** 127, growth_interval=1), 4, {}, 0.0),
}


@pytest.mark.parametrize("name", STREAMS)
@pytest.mark.parametrize("unscale_first", [False, True])
def test_dynamic_scaler_decides_as_gradscaler(name, unscale_first):
    kwargs, steps, inject, mult = STREAMS[name]
    ours = run_stream(DynamicLossScaler(**kwargs), steps, inject, mult, unscale_first)
    theirs = run_stream(torch.amp.GradScaler("cpu", **kwargs), steps, inject, mult, unscale_first)
    assert_same_decisions(ours, theirs)
    assert any(not ran for _, ran, _, _ in ours) == bool(inject or mult > 1), "the stream skipped nothing"


def test_defaults_are_gradscalers():
    ours, theirs = DynamicLossScaler(), torch.amp.GradScaler("cpu")
    theirs.scale(torch.ones(()))                     # GradScaler builds its state lazily
    assert ours.state_dict() == theirs.state_dict() == {
        "scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
        "_growth_tracker": 0}


def test_state_dicts_load_both_ways():
    theirs = torch.amp.GradScaler("cpu", growth_interval=3)
    first = run_stream(theirs, 5, {1: INF})
    ours = DynamicLossScaler()
    ours.load_state_dict(theirs.state_dict())
    assert ours.state_dict() == theirs.state_dict() == first[-1][3]
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(ours.state_dict())
    assert back.state_dict() == ours.state_dict()


def test_two_optimizers_skip_separately_and_back_off_together():
    """GradScaler keeps an inf check per optimizer: only the one with the inf skips; update sees both."""
    results = []
    for scaler in (DynamicLossScaler(growth_interval=2), torch.amp.GradScaler("cpu", growth_interval=2)):
        a, b = MLP((3, 4), seed=1), MLP((3, 4), seed=2)
        opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
        trace = []
        for step in range(4):
            x, y = regression_batch(5, 3, 4, seed=step)
            scaler.scale(F.mse_loss(a(x), y) + F.mse_loss(b(x), y)).backward()
            if step == 1:
                a.net[0].bias.grad[0] = INF
            scaler.step(opt_a)
            scaler.step(opt_b)
            scaler.update()
            trace.append((scaler.get_scale(), [p.detach().clone() for p in [*a.parameters(), *b.parameters()]]))
            opt_a.zero_grad()
            opt_b.zero_grad()
        results.append(trace)
    for (s1, p1), (s2, p2) in zip(*results):
        assert s1 == s2 and all(torch.equal(x, y) for x, y in zip(p1, p2))
    assert [s for s, _ in results[0]] == [65536.0, 32768.0, 32768.0, 65536.0]


def test_static_scaler_keeps_its_scale_and_still_skips_overflow():
    record = run_stream(StaticLossScaler(2.0 ** 10), 6, {2: INF})
    assert [s for s, *_ in record] == [1024.0] * 6
    assert [ran for _, ran, *_ in record] == [True, True, False, True, True, True]
    assert all(torch.equal(a, b) for a, b in zip(record[1][2], record[2][2]))      # skipped: unchanged


def test_update_with_new_scale_sets_it():
    scaler = DynamicLossScaler()
    scaler.update(new_scale=3.0)
    assert scaler.get_scale() == 3.0


# --------------------------------------------------------------------------- #
# Clear errors
# --------------------------------------------------------------------------- #
def one_backward(scaler):
    model = MLP((2, 2), seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = regression_batch(3, 2, 2)
    scaler.scale(F.mse_loss(model(x), y)).backward()
    return model, optimizer


def test_stepping_twice_without_update_is_refused():
    scaler = DynamicLossScaler()
    _, optimizer = one_backward(scaler)
    scaler.step(optimizer)
    with pytest.raises(RuntimeError, match=r"step\(\) was already called for this optimizer since the last "
                                           r"update\(\)\. Call update\(\) once"):
        scaler.step(optimizer)


def test_unscaling_twice_or_after_step_is_refused():
    scaler = DynamicLossScaler()
    _, optimizer = one_backward(scaler)
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match=r"unscale_: called twice .* shrink them by the scale a second time"):
        scaler.unscale_(optimizer)
    scaler.step(optimizer)
    with pytest.raises(RuntimeError, match="already stepped this iteration"):
        scaler.unscale_(optimizer)
    scaler.update()
    one_backward(scaler)        # a new iteration may unscale again
    scaler.unscale_(optimizer)


def test_other_misuse_is_refused():
    scaler = DynamicLossScaler()
    with pytest.raises(RuntimeError, match=r"no optimizer was stepped or unscaled since the last update\(\)"):
        scaler.update()
    model, optimizer = one_backward(scaler)
    with pytest.raises(RuntimeError, match="closure is not supported"):
        scaler.step(optimizer, closure=lambda: 0.0)
    model.half()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.raises(ValueError, match=r"gradient 0 is float16\. Unscale fp32 gradients"):
        scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="state dict is empty"):
        scaler.load_state_dict({})
    with pytest.raises(TypeError, match="expected a tensor"):
        scaler.scale(3.0)


@pytest.mark.parametrize("kwargs, complaint", [
    (dict(init_scale=0.0), "positive finite"), (dict(init_scale=INF), "positive finite"),
    (dict(growth_factor=1.0), "growth_factor must be > 1"),
    (dict(backoff_factor=1.0), r"backoff_factor must be in \(0, 1\)"),
    (dict(growth_interval=0), "growth_interval must be a positive int"),
    (dict(growth_interval=2.5), "growth_interval must be a positive int"),
])
def test_bad_settings(kwargs, complaint):
    with pytest.raises(ValueError, match=complaint):
        DynamicLossScaler(**kwargs)


# --------------------------------------------------------------------------- #
# Master weights, and the fp16 pipeline against GradScaler
# --------------------------------------------------------------------------- #
def test_master_weights_keep_fp32_and_round_into_the_copy():
    model = MLP((3, 5, 2), seed=0)
    original = [p.detach().clone() for p in model.parameters()]
    master = MasterWeights(model, torch.float16)
    assert all(p.dtype == torch.float16 for p in model.parameters())
    assert all(m.dtype == torch.float32 and torch.equal(m, o) for m, o in zip(master.parameters(), original))
    x, y = regression_batch(4, 3, 2)
    F.mse_loss(model(x.half()).float(), y).backward()
    grads16 = [p.grad.clone() for p in model.parameters()]
    master.grads_to_master()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(m.grad, g.float()) for m, g in zip(master.parameters(), grads16))   # exact
    with torch.no_grad():
        for m in master.parameters():
            m += 1e-5                    # below fp16's spacing for most weights
    master.master_to_model()
    assert all(torch.equal(p, m.half()) for p, m in zip(model.parameters(), master.parameters()))
    with pytest.raises(ValueError, match="must start in float32"):
        MasterWeights(model, torch.bfloat16)
    with pytest.raises(ValueError, match="dtype must be torch.float16 or torch.bfloat16"):
        MasterWeights(MLP((2, 2)), torch.float64)


def test_master_weights_keep_updates_that_fp16_loses():
    """Micikevicius et al. 3.1: an update 2^11 times smaller than its weight vanishes in fp16."""
    ones = torch.ones(1000)
    assert figures.lost_updates(ones, torch.full_like(ones, 2.0 ** -12)).all()   # below half of 2^-10
    assert not figures.lost_updates(ones, torch.full_like(ones, 2.0 ** -10)).any()
    history = figures.update_underflow(1.0, 1e-4, 1000)
    assert set(history["fp16 weight"]) == {1.0}
    assert history["fp32 master"][-1] == pytest.approx(1.1, abs=1e-4)   # fp32 rounding over 1000 adds
    assert history["fp16 copy of the master"][-1] == torch.tensor(history["fp32 master"][-1]).half().item()


def test_fp16_training_matches_gradscaler():
    """Real fp16 overflow (the scale starts at 2^32): the same skips, scales, losses and weights."""
    settings = dict(init_scale=2.0 ** 32, growth_interval=3)
    runs = [train(Recipe(torch.float16, scaler=make), 12, batch_size=4, loss_factor=figures.LOSS_FACTOR)
            for make in (partial(DynamicLossScaler, **settings),
                         partial(torch.amp.GradScaler, "cpu", **settings))]
    ours, theirs = runs
    assert ours.losses == theirs.losses and ours.scales == theirs.scales and ours.skipped == theirs.skipped
    assert all(torch.equal(a, b) for a, b in zip(ours.params, theirs.params))
    # measured: steps 0-4 overflow while the scale halves to 2^27, it grows back at step 8 and
    # overflows once more at step 9
    assert ours.skipped[:1] == [0] and 0 < len(ours.skipped) < 12, ours.skipped


def test_fp16_without_scaling_loses_the_attention_gradients():
    """At the lesson's loss factor, unscaled fp16 flushes the query and key gradients to exactly 0."""
    grads = {}
    for scale in (1.0, 2.0 ** 16):
        model = GPT(CURVE_GPT, seed=0)
        c_attn = [name for name, _ in model.named_parameters()].index("blocks.0.attn.c_attn.weight")
        master = MasterWeights(model, torch.float16)
        x, y = token_batch(CURVE_GPT, figures.CURVE_BATCH)
        (lm_loss(model(x).float(), y) * figures.LOSS_FACTOR * scale).backward()
        master.grads_to_master()
        grads[scale] = master.parameters()[c_attn].grad          # (3 * d_model, d_model): q, k, v rows
    d = CURVE_GPT.d_model
    assert (grads[1.0][:2 * d] == 0).all()                 # rows of q and k: no gradient at all
    assert (grads[2.0 ** 16][:2 * d] != 0).float().mean() > 0.99


def test_recipes_train_and_check_themselves():
    names = ("fp32", "fp16, dynamic loss scaling", "bf16 autocast")
    runs = {name: train(name, 30, batch_size=8) for name in names}
    fp32 = runs["fp32"].losses
    # fp16 rounds each op's output to 11 significant bits and bf16 to 8. Over these 30 steps the
    # losses stayed within 7e-5 (fp16) and 4e-4 (bf16) of fp32's, relatively; 2e-3 leaves a
    # margin of 5 over bf16's, and is far below the 0.1 the loss falls.
    for name in ("fp16, dynamic loss scaling", "bf16 autocast"):
        assert runs[name].losses == pytest.approx(fp32, rel=2e-3), name
        assert sum(runs[name].losses[-5:]) / 5 < fp32[0] - 0.1
    assert runs["fp16, dynamic loss scaling"].scales == [65536.0] * 30
    with pytest.raises(ValueError, match="autocast=True needs a 16-bit"):
        Recipe(torch.float32, autocast=True)
    with pytest.raises(ValueError, match="compute must be float32, float16 or bfloat16"):
        Recipe(torch.float64)


def test_master_weight_memory_is_16_bytes_per_parameter():
    """What MasterWeights + Adam hold equals dtcourse.memory's mixed-precision prediction."""
    model = GPT(CURVE_GPT, seed=0)
    master = MasterWeights(model, torch.bfloat16)
    optimizer = torch.optim.Adam(master.parameters())
    x, y = token_batch(CURVE_GPT, 2)
    lm_loss(model(x).float(), y).backward()
    low_grads = memory.storage_bytes(p.grad for p in model.parameters())
    master.grads_to_master()
    optimizer.step()
    master.master_to_model()
    state = [t for s in optimizer.state.values() for t in s.values()]
    predicted = memory.predict_adam_step(GPT(CURVE_GPT), mixed=True)
    assert memory.storage_bytes(model.parameters()) == predicted.params
    assert low_grads == predicted.grads
    assert memory.storage_bytes(state + master.parameters()) == predicted.optimizer_states
    measured = memory.measure_step(GPT(CURVE_GPT), (x, y), lm_loss, mixed_dtype=torch.bfloat16)
    assert measured.model_states == predicted.model_states


# --------------------------------------------------------------------------- #
# Figures, headless
# --------------------------------------------------------------------------- #
def test_number_formats_from_finfo():
    f = figures.number_formats()
    assert f["fp16"].max == 65504 and f["fp16"].smallest_subnormal == 2.0 ** -24
    assert f["fp16"].smallest_normal == 2.0 ** -14 == pytest.approx(6.1e-5, rel=1e-3)
    assert f["bf16"].max == pytest.approx(3.39e38, rel=1e-3)
    assert f["bf16"].exponent_bits == f["fp32"].exponent_bits
    assert f["bf16"].smallest_normal == f["fp32"].smallest_normal
    assert [(x.exponent_bits, x.mantissa_bits) for x in f.values()] == [(8, 23), (8, 7), (5, 10)]
    for x, dtype in zip(f.values(), figures.FORMATS.values()):   # the smallest subnormal exists, half of it not
        tiny = torch.tensor(x.smallest_subnormal, dtype=torch.float64)
        assert tiny.to(dtype).item() == x.smallest_subnormal and (tiny / 2).to(dtype).item() == 0
    fig = figures.plot_number_formats()
    bars = fig.axes[0].patches          # (subnormal, normal) for fp32, bf16, fp16
    assert bars[4].get_x() == -24 and bars[4].get_x() + bars[4].get_width() == -14
    assert bars[5].get_x() + bars[5].get_width() == pytest.approx(math.log2(65504))


def test_loss_scale_widget_slider_drives_the_figure():
    grads = {"activation": torch.tensor([2.0 ** -30, 2.0 ** -20, 2.0 ** -10, 1.0]),
             "weight": torch.tensor([2.0 ** -26, 3.0, 100.0])}
    box = figures.loss_scale_widget(grads, max_log2_scale=20)
    view, slider, image = box.view, box.slider, box.image
    first = image.value
    assert view.fractions["activation"] == figures.Fractions(zero=0.25, subnormal=0.25, overflow=0.0)
    slider.value = 14
    assert view.log2_scale == 14 and image.value != first
    # activations x 2^14: 2^-16 subnormal, 2^-6, 2^4, 2^14 normal; weights: 2^-12 and 3 * 2^14 = 49152
    # normal, 100 * 2^14 > 65504 inf
    assert view.fractions["activation"] == figures.Fractions(zero=0.0, subnormal=0.25, overflow=0.0)
    assert view.fractions["weight"] == figures.Fractions(zero=0.0, subnormal=0.0, overflow=pytest.approx(1 / 3))
    heights = view.stairs["activation"].get_data().values
    edges = view.stairs["activation"].get_data().edges
    filled = sorted(edges[i] for i in range(len(heights)) if heights[i] > 0)
    assert filled == [-16.0, -6.0, 4.0, 14.0] and heights.sum() == pytest.approx(1.0)
    assert "inf  33.3%" in view.note.get_text() and "2^14" in view.ax.get_title()


def test_gradient_sample_is_real_and_scaling_rescues_it():
    grads = figures.gradient_sample()
    assert set(grads) == {"activation", "weight"} and all((g != 0).all() for g in grads.values())
    unscaled = figures.fp16_fractions(grads["activation"], 1.0)
    scaled = figures.fp16_fractions(grads["activation"], 2.0 ** 16)
    assert unscaled.zero > 0.3 and scaled.zero < 0.001 and scaled.overflow == 0.0


def test_loss_curve_figure_marks_skipped_steps():
    runs = {"a": TrainingRun("a", [5.0, 4.0, 3.0, 2.0], [1.0] * 4),
            "b": TrainingRun("b", [5.0, 5.0, 5.0, 5.0], [8.0, 4.0, 4.0, 8.0], skipped=[0])}
    fig = figures.plot_loss_curves(runs, smooth=2)
    loss_ax, scale_ax = fig.axes
    assert list(loss_ax.lines[0].get_ydata()) == [4.5, 3.5, 2.5]
    assert list(scale_ax.lines[0].get_ydata()) == [3.0, 2.0, 2.0, 3.0]     # run "a" never scaled: not drawn
    assert list(scale_ax.lines[1].get_xdata()) == [0] and list(scale_ax.lines[1].get_ydata()) == [3.0]


# --------------------------------------------------------------------------- #
# GPU paths (skipped without CUDA)
# --------------------------------------------------------------------------- #
@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_autocast_with_our_scaler_matches_gradscaler(dtype):
    """fp32 weights, torch.autocast on CUDA: our scaler and GradScaler("cuda") take the same steps."""
    results = []
    for make in (partial(DynamicLossScaler, growth_interval=2),
                 partial(torch.amp.GradScaler, "cuda", growth_interval=2)):
        model = GPT(CURVE_GPT, seed=0).cuda()
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        scaler, trace = make(), []
        for step in range(6):
            x, y = (t.cuda() for t in token_batch(CURVE_GPT, 4, seed=step))
            with torch.autocast("cuda", dtype=dtype):
                logits = model(x)
            scaler.scale(lm_loss(logits.float(), y)).backward()
            if step == 2:
                model.lm_head.weight.grad[0, 0] = INF
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            trace.append((scaler.get_scale(), [p.detach().clone() for p in model.parameters()]))
        results.append(trace)
    for (s1, p1), (s2, p2) in zip(*results):
        assert s1 == s2 and all(torch.equal(a, b) for a, b in zip(p1, p2))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("name", ["fp16, dynamic loss scaling", "bf16 autocast"])
def test_cuda_recipes_train(name):
    run = train(name, 60, batch_size=16, device="cuda")
    assert sum(run.losses[-5:]) / 5 < run.losses[0] - 0.5      # on CPU: 5.55 -> 4.3 in 60 steps


def test_scaler_trace_reports_the_planted_overflows_as_skipped():
    from dtcourse.lab.mixed_precision import scaler_trace

    ours, our_weights = scaler_trace(DynamicLossScaler(growth_interval=3))
    theirs, their_weights = scaler_trace(torch.amp.GradScaler("cpu", growth_interval=3))
    assert [i for i, (_, skipped) in enumerate(ours) if skipped] == [3, 4, 9]   # inf, nan, inf planted
    assert ours == theirs and all(torch.equal(a, b) for a, b in zip(our_weights, their_weights))
