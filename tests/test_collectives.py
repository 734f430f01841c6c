"""Naive, tree and ring collectives (plain and pipelined) against torch.distributed and a float64 sum,
bit-identity across ranks, byte and message counts, and the cost model's formulas and fit.

Many cases run inside one launch per world size, so the suite stays fast on 2 cores.
"""

import math
import random
import threading
from contextlib import contextmanager
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from dtcourse import launch
from dtcourse.collectives import (
    ALGORITHMS, ByteCounter, algbw, analytic_bytes, busbw, chunk_sizes, fast_ring_all_gather, fast_ring_all_reduce,
    fast_ring_reduce_scatter, fit_alpha_beta, predict_ring_step, predict_time, ring_all_gather, ring_all_reduce,
    ring_reduce_scatter,
)
from dtcourse.collectives.fast_ring import fast_reduce_scatter_steps
from dtcourse.collectives.messages import ALL_GATHER_TAG, scratch, wait_all

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
# The reference sums in a different order than our algorithms, so results may
# differ by rounding: a few units in the last place of each dtype, times N terms.
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float32: 1e-5, torch.float64: 1e-12}


def _rank_data(numel: int, dtype: torch.dtype, rank: int, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


# the fast ring as it is, with 2 and 3 slices per chunk, and in blocks of 8-byte chunks (2 float32 elements,
# 4 float16: up to 1001 elements make many blocks, the last one short), beside the three textbook algorithms
VARIANTS = {**ALGORITHMS, "fast ring": fast_ring_all_reduce, "ring/2": partial(fast_ring_all_reduce, slices=2),
            "ring/3": partial(fast_ring_all_reduce, slices=3), "ring/blocks": partial(fast_ring_all_reduce, chunk_bytes=8)}


def _all_reduce_cases(lengths):
    """On every rank: run each algorithm on each (length, dtype, op); return results and the reference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, algorithm in VARIANTS.items():
        for numel in lengths:
            for dtype in DTYPES if name in ALGORITHMS else (torch.float32, torch.float16):   # dtype-blind variants
                for op in (ReduceOp.SUM, ReduceOp.AVG):
                    x = _rank_data(numel, dtype, rank, salt=numel)
                    # gloo has no AVG: the reference is a float64 sum divided by N
                    ref = _rank_data(numel, torch.float64, rank, salt=numel).to(dtype).double()
                    dist.all_reduce(ref)
                    if op == ReduceOp.AVG:
                        ref /= world
                    counter = ByteCounter()
                    algorithm(x, op=op, counter=counter)
                    out[name, numel, dtype, str(op)] = (x, ref.to(dtype), counter.sent, counter.received)
    return out


def _single_process_sum(numel, world, op, salt):
    """The same data summed in one process, in float64: the reference that needs no backend."""
    total = sum(_rank_data(numel, torch.float64, r, salt=salt) for r in range(world))
    return total / world if op == str(ReduceOp.AVG) else total


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_all_reduce_matches_torch_and_is_bit_identical(world_size):
    lengths = [1, 2, 3, 7, 64, 1001]  # fewer than N (and than N x slices), not divisible by N, larger
    per_rank = launch(_all_reduce_cases, world_size, lengths, timeout=120)
    assert {k[0] for k in per_rank[0]} == set(VARIANTS)
    for key, (x0, ref0, _, _) in per_rank[0].items():
        name, numel, dtype, op = key
        tol = TOLERANCE[dtype] * max(1, world_size)
        torch.testing.assert_close(x0, ref0, atol=tol, rtol=tol, msg=lambda m: f"{key}: {m}")
        # and against a float64 sum in this process, rounded once to dtype
        torch.testing.assert_close(x0, _single_process_sum(numel, world_size, op, numel).to(dtype), atol=tol,
                                   rtol=tol, msg=lambda m: f"{key} against one process: {m}")
        for rank in range(1, world_size):
            assert torch.equal(per_rank[rank][key][0], x0), f"{key}: rank {rank} differs from rank 0"


def _sliced_against_plain(lengths, slices):
    """Slicing must not change a single bit: the same additions happen in the same order."""
    rank = dist.get_rank()
    same = {}
    for numel in lengths:
        plain, sliced = _rank_data(numel, torch.float32, rank), _rank_data(numel, torch.float32, rank)
        ring_all_reduce(plain)                         # the textbook ring
        fast_ring_all_reduce(sliced, slices=slices)
        same[numel] = torch.equal(plain, sliced)
    return same


def _textbook_against_fast(lengths):
    """The fast ring sends the textbook ring's messages and computes its sums, bit for bit."""
    rank = dist.get_rank()
    out = {}
    for numel in lengths:
        results, sent = [], []
        for fn in (ring_all_reduce, fast_ring_all_reduce):
            x, counter = _rank_data(numel, torch.float32, rank), ByteCounter()
            fn(x, counter=counter)
            results.append(x)
            sent.append(sorted(counter.messages, key=lambda m: (m.phase, m.step)))
        out[numel] = (torch.equal(*results), sent[0] == sent[1], len(sent[0]))
    return out


@pytest.mark.parametrize("world_size", [3, 5])
def test_the_fast_ring_sends_the_textbook_rings_messages_and_its_sums(world_size):
    for rank_out in launch(_textbook_against_fast, world_size, [1, 2 * world_size + 1, 1000]):
        for numel, (same_sum, same_messages, count) in rank_out.items():
            assert same_sum and same_messages, numel
            if numel >= world_size:                          # every chunk non-empty: one message per step
                assert count == 2 * (world_size - 1)


@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
def test_pipelined_ring_is_bit_identical_to_the_plain_ring(world_size):
    lengths = [1, world_size * 4 - 1, 1000, 4099]   # below N x slices, uneven, even, prime
    for same in launch(_sliced_against_plain, world_size, lengths, 4):
        assert all(same.values()), same


def _ring_rs_ag_cases(chunk_numels):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for k in chunk_numels:
        for dtype in DTYPES:
            x = _rank_data(world * k, dtype, rank, salt=k).reshape(world, k)   # 2-D input works too
            mine, sliced = torch.empty(k, dtype=dtype), torch.empty(k, dtype=dtype)
            before = x.clone()
            ring_reduce_scatter(mine, x)
            fast_ring_reduce_scatter(sliced, x, slices=3)
            assert torch.equal(mine, sliced), "slicing the reduce-scatter changed its result"
            assert torch.equal(x, before), "reduce-scatter must leave its input untouched"
            ref_out = torch.empty(k, dtype=torch.float64)             # reference summed in float64
            dist.reduce_scatter_tensor(ref_out, x.double().reshape(-1))
            gathered, ref_gathered = torch.empty(world * k, dtype=dtype), torch.empty(world * k, dtype=dtype)
            ring_all_gather(gathered, mine)
            dist.all_gather_into_tensor(ref_gathered, mine)
            out[k, dtype] = (mine, ref_out.to(dtype), gathered, ref_gathered)
    return out


def _receive_buffer_and_pending_sends(numel):
    rank, world = dist.get_rank(), dist.get_world_size()
    fast_ring_all_reduce(torch.ones(numel))
    kept = scratch(1, torch.float32, "cpu").data_ptr()
    fast_ring_all_reduce(torch.ones(numel))
    chunks = list(torch.ones(numel).split(chunk_sizes(numel, world)))
    pending = fast_reduce_scatter_steps(chunks, rank, world, None, None)
    waiting = len(pending)
    wait_all(pending)
    return kept == scratch(1, torch.float32, "cpu").data_ptr(), waiting, chunks[rank].tolist()


@pytest.mark.parametrize("world_size", [3, 5])
def test_the_plain_ring_keeps_its_receive_buffer_and_leaves_its_sends_to_the_end(world_size):
    # numel 11 on 3 or 5 ranks: uneven chunks; one receive buffer serves every call, and every step's send
    # is handed back unwaited (a step waits only for the sum it adds), for the caller to wait once
    for same_buffer, waiting, mine in launch(_receive_buffer_and_pending_sends, world_size, 11):
        assert same_buffer
        assert waiting == world_size - 1
        assert mine and all(v == world_size for v in mine)


@contextmanager
def _recording_posts():
    """Inside: every isend and irecv, as torch.distributed sees them, appended to the list yielded as
    ("send" or "recv", tag, bytes), in the order posted."""
    posted, real = [], {"send": dist.isend, "recv": dist.irecv}

    def recording(kind):
        def post(tensor, *args, tag=0, **kwargs):
            posted.append((kind, tag, tensor.nbytes))
            return real[kind](tensor, *args, tag=tag, **kwargs)
        return post

    dist.isend, dist.irecv = recording("send"), recording("recv")
    try:
        yield posted
    finally:
        dist.isend, dist.irecv = real["send"], real["recv"]


def _arange_case(numel):
    """This rank's input, 0..numel-1 plus its rank, and the exact sum over the ranks that an all-reduce must give."""
    world = dist.get_world_size()
    return torch.arange(float(numel)) + dist.get_rank(), torch.arange(float(numel)) * world + world * (world - 1) / 2


def _posts(slices, numel):
    """The order in which one rank posts its messages in a ring all-reduce, then in a ring all-gather:
    ("send" or "recv", tag) for each isend and irecv."""
    x, expected = _arange_case(numel)
    with _recording_posts() as all_reduce_posts:
        fast_ring_all_reduce(x, slices=slices)
    with _recording_posts() as all_gather_posts:
        fast_ring_all_gather(torch.empty(dist.get_world_size() * 7), torch.ones(7))
    return ([p[:2] for p in all_reduce_posts], [p[:2] for p in all_gather_posts]), torch.equal(x, expected)


@pytest.mark.parametrize("world_size,slices", [(3, 1), (3, 2), (5, 1)])
def test_the_all_gather_receives_are_posted_before_the_reduce_scatter_starts(world_size, slices):
    # gloo sends a message only once its receiver has posted the receive: posted first, under a tag of their own,
    # the all-gather's receives never keep a neighbour waiting. 23 elements: uneven chunks, every one non-empty
    for (all_reduce_posts, all_gather_posts), correct in launch(_posts, world_size, slices, 23):
        assert correct
        early = (world_size - 1) * slices
        assert all_reduce_posts[:early] == [("recv", ALL_GATHER_TAG)] * early
        sends = [tag for kind, tag in all_reduce_posts if kind == "send"]
        assert sends == [0] * early + [ALL_GATHER_TAG] * early    # reduce-scatter first, then the all-gather
        assert sum(1 for kind, tag in all_reduce_posts if kind == "recv" and tag == 0) == early
        # alone, the all-gather posts every receive before its first send too
        steps = world_size - 1
        assert all_gather_posts == [("recv", ALL_GATHER_TAG)] * steps + [("send", ALL_GATHER_TAG)] * steps


def _blocked_rounds(numel, chunk_bytes):
    """One rank's posts and sent messages in ``ring_all_reduce(x, chunk_bytes=...)``, and whether the sum is right."""
    (x, expected), counter = _arange_case(numel), ByteCounter()
    with _recording_posts() as posted:
        fast_ring_all_reduce(x, chunk_bytes=chunk_bytes, counter=counter)
    return posted, counter.messages, torch.equal(x, expected)


@pytest.mark.parametrize("world_size", [3, 5])
def test_the_ring_in_blocks_sends_each_blocks_all_gather_beside_the_next_blocks_reduce_scatter(world_size):
    # 4-element chunks (16 bytes of float32): 10N + 3 elements make 3 blocks, two of 4N elements and a short one of
    # 2N + 3, whose chunks differ by one element
    n, blocks = world_size, 3
    numel = 10 * n + 3
    for rank, (posted, messages, correct) in enumerate(launch(_blocked_rounds, world_size, numel, 16)):
        assert correct
        # every all-gather receive of every block first, under its own tag; then nothing above chunk_bytes
        assert posted[:blocks * (n - 1)] == [("recv", ALL_GATHER_TAG, 16)] * (2 * (n - 1)) + \
            [("recv", ALL_GATHER_TAG, 4 * c) for c in _all_gather_receipts(2 * n + 3, n, rank)]
        assert all(nbytes <= 16 for _, _, nbytes in posted)
        assert all(m.src == rank and m.dst == (rank + 1) % n for m in messages), "only ever to the right neighbour"
        # round r of pass b carries block b's reduce-scatter and block b-1's all-gather: (B+1)(N-1) rounds
        rounds = [[(m.phase, m.part) for m in messages if m.step == r] for r in range((blocks + 1) * (n - 1))]
        for r, got in enumerate(rounds):
            b = r // (n - 1)
            assert got == [("reduce-scatter", b)] * (b < blocks) + [("all-gather", b - 1)] * (b > 0), (rank, r)
        assert len(messages) == sum(map(len, rounds)) == 2 * blocks * (n - 1)
        # the plain ring's bytes, block by block: 2(N-1)/N of each full block, and the short block's chunks
        sizes = chunk_sizes(2 * n + 3, n)
        short = sum(sizes[(rank - s - 1) % n] + sizes[(rank - s) % n] for s in range(n - 1))
        assert sum(m.nbytes for m in messages) == 4 * (2 * 2 * (n - 1) * 4 + short)


def _all_gather_receipts(numel: int, n: int, rank: int) -> list[int]:
    """The sizes of the chunks a rank receives in a ring all-gather of ``numel`` elements, step by step."""
    sizes = chunk_sizes(numel, n)
    return [sizes[(rank - s - 1) % n] for s in range(n - 1)]


def test_scratch_is_kept_per_dtype_device_and_thread_and_grows_when_asked_for_more():
    first = scratch(10, torch.float32, "cpu")
    assert scratch(6, torch.float32, "cpu").data_ptr() == first.data_ptr()
    assert scratch(6, torch.float32, "cpu").numel() == 6
    assert scratch(10, torch.float64, "cpu").data_ptr() != first.data_ptr()
    grown = scratch(10_000, torch.float32, "cpu")
    assert grown.numel() == 10_000 and scratch(10, torch.float32, "cpu").data_ptr() == grown.data_ptr()
    other_thread = []
    worker = threading.Thread(target=lambda: other_thread.append(scratch(10, torch.float32, "cpu").data_ptr()))
    worker.start()
    worker.join()
    assert other_thread[0] != grown.data_ptr()


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_ring_reduce_scatter_and_all_gather_follow_torch(world_size):
    per_rank = launch(_ring_rs_ag_cases, world_size, [1, 5, 33], timeout=120)
    for rank, cases in enumerate(per_rank):
        for (k, dtype), (mine, ref, gathered, ref_gathered) in cases.items():
            tol = TOLERANCE[dtype] * max(1, world_size)
            torch.testing.assert_close(mine, ref, atol=tol, rtol=tol)
            assert torch.equal(gathered, ref_gathered), f"all-gather differs at rank {rank}, k={k}, {dtype}"


def _shape_errors():
    errors = []
    for call in (lambda: ring_reduce_scatter(torch.empty(3), torch.empty(10)),
                 lambda: ring_all_gather(torch.empty(10), torch.empty(3)),
                 lambda: ring_reduce_scatter(torch.empty(3), torch.empty(9, dtype=torch.float64)),
                 lambda: ALGORITHMS["ring"](torch.ones(4), op=ReduceOp.MAX),
                 lambda: fast_ring_all_reduce(torch.ones(4), slices=0),
                 lambda: fast_ring_all_reduce(torch.ones(4), slices=1.5),
                 lambda: fast_ring_all_reduce(torch.ones(4), chunk_bytes=3),
                 lambda: fast_ring_all_reduce(torch.ones(4), slices=2, chunk_bytes=8),
                 lambda: fast_ring_reduce_scatter(torch.empty(3), torch.empty(10))):
        try:
            call()
            errors.append(None)
        except (ValueError, TypeError) as exc:
            errors.append(str(exc))
    return errors


def test_shape_and_op_errors_say_what_to_change():
    errors = launch(_shape_errors, 3)[0]
    assert "input has 10 elements but must have world_size (3) x output.numel() (3) = 9" in errors[0]
    assert "output has 10 elements but must have world_size (3) x input.numel() (3) = 9" in errors[1]
    assert "dtype" in errors[2]
    assert "ReduceOp.SUM or ReduceOp.AVG" in errors[3]
    assert "slices must be 1 (each chunk travels whole) or a whole number >= 2" in errors[4]
    assert "got 1.5" in errors[5]
    assert "chunk_bytes must be a whole number of bytes, at least one element (4 bytes here)" in errors[6]
    assert "got 3" in errors[6]
    assert "choose slices=2 (each chunk pipelined in slices) or chunk_bytes=8" in errors[7]
    assert errors[8].startswith("fast_ring_reduce_scatter: input has 10 elements")


def _refusals_on_nccl():
    """On nccl (its name faked: this box has no GPUs) the ring's gloo-only variants refuse before sending."""
    real = dist.get_backend
    dist.get_backend = lambda group=None: "nccl"
    errors = []
    try:
        for kwargs in ({"slices": 2}, {"chunk_bytes": 8}):
            try:
                fast_ring_all_reduce(torch.ones(8), **kwargs)
                errors.append(None)
            except ValueError as exc:
                errors.append(str(exc))
    finally:
        dist.get_backend = real
    return errors


def test_the_gloo_only_variants_refuse_nccl_and_say_what_to_use():
    slices, blocks = launch(_refusals_on_nccl, 2)[0]
    assert "use slices=1 on nccl" in slices
    assert "use chunk_bytes=None on nccl" in blocks


def _count_bytes(numel):
    counts = {}
    for name, algorithm in VARIANTS.items():
        counter = ByteCounter()
        algorithm(torch.ones(numel), counter=counter)
        counts[name] = (counter.sent, counter.received, len(counter.messages))
    return counts


@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
def test_byte_counters_match_the_analytic_volumes(world_size):
    numel = 60 * world_size          # divisible, so the ring formula is exact
    nbytes = numel * 4
    per_rank = launch(_count_bytes, world_size, numel)
    for rank, counts in enumerate(per_rank):
        for name in ALGORITHMS:
            sent, received, _ = counts[name]
            assert (sent, received) == analytic_bytes(name, nbytes, world_size, rank), (name, rank)
    n, s = world_size, nbytes
    # the headline numbers of lesson 01, written out
    assert per_rank[0]["ring"][0] == 2 * (n - 1) / n * s
    assert per_rank[0]["naive"][:2] == ((n - 1) * s, (n - 1) * s)
    # ring: every rank sends 2(N-1) messages; pipelined, each of them becomes k slices
    assert all(c["ring"][2] == 2 * (n - 1) for c in per_rank)
    for k in (2, 3):
        assert all(c[f"ring/{k}"][:2] == c["ring"][:2] for c in per_rank), "slicing must not change the bytes"
        assert all(c[f"ring/{k}"][2] == 2 * (n - 1) * k for c in per_rank)
    # in blocks of N chunks of 2 elements: numel / 2N = 30 blocks, each 2(N-1) messages, and the same bytes
    assert all(c["ring/blocks"][:2] == c["ring"][:2] for c in per_rank), "blocks must not change the bytes"
    assert all(c["ring/blocks"][2] == 2 * (n - 1) * 30 for c in per_rank)


@pytest.mark.parametrize("world_size", [3, 5])
def test_ring_bytes_with_uneven_chunks(world_size):
    numel = 7 * world_size + 2       # not divisible: chunks differ by one element
    per_rank = launch(_count_bytes, world_size, numel)
    sizes = chunk_sizes(numel, world_size)
    for rank, counts in enumerate(per_rank):
        # reduce-scatter sends chunks rank-1, rank-2, ...; all-gather sends rank, rank-1, ...
        rs = [sizes[(rank - s - 1) % world_size] for s in range(world_size - 1)]
        ag = [sizes[(rank - s) % world_size] for s in range(world_size - 1)]
        assert counts["ring"][0] == 4 * (sum(rs) + sum(ag))
        assert abs(counts["ring"][0] - 2 * (world_size - 1) / world_size * numel * 4) <= 4 * 2 * (world_size - 1)


def test_chunk_sizes():
    assert chunk_sizes(10, 3) == [4, 3, 3]
    assert chunk_sizes(2, 5) == [1, 1, 0, 0, 0]
    assert sum(chunk_sizes(1001, 7)) == 1001


def test_analytic_tree_edges_sum_to_n_minus_one_per_direction():
    for n in range(1, 17):
        total = sum(analytic_bytes("tree", 1, n, r)[0] for r in range(n))
        assert total == 2 * (n - 1)  # each of N-1 tree edges carries one message up and one down


def test_cost_model_and_bandwidth_definitions():
    alpha, beta = 1e-5, 1e-9
    s = 1 << 20
    assert predict_time("ring", s, 4, alpha, beta) == pytest.approx(6 * alpha + 1.5 * s * beta)
    assert predict_time("tree", s, 5, alpha, beta) == pytest.approx(6 * (alpha + s * beta))
    assert predict_time("naive", s, 4, alpha, beta) == pytest.approx(6 * (alpha + s * beta))
    # ring's bandwidth term tends to 2 S beta as N grows; naive's grows without bound
    assert predict_time("ring", s, 1000, 0, beta) < 2 * s * beta < predict_time("naive", s, 3, 0, beta)
    assert algbw(100, 2) == 50
    assert busbw("all_reduce", 100, 1, 4) == pytest.approx(150)
    assert busbw("all_gather", 100, 1, 4) == pytest.approx(75)
    with pytest.raises(ValueError, match="unknown collective"):
        busbw("broadcast", 1, 1, 2)


def test_cost_model_with_gamma_and_the_ring_halves():
    alpha, beta, gamma, s, n = 1e-5, 1e-9, 5e-10, 1 << 20, 4
    ring = predict_time("ring", s, n, alpha, beta, gamma)
    assert ring == pytest.approx(predict_time("ring", s, n, alpha, beta) + 0.75 * s * gamma)
    rs = predict_time("ring", s, n, alpha, beta, gamma, collective="reduce_scatter")
    ag = predict_time("ring", s, n, alpha, beta, gamma, collective="all_gather")
    assert rs + ag == pytest.approx(ring)              # all-reduce = reduce-scatter + all-gather
    assert predict_time("tree", s, 5, alpha, beta, gamma) == pytest.approx(6 * (alpha + s * beta) + 3 * s * gamma)
    assert predict_time("naive", s, 4, alpha, beta, gamma) == pytest.approx(6 * (alpha + s * beta) + 3 * s * gamma)
    with pytest.raises(ValueError, match="ring only"):
        predict_time("tree", s, n, alpha, beta, collective="all_gather")
    with pytest.raises(ValueError, match="unknown algorithm"):
        predict_time("butterfly", s, n, alpha, beta)


def test_a_sliced_step_hides_all_but_one_slice_of_the_additions():
    alpha, beta, gamma, m = 1e-5, 1e-9, 5e-10, 1 << 22
    plain = predict_ring_step(m, 1, alpha, beta, gamma)
    assert plain == pytest.approx(alpha + m * beta + m * gamma)
    for k in (2, 4, 8):   # transfer-bound (beta > gamma): k alpha + m beta + m gamma / k
        assert predict_ring_step(m, k, alpha, beta, gamma) == pytest.approx(k * alpha + m * beta + m * gamma / k)
    # addition-bound (adding slower than sending): the additions set the pace, one slice's transfer shows
    slow_add, fast_link = 2 * beta, beta / 2
    expected = alpha + m * fast_link / 4 + m * slow_add
    assert predict_ring_step(m, 4, alpha, fast_link, slow_add) == pytest.approx(expected)
    best = min(range(1, 200), key=lambda k: predict_ring_step(m, k, alpha, beta, gamma))
    assert abs(best - math.sqrt(m * gamma / alpha)) <= 1     # the best k is near sqrt(m gamma / alpha)
    with pytest.raises(ValueError, match="slices must be at least 1"):
        predict_ring_step(m, 0, alpha, beta, gamma)


def test_fit_alpha_beta_recovers_a_line():
    sizes = [1e3, 1e4, 1e5, 1e6]
    alpha, beta = fit_alpha_beta(sizes, [2e-5 + 3e-10 * s for s in sizes])
    assert alpha == pytest.approx(2e-5, rel=1e-6)
    assert beta == pytest.approx(3e-10, rel=1e-6)
    assert math.isfinite(alpha)


def _noisy_samples(seed, sizes, repeats, alpha=5e-5, beta=2e-10, noise=0.3, outliers=0.1):
    """Timings with +-noise relative jitter and a share of 10x outliers (a rank descheduled mid-message)."""
    rng = random.Random(seed)
    xs, ts = [], []
    for s in sizes:
        for _ in range(repeats):
            t = (alpha + beta * s) * (1 + rng.uniform(-noise, noise))
            xs.append(s)
            ts.append(t * 10 if rng.random() < outliers else t)
    return xs, ts


def test_fit_alpha_beta_takes_medians_of_repeats_and_weights_by_one_over_t():
    sizes = [4, 4 << 10, 64 << 10, 1 << 20, 4 << 20]
    for seed in range(20):
        alpha, beta = fit_alpha_beta(*_noisy_samples(seed, sizes, repeats=9))
        # medians shrug off the 10x outliers; 1/t weighting keeps alpha (set by the small sizes) close
        assert alpha == pytest.approx(5e-5, rel=0.35) and beta == pytest.approx(2e-10, rel=0.35), seed
    # unweighted, the 4 MB point would decide alone; weighted, a 4-byte error of 20% moves alpha by about 20%
    alpha, _ = fit_alpha_beta([4, 4, 4 << 20], [6e-5, 6e-5, 5e-5 + 2e-10 * (4 << 20)])
    assert alpha == pytest.approx(6e-5, rel=0.05)


def test_fit_alpha_beta_never_returns_a_non_positive_parameter():
    # a busy machine: the largest message happened to run faster than the small ones
    with pytest.raises(ValueError, match="beta = .* both must be positive.*too noisy"):
        fit_alpha_beta([4, 4 << 10, 64 << 10], [3e-4, 2e-4, 1e-4])
    # slope fine, intercept below zero (the small messages ran faster than the line through the big ones)
    with pytest.raises(ValueError, match="alpha = -"):
        fit_alpha_beta([1 << 20, 2 << 20, 4 << 20], [1e-4, 3e-4, 7e-4])
    for bad in (([4], [1e-5]), ([4, 8], [1e-5, 0.0]), ([4, 8], [1e-5])):
        with pytest.raises(ValueError):
            fit_alpha_beta(*bad)
    # whatever the noise, a returned fit is positive: 1/beta is a bandwidth (lesson 02 divides by beta)
    sizes = [4, 1 << 10, 16 << 10]
    for seed in range(200):
        try:
            alpha, beta = fit_alpha_beta(*_noisy_samples(seed, sizes, repeats=3, noise=0.9, outliers=0.3))
        except ValueError as err:
            assert "too noisy" in str(err)
        else:
            assert alpha > 0 and beta > 0 and math.isfinite(1 / beta)
