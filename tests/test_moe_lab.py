"""What lesson 11 runs and draws (dtcourse/lab/moe.py): tokens per expert recorded while training, drops against
the capacity factor, all-to-all bytes on real ranks, parameters and FLOPs against the dense GPT, the routing widget
driven by ``.value``, the parity demo and the problems.

Counts, bytes, parameters and FLOPs are asserted exactly. Whether the balancing loss balances a given run is
measured and reported by the lesson, never asserted; step times never are.
"""

import math
from dataclasses import replace

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from dtcourse.lab import moe as lab  # noqa: E402
from dtcourse.lab.problems import check  # noqa: E402
from dtcourse.models import GPT, GPTConfig, token_batch  # noqa: E402
from dtcourse.models.moe import capacity, load_balancing_loss, route  # noqa: E402

STEPS = 12
N = lab.ROWS * lab.LAB_GPT.block_size                            # 256 tokens per MoE layer and step


@pytest.fixture(scope="module")
def runs():
    return {alpha: lab.train(alpha, steps=STEPS) for alpha in (0.0, 0.01)}


def test_the_recording_holds_every_step_and_its_counts_add_up(runs):
    C = capacity(N, 8, 1, 1.25)
    for run in runs.values():
        L, E = lab.LAB_GPT.n_layer, lab.LAB_GPT.n_expert
        assert run.tokens.shape == run.kept.shape == (STEPS, L, E) and run.dropped.shape == (STEPS, L)
        assert torch.all(run.tokens.sum(-1) == N * lab.LAB_GPT.top_k)          # every token's k choices counted once
        assert torch.all(run.kept <= run.tokens) and torch.all(run.kept <= C)  # no expert takes more than C
        assert torch.all((0 <= run.dropped) & (run.dropped <= 1))
        assert torch.allclose(run.dropped, 1 - run.kept.sum(-1) / run.tokens.sum(-1))
        assert torch.all(run.imbalance() >= 1) and run.loss.shape == (STEPS,) and run.loss[-1] < run.loss[0]
    # the same initial weights and first batch: step 0 routes identically; alpha only changes the gradient
    assert torch.equal(runs[0.0].tokens[0], runs[0.01].tokens[0])
    assert runs[0.0].model.config.moe_aux_loss == 0.0 and runs[0.01].model.config.moe_aux_loss == 0.01


def test_a_direct_recount_of_the_first_step_matches_the_record(runs):
    model = GPT(replace(lab.LAB_GPT, moe_aux_loss=0.01), seed=0)          # the weights train() starts from
    idx = token_batch(model.config, lab.ROWS, seed=0)[0]                  # its first batch
    for layer, logits in enumerate(lab.router_logits(model, idx)):
        routing = route(logits, 1, 1.25)
        assert torch.equal(torch.bincount(routing.experts.reshape(-1), minlength=8), runs[0.01].tokens[0, layer])
        assert torch.equal(torch.bincount(routing.experts[routing.kept], minlength=8), runs[0.01].kept[0, layer])


def test_the_balance_table_and_the_training_figure(runs):
    table = lab.balance_table(runs, first=4)
    assert [(r[0], r[1]) for r in table] == [(a, w) for a in (0.0, 0.01) for w in ("steps 0-3", "steps 6-11")]
    assert table[0][2] == pytest.approx(runs[0.0].imbalance()[:4].mean().item())
    assert table[3][3] == pytest.approx(runs[0.01].dropped[6:].mean().item())
    figure = lab.training_figure(runs)
    heat = [ax for ax in figure.axes if ax.images]
    assert len(heat) == 2 and heat[0].images[0].get_array().shape == (8, STEPS)
    assert heat[1].images[0].get_array().sum() == pytest.approx(STEPS)    # each step's shares add up to 1
    curves = [ax for ax in figure.axes if ax.lines]
    assert len(curves) == 2 and all(len(ax.lines) == 2 * len(runs) for ax in curves)   # raw and smoothed per run


def test_drops_against_the_capacity_factor(runs):
    model = runs[0.01].model
    sweep = lab.drop_sweep(model)
    assert set(sweep) == {(k, cf) for k in (1, 2) for cf in lab.CFS}
    for k in (1, 2):
        drops = [sweep[k, cf] for cf in lab.CFS]
        assert drops == sorted(drops, reverse=True) and all(0 <= d <= 1 for d in drops)   # more room, fewer drops
        for cf in lab.CFS:    # E experts keep at most E C choices: no router drops less than a balanced one
            assert sweep[k, cf] >= lab.balanced_drop(N, 8, k, cf) - 1e-9
    assert lab.balanced_drop(N, 8, 1, 0.75) == 0.25 and lab.balanced_drop(N, 8, 2, 1.0) == 0.0
    own = []                                                              # the layer's own count on each batch
    for seed in lab.SWEEP_SEEDS:
        model(token_batch(model.config, lab.ROWS, seed=seed)[0])
        own.append(sum(b.mlp.stats["dropped"].item() for b in model.blocks) / len(model.blocks))
        assert lab.drop_sweep(model, seeds=[seed])[1, 1.25] == pytest.approx(own[-1], abs=1e-6)
    assert len(own) == 16 and sweep[1, 1.25] == pytest.approx(sum(own) / len(own), abs=1e-6)   # every group N k
    figure = lab.drop_figure({"trained": sweep, "initial": lab.drop_sweep(GPT(lab.LAB_GPT))})
    assert len(figure.axes) == 2 and all(len(ax.lines) == 3 for ax in figure.axes)


def test_all_to_all_bytes_on_real_ranks_equal_the_formulas():
    table = lab.measure_bytes(eps=(2, 4))
    assert len(table) == 2 * (2 + 4)
    C = capacity(2 * 16, 8, 2, 1.25)                                       # 32 tokens per rank, top-2: C = 10
    for ep, mode, rank, forward, backward, formula, uniform in table:
        assert forward == backward == formula, (ep, mode, rank)           # backward retraces forward's exchanges
        if mode == "padded":
            assert formula == 2 * 2 * (ep - 1) * (8 // ep) * C * 32 * 4   # 2 layers, dispatch + combine
        assert uniform == 2 * 2 * (ep - 1) / ep * 32 * 2 * 32 * 4
    answer = lab.problem_all_to_all_bytes(table, ep=4)
    assert answer.measured == answer.formula == 61440


def test_parameters_and_flops_against_the_dense_gpt():
    for E in (0, 2, 8):
        cfg = replace(lab.LAB_GPT, n_expert=E)
        assert lab.parameters(cfg) == sum(p.numel() for p in GPT(cfg).parameters()), E
    small = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, d_model=16)
    rows = lab.compute_table(n_experts=(2, 4), config=small, rows=2, steps=2)
    assert [r["E"] for r in rows] == [0, 2, 4]
    for r in rows:
        assert r["flops counted"] == r["flops formula"] and r["fwd+bwd ms"] > 0 and r["AdamW ms"] > 0
        for key in ("fwd+bwd", "AdamW"):                                 # a median lies within its range
            low, high = r[f"{key} range ms"]
            assert 0 < low <= r[f"{key} ms"] <= high
    dense, four = rows[0], rows[2]
    assert four["flops formula"] - dense["flops formula"] == 2 * 2 * 16 * 4   # the router's matmuls only
    mlp = 8 * 16 * 16 + 5 * 16
    assert four["parameters"] - dense["parameters"] == 2 * (3 * mlp + 16 * 4)
    top2 = GPT(replace(small, n_expert=4, top_k=2, capacity_factor=None))
    with FlopCounterMode(display=False) as counter:
        top2(token_batch(small, 2)[0])
    assert counter.get_total_flops() / 16 == lab.flops_per_token(top2.config)   # two experts per token


def test_the_routing_widget_follows_its_controls():
    logits = lab.routers(n_experts=(2, 4), steps=2)
    assert {E: tuple(lg.shape) for E, lg in logits.items()} == {2: (N, 2), 4: (N, 4)}
    widget = lab.routing_widget(logits, n_expert=4, top_k=1, capacity_factor=1.0)
    view, first = widget.view, widget.image.value
    heights = lambda: sum(p.get_height() for p in view.bars.patches)
    assert view.capacity == 64 and heights() == N and view.tokens_per_expert.sum() == N
    assert view.dropped == pytest.approx(1 - view.kept_per_expert.sum().item() / N)
    assert view.balance == pytest.approx(load_balancing_loss(route(logits[4], 1, 1.0)).item())
    assert any(line.get_label() == "capacity C = 64" for line in view.bars.lines)
    widget.k.value = 2
    assert view.capacity == 128 and heights() == 2 * N and widget.image.value != first
    widget.cf.value = "dropless"
    assert view.capacity is None and view.dropped == 0
    assert not any("capacity" in line.get_label() for line in view.bars.lines)
    widget.E.value, widget.cf.value = 2, 0.5
    assert view.capacity == math.ceil(N * 2 / 2 * 0.5) and view.grid.images[0].get_array().shape == (2, 32)
    assert view.dropped >= 0.5 and "dropped" in view.figure.get_suptitle()
    # one colour bar, made once, reads the gates of the image now shown; the right panel says what it counts
    assert len(view.figure.axes) == 3 and view.colorbar.mappable is view.grid.images[0]
    assert view.colorbar.ax.get_ylabel() == "gate"
    assert view.colorbar.vmin == 0 and view.colorbar.vmax == pytest.approx(view.routing.gates[-32:].max().item())
    assert view.bars.get_ylabel() == f"choices (of N k = {2 * N})"


def test_expert_parallelism_matches_one_process_and_the_problems():
    report = lab.parity(ep=2)
    assert report.steps == 3 and report.worst("ranks") == 0.0 and report.worst("single") < 1e-5
    answers = {name: getattr(lab, name)() for name in ("problem_capacity", "problem_uniform_loss",
                                                        "problem_skewed_drops", "problem_parameters")}
    for answer in answers.values():
        assert check(None, answer).answer.agrees
    assert answers["problem_capacity"].measured == 40
    assert answers["problem_uniform_loss"].measured == pytest.approx(0.01 + 0.001 * math.log(8) ** 2, rel=1e-6)
    assert answers["problem_skewed_drops"].measured == 0.25 and answers["problem_parameters"].measured == 147520
