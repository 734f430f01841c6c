"""DistributedDataParallel: parity with one process and with torch DDP, no_sync, buckets, events, errors;
and what lesson 02's lab computes beside it (the link's fallback, FLOPs, the bucket model, the problems).

The parity tests go through ``dtcourse.parity.check_parity``: after every step it compares the outputs,
the gradients and the parameters with one process and with torch DDP, and checks that every rank holds
the same bits. Every world size runs all of its cases inside one launch, and the strategies of a case
train side by side against one baseline and one torch DDP, so the file stays fast on 2 cores.
"""

import time
from dataclasses import replace

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dtcourse import RankError, launch  # noqa: E402
from dtcourse.collectives import predict_time  # noqa: E402
from dtcourse.data_parallel import COMMS, STRATEGIES, DistributedDataParallel, assign_buckets  # noqa: E402
from dtcourse.data_parallel.cost import best_bucket_count, exposed_comm, step_flops  # noqa: E402
from dtcourse.lab import data_parallel as lab  # noqa: E402
from dtcourse.lab.widgets import COLUMN_IN  # noqa: E402
from dtcourse.models import GPT, GPTConfig, MLP, lm_loss, regression_batch, token_batch  # noqa: E402
from dtcourse.lab.data_parallel import DDPRecorder  # noqa: E402
from dtcourse.parity import Replicated, Tolerance, check_parity  # noqa: E402
from dtcourse.runtime.observe import observe  # noqa: E402
from dtcourse.runtime.timeline import Timeline  # noqa: E402

B = 12                    # global batch, divisible by every world size tested (1-4)
ACC_B, MICRO = 36, 3      # accumulation: 36 / (N * 3) rows per micro-batch for N = 1..4
STEPS, LR = 3, 1e-3
SIZES = (7, 13, 11, 5)    # parameter numels 91, 13, 143, 11, 55, 5: none divisible by 2, 3 or 4
MLP_CAP = 0.0002          # MiB, about 210 bytes: three buckets (see test_bucket_assignment)
GPT_CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, d_model=16)
GPT_CAP = 0.002           # MiB, about 2 KiB: the 3.9k-parameter GPT in several buckets
# float32 throughout; `pytest -s` prints the largest differences measured.
ONE_PROCESS = Tolerance(1e-5, 0, (
    "a rank's mean over B/N rows, averaged over N ranks, adds the same numbers as the mean over B rows "
    "in another order: gradients differ by a few ulps (5e-7 at most, GPT at N = 3). Adam's first step "
    "is lr * g / (|g| + eps), so where g nearly cancels (3e-8, near eps = 1e-8) those ulps move the "
    "parameter by up to 4.7e-6 (GPT c_attn at N = 3), and the outputs by 1e-6"))
TORCH_DDP = Tolerance(1e-5, 0, (
    "torch divides by N before summing and we after, and the N-term sums may run in another order "
    "(torch's buckets differ, and comm='ring' is our own ring): 6.9e-7 at most, at N = 4"))
TORCH_DDP_EXACT = Tolerance.exact(
    "N <= 2: one addition a + b per element and an exact halving, (a + b) / 2 == a / 2 + b / 2, so "
    "the same bits as torch DDP, and the same outputs from the same parameters")


def _adam(params):
    return torch.optim.Adam(params, lr=LR)


def _mlp() -> nn.Module:
    model = MLP(SIZES, seed=0)
    model.net[2].bias.requires_grad_(False)   # frozen: left out of every bucket
    return model


MODELS = {   # name: (build, batches(global batch, seed), loss, bucket cap)
    "mlp": (_mlp, lambda b, s: regression_batch(b, SIZES[0], SIZES[-1], seed=s), F.mse_loss, MLP_CAP),
    "gpt": (lambda: GPT(GPT_CFG, seed=0), lambda b, s: token_batch(GPT_CFG, b, seed=s), lm_loss, GPT_CAP),
}
# case: (model, global batch, micro-batches per step). "acc": 2 micro-batches under no_sync + 1 synced
# must equal one step on the full batch.
PARITY_CASES = {"mlp": ("mlp", B, 1), "gpt": ("gpt", B, 1), "acc": ("mlp", ACC_B, MICRO)}


def _ours(strategy, comm, cap, micro):
    return lambda model, group: Replicated(DistributedDataParallel(model, strategy=strategy, comm=comm,
                                                                   bucket_cap_mb=cap, group=group), _adam, micro)


def _parity_cases():
    """Every strategy and comm side by side, against one process and torch DDP, after every step."""
    exact = dist.get_world_size() <= 2
    reports = {}
    for case, (model, rows, micro) in PARITY_CASES.items():
        build, batch, loss_fn, cap = MODELS[model]
        ours = {f"{strategy}/{comm}": _ours(strategy, comm, cap, micro) for strategy in STRATEGIES for comm in COMMS}
        theirs = lambda m, g: Replicated(nn.parallel.DistributedDataParallel(m, bucket_cap_mb=cap, process_group=g),
                                         _adam, micro)
        reports[case] = check_parity(build, ours, [batch(rows, s) for s in range(STEPS)], loss_fn, _adam,
                                     tolerance=ONE_PROCESS, reference=theirs,
                                     reference_tolerance=TORCH_DDP_EXACT if exact else TORCH_DDP)
    return reports


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_parity_with_single_process_and_torch_ddp(world_size):
    reports = launch(_parity_cases, world_size, timeout=120)[0]   # check_parity raised in the ranks if not
    assert reports.keys() == PARITY_CASES.keys()
    against = {"single", "reference"} | ({"ranks"} if world_size > 1 else set())   # "ranks": the same bits
    for case, report in reports.items():
        assert report.steps == STEPS
        assert {key[:2] for key in report.max_diff} == {(f"{s}/{c}", a) for s in STRATEGIES for c in COMMS
                                                        for a in against}, case
    print(f"N={world_size}: largest difference vs one process "
          f"{max(r.worst('single') for r in reports.values()):.2e}, "
          f"vs torch DDP {max(r.worst('reference') for r in reports.values()):.2e}")


def _subgroup_cases():
    """Ranks {0, 1} and {2, 3} train separate replicas: each group starts from its own rank 0."""
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]   # every rank creates both, in order
    g = rank // 2
    batches = [regression_batch(B, SIZES[0], SIZES[-1], seed=10 * g + s) for s in range(STEPS)]
    trained = []

    def build():                                                # the baseline: group rank 0 = global rank 2g
        trained.append(MLP(SIZES, seed=2 * g))
        return trained[-1]

    def scrambled(strategy, comm):
        def shard(model, group):
            model.load_state_dict(MLP(SIZES, seed=rank).state_dict())   # differs on every rank before wrapping
            return _ours(strategy, comm, MLP_CAP, 1)(model, group)
        return shard

    cases = (("overlapped", "backend"), ("overlapped", "ring"), ("bucketed", "ring"))
    check_parity(build, {"/".join(case): scrambled(*case) for case in cases}, batches, F.mse_loss, _adam,
                 tolerance=ONE_PROCESS, group=groups[g])
    return torch.cat([p.detach().reshape(-1) for p in trained[0].parameters()])   # trained by the first case


def test_process_subgroups_average_only_within_their_group():
    per_rank = launch(_subgroup_cases, 4, timeout=120)   # parity within each group, checked in the ranks
    assert not torch.allclose(per_rank[0], per_rank[2])


# --------------------------------------------------------------------------- #
# Buckets, events, no_sync
# --------------------------------------------------------------------------- #
def test_assign_buckets_walks_backwards_and_closes_at_the_cap():
    params = [torch.empty(n) for n in (10, 3, 4, 20, 1)]        # 40, 12, 16, 80, 4 bytes
    assert assign_buckets(params, 16) == [[4, 3], [2], [1, 0]]  # 84 | 16 | 12+40: each closes at >= 16
    assert assign_buckets(params, 10**6) == [[4, 3, 2, 1, 0]]
    mixed = [torch.empty(2), torch.empty(2, dtype=torch.float64), torch.empty(2)]
    assert assign_buckets(mixed, 10**6) == [[2], [1], [0]]      # a bucket is one flat tensor: one dtype


def _events_and_layout():
    rank = dist.get_rank()
    x, y = regression_batch(4, SIZES[0], SIZES[-1], seed=rank)
    out = {}
    for strategy in STRATEGIES:
        for comm in COMMS:
            ddp = DistributedDataParallel(_mlp(), strategy=strategy, comm=comm, bucket_cap_mb=MLP_CAP)
            with ddp.no_sync(), observe() as quiet:
                F.mse_loss(ddp(x), y).backward()
            local = [p.grad.clone() for p in ddp.module.parameters() if p.grad is not None]
            timeline = Timeline()
            if comm == "backend":
                recorder = DDPRecorder(ddp, timeline)
                loss = F.mse_loss(ddp(x), y)
                with recorder.backward():
                    loss.backward()
            else:
                F.mse_loss(ddp(x), y).backward()
            out[strategy, comm] = (ddp.buckets, len(quiet.records), [s.kind for s in timeline.spans], local)
    return out


def test_bucket_layout_events_and_no_sync():
    per_rank = launch(_events_and_layout, 2)
    for (strategy, comm), (buckets, quiet, kinds, local) in per_rank[0].items():
        if strategy == "per_parameter":
            assert buckets == [["net.4.bias"], ["net.4.weight"], ["net.2.weight"], ["net.0.bias"], ["net.0.weight"]]
        else:   # 20+220 bytes >= 210 | 572 | 52+364; the frozen net.2.bias is in no bucket
            assert buckets == [["net.4.bias", "net.4.weight"], ["net.2.weight"], ["net.0.bias", "net.0.weight"]]
        assert quiet == 0, "no_sync must not communicate"
        assert not all(torch.equal(a, b) for a, b in zip(local, per_rank[1][strategy, comm][3])), \
            "under no_sync each rank keeps its own gradient"
        if comm == "backend":            # the timeline lab.data_parallel draws, seen from outside the wrapper
            assert kinds[0] == "forward" and "backward" in kinds
            assert kinds.count("all_reduce") == len(buckets) and kinds.count("grad") == 5
            assert kinds.count("wait") == (len(buckets) if strategy == "overlapped" else 0)


def _overlap_order():
    """Sends against gradient times: overlapped sends buckets before backward ends, bucketed after."""
    x, y = regression_batch(4, SIZES[0], SIZES[-1], seed=dist.get_rank())
    out = {}
    for strategy in ("bucketed", "overlapped"):
        for comm in COMMS:
            ddp = DistributedDataParallel(_mlp(), strategy=strategy, comm=comm, bucket_cap_mb=MLP_CAP)
            grads = []
            for p in ddp.module.net[0].parameters():       # bucket 2's: a tensor hook runs before DDP's hook
                p.register_hook(lambda g: grads.append(time.perf_counter()))
            loss = F.mse_loss(ddp(x), y)
            with observe() as log:
                loss.backward()
            early = [r for r in log.records if r.start < min(grads)]
            out[strategy, comm] = (len(early) if comm == "backend" else sum(r.nbytes for r in early if r.op == "send"))
    return out


def test_overlapped_buckets_start_before_backward_ends():
    counts = launch(_overlap_order, 2)[0]
    assert counts["bucketed", "backend"] == counts["bucketed", "ring"] == 0
    # Buckets 0 and 1 fill before net.0's gradients exist; bucket 2 fills with the last gradient. On 2 ranks
    # the ring sends a bucket's whole bytes: 240 + 572 before the last gradient.
    assert counts["overlapped", "backend"] == 2
    assert counts["overlapped", "ring"] == 240 + 572


# --------------------------------------------------------------------------- #
# Unused parameters
# --------------------------------------------------------------------------- #
class _WithExtra(nn.Module):
    """The test MLP plus a head that forward uses only when asked to."""

    def __init__(self):
        super().__init__()
        self.body = _mlp()
        with torch.random.fork_rng():
            torch.manual_seed(1)
            self.extra = nn.Linear(SIZES[-1], SIZES[-1])

    def forward(self, x, use_extra=False):
        h = self.body(x)
        return self.extra(h) if use_extra else h


UNUSED_CASES = [(strategy, "backend") for strategy in STRATEGIES] + [("overlapped", "ring")]


def _unused_cases():
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = regression_batch(B, SIZES[0], SIZES[-1], seed=0)
    rows = B // world
    xs, ys = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
    out = {}
    for strategy, comm in UNUSED_CASES:
        ddp = DistributedDataParallel(_WithExtra(), strategy=strategy, comm=comm, bucket_cap_mb=MLP_CAP)
        try:
            F.mse_loss(ddp(xs), ys).backward()
            out["error", strategy, comm] = None
        except RuntimeError as exc:
            out["error", strategy, comm] = str(exc)
        t = torch.ones(1)
        dist.all_reduce(t)                        # the ranks are still in step after the error
        out["in_step", strategy, comm] = t.item()
        # find_unused_parameters=True, with extra used by no rank, then by rank 0 only, against torch DDP
        for use in ("none", "rank0"):
            grads = []
            for wrap in (lambda m: DistributedDataParallel(m, strategy=strategy, comm=comm, bucket_cap_mb=MLP_CAP,
                                                           find_unused_parameters=True),
                         lambda m: nn.parallel.DistributedDataParallel(m, find_unused_parameters=True)):
                ddp = wrap(_WithExtra())
                for _ in range(2):                # twice: the bookkeeping must reset between steps
                    ddp.zero_grad(set_to_none=True)
                    F.mse_loss(ddp(xs, use_extra=use == "rank0" and rank == 0), ys).backward()
                grads.append({n: None if p.grad is None else p.grad.clone()
                              for n, p in ddp.module.named_parameters()})
            out["found", strategy, comm, use] = grads
    return out


def test_unused_parameters_raise_or_are_handled_like_torch():
    world = 3
    per_rank = launch(_unused_cases, world, timeout=120)
    for rank, results in enumerate(per_rank):
        for strategy, comm in UNUSED_CASES:
            message = results["error", strategy, comm]
            assert message and "['extra.weight', 'extra.bias']" in message \
                and "find_unused_parameters=True" in message, message
            assert results["in_step", strategy, comm] == world
            for use in ("none", "rank0"):
                ours, theirs = results["found", strategy, comm, use]
                assert ours.keys() == theirs.keys()
                for name in ours:
                    if theirs[name] is None:
                        assert ours[name] is None, f"{strategy} {comm} {use} {name}: torch leaves it None"
                    else:   # same sums in another order (torch divides before summing): few-ulp differences
                        torch.testing.assert_close(ours[name], theirs[name], atol=TORCH_DDP.atol, rtol=0)
                        assert torch.equal(ours[name], per_rank[0]["found", strategy, comm, use][0][name])


# --------------------------------------------------------------------------- #
# Bad input
# --------------------------------------------------------------------------- #
def _bad_inputs():
    rank = dist.get_rank()
    errors = {}

    def attempt(key, make):
        try:
            make()
            errors[key] = None
        except ValueError as exc:
            errors[key] = str(exc)

    attempt("shape", lambda: DistributedDataParallel(MLP((7, 13 + rank, 11, 5))))
    frozen = MLP(SIZES)
    frozen.net[0].bias.requires_grad_(rank == 0)
    attempt("frozen", lambda: DistributedDataParallel(frozen))
    attempt("depth", lambda: DistributedDataParallel(MLP(SIZES[: 3 + rank])))
    attempt("cap zero", lambda: DistributedDataParallel(MLP(SIZES), bucket_cap_mb=0))
    attempt("cap negative", lambda: DistributedDataParallel(MLP(SIZES), bucket_cap_mb=-1))
    attempt("strategy", lambda: DistributedDataParallel(MLP(SIZES), strategy="fast"))
    attempt("comm", lambda: DistributedDataParallel(MLP(SIZES), comm="nccl"))
    model = MLP(SIZES)
    ddp = DistributedDataParallel(model)
    attempt("wrap the wrapper", lambda: DistributedDataParallel(ddp))
    attempt("wrap twice", lambda: DistributedDataParallel(model))
    attempt("torch ddp", lambda: DistributedDataParallel(nn.parallel.DistributedDataParallel(MLP(SIZES))))
    # Parameters differ on rank 1 before wrapping: construction copies rank 0's everywhere.
    differs = MLP(SIZES, seed=rank)
    DistributedDataParallel(differs)
    errors["broadcast"] = torch.cat([p.detach().reshape(-1) for p in differs.parameters()])
    return errors


def test_bad_input_errors_say_what_to_change():
    per_rank = launch(_bad_inputs, 2)
    for errors in per_rank:
        assert ("rank 0 has parameter 'net.0.weight' (shape (13, 7), torch.float32, requires_grad=True) where "
                "rank 1 has parameter 'net.0.weight' (shape (14, 7)") in errors["shape"]
        assert "same model" in errors["shape"]
        assert "'net.0.bias' (shape (13,), torch.float32, requires_grad=True) where rank 1 has parameter " \
               "'net.0.bias' (shape (13,), torch.float32, requires_grad=False)" in errors["frozen"]
        assert "rank 0 has nothing where rank 1 has parameter 'net.4.weight'" in errors["depth"]
        for key in ("cap zero", "cap negative"):
            assert "bucket_cap_mb must be a positive number of MiB" in errors[key]
        assert "strategy must be one of" in errors["strategy"] and "'fast'" in errors["strategy"]
        assert "comm must be one of" in errors["comm"]
        for key in ("wrap the wrapper", "wrap twice", "torch ddp"):
            assert "already wrapped" in errors[key], key
    assert torch.equal(per_rank[0]["broadcast"], per_rank[1]["broadcast"])


def test_without_a_process_group_the_error_says_how_to_start_one():
    with pytest.raises(RuntimeError, match="dtcourse.launch"):
        DistributedDataParallel(MLP(SIZES))


def test_a_rank_error_reaches_the_caller():
    def fn():
        DistributedDataParallel(MLP(SIZES), bucket_cap_mb=0)

    with pytest.raises(RankError, match="bucket_cap_mb"):
        launch(fn, 1)


def _strategy_from_overlap():
    return [DistributedDataParallel(MLP(seed=0), overlap=flag).strategy for flag in (True, False)] + \
        [DistributedDataParallel(MLP(seed=0), 25, False, None, strategy="per_parameter").strategy]


def test_overlap_flag_picks_step_three_or_two():
    assert launch(_strategy_from_overlap, 2)[0] == ["overlapped", "bucketed", "per_parameter"]


# --------------------------------------------------------------------------- #
# Counting the ring's messages
# --------------------------------------------------------------------------- #
def _counted_ring():
    x, y = regression_batch(6, SIZES[0], SIZES[-1], seed=dist.get_rank())
    out = {}
    for strategy in STRATEGIES:
        ddp = DistributedDataParallel(_mlp(), strategy=strategy, comm="ring", bucket_cap_mb=MLP_CAP)
        with observe() as log:
            F.mse_loss(ddp(x), y).backward()
            with ddp.no_sync():
                F.mse_loss(ddp(x), y).backward()          # sends nothing: no record more
        sends = log.select(op="send")
        out[strategy] = (sum(r.nbytes for r in sends), len(sends), len(ddp.buckets))
    try:
        DDPRecorder(DistributedDataParallel(_mlp(), comm="ring"), Timeline())
    except ValueError as err:
        out["backend"] = str(err)
    return out


def test_the_observer_sees_every_ring_message():
    n = 3
    per_rank = launch(_counted_ring, n)
    # 307 trainable elements (the frozen net.2.bias sent by no one), none divisible by 3: uneven chunks
    S = 4 * sum(p.numel() for p in _mlp().parameters() if p.requires_grad)
    for strategy in STRATEGIES:
        sent = [counts[strategy][0] for counts in per_rank]
        # each phase of a ring sends every chunk N-1 times in all, whatever their sizes
        assert sum(sent) == 2 * (n - 1) * S, strategy
        buckets = per_rank[0][strategy][2]
        # one rank: all chunks but one per phase; a chunk is within one float of 1/N of its bucket
        assert all(abs(s - 2 * (n - 1) / n * S) < 2 * 4 * buckets for s in sent)
        assert [counts[strategy][1] for counts in per_rank] == [2 * (n - 1) * buckets] * n   # 2(N-1) per bucket
    assert per_rank[0]["per_parameter"][2] == 5 and per_rank[0]["bucketed"][2] == 3
    assert "count them with observe() instead" in per_rank[0]["backend"]   # the timeline draws the backend's


# --------------------------------------------------------------------------- #
# Lesson 02's lab: the link, the forward pass, compute beside communication, problems
# --------------------------------------------------------------------------- #
def test_a_noisy_fit_falls_back_to_stated_figures_and_says_so(monkeypatch):
    monkeypatch.setattr(lab.lab_collectives, "ping_pong", lambda sizes, repeats: [(s, 1e-4) for s in sizes])

    def too_noisy(samples):
        raise ValueError("the medians are too noisy to fit")

    monkeypatch.setattr(lab.lab_collectives, "fitted_model", too_noisy)
    link = lab.fitted_link()
    assert (link.alpha, link.beta, link.measured) == (lab.LOOPBACK.alpha, lab.LOOPBACK.beta, False)
    assert "too noisy" in link.source and "stated" in link.source and "stated" in str(link)
    monkeypatch.setattr(lab.lab_collectives, "fitted_model", lambda samples: (3e-5, 0.0))   # no positive beta
    assert not lab.fitted_link().measured
    monkeypatch.setattr(lab.lab_collectives, "fitted_model", lambda samples: (3e-5, 5e-10))
    fitted = lab.fitted_link()
    assert fitted.measured and fitted.bandwidth == pytest.approx(2e9) and "fitted" in fitted.source
    with pytest.raises(ValueError, match="alpha > 0 and beta > 0"):
        lab.Link(1e-5, -1e-9, "a negative fit")


def test_flop_rate_counts_and_never_divides_by_a_clock_that_did_not_move(monkeypatch):
    assert lab.counted_step_flops(GPT_CFG, 2, 8, device="meta") == lab.counted_step_flops(GPT_CFG, 2, 8) > 0
    measured = lab.measure_flops_per_s(GPT_CFG, 2, 8, repeats=3)
    assert measured.measured and measured.flops_per_s > 0
    monkeypatch.setattr(lab.time, "perf_counter", lambda: 1.0)   # every pass "takes" 0 s
    stuck = lab.measure_flops_per_s(GPT_CFG, 2, 8, repeats=3)
    assert not stuck.measured and stuck.flops_per_s == lab.ONE_CORE.flops_per_s and "0.0 s" in stuck.source


def test_compute_covers_the_all_reduce_from_the_hiding_batch():
    case = lab.GPU_CASE
    assert case.comm_s == predict_time("ring", 2 * 1.5e9, 64, 10e-6, 1 / 50e9)
    compute = case.hiding_batch * step_flops(case.params, case.seq_len) / case.flops_per_s
    assert compute == pytest.approx(case.comm_s)
    assert 5 < case.hiding_batch < 6 and "(6, 6,144 tokens)" in case.row()


def test_bucket_model_exposes_a_whole_bucket_or_only_the_last_one():
    S, n, ab = 1e8, 4, (1e-5, 1e-9)                                  # alpha, beta
    each = lambda k: predict_time("ring", S / k, n, *ab)              # 6 alpha + 1.5 S/k beta
    assert exposed_comm(1, S, n, *ab, backward_s=1.0) == pytest.approx(each(1))          # nothing overlaps
    assert exposed_comm(10, S, n, *ab, backward_s=1.0) == pytest.approx(each(10))        # the link keeps pace
    # it cannot: the first bucket is ready at 1 ms, then ten all-reduces back to back
    assert exposed_comm(10, S, n, *ab, backward_s=0.01) == pytest.approx(0.001 + 10 * each(10) - 0.01)
    # keeps pace while k * 6 alpha + 1.5 S beta <= backward: k <= (0.16 - 0.15) / 6e-5 = 166.7
    assert best_bucket_count(S, n, *ab, backward_s=0.16) == 166
    with pytest.raises(ValueError, match="at least 1"):
        exposed_comm(0, S, n, *ab, 1.0)
    fig = lab.plot_bucket_model(lab.GPU_CASE, sequences=16)
    try:
        backward = 4 * lab.GPU_CASE.params * 16 * 1024 / lab.GPU_CASE.flops_per_s
        assert fig.best == best_bucket_count(2 * 1.5e9, 64, 10e-6, 1 / 50e9, backward, most=500) == 101
        assert fig.get_figwidth() <= COLUMN_IN and fig.axes[0].get_title()
        assert all(t.get_fontsize() >= 8 for t in fig.axes[0].get_legend().get_texts())
    finally:
        plt.close(fig)


def test_torch_ddp_broadcasts_every_buffer_in_forward_and_ours_sends_nothing():
    seen = lab.forward_collectives(2, GPT_CFG)
    assert seen["dtcourse"] == [] and seen["torch, no buffer sync"] == []
    masks = sum(b.numel() for b in GPT(GPT_CFG).buffers())    # one 8 x 8 causal mask
    assert sum(n for kind, n in seen["torch"] if kind == "broadcast") == masks == 64


def test_problems_agree_with_their_formulas_and_a_wrong_formula_would_not():
    # about 2 s on the busy 2-core machine: two launches of 3 ranks through our Python ring
    P, p = 867_072, sum(t.numel() for t in GPT(GPT_CFG).parameters())   # the lesson's GPT; the small one
    params = list(GPT(GPT_CFG).parameters())
    tensors, buckets = len(params), len(assign_buckets(params, int(GPT_CAP * 2**20)))   # 17 tensors, 5 buckets
    answers = [
        (lab.problem_sampler_repeats(1003, 8), 1003 % 8),                  # the remainder, not the padding
        (lab.problem_sampler_repeats(10, 4), 0),
        (lab.problem_ring_bytes(3, GPT_CAP, GPT_CFG), 4 * p),             # S, not 2(N-1)/N S
        (lab.problem_bucket_latency(3, bucket_cap_mb=GPT_CAP, config=GPT_CFG),
         (tensors - buckets) * 2 * 5e-6),                                 # (N-1) alpha, not 2(N-1) alpha
        (lab.problem_step_flops(), 2 * P * 128),                          # forward only
        (lab.problem_hiding_tokens(), predict_time("ring", 4 * P, 8, 5e-6, 1 / 25e9) * 100e12 / (2 * P)),
    ]
    for answer, wrong in answers:
        assert answer.agrees, answer
        assert not replace(answer, formula=wrong).agrees, answer
    assert answers[0][0].measured == 5 and answers[1][0].measured == 2 and answers[2][0].unit == "B"
    assert answers[2][0].measured != answers[2][0].formula     # 3 does not divide every bucket: uneven chunks
