"""The parameter server on torch.distributed.rpc (dtcourse.parameter_server.rpc): parity and counts.

Each ``rpc_train`` is one launch whose ranks also start an RPC agent (about a second each on 2 cores).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils import parameters_to_vector

from dtcourse.parameter_server import Problem, PSConfig, reference_sgd, shard_ranges, train
from dtcourse.parameter_server.rpc import rpc_train

F64 = Problem(dtype=torch.float64)
P = 676


@pytest.mark.parametrize("world_size, num_servers", [(4, 1), (5, 2)])
def test_sync_rpc_reaches_the_message_servers_parameters_with_the_same_bytes(world_size, num_servers):
    config = PSConfig(world_size=world_size, num_servers=num_servers, steps=4, lr=0.2)
    run = rpc_train(config, F64)
    # float64. The message server steps once on the mean of the N gradients; the RPC server takes N
    # steps of lr * g_w / N on the same parameters, in whatever order the workers arrive: the same
    # sum, added in another order, so they differ by rounding (~1e-16 per step), far below 1e-12.
    assert (run.params - train(config, F64).params).abs().max() < 1e-12
    assert (run.params - reference_sgd(config, F64)).abs().max() < 1e-12
    assert not torch.equal(run.params, parameters_to_vector(F64.model().parameters()))   # it did train
    n, steps = config.num_workers, config.steps
    for j, (s, (lo, hi)) in enumerate(zip(run.servers, shard_ranges(P, num_servers))):
        assert (s.lo, s.hi) == (lo, hi)
        # Per worker iteration, each server: one pull out, one gradient in, one optimizer step.
        assert s.calls["pull"] == s.calls["gradient"] == s.calls["optimizer step"] == n * steps
        assert s.calls.get("arrive", 0) == (n * steps if j == 0 else 0)        # the sync gate lives on server 0
        assert s.bytes_out == s.bytes_in == n * steps * 8 * (hi - lo)           # S / k each way, as messages
    assert run.startup_seconds > 0 and len(run.losses) == n and all(len(l) == steps for l in run.losses)


def test_sync_rpc_in_float32_matches_within_rounding():
    config = PSConfig(world_size=4, steps=5, lr=0.2)
    run = rpc_train(config)
    # float32: reordering N = 3 additions per step moves a value by a few ulps (~1e-7 relative);
    # over 5 steps the parameters (of order 0.1 to 1) stay within 1e-6.
    assert (run.params - train(config).params).abs().max() < 1e-6
    assert run.servers[0].bytes_out == 3 * 5 * 4 * P                           # float32: 4 bytes a value


def test_async_rpc_applies_every_gradient_once():
    config = PSConfig(world_size=4, mode="async", steps=4, lr=0.1)
    run = rpc_train(config, F64)
    s = run.servers[0]
    assert "arrive" not in s.calls and s.calls["optimizer step"] == config.num_workers * config.steps
    # Plain SGD is linear in the gradients: in whatever order the steps land, and whatever each worker
    # read, the parameters end at w0 - lr * (sum of every gradient that arrived). float64, 12 additions.
    expected = parameters_to_vector(F64.model().parameters()).detach() - config.lr * s.grad_sum
    assert (run.params - expected).abs().max() < 1e-12


def test_rpc_refuses_what_it_cannot_do():
    with pytest.raises(Exception, match="plain SGD"):
        rpc_train(PSConfig(world_size=3, steps=2, momentum=0.9))
