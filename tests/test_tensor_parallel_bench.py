"""``dtcourse.bench.tensor_parallel`` at ``--quick`` size, t = 2 and 4: what ``measure`` returns, its table and
its plot.

Only the structure is checked: speed is measured by the benchmark, never asserted here.
"""

import math
import os

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from dtcourse.bench import tensor_parallel as bench  # noqa: E402

STEPS, WORLDS = 3, (2, 4)


@pytest.fixture(scope="module")
def rows():
    # --quick's sizes: 2 x 32 tokens on every rank, 1 warm-up and 3 timed rounds, one launch per t
    return [row for t in WORLDS for row in bench.measure(t, bench.TP_GPT, batch_size=2, seq_len=32,
                                                         warmup=1, steps=STEPS)]


def test_one_row_per_layout_and_t_with_both_engines_timed_every_step(rows):
    assert [(r["world_size"], r["layout"]) for r in rows] == [(t, layout) for t in WORLDS for layout in bench.LAYOUTS]
    for r in rows:
        # gloo on CPU ranks; nccl, one GPU per rank, only where launch finds t GPUs
        assert (r["backend"], r["device"].split(":")[0]) in {("gloo", "cpu"), ("nccl", "cuda")}
        for engine in bench.ENGINES:
            times = r[engine]
            assert len(times["times"]) == STEPS and all(t > 0 for t in times["times"])
            assert times["q1_ms"] <= times["median_ms"] <= times["q3_ms"]
        assert 0 < r["ratio"] < math.inf
        assert r["ratio_q1"] <= r["ratio"] <= r["ratio_q3"]


def test_sent_bytes_come_from_the_traffic_log_and_sp_adds_the_layernorm_gradients(rows):
    by = {(r["world_size"], r["layout"]): r["sent"] for r in rows}
    for t in WORLDS:
        # the same all-reduce bytes split into reduce-scatter + all-gather, plus one all-reduce of the
        # replicated parameters' gradients that saw a sequence shard (LayerNorms, row biases, wpe)
        assert 0 < by[(t, "TP")] < by[(t, "TP+SP")]
    assert by[(2, "TP")] < by[(4, "TP")]          # 2(t-1)/t of the same tensors grows with t


def test_table_and_plot(rows):
    text = bench.table(rows)
    assert len(text.splitlines()) == 2 + len(rows)
    assert all(f"{r['ratio']:.2f}x" in text for r in rows)
    fig = bench.plot(rows, "quick")
    assert len(fig.axes) == len(WORLDS)
    for ax, t in zip(fig.axes, WORLDS):
        mine = [r for r in rows if r["world_size"] == t]
        assert [p.get_height() for p in ax.patches] == [r[e]["median_ms"] for e in bench.ENGINES for r in mine]


def test_main_quick_prints_the_table_and_saves_the_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "measure", lambda t, *args: [
        {"world_size": t, "layout": layout, "sent": 1024, "device": "cpu", "backend": "gloo",
         **{e: bench.step_times([0.01, 0.02]) for e in bench.ENGINES}, "ratio": 1.0, "ratio_q1": 1.0,
         "ratio_q3": 1.0} for layout in bench.LAYOUTS])
    out = tmp_path / "tp.png"
    bench.main(["--quick", "--out", str(out)])
    printed = capsys.readouterr().out
    assert ("oversubscribed: t = 4" in printed) == (os.cpu_count() < 4)   # more ranks than CPUs, said so
    assert "t = 2: dtcourse / DTensor = TP 1.00x, TP+SP 1.00x" in printed and out.exists()
