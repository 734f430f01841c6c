"""What lesson 09 runs and draws (dtcourse/lab/tensor_parallel.py): bytes per layer, as the observer records them, of real
ranks against 2·2(t-1)/t·sbh·4, one block's saved bytes by Korthikanti's terms against the paper's formula
adjusted term by term, Megatron's saved shards, the alpha-beta crossover, the split figure rebuilt from the real
shards, the widget driven by ``.value`` and the problems.

Bytes and saved bytes are counts, asserted exactly. The cost model is a formula; its crossover is computed, not
written down here.
"""

import pytest
import torch
from matplotlib.figure import Figure

from dtcourse.collectives.cost import predict_time
from dtcourse.lab import tensor_parallel as lab
from dtcourse.lab.problems import check
from dtcourse.memory import gpt_layer_activation_bytes
from dtcourse.models import GPTConfig

CFG, B = lab.TP_GPT, lab.ROWS
S, H, A = CFG.block_size, CFG.d_model, CFG.n_head
SBH = S * B * H
TS = (2, 3, 4)


@pytest.fixture(scope="module")
def traffic():
    return lab.measure_traffic(TS)


@pytest.fixture(scope="module")
def saves():
    return lab.measure_activations((1, *TS))


# --------------------------------------------------------------------------- #
# Bytes per layer
# --------------------------------------------------------------------------- #
def test_every_layer_sends_two_all_reduces_each_way_or_the_same_bytes_as_gathers_and_scatters(traffic):
    rows = lab.bytes_table(traffic)
    blocks = [r for r in rows if r[2].startswith("blocks.")]
    assert len(blocks) == len(TS) * 2 * CFG.n_layer * 2                # t, layout, layer, phase
    for t, layout, where, phase, ops, numel, sent, formula in blocks:
        assert sent == formula == 2 * 2 * (t - 1) * SBH * 4 // t, (t, layout, where, phase)
        if layout == "TP":
            assert ops == "2 all_reduce" and numel == 2 * SBH
        else:   # all-gathers and reduce-scatters name the full s·b·h tensor, and send half an all-reduce each
            assert sorted(ops.split(" + ")) == ["2 all_gather", "2 reduce_scatter"] and numel == 4 * SBH
    assert lab.layer_bytes(2) == 2 * SBH * 4                           # t = 2: each rank sends one sbh per layer
    for t in TS:   # a whole step: the same bytes both ways, but for SP's all-reduce of the replicated gradients
        tp, sp = traffic[t, "TP"], traffic[t, "TP+SP"]
        grads = sp.total("sent", where="sequence_parallel_grads")
        assert grads > 0 and tp.total("sent") == sp.total("sent") - grads
        assert tp.total("sent", where="loss") == 3 * 2 * (t - 1) * S * B * 4 // t   # max, sum of exp, target logit


# --------------------------------------------------------------------------- #
# Activation memory against Korthikanti et al.
# --------------------------------------------------------------------------- #
def test_every_term_is_measured_as_predicted(saves):
    assert len(saves) == 2 * (1 + 3 * len(TS))                          # dropout 0.1 and 0; t = 1, then 3 layouts
    for (t, layout, dropout), r in saves.items():
        predicted = lab.predicted_terms(S, B, H, A, t, layout, dropout > 0)
        assert set(r.by_term) <= set(predicted), r.by_term               # nothing saved outside the paper's terms
        for term, value in predicted.items():
            assert r.by_term.get(term, 0) == value, (t, layout, dropout, term)
        table = lab.activation_table(r)
        assert table[-1][2] == table[-1][3] == r.nbytes


def test_in_the_papers_units_the_terms_add_up_to_the_papers_formulas(saves):
    for t in (1, *TS):
        for layout in ("TP", lab.LAYOUTS[2]):
            paper = lab.predicted_terms(S, B, H, A, t, layout, True, elt=2, mask=1, stats=0)
            assert sum(paper.values()) == pytest.approx(lab.paper_layer_bytes(S, B, H, A, t, layout), rel=1e-12)
    assert lab.paper_layer_bytes(S, B, H, A) == SBH * (34 + 5 * A * S / H)
    assert lab.paper_layer_bytes(S, B, H, A, 2, "TP") == SBH * (10 + 24 / 2 + 5 * A * S / (H * 2))
    assert lab.activation_table(saves[4, "TP+SP", 0.1])[-1][1] == SBH / 4 * (34 + 5 * A * S / H)


def test_the_measured_layer_differs_from_the_paper_only_as_explained(saves):
    masks = 2 * SBH + A * S * S * B                  # the paper's 1-byte masks: two residual, one attention
    stats = 2 * 2 * S * B * 4                        # 2 LayerNorms × (mean, 1/std) per token, fp32
    with_dropout, without = saves[1, "TP", 0.1].nbytes, saves[1, "TP", 0.0].nbytes
    paper = lab.paper_layer_bytes(S, B, H, A)
    # fp32 doubles every 16-bit activation; CPU dropout keeps float masks (4 bytes, not 1)
    assert with_dropout == 2 * (paper - masks) + 4 * masks + stats
    # without dropout: no masks, and the softmax output is saved once, not again as the dropout's output (2as²b)
    assert without == 2 * (paper - masks - 2 * A * S * S * B) + stats
    assert without == gpt_layer_activation_bytes(CFG, B, S)              # lesson 00's count, op by op


def test_sequence_parallel_divides_the_activations_by_t(saves):
    for t in TS:
        for p in (0.1, 0.0):
            serial = saves[1, "TP", p].nbytes
            assert saves[t, lab.LAYOUTS[2], p].nbytes * t == serial                 # Megatron's: every term / t
            # dtcourse.tensor_parallel keeps the all-gathered inputs of c_attn and c_fc in full: sbh each
            assert saves[t, "TP+SP", p].nbytes * t == serial + 2 * SBH * 4 * (t - 1)
            tp = saves[t, "TP", p].by_term
            for term in lab.TERMS:                                                   # TP splits only its pairs
                assert tp.get(term.name, 0) * (t if term.split else 1) == saves[1, "TP", p].by_term.get(term.name, 0)


def test_saving_shards_changes_no_gradient_and_costs_two_all_gathers_in_backward(saves):
    for t in TS:
        for p in (0.1, 0.0):
            kept, gathered = saves[t, lab.LAYOUTS[2], p], saves[t, "TP+SP", p]
            assert kept.grads.keys() == gathered.grads.keys() and "x" in kept.grads
            for name, grad in gathered.grads.items():
                assert torch.equal(kept.grads[name], grad), (t, p, name)      # the same values, gathered again
            assert kept.regathered == lab.layer_bytes(t) // 2 and gathered.regathered == 0


def test_head_size_equal_to_the_sequence_is_refused():
    with pytest.raises(ValueError, match="head size other than the sequence, 8"):
        lab.measure_activations((1,), config=GPTConfig(vocab_size=16, block_size=8, n_head=2, d_model=16))


# --------------------------------------------------------------------------- #
# Why TP stays inside a node
# --------------------------------------------------------------------------- #
def test_across_nodes_the_all_reduces_outlast_compute_at_modest_t():
    rows = lab.tp_cost()
    at = lab.crossover(rows)
    assert at is not None and 2 < at <= lab.NODE                  # GPT-3's layer: already inside one node's size
    assert lab.crossover(rows, "nvlink") is None                  # over NVLink, never up to t = 32
    assert lab.crossover(rows, "in_nodes") == 2 * lab.NODE        # a real cluster: the first t that leaves the node
    s, b, h = lab.GPT3_LAYER.values()
    for r in rows:
        assert r.compute == pytest.approx(3 * (24 * s * b * h * h + 4 * s * s * b * h) / r.t / (0.5 * 989e12))
        for link, value in ((lab.NVLINK, r.nvlink), (lab.INFINIBAND, r.infiniband)):
            ring = predict_time("ring", 2 * s * b * h, r.t, link.latency, 1 / link.bandwidth)   # bf16: 2 bytes
            assert value == pytest.approx(4 * ring)
    no_latency = (lab.Link("a", lab.NVLINK.bandwidth, 0.0), lab.Link("b", lab.INFINIBAND.bandwidth, 0.0))
    assert lab.crossover(lab.tp_cost(links=no_latency)) == at
    figure = lab.cost_figure(rows)
    assert isinstance(figure, Figure) and any(f"t = {at}" in t.get_text() for t in figure.axes[0].texts)


# --------------------------------------------------------------------------- #
# The split figure, from the real shards
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("t", [2, 4])
def test_the_shards_reassemble_the_full_weights_exactly(t):
    split = lab.gather_split(t)
    for name, (dim, parts) in lab.SPLITS.items():
        full = split.full[name]
        assert torch.equal(split.gathered[name], full)                       # gather_shards, in the ranks
        assert torch.equal(lab.assemble(split, name).T, full)               # where the figure draws each shard
        assert all(s.shape[dim] == full.shape[dim] // t for s in split.shards[name])
        # rank r's q block holds heads [r nh/t, (r+1) nh/t): the first rows of its shard are q's
        if parts == 3:
            width = lab.SPLIT_GPT.d_model // t
            assert torch.equal(split.shards[name][t - 1][:width], full[(t - 1) * width:t * width])
    figure = lab.split_figure(split)
    assert [ax.get_title().split(":")[0] for ax in figure.axes] == ["attention c_attn", "attention c_proj",
                                                                     "MLP c_fc", "MLP c_proj"]
    for ax, name in zip(figure.axes, ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")):
        assert len(ax.images) == len(ax.patches) == t * lab.SPLITS[name][1]
        assert ax.get_xlim()[1] == split.full[name].shape[0] - 0.5              # columns of A: output features


# --------------------------------------------------------------------------- #
# The widget and the problems
# --------------------------------------------------------------------------- #
def test_the_widget_looks_up_bytes_and_activations(traffic, saves):
    widget = lab.tp_widget(traffic, saves, t=2)
    view = widget.view
    assert view.bytes_measured == view.bytes_formula == {"forward": 2 * SBH * 4, "backward": 2 * SBH * 4}
    assert view.activations["measured"] == view.activations["predicted"] == saves[2, "TP", 0.1].nbytes
    first = widget.image.value
    widget.scheme.value = lab.LAYOUTS[2]                 # two more all-gathers backward, half a layer's bytes
    assert view.bytes_measured == view.bytes_formula == {"forward": 2 * SBH * 4, "backward": 3 * SBH * 4}
    widget.t.value = 4
    assert view.activations["measured"] * 4 == view.activations["serial"] == saves[1, "TP", 0.1].nbytes
    widget.dropout.value = False
    assert view.activations["measured"] == saves[4, lab.LAYOUTS[2], 0.0].nbytes
    assert view.activations["paper"] == pytest.approx(SBH / 4 * (34 + 5 * A * S / H))
    # the stack: Korthikanti's groups, adding up to what was measured, the legend in the order of the stack
    for x, run in enumerate((saves[1, "TP", 0.0], saves[4, lab.LAYOUTS[2], 0.0])):
        heights = [view.groups[x, label].get_height() for _, label, *_ in lab.TERM_GROUPS]
        assert sum(heights) * 1024 == pytest.approx(run.nbytes)
        tops = [view.groups[x, label].get_y() + view.groups[x, label].get_height() for _, label, *_ in lab.TERM_GROUPS]
        assert tops == sorted(tops)                                             # stacked in TERM_GROUPS' order
    legend = [text.get_text() for text in view.ax_memory.get_legend().get_texts()]
    assert legend[:len(lab.TERM_GROUPS)] == [label for _, label, *_ in reversed(lab.TERM_GROUPS)]
    assert len(legend) == len(lab.TERM_GROUPS) + 2                              # and the two formulas' lines
    widget.t.value = 1
    assert view.bytes_measured == view.bytes_formula == {"forward": 0, "backward": 0}
    assert widget.image.value != first
    # nothing is split at t = 1: no bars, and a note that says why the panel is empty
    assert len(view.ax_bytes.patches) == 0 and view.ax_bytes.get_legend() is None
    assert any("nothing is split" in text.get_text() for text in view.ax_bytes.texts)
    missing = lab.tp_widget({}, saves, t=3, layout="TP+SP").view                # no traffic measured at t = 3
    assert missing.bytes_measured is None and any("no measured run" in t.get_text() for t in missing.ax_bytes.texts)


def test_the_problems_agree_with_their_formulas(traffic, saves):
    answers = [lab.problem_layer_bytes(4, traffic), lab.problem_loss_bytes(2, traffic),
               lab.problem_tp_activations(2, saves), lab.problem_sp_share(4, saves), lab.problem_inter_node(8)]
    for answer in answers:
        assert check(None, answer).answer.agrees
    assert answers[0].measured == 2 * 2 * 2 * 3 * SBH * 4 // 4                 # 4 all-reduces, 3/2 of sbh·4 each
    assert answers[3].measured == 0.25
    assert 1 < answers[4].measured < 1.5                                        # comm outlasts compute at t = 8
    assert lab.problem_layer_bytes(2).agrees                                    # measuring by itself
