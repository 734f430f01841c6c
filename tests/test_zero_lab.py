"""What lesson 06 measures and draws (dtcourse/lab/zero.py): memory by kind against the paper, bytes sent per
stage, which collective runs on which unit, stage 3's recorded prefetch, FSDP2 parity, the memory widget driven
by ``.value``, and the problems. Structure and bytes are asserted, never timings."""

import pytest

from dtcourse.lab import zero as lab
from dtcourse.lab.problems import check
from dtcourse.zero import STAGES

N_MEASURED = (2, 4)


@pytest.fixture(scope="module")
def runs():
    return lab.measure_memory(worlds=N_MEASURED)


def test_the_paper_case_extrapolates_to_its_published_numbers():
    # Rajbhandari et al., Figure 1: Ψ = 7.5B, N = 64, mixed-precision Adam (K = 12)
    gb = [lab.predicted_memory(7.5e9, 64, s).device / 1e9 for s in STAGES]
    assert gb == [120.0, 31.40625, 16.640625, 1.875]
    assert [round(g, 1) for g in gb] == [120.0, 31.4, 16.6, 1.9]
    # K: the fp32 master and the optimizer's states; fp32 training has no master and 4-byte parameters
    assert lab.predicted_memory(1, 1, 0, "sgd_momentum").device == 2 + 2 + 8
    assert lab.predicted_memory(1, 1, 0, "sgd").device == 2 + 2 + 4
    assert lab.predicted_memory(1, 1, 0, "adam", mixed=False).device == 4 + 4 + 8
    # offloading moves K to the host and leaves parameters and gradients on the device
    off = lab.predicted_memory(7.5e9, 64, 2, offload=True)
    assert off.optimizer_states == 0 and off.device == 2 * 7.5e9 + 2 * 7.5e9 / 64 and off.host == 12 * 7.5e9 / 64
    with pytest.raises(ValueError, match="optimizer must be one of"):
        lab.predicted_memory(1, 1, 0, "lion")


def test_measured_model_states_equal_the_formula_on_the_padded_count(runs):
    assert {(r.world, r.stage, r.optimizer, r.mixed, r.offload) for r in runs} == {
        (n, s, o, m, f) for n in N_MEASURED for s in STAGES for o in ("adam", "sgd_momentum") for m in (True, False)
        for f in (False, True) if not (m and f)}       # offloaded: fp32 only (see measure_memory)
    for r in runs:
        assert (r.optimizer_states == 0) == r.offload      # offloaded, the device keeps no optimizer state
    psi = 630 + 930 + 155
    for r in runs:
        assert r.psi == psi and r.model_states == r.paper, r
        assert r.padded - r.psi == sum(-u % r.world for u in (630, 930, 155))   # 1 at N = 2, 5 at N = 4
        assert r.activations == lab.activation_bytes(r.sizes, r.rows, r.mixed)    # never sharded
        assert (r.gathered > 0) == (r.stage == 3) and (r.buckets > 0) == (r.stage >= 2)
    at4 = {(r.rank, r.stage): r for r in runs if r.world == 4 and r.optimizer == "adam" and r.mixed}
    assert at4[3, 3].padding == 5 * 16 and at4[0, 3].padding == 0      # the zeros sit in the last rank's part
    assert at4[3, 0].padding == at4[0, 0].padding == 5 * 16            # stage 0 keeps every padded vector
    assert [at4[0, s].model_states for s in STAGES] == sorted((at4[0, s].model_states for s in STAGES),
                                                              reverse=True)


def test_bytes_sent_per_stage_and_the_collectives_that_send_them():
    n = 4
    per_rank = lab.measure_traffic(world=n)
    for rank in per_rank:
        for stage, (log, counted, padded, by_unit) in rank.items():
            # the ring's messages, counted, against the backend's collectives at a ring's bytes, and the formula
            assert counted == sum(c.sent for c in log) == sum(by_unit.values()) == lab.traffic_formula(stage, padded, n)
    log2, log3 = per_rank[0][2][0], per_rank[0][3][0]
    # stage 2 reduce-scatters the gradients: no all-reduce or all-gather of gradients
    assert {c.op for c in log2 if c.what == "gradients"} == {"reduce_scatter"}
    assert {c.op for c in log2 if c.what == "parameters"} == {"all_gather"}
    # stage 3: every unit gathered from every rank before forward and backward, no broadcast from an owner
    units = lab.collectives_by_unit(log3)
    assert list(units) == ["net.0", "net.2", "net.4"]
    for ops in units.values():
        assert [op[:3] for op in ops] == [("all_gather", "parameters", "forward"),
                                          ("all_gather", "parameters", "backward"),
                                          ("reduce_scatter", "gradients", "backward")]
    for unit in units:      # every rank sends the same share of every unit, counted on the ring: nobody owns a layer
        sent = {r[3][3][unit] for r in per_rank}
        assert len(sent) == 1 and sent == {sum(s for *_, s in units[unit])}


def test_stage3_prefetch_overlaps_gathers_with_compute_and_no_prefetch_does_not():
    runs = lab.record_stage3(world=2, rows=32, steps=2)
    for rank in (0, 1):
        on, off = runs["prefetch"][rank], runs["no prefetch"][rank]
        for spans in (on, off):
            assert [s.name for s in spans if s.kind == "forward"] == ["net.0", "net.2", "net.4", "net.6"]
            assert [s.name for s in spans if s.kind == "backward"] == ["net.6", "net.4", "net.2", "net.0"]
            assert sum(s.kind == "all_gather" for s in spans) == 8 and sum(s.kind == "reduce_scatter" for s in spans) == 4
        assert lab.prefetch_overlaps(off) == [] and lab.requested_ahead(off) == []   # gather, wait, then compute
        ahead = {(g.name, c.name) for g, c in lab.requested_ahead(on)}
        # the next unit is asked for before this one computes: in forward order, then in backward order
        assert ahead == {("net.2 forward", "net.0"), ("net.4 forward", "net.2"), ("net.6 forward", "net.4"),
                         ("net.4 backward", "net.6"), ("net.2 backward", "net.4"), ("net.0 backward", "net.2")}
    box = lab.zero_timeline_widget(runs)
    assert "overlaps" in box.view.ax.get_title() and len(box.view.bars) == sum(len(v) for v in runs["prefetch"].values())


def test_the_memory_widget_draws_the_prediction_and_overlays_measured_runs(runs):
    box = lab.memory_widget(runs)
    view = box.view
    # every Ψ readout is short enough for the slider's readout box; the note says which Ψ was measured
    assert all(len(label) <= 6 for label, _ in box.psi.options) and box.psi.label == "7.5B"
    assert "Ψ = 1,715 on N = 2, 4" in box.note.value and box.children[2] is box.note
    assert view.state == dict(psi=75 * 10**8, world=64, stage=2, optimizer="adam", mixed=True, offload=False)
    assert [round(view.totals[s] / 1e9, 1) for s in STAGES] == [120.0, 31.4, 16.6, 1.9]
    assert view.measured == {} and view.bars["predicted", 2, "parameters"].get_height() == pytest.approx(15)
    assert view.bars["predicted", 2, "parameters"].get_alpha() == 1 and view.bars["predicted", 0, "gradients"].get_alpha() < 1
    first = box.image.value
    box.psi.value, box.world.value = 1715, 4            # the measured MLP: its runs appear beside the prediction
    assert box.image.value != first and set(view.measured) == set(STAGES)
    for s in STAGES:
        r = view.measured[s]
        assert (r.world, r.stage, r.rank) == (4, s, 3)  # the rank holding the padding
        for kind, nbytes in r.by_kind().items():        # drawn in kB
            assert view.bars["measured", s, kind].get_height() == pytest.approx(nbytes / 1e3)
        # the paper's total sits above both bars of its stage, where neither bar hides it
        tops = [b.get_y() + b.get_height() for k, b in view.bars.items() if k[1] == s]
        assert view.labels[s].get_text() == f"{view.totals[s] / 1e3:.3g}"
        assert view.labels[s].xy == (s, pytest.approx(max(tops))) and max(tops) > view.totals[s] / 1e3
    box.offload.value = True                            # no bf16 run offloads: the overlay goes
    assert view.measured == {} and view.bars["predicted", 3, "optimizer states"].get_height() == 0
    assert "offloaded" in view.ax.get_title()
    box.mixed.value = False                             # fp32 runs with the optimizer on the host come back
    assert set(view.measured) == set(STAGES) and all(r.offload for r in view.measured.values())
    assert all(view.bars["measured", s, "optimizer states"].get_height() == 0 for s in STAGES)
    box.mixed.value = True
    assert view.lines[3].get_linewidth() < view.lines[2].get_linewidth()


def test_zero_stage3_matches_fsdp2():
    assert lab.fsdp2_parity(world=2, steps=2) < 1e-6     # float32, the same sums: 0 measured


@pytest.mark.parametrize("problem", [lab.problem_stage2_bytes, lab.problem_stage3_traffic, lab.problem_padding,
                                     lab.problem_prefetch_memory])
def test_every_problem_measures_what_its_formula_says(problem):
    answer = problem()
    assert answer.agrees and answer.measured > 0
    assert "right" in repr(check(answer.formula, answer))
