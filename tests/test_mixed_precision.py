"""Mixed precision: the loss scalers against torch.amp.GradScaler, master weights, recipes, figures, problems.

The scalers are fed the same gradient stream as ``torch.amp.GradScaler("cpu")``, with infs
and NaNs injected, and must make the same decisions: the same scale after every update, the
same steps skipped and bit-identical parameters (both multiply the gradients by the same
fp32 reciprocal, so no tolerance is needed). The same holds for whole training runs of both
recipes, the 16-bit copy with fp32 masters and PyTorch's fp16 autocast. Run just these with
``pytest -q tests/test_mixed_precision.py``; the GPU tests are skipped without CUDA.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from dtcourse import memory
from dtcourse.lab import mixed_precision as figures
from dtcourse.lab.mixed_precision import TrainingRun, train
from dtcourse.lab.widgets import COLUMN_IN
from dtcourse.mixed_precision import DynamicLossScaler, MasterWeights, Recipe, StaticLossScaler, Trainer
from dtcourse.models import CURVE_GPT, GPT, MLP, GPTConfig, lm_loss, regression_batch, token_batch

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
    (dict(init_scale=2.0 ** 140), "positive finite number in fp32"), (dict(init_scale=1e-50), "positive finite"),
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
    # lesson 04's claim: at lr 1e-4 the updates lost are those of the LayerNorm gains (1.0), all and only them
    gpt = GPT(CURVE_GPT, seed=0)
    lost = {name: figures.lost_updates(p.detach(), torch.full_like(p, 1e-4)) for name, p in gpt.named_parameters()}
    gains = {f"{name}.weight" for name, m in gpt.named_modules() if isinstance(m, torch.nn.LayerNorm)}
    assert {name for name, m in lost.items() if m.any()} == gains and all(lost[g].all() for g in gains)


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


def test_fp16_autocast_recipe_matches_gradscaler():
    """PyTorch's standard recipe (fp32 weights, fp16 autocast) under GradScaler and under ours.

    Both unscale the same fp32 gradients by the same fp32 reciprocal and step the same Adam, so
    the tolerance is zero: the same scale sequence, skips, losses and bit-identical weights.
    """
    settings = dict(init_scale=2.0 ** 30, growth_interval=2)
    ours, theirs = (train(Recipe(torch.float16, autocast=True, scaler=make), 12, batch_size=4,
                          loss_factor=figures.LOSS_FACTOR)
                    for make in (partial(DynamicLossScaler, **settings),
                                 partial(torch.amp.GradScaler, "cpu", **settings)))
    assert ours.scales == theirs.scales and ours.skipped == theirs.skipped and ours.losses == theirs.losses
    assert all(torch.equal(a, b) for a, b in zip(ours.params, theirs.params))
    assert all(p.dtype == torch.float32 for p in ours.params)
    grew = [i for i in range(1, 12) if ours.scales[i] > ours.scales[i - 1]]
    assert ours.skipped[:1] == [0] and grew, (ours.skipped, ours.scales)     # both decisions were exercised


def test_trainer_casts_float_inputs_for_a_16_bit_copy_and_reports_skips():
    trainer = Trainer(MLP((4, 8, 3), seed=0), Recipe(torch.float16, scaler=partial(StaticLossScaler, 2.0 ** 40)),
                      F.mse_loss, partial(torch.optim.SGD, lr=0.1))
    assert all(p.dtype == torch.float16 for p in trainer.model.parameters())
    x, y = regression_batch(8, 4, 3)
    loss = trainer.forward(x, y)                 # fp32 x is cast for the fp16 copy; the loss comes back fp32
    assert loss.dtype == torch.float32
    trainer.backward(loss)                       # gradients x 2^40 are far past 65504: inf in fp16
    before = [m.detach().clone() for m in trainer.master.parameters()]
    assert trainer.step() is False and trainer.steps_taken == 0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.master.parameters()))


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
    # without the loss factor (no accumulation to imitate), unscaled fp16 keeps them: the failure needs it
    model = GPT(CURVE_GPT, seed=0)
    MasterWeights(model, torch.float16)
    x, y = token_batch(CURVE_GPT, figures.CURVE_BATCH)
    lm_loss(model(x).float(), y).backward()
    assert (model.blocks[0].attn.c_attn.weight.grad[:2 * d] == 0).float().mean() < 0.01


def test_recipes_train_and_check_themselves():
    """Every recipe that should learn, end to end: the one test that trains them all (about 3 s)."""
    names = ("fp32", "fp16 copy, our dynamic scaler", "fp16 autocast, GradScaler", "bf16 autocast")
    runs = {name: train(name, 30, batch_size=8) for name in names}
    fp32 = runs["fp32"].losses
    # fp16 rounds each op's output to 11 significant bits and bf16 to 8. Over these 30 steps the
    # losses stayed within 1e-4 (fp16 copy), 7e-4 (fp16 autocast) and 3e-4 (bf16) of fp32's,
    # relatively; 2e-3 leaves a margin of about 3, and is far below the 0.1 the loss falls.
    for name in names[1:]:
        assert runs[name].losses == pytest.approx(fp32, rel=2e-3), name
        assert sum(runs[name].losses[-5:]) / 5 < fp32[0] - 0.1
    assert runs["fp16 copy, our dynamic scaler"].scales == runs["fp16 autocast, GradScaler"].scales == [65536.0] * 30
    with pytest.raises(ValueError, match="autocast=True needs a 16-bit"):
        Recipe(torch.float32, autocast=True)
    with pytest.raises(ValueError, match="compute must be float32, float16 or bfloat16"):
        Recipe(torch.float64)


def test_train_side_by_side_is_train_one_by_one():
    """Three recipes in three processes: exactly the runs train() makes in this one."""
    recipes = {"a": "fp32", "b": Recipe(torch.bfloat16, autocast=True), "c": "fp16 copy, our dynamic scaler"}
    together = figures.train_side_by_side(recipes, 4, batch_size=4, loss_factor=figures.LOSS_FACTOR)
    assert list(together) == list(recipes) and [r.name for r in together.values()] == list(recipes)
    for name, recipe in recipes.items():
        alone = train(recipe, 4, batch_size=4, loss_factor=figures.LOSS_FACTOR)
        assert together[name].losses == alone.losses and together[name].scales == alone.scales
        assert all(torch.equal(a, b) for a, b in zip(together[name].params, alone.params))


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
# What each recipe holds, and what its all-reduce sends
# --------------------------------------------------------------------------- #
def test_recipe_memory_counts_each_recipe_to_the_byte():
    config, b = GPTConfig(), 8
    recipes = {"fp32": Recipe(), "copy": Recipe(torch.bfloat16), "autocast": Recipe(torch.bfloat16, autocast=True)}
    held = {name: figures.recipe_memory(recipe, config, b) for name, recipe in recipes.items()}
    gpt = GPT(config)
    n = sum(p.numel() for p in gpt.parameters())
    fp32, copy, auto = held.values()
    assert (fp32.weights, fp32.masters, fp32.grads) == (4 * n, 0, 4 * n)
    assert (copy.weights, copy.masters, copy.grads) == (2 * n, 4 * n, 2 * n)      # the grads DDP would send: 2n
    assert (auto.weights, auto.masters, auto.grads) == (4 * n, 0, 4 * n)          # autocast's grads are fp32
    assert fp32.model_states == copy.model_states == auto.model_states == \
        memory.predict_adam_step(gpt, mixed=True).model_states
    # Activations. fp32: lesson 00's formula, exactly. The copy recipe: the same formula in bf16,
    # except that Trainer computes the loss in fp32 (its log-probabilities s*b*V, and the 0-dim
    # total weight, take 4 bytes instead of 2).
    s, V = config.block_size, config.vocab_size
    assert fp32.activations == memory.gpt_activation_bytes(config, b)
    assert copy.activations == memory.gpt_activation_bytes(config, b, dtype=torch.bfloat16) + 2 * s * b * V + 2
    assert copy.saved["16-bit weight copies"] == 0 == fp32.saved["16-bit activations"]
    # Autocast saves a bf16 copy of every matmul weight for backward, and keeps some activations fp32.
    matmul = sum(m.weight.numel() for m in gpt.modules() if isinstance(m, torch.nn.Linear))
    assert auto.saved["16-bit weight copies"] == 2 * matmul
    assert auto.saved["fp32 activations"] > copy.saved["fp32 activations"] > 0
    # measured: 0.544 and 0.638 of fp32's bytes
    assert 0.5 < copy.activations / fp32.activations < 0.56 and 0.6 < auto.activations / fp32.activations < 0.67
    # the by-kind count is memory.SavedTensors's total, split: the same step counted by it alone
    model = GPT(config)
    trainer = Trainer(model, Recipe(torch.bfloat16, autocast=True), lm_loss)
    with memory.SavedTensors(model) as saved:
        trainer.forward(*token_batch(config, b))
    assert saved.nbytes == auto.activations


def test_allreduce_bytes_are_the_ring_formula_and_the_average_is_right():
    """Three ranks, torch DDP, a bf16-autocast step; the hook's ring all-reduce against one process."""
    config, world = GPTConfig(), 3
    n = sum(p.numel() for p in GPT(config).parameters())
    sent32, avg32 = figures.allreduce_bytes(world, torch.float32, config)
    sent16, avg16 = figures.allreduce_bytes(world, torch.bfloat16, config)
    for sent, width in ((sent32, 4), (sent16, 2)):       # 2(N-1)/N * bytes; uneven chunks: a few bytes off
        assert all(s == pytest.approx(2 * (world - 1) / world * width * n, abs=2 * 2 * width) for s in sent)
    # single-process reference: each rank's gradients, averaged in fp64
    per_rank = []
    for rank in range(world):
        model = GPT(config, seed=0)
        x, y = token_batch(config, 4, seed=rank)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        lm_loss(logits.float(), y).backward()
        per_rank.append([p.grad.double() for p in model.parameters()])
    reference = [sum(gs) / world for gs in zip(*per_rank)]
    for ref, a32, a16 in zip(reference, avg32, avg16):
        top = ref.abs().max().item()
        # fp32 on the wire: each gradient divided by 3 and summed in fp32 (a few ulps of 2^-24)
        assert (a32.double() - ref).abs().max().item() <= 1e-6 * top
        # bf16 on the wire: rounded on the way in, and after each of the ring's two additions (2^-9 each)
        assert (a16.double() - ref).abs().max().item() <= 2 ** -6 * top


# --------------------------------------------------------------------------- #
# The lesson's problems: each agrees with its formula, and a wrong formula would not
# --------------------------------------------------------------------------- #
def _wrong(answer, formula) -> bool:
    return not dataclasses.replace(answer, formula=formula).agrees


def test_problem_largest_scale():
    answer = figures.problem_largest_scale({"a": torch.tensor([3.0, -1e-3]), "b": torch.tensor([0.5])})
    assert answer.agrees and answer.measured == 14            # 3 * 2^14 = 49152 <= 65504 < 3 * 2^15
    lesson = figures.problem_largest_scale(figures.gradient_sample())
    assert lesson.agrees and lesson.measured == 28 and _wrong(lesson, 29)


def test_problem_smallest_gradient():
    answer = figures.problem_smallest_gradient(2.0 ** 16)
    assert answer.agrees and answer.measured > 2.0 ** -41 == answer.formula
    assert _wrong(answer, 2.0 ** -24 / 2 ** 16)               # the smallest subnormal itself: rounding saves half of it
    assert figures.problem_smallest_gradient(1.0).agrees


def test_problem_model_state_bytes():
    answer = figures.problem_model_state_bytes()
    assert answer.agrees and answer.measured > 16
    assert _wrong(answer, 2 + 2 + 8) and _wrong(answer, 4 + 4 + 8 + 4)      # no masters; fp32 plus masters


def test_problem_allreduce_bytes():
    answer = figures.problem_allreduce_bytes(3)
    n = sum(p.numel() for p in GPT(GPTConfig()).parameters())
    assert answer.agrees and _wrong(answer, 2 * 2 / 3 * 4 * n) and _wrong(answer, 2 * n)   # fp32; no ring factor


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
    assert view.note.axes is not view.ax                     # no histogram peak can draw over the counts


def test_scale_window_from_real_fp16_casts():
    grads = {"activation": torch.tensor([2.0 ** -30, 2.0 ** -10]), "weight": torch.tensor([1.0, -3e-3])}
    # 2^-30 * 2^5 = 2^-25 is a tie that rounds to 0; at 2^6 it is 2^-24. 1.0 * 2^16 = 65536 > 65504.
    assert figures.scale_window(grads, lost=0.0) == (6, 15)
    assert figures.scale_window(grads, lost=0.5) == (0, 15)
    assert figures.scale_window(figures.gradient_sample()) == (13, 28)      # the window lesson 04 states


def test_gradient_sample_is_real_and_scaling_rescues_it():
    grads = figures.gradient_sample()
    assert set(grads) == {"activation", "weight"} and all((g != 0).all() for g in grads.values())
    unscaled = figures.fp16_fractions(grads["activation"], 1.0)
    scaled = figures.fp16_fractions(grads["activation"], 2.0 ** 16)
    assert unscaled.zero > 0.3 and scaled.zero < 0.001 and scaled.overflow == 0.0


def test_loss_curve_figure_marks_skipped_steps():
    runs = {"a": TrainingRun("a", [5.0, 4.0, 3.0, 2.0], [1.0] * 4),
            "b": TrainingRun("b", [5.0, 5.0, 5.0, 5.0], [8.0, 4.0, 4.0, 8.0], skipped=[0])}
    fig = figures.plot_loss_curves(runs, smooth=2, title="Two runs")
    loss_ax, scale_ax = fig.axes
    assert list(loss_ax.lines[0].get_ydata()) == [4.5, 3.5, 2.5]
    assert list(scale_ax.lines[0].get_ydata()) == [3.0, 2.0, 2.0, 3.0]     # run "a" never scaled: not drawn
    assert list(scale_ax.lines[1].get_xdata()) == [0] and list(scale_ax.lines[1].get_ydata()) == [3.0]
    assert loss_ax.get_title().startswith("Two runs") and scale_ax.get_title()


def test_loss_curve_figure_draws_differences_from_a_reference():
    runs = {"ref": TrainingRun("ref", [5.0, 4.0, 3.0, 2.0]), "x": TrainingRun("x", [5.0, 4.5, 3.0, 2.5]),
            "y": TrainingRun("y", [9.0, 9.0, 9.0, 9.0])}
    fig = figures.plot_loss_curves(runs, smooth=2, title="Three runs", reference="ref", compare=("x",))
    low_ax = fig.axes[1]
    assert list(low_ax.lines[0].get_ydata()) == [0.25, 0.25, 0.25] and len(low_ax.lines) == 2   # x, and y = 0
    assert "ref" in low_ax.get_title() and low_ax.get_title() != fig.axes[0].get_title()


def test_figures_fit_the_column():
    held = {"fp32": figures.recipe_memory(Recipe(), batch_size=1),
            "bf16 autocast": figures.recipe_memory(Recipe(torch.bfloat16, autocast=True), batch_size=1)}
    fig = figures.plot_recipe_memory(held)
    states_ax = fig.axes[0]
    widths = [bar.get_width() for bar in states_ax.patches]                # weights, masters, grads, Adam
    assert widths[::2] == [4.0, 0.0, 4.0, pytest.approx(8.0, rel=1e-3)]    # fp32's row, bytes per parameter
    runs = {"a": TrainingRun("a", [5.0, 4.0], [1.0, 1.0])}
    grads = {"activation": torch.tensor([1e-3]), "weight": torch.tensor([1e-2])}
    for figure in (fig, figures.plot_number_formats(), figures.LossScaleView(grads).figure,
                   figures.plot_loss_curves(runs, smooth=1),
                   figures.plot_update_underflow(figures.update_underflow(steps=3))):
        assert figure.get_size_inches()[0] <= COLUMN_IN
        assert all(ax.get_title() or not ax.axison for ax in figure.axes)


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
@pytest.mark.parametrize("name", ["fp16 copy, our dynamic scaler", "bf16 autocast"])
def test_cuda_recipes_train(name):
    run = train(name, 60, batch_size=16, device="cuda")
    assert sum(run.losses[-5:]) / 5 < run.losses[0] - 0.5      # on CPU: 5.55 -> 4.3 in 60 steps


def test_scaler_trace_reports_the_planted_overflows_as_skipped():
    from dtcourse.lab.mixed_precision import scaler_trace

    ours, our_weights = scaler_trace(DynamicLossScaler(growth_interval=3))
    theirs, their_weights = scaler_trace(torch.amp.GradScaler("cpu", growth_interval=3))
    assert [i for i, (_, skipped) in enumerate(ours) if skipped] == [3, 4, 9]   # inf, nan, inf planted
    assert ours == theirs and all(torch.equal(a, b) for a, b in zip(our_weights, their_weights))
