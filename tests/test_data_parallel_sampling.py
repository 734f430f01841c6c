"""dtcourse.data_parallel.sampling (drawn by dtcourse.lab.data_parallel.plot_shards): the rebuilt DistributedSampler rule against torch's, padding, epochs, the figure.

None of these tests starts a process group: the sampler must work without one.
"""

import itertools

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
import torch.distributed as dist

from dtcourse.data_parallel.sampling import padding_mask, shard_indices, torch_shards
from dtcourse.lab.data_parallel import plot_shards

# lengths divisible by N, not divisible, and shorter than N (padding wraps more than once)
CASES = list(itertools.product((1, 3, 10, 12, 17), (1, 2, 3, 4, 5), (0, 1), (True, False), (True, False)))


@pytest.mark.parametrize("length, n, epoch, shuffle, drop_last", CASES)
def test_rebuilt_rule_matches_torch_without_a_process_group(length, n, epoch, shuffle, drop_last):
    assert not dist.is_initialized()
    ours = [shard_indices(length, n, r, epoch=epoch, seed=3, shuffle=shuffle, drop_last=drop_last)
            for r in range(n)]
    assert ours == torch_shards(length, n, epoch=epoch, seed=3, shuffle=shuffle, drop_last=drop_last)
    assert len({len(s) for s in ours}) == 1          # every rank reads as many samples


@pytest.mark.parametrize("length, n", [(10, 4), (12, 4), (17, 3), (3, 5)])
def test_padding_repeats_only_the_marked_slots(length, n):
    shards = torch_shards(length, n, epoch=2)
    mask = padding_mask(length, n)
    fresh = [i for s, m in zip(shards, mask) for i, pad in zip(s, m) if not pad]
    padded = [i for s, m in zip(shards, mask) for i, pad in zip(s, m) if pad]
    assert sorted(fresh) == list(range(length))      # disjoint, and every sample once
    assert len(padded) == -(-length // n) * n - length
    assert set(padded) <= set(fresh)


def test_drop_last_cuts_instead_of_padding():
    shards = torch_shards(10, 4, drop_last=True)
    flat = [i for s in shards for i in s]
    assert len(flat) == 8 and len(set(flat)) == 8
    assert not any(any(row) for row in padding_mask(10, 4, drop_last=True))


def test_set_epoch_reshuffles_and_same_epoch_repeats():
    assert torch_shards(16, 4, epoch=0) == torch_shards(16, 4, epoch=0)
    assert torch_shards(16, 4, epoch=0) != torch_shards(16, 4, epoch=1)
    assert shard_indices(10, 4, 1, shuffle=False) == [1, 5, 9]


def test_bad_arguments_say_what_is_wrong():
    with pytest.raises(ValueError, match="rank must be in"):
        shard_indices(10, 4, 4)
    with pytest.raises(ValueError, match="dataset_len"):
        shard_indices(0, 4, 0)
    with pytest.raises(ValueError, match="num_replicas"):
        torch_shards(10, 0)


def test_plot_shows_every_index_and_stars_the_padding():
    panels = {"epoch 0": torch_shards(10, 4, epoch=0), "epoch 1": torch_shards(10, 4, epoch=1)}
    fig = plot_shards(panels, 10)
    try:
        for ax, shards in zip(fig.axes, panels.values()):
            texts = [t.get_text() for t in ax.texts]
            assert [int(t.rstrip("*")) for t in texts] == [i for s in shards for i in s]
            assert sum(t.endswith("*") for t in texts) == 2     # 12 slots for 10 samples
    finally:
        plt.close(fig)


def test_plot_fits_the_notebook_column_however_many_panels():
    from dtcourse.lab.widgets import COLUMN_IN

    for n_panels in (1, 2, 3):
        fig = plot_shards({f"epoch {e}": torch_shards(10, 4, epoch=e) for e in range(n_panels)}, 10)
        try:
            assert fig.get_figwidth() <= COLUMN_IN
            assert [ax.get_title() for ax in fig.axes] == [f"epoch {e}" for e in range(n_panels)]
            assert "10 samples on 4 ranks" in fig._suptitle.get_text()
        finally:
            plt.close(fig)
