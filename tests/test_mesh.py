"""The dp x pp x tp (x ep) grid: the rank lists for every factorisation of 1..8 ranks, bad sizes,
and all-reduces over the groups that build_groups creates, in a few launches."""

import itertools
import re

import pytest
import torch
import torch.distributed as dist

from dtcourse import launch
from dtcourse.mesh import ParallelDims, build_groups, factorisations


def _all_dims(max_world: int = 8) -> list[ParallelDims]:
    """Every (dp, pp, tp) with dp*pp*tp <= max_world, with every ep that divides dp."""
    out = []
    for dp, pp, tp in itertools.product(range(1, max_world + 1), repeat=3):
        if dp * pp * tp <= max_world:
            out += [ParallelDims(dp, pp, tp, ep) for ep in range(1, dp + 1) if dp % ep == 0]
    return out


ALL_DIMS = _all_dims()
SIZES = ("dp", "pp", "tp")


def _size(dims: ParallelDims, dim: str) -> int:
    return getattr(dims, dim)


@pytest.mark.parametrize("dims", ALL_DIMS, ids=str)
def test_groups_partition_the_ranks(dims):
    world = dims.world_size
    for dim in ("dp", "pp", "tp", "ep"):
        groups = dims.groups(dim)
        assert all(len(g) == _size(dims, dim) for g in groups), (dim, groups)
        assert len(groups) == world // _size(dims, dim), (dim, groups)
        members = [r for g in groups for r in g]
        assert sorted(members) == list(range(world)), (dim, groups)   # union = all ranks, disjoint
        for rank in range(world):
            assert sum(rank in g for g in groups) == 1, (dim, rank, groups)
    for g in dims.groups("tp"):   # Megatron order: tp ranks adjacent
        assert g == list(range(g[0], g[0] + dims.tp)), g


@pytest.mark.parametrize("dims", ALL_DIMS, ids=str)
def test_coordinates_round_trip_and_groups_vary_one_coordinate(dims):
    world = dims.world_size
    coords = [dims.coordinates(r) for r in range(world)]
    for rank, c in enumerate(coords):
        # grid = arange(world).reshape(pp, dp, tp): tp fastest, pp slowest
        assert rank == c["pp"] * dims.dp * dims.tp + c["dp"] * dims.tp + c["tp"], (rank, c)
        assert dims.rank_at(c["pp"], c["dp"], c["tp"]) == rank
        assert dims.grid()[c["pp"], c["dp"], c["tp"]].item() == rank
        assert c["ep"] == c["dp"] % dims.ep
    for dim in SIZES:
        others = [d for d in SIZES if d != dim]
        for g in dims.groups(dim):
            # a group holds the ranks that agree on every other coordinate, one per index of its own
            assert [coords[r][dim] for r in g] == list(range(_size(dims, dim))), (dim, g)
            assert len({tuple(coords[r][d] for d in others) for r in g}) == 1, (dim, g)
    dp_groups = dims.groups("dp")
    for g in dims.groups("ep"):
        # ep: a run of consecutive dp ranks inside one dp group, starting at a multiple of ep
        assert any(set(g) <= set(d) for d in dp_groups), g
        dp_index = [coords[r]["dp"] for r in g]
        assert dp_index == list(range(dp_index[0], dp_index[0] + dims.ep)) and dp_index[0] % dims.ep == 0
        assert [coords[r]["ep"] for r in g] == list(range(dims.ep))


def test_the_docstring_example():
    dims = ParallelDims(dp=2, pp=2, tp=2)
    assert dims.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert ParallelDims(dp=4, pp=1, tp=2, ep=2).groups("ep") == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert dims.coordinates(5) == {"pp": 1, "dp": 0, "tp": 1, "ep": 0}


@pytest.mark.parametrize("world", range(1, 9))
def test_check_accepts_every_factorisation(world):
    expected = {(dp, pp, tp) for dp, pp, tp in itertools.product(range(1, world + 1), repeat=3)
                if dp * pp * tp == world}
    assert set(factorisations(world)) == expected
    for dp, pp, tp in expected:
        ParallelDims(dp, pp, tp).check(world)


def test_world_size_mismatch_says_what_fits():
    dims = ParallelDims(dp=3, pp=1, tp=2)
    with pytest.raises(ValueError, match=re.escape("dp*pp*tp = 6 does not equal the world size 4")) as info:
        dims.check(4)
    assert "(dp, pp, tp) = (2, 1, 2)" in str(info.value)   # the hint lists sizes that fit


@pytest.mark.parametrize("kwargs, message", [
    (dict(dp=0, pp=1, tp=1), "dp must be a positive int, got 0"),
    (dict(dp=1, pp=-2, tp=1), "pp must be a positive int, got -2"),
    (dict(dp=1, pp=1, tp=1.5), "tp must be a positive int, got 1.5"),
    (dict(dp=1, pp=1, tp=True), "tp must be a positive int, got True"),
    (dict(dp=2, pp=1, tp=1, ep=0), "ep must be a positive int, got 0"),
    (dict(dp=4, pp=1, tp=1, ep=3), "ep=3 does not divide data-parallel size dp=4.*choose ep among 1, 2, 4"),
])
def test_bad_sizes_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


def test_bad_dimension_and_rank_are_refused():
    dims = ParallelDims(dp=2, pp=1, tp=2)
    with pytest.raises(ValueError, match="unknown dimension 'cp'; choose one of dp, pp, tp, ep"):
        dims.groups("cp")
    with pytest.raises(ValueError, match="rank 4 is outside the grid of 4 ranks"):
        dims.coordinates(4)


def _all_reduce_over_each_group(dims: ParallelDims, wrong: ParallelDims):
    """On every rank: build the mesh, all-reduce the rank number over each dimension's group."""
    try:
        build_groups(wrong)
        mismatch = None
    except ValueError as e:
        mismatch = str(e)
    mesh = build_groups(dims)
    sums = {}
    for dim in ("dp", "pp", "tp", "ep"):
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=mesh.group(dim))   # sends 2(n-1)/n * 4 bytes per rank
        sums[dim] = t.item()
    return mesh.rank, mesh.coordinates, mesh.ranks, sums, mismatch


@pytest.mark.parametrize("dims", [
    ParallelDims(dp=2, pp=1, tp=2, ep=2),
    ParallelDims(dp=3, pp=2, tp=1, ep=3),
    ParallelDims(dp=1, pp=2, tp=3),
    ParallelDims(dp=2, pp=2, tp=2, ep=2),
], ids=str)
def test_collectives_run_over_each_group(dims):
    world = dims.world_size
    wrong = ParallelDims(dp=world + 1, pp=1, tp=1)
    per_rank = launch(_all_reduce_over_each_group, world, dims, wrong, timeout=60)
    for rank, (mesh_rank, coords, ranks, sums, mismatch) in enumerate(per_rank):
        assert mesh_rank == rank and coords == dims.coordinates(rank)
        assert mismatch is not None and mismatch.startswith(
            f"dp*pp*tp = {world + 1} does not equal the world size {world}")
        for dim in ("dp", "pp", "tp", "ep"):
            (mine,) = [g for g in dims.groups(dim) if rank in g]
            assert ranks[dim] == mine
            assert sums[dim] == sum(mine), (rank, dim, mine, sums[dim])
