"""Offloading: ZeRO with its optimizer on the host or on disk, against one process, against ZeRO without
offloading (bit for bit) and against FSDP2's CPUOffloadPolicy; what it moves; the delayed update's lag.

The parity cases go through ``dtcourse.parity.check_parity`` (see tests/test_zero.py for its protocol).
"""

import functools
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtcourse import launch
from dtcourse.models import MLP, regression_batch
from dtcourse.offload import OffloadedOptimizer
from dtcourse.parity import FullyShard, Tolerance, check_parity
from dtcourse.zero import ZeRO, default_units

SIZES = (6, 10, 12, 7)           # 70, 132 and 91 elements per unit: padded at N = 2, 3, 4 and 5
B, STEPS, LR = 60, 4, 1e-3
adamw = functools.partial(torch.optim.AdamW, lr=LR)
ONE_PROCESS = Tolerance(1e-5, 0, (
    "the N ranks' mean gradients summed and divided by N add the same numbers as one process's mean in "
    "another order, a few ulps, which AdamW's first steps (lr * g / |g|) can move to ~1e-7"))
SAME = Tolerance(0, 0, "the host runs the same AdamW on the same fp32 numbers as the device would: bit for bit")
TORCH = Tolerance(1e-5, 0, "FSDP2 sums the same per-rank gradients and may divide by N elsewhere: a few ulps")


def _batches():
    return [regression_batch(B, SIZES[0], SIZES[-1], seed=s) for s in range(STEPS)]


def _offloaded(stage, **options):
    opt = functools.partial(OffloadedOptimizer, inner=adamw, **options)
    return lambda model, group: ZeRO(model, stage, opt, group)


def _FSDP2Offload(model, group):
    """FSDP2 with ``CPUOffloadPolicy(pin_memory=False)`` (the default pins, which needs a GPU), per unit then root."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return FullyShard(model, group, adamw, default_units(model), offload_policy=CPUOffloadPolicy(pin_memory=False))


def _parity(tmp):
    mlp = lambda: MLP(SIZES, seed=0)
    ours = {f"stage {s}/{tier}": _offloaded(s, tier=tier, directory=os.path.join(tmp, f"{s}") if tier == "disk"
                                            else None) for s in (1, 2, 3) for tier in ("host", "disk")}
    vs_one = check_parity(mlp, ours, _batches(), F.mse_loss, adamw, tolerance=ONE_PROCESS,
                          reference=lambda m, g: ZeRO(m, 2, adamw, g), reference_tolerance=SAME)
    vs_torch = check_parity(mlp, _offloaded(3, tier="disk", directory=os.path.join(tmp, "t")), _batches(),
                            F.mse_loss, adamw, tolerance=ONE_PROCESS, reference=_FSDP2Offload,
                            reference_tolerance=TORCH)
    return vs_one, vs_torch


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_offloaded_zero_matches_one_process_zero_and_fsdp2_offload(world_size, tmp_path):
    for report in launch(_parity, world_size, str(tmp_path), timeout=120)[0]:
        assert report.steps == STEPS and report.worst("ranks") == 0.0
        assert report.worst("reference") <= 1e-5


def _traffic(tmp):
    model = ZeRO(MLP(SIZES, seed=0), 2, functools.partial(OffloadedOptimizer, inner=adamw, tier="disk",
                                                           directory=tmp))
    opt, files = model.optimizer, []
    held = []
    for s in range(3):
        x, y = regression_batch(B // dist.get_world_size(), SIZES[0], SIZES[-1], seed=s)
        F.mse_loss(model(x), y).backward()
        model.step()
        model.zero_grad()
        held.append(opt.host_bytes())
    files = sorted(f for f in os.listdir(tmp) if f.startswith(f"{os.getpid()}-"))
    shard = sum(p.numel() for p in opt.param_groups[0]["params"]) * 4
    return opt.stats, shard, held, files, model.memory()


def test_disk_tier_moves_a_shard_each_way_and_holds_nothing_between_steps(tmp_path):
    for stats, shard, held, files, memory in launch(_traffic, 3, str(tmp_path), timeout=60):
        assert stats.steps == 3
        assert stats.down == stats.up == 3 * shard             # the gradient part down, the parameter part up
        # the parameter part and Adam's m and v are read in for each step and written back after it
        assert stats.read == 3 * shard + 2 * 2 * shard         # step 1 has no states to read yet
        assert stats.written == shard + 3 * (3 * shard)        # the first copy out, then part + m + v per step
        assert held == [0, 0, 0]                               # between steps, nothing of it is in memory
        assert len(files) == 3 * 3                             # 3 units: part, m, v each
        assert memory.optimizer_states == 0                    # the device keeps no optimizer state


def _linear_run(delayed):
    """A loss linear in the weights: each step's gradient does not depend on them, so two runs see the same."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(50))
    opt = OffloadedOptimizer([w], adamw, delayed=delayed)
    seen = []
    for step in range(5):
        g = torch.randn(50, generator=torch.Generator().manual_seed(step))
        (w * g).sum().backward()
        opt.step()
        opt.zero_grad()
        seen.append(w.detach().clone())
    opt.flush()
    return seen, w.detach().clone()


def test_the_delayed_update_lags_the_normal_run_by_exactly_one_step():
    normal, last = _linear_run(False)
    delayed, flushed = _linear_run(True)
    assert not torch.equal(delayed[0], normal[0])             # after step 1 the device has no update yet
    for t in range(1, 5):
        assert torch.equal(delayed[t], normal[t - 1])          # after step t+1: step t's update, bit for bit
    assert torch.equal(flushed, last)


def test_bad_inputs_say_what_to_change(tmp_path):
    w = [nn.Parameter(torch.zeros(3))]
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(PermissionError, match=r"cannot write to the offload directory .*a-file/states.*directory="):
        OffloadedOptimizer(w, adamw, tier="disk", directory=str(blocker / "states"))
    with pytest.raises(ValueError, match=r"tier must be one of \('host', 'disk'\), got 'nvme'"):
        OffloadedOptimizer(w, adamw, tier="nvme")
    with pytest.raises(TypeError, match="optimizer class or a factory"):
        OffloadedOptimizer(w, adamw(w))
    with pytest.raises(ValueError, match="must be fp32"):
        OffloadedOptimizer([nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))], adamw)


# --------------------------------------------------------------------------- #
# What lesson 07 measures and draws (dtcourse.lab.offload)
# --------------------------------------------------------------------------- #
def test_the_lesson_measurement_counts_each_tier_and_draws_it():
    from dtcourse.lab import offload as lab

    runs = lab.measure_offload(2, sizes=(16, 33, 9), steps=2)       # 561 + 306 elements: odd, so padded
    device, host, disk = (runs[v] for v in lab.VARIANTS)
    assert device.shard_bytes == host.shard_bytes == 4 * (281 + 153)  # ceil(561/2) + ceil(306/2) elements
    assert (device.down, device.up, device.read, device.written) == (0, 0, 0, 0)
    assert host.down == host.up == host.shard_bytes and host.read == host.written == 0
    assert disk.down == disk.up == disk.shard_bytes and disk.read == disk.written == 3 * disk.shard_bytes
    assert device.device_states == 2 * device.shard_bytes + 2 * 4   # m, v and one step count per unit
    assert host.device_states == disk.device_states == 0
    assert all(set(r.seconds) == set(lab.PARTS) and min(r.seconds.values()) >= 0 for r in runs.values())
    times, states, resident = lab.plot_offload(runs).axes         # one quantity per panel
    assert len(times.patches) == len(lab.PARTS) * 3
    assert [b.get_height() for b in states.patches] == [r.device_states / 2**20 for r in (device, host, disk)]
    assert [b.get_height() for b in resident.patches] == [(r.resident - device.resident) / 2**20
                                                          for r in (device, host, disk)]
    # every bar carries its value; a zero bar, invisible otherwise, reads "0"
    assert [t.get_text() for t in states.texts] == [f"{device.device_states / 2**20:.1f}", "0", "0"]
    assert [t.get_text() for t in resident.texts][0] == "0"
    assert "device" in states.get_title() and "Resident" in resident.get_title()
    with pytest.raises(ValueError, match=r"variants must come from \('device', 'host', 'disk'\)"):
        lab.measure_offload(2, ("gpu",))


def test_the_lesson_problems_agree_with_their_formulas():
    from dtcourse.lab import offload as lab
    from dtcourse.lab.problems import check

    small = (16, 32, 8)
    for answer in (lab.problem_bytes_each_way(2, small), lab.problem_disk_bytes(2, small),
                   lab.problem_device_states(2, small), lab.problem_delayed_lag()):
        assert answer.agrees, answer
    assert lab.delayed_lag(steps=4) == [True, True, True]
    assert lab.lag_in_steps() == 1                     # measured: the first k that matches every step
    lag = lab.problem_delayed_lag()
    assert "measured 1 step; the lesson's formula gives 1 step\n" in repr(check(1, lag))
    assert "your prediction 2 steps is 100% too high" in repr(check(2, lag))   # read as "lands at t + 2"


def _mixed():
    from dtcourse.mixed_precision import Recipe

    found = []
    for opt in (adamw, functools.partial(OffloadedOptimizer, inner=adamw, tier="disk")):
        model = ZeRO(MLP(SIZES, seed=0), 3, opt, precision=Recipe(torch.bfloat16), reduce_dtype=torch.float32)
        for s in range(3):
            x, y = regression_batch(B // dist.get_world_size(), SIZES[0], SIZES[-1], seed=s + 10 * dist.get_rank())
            F.mse_loss(model(x), y).backward()
            model.step()
            model.zero_grad()
        found.append((model.full_parameters(), model.memory()))
    return found


def test_offloading_a_bf16_zero_changes_no_bit_and_frees_the_states():
    (plain, plain_memory), (offloaded, offloaded_memory) = launch(_mixed, 3, timeout=60)[0]
    assert all(torch.equal(plain[n], offloaded[n]) for n in plain)
    # what leaves the device: Adam's m and v (and step counts); ZeRO's fp32 master part stays
    assert plain_memory.optimizer_states - offloaded_memory.optimizer_states >= 2 * offloaded_memory.optimizer_states
    assert offloaded_memory.optimizer_states == plain_memory.parameters * 2    # the fp32 master of a bf16 part


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_host_copies_are_pinned_and_the_steps_match_adamw_on_the_gpu():
    torch.manual_seed(0)
    plain = nn.Parameter(torch.randn(1000, device="cuda"))
    offloaded = nn.Parameter(plain.detach().clone())
    opts = [adamw([plain]), OffloadedOptimizer([offloaded], adamw)]
    assert opts[1].host[0].is_pinned() and not opts[1].host[0].is_cuda
    for step in range(4):
        g = torch.randn(1000, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        for p, opt in zip((plain, offloaded), opts):
            p.grad = g.clone()
            opt.step()
    # the CPU's AdamW and the GPU's round differently (fused or foreach kernels, another order): ulps
    torch.testing.assert_close(offloaded.detach(), plain.detach(), rtol=0, atol=1e-6)
    assert opts[1].stats.down == opts[1].stats.up == 4 * 4000


def test_the_benchmark_prints_every_tier_against_the_device(capsys):
    from dtcourse.bench import offload as bench

    bench.main(["--quick"])
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("device ", "host ", "disk "))}
    assert set(rows) == {"device", "host", "disk"} and rows["device"][-3] == "1.00x"
    assert "resident: VmRSS between steps" in out
