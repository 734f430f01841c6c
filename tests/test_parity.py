"""The parity harness itself: it passes right strategies, and it catches wrong ones, with messages that
name the step, the kind and the parameter.

The checks that need no process group run in this process (check_parity treats it as a world of one);
the distributed ones run together in one launch of 3 ranks (a world size that is not a power of two).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtcourse import launch
from dtcourse.data_parallel import DistributedDataParallel
from dtcourse.models import MLP, regression_batch
from dtcourse.parity import KINDS, Replicated, Tolerance, check_parity, even_split, whole_batch

SIZES = (6, 8, 4)            # net.0 (8, 6), net.2 (4, 8)
B, STEPS = 12, 3             # 12 rows: 4 per rank at N = 3
NAMES = ("net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias")
# float32; the baseline's mean over 12 rows against the mean over 3 ranks of 4-row means: the same
# numbers added in another order, so few-ulp differences (3e-8 at most, measured at N = 3).
ONE_PROCESS = Tolerance(1e-5, 0, "the N-rank mean adds the same numbers in another order: a few ulps")
SAME_SUMS = Tolerance.exact("every rank and the baseline compute the same sums in the same order")


def _adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def _model():
    return MLP(SIZES, seed=0)


def _batches(rows=B):
    return [regression_batch(rows, SIZES[0], SIZES[-1], seed=s) for s in range(STEPS)]


def _nudge(t: torch.Tensor) -> None:
    """Move the first element of ``t`` by one ulp, upwards."""
    with torch.no_grad():
        t.view(-1)[0] = torch.nextafter(t.view(-1)[0], torch.tensor(float("inf")))


class _OneUlpOff(Replicated):
    """Right in every step but one ulp off in net.2.bias after the first optimizer step."""

    def step(self):
        super().step()
        if not getattr(self, "nudged", False):
            _nudge(self.module.net[2].bias)
            self.nudged = True


class _DropsAGradient(Replicated):
    def full_gradients(self):
        return {n: g for n, g in super().full_gradients().items() if n != "net.0.bias"}


# --------------------------------------------------------------------------- #
# In this process
# --------------------------------------------------------------------------- #
def test_a_tolerance_needs_a_reason_and_no_negative_bound():
    for why in ("", "   ", None):
        with pytest.raises(ValueError, match="Tolerance needs a reason"):
            Tolerance(1e-5, 0, why)
    with pytest.raises(ValueError, match="must be >= 0"):
        Tolerance(-1e-5, 0, "a reason")
    exact = Tolerance.exact("nothing reordered")
    assert (exact.atol, exact.rtol) == (0, 0) and str(exact) == "exact: nothing reordered"
    with pytest.raises(ValueError, match="one Tolerance for each of"):
        check_parity(_model, lambda m, g: Replicated(m, _adam), _batches(), F.mse_loss, _adam,
                     tolerance={"output": exact, "gradient": exact})


def test_the_same_computation_is_exact_and_the_report_has_every_step_and_kind():
    report = check_parity(_model, lambda m, g: Replicated(m, _adam), _batches(), F.mse_loss, _adam,
                          tolerance=SAME_SUMS)
    assert report.steps == STEPS
    assert report.max_diff == {("strategy", "single", k): (0.0,) * STEPS for k in KINDS}
    assert report.worst("single") == 0 and "strategy vs single: output 0.00e+00" in str(report)


def test_exact_mode_catches_a_one_ulp_difference():
    with pytest.raises(AssertionError) as caught:
        check_parity(_model, lambda m, g: _OneUlpOff(m, _adam), _batches(), F.mse_loss, _adam, tolerance=SAME_SUMS)
    message = str(caught.value)
    assert message.startswith("parity fails at step 1 of 3: parameter 'net.2.bias' on rank 0 differs from the "
                              "single-process run's by "), message
    assert "beyond the tolerance (exact: every rank and the baseline" in message
    # One ulp of a value below 1 is under 1.2e-7: a float32 tolerance lets it through.
    report = check_parity(_model, lambda m, g: _OneUlpOff(m, _adam), _batches(), F.mse_loss, _adam,
                          tolerance=Tolerance(1.2e-7, 0, "one ulp at most, on purpose"))
    assert 0 < report.max_diff["strategy", "single", "parameter"][0] < 1.2e-7
    assert report.max_diff["strategy", "single", "gradient"][0] == 0      # the nudge comes after it


def test_a_missing_gradient_is_named():
    with pytest.raises(AssertionError, match=r"step 1 of 3: gradient names \(\['net.0.bias'\] missing, \[\] "):
        check_parity(_model, lambda m, g: _DropsAGradient(m, _adam), _batches(), F.mse_loss, _adam,
                     tolerance=ONE_PROCESS)


def test_an_uneven_batch_is_refused_with_what_to_change():
    assert torch.equal(even_split(torch.arange(12), 2, 3), torch.tensor([8, 9, 10, 11]))
    with pytest.raises(ValueError, match=r"10 rows, which 3 ranks cannot share equally .* use a batch size "
                                         r"divisible by 3, such as 12"):
        even_split(torch.arange(10), 0, 3)


# --------------------------------------------------------------------------- #
# Three ranks
# --------------------------------------------------------------------------- #
class _ForgetsToAverage(Replicated):
    """Data parallel without the all-reduce: each rank steps on its own slice's gradient."""


class _SumsGradients(Replicated):
    """DDP's classic slip: all-reduce the gradients, but never divide by N."""

    def forward_backward(self, x, y, loss_fn):
        out = super().forward_backward(x, y, loss_fn)
        for p in self.module.parameters():
            dist.all_reduce(p.grad)
        return out


class _Rank2Drifts(Replicated):
    """Right to 1e-5, but rank 2 ends the first step one ulp away from the others."""

    def step(self):
        super().step()
        if dist.get_rank() == 2 and not getattr(self, "nudged", False):
            _nudge(self.module.net[0].weight)
            self.nudged = True


class _LastStageOutputs(Replicated):
    """Like a pipeline: only the last rank returns outputs."""

    def forward_backward(self, x, y, loss_fn):
        out = super().forward_backward(x, y, loss_fn)
        return out if dist.get_rank() == dist.get_world_size() - 1 else None


def _three_ranks():
    def attempt(key, *args, **kwargs):
        try:
            out[key] = check_parity(_model, *args, **kwargs)
        except (AssertionError, ValueError) as exc:
            out[key] = f"{type(exc).__name__}: {exc}"

    ddp = lambda m, g: Replicated(DistributedDataParallel(m, group=g), _adam)
    out = {}
    attempt("ddp", ddp, _batches(), F.mse_loss, _adam, tolerance=ONE_PROCESS,
            reference=lambda m, g: Replicated(nn.parallel.DistributedDataParallel(m, process_group=g), _adam))
    attempt("forgets", lambda m, g: _ForgetsToAverage(m, _adam), _batches(), F.mse_loss, _adam, tolerance=ONE_PROCESS)
    attempt("sums", {"ours": ddp, "sums": lambda m, g: _SumsGradients(m, _adam)}, _batches(), F.mse_loss, _adam,
            tolerance=ONE_PROCESS)
    attempt("drifts", lambda m, g: _Rank2Drifts(DistributedDataParallel(m, group=g), _adam), _batches(),
            F.mse_loss, _adam, tolerance=ONE_PROCESS)
    attempt("uneven", ddp, _batches(10), F.mse_loss, _adam, tolerance=ONE_PROCESS)
    rank = dist.get_rank()
    out["seeds"] = None
    try:
        check_parity(lambda: MLP(SIZES, seed=rank), ddp, _batches(), F.mse_loss, _adam, tolerance=ONE_PROCESS)
    except ValueError as exc:
        out["seeds"] = str(exc)
    # Every rank trains the whole batch with no communication: the baseline's very sums, bit for bit.
    attempt("whole", lambda m, g: _LastStageOutputs(m, _adam), _batches(), F.mse_loss, _adam,
            tolerance=SAME_SUMS, split=whole_batch)
    t = torch.ones(1)
    dist.all_reduce(t)                       # after every failure above, the ranks are still in step
    out["in step"] = t.item()
    return out


def test_three_ranks_right_strategies_pass_and_wrong_ones_are_named():
    per_rank = launch(_three_ranks, 3, timeout=120)
    results = per_rank[0]
    for other in per_rank[1:]:   # every rank raised the same error, and reports the same differences
        assert {k: repr(v) for k, v in other.items()} == {k: repr(v) for k, v in results.items()}
    assert results["in step"] == 3

    ddp = results["ddp"]
    assert 0 < ddp.worst("single") < ONE_PROCESS.atol and ddp.worst("ranks") == 0
    assert {key[1] for key in ddp.max_diff} == {"single", "reference", "ranks"}

    for key in ("forgets", "sums"):   # step 1's outputs agree (same parameters); its gradients cannot
        message = results[key]
        assert message.startswith("AssertionError: parity fails at step 1 of 3: gradient '"), message
        name = message.split("'")[1]
        assert name in NAMES and "differs from the single-process run's by" in message, message
        assert f"beyond the tolerance (atol=1e-05, rtol=0: {ONE_PROCESS.why})" in message
    assert "gradient 'net" in results["sums"] and " of 'sums' on rank " in results["sums"]
    assert "'ours'" not in results["sums"].split(";")[0]

    assert results["drifts"].startswith("AssertionError: parity fails at step 1 of 3: parameter 'net.0.weight' "
                                        "on rank 2 differs from group rank 0's by "), results["drifts"]
    assert "10 rows, which 3 ranks cannot share equally" in results["uneven"]
    assert "divisible by 3, such as 12" in results["uneven"]
    assert "make_model built different parameters on different ranks" in results["seeds"]

    whole = results["whole"]
    assert whole.worst("single") == 0 and whole.worst("ranks") == 0
    assert len(whole.max_diff["strategy", "single", "output"]) == STEPS   # compared on the last rank
