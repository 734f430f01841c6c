"""dtcourse.runtime.observe: every process-group call recorded at the ProcessGroup boundary, with its bytes,
peer, label, whether backward made it, and its start and end; nothing recorded, and nothing patched, outside."""

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup

from dtcourse import launch
from dtcourse.runtime.observe import label, labelled, observe


class _SumInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)                       # as Megatron's f does in backward
        return grad


def _observed_rank():
    rank, n = dist.get_rank(), dist.get_world_size()
    before = ProcessGroup.__dict__["allreduce"]
    saved_all_reduce = dist.all_reduce             # bound before the block: still seen
    x = torch.ones(7)                              # 7 elements: no world size here divides it
    with observe() as log:
        with label("outer"):
            saved_all_reduce(x)
            with label("inner"):
                out = torch.empty(3 * n)
                dist.all_gather_into_tensor(out, torch.ones(3))
        dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * n))
        splits = [r + 1 for r in range(n)]                                  # uneven: r + 1 rows to rank r
        dist.all_to_all_single(torch.empty(sum(rank + 1 for _ in range(n))), torch.ones(sum(splits)),
                               output_split_sizes=[rank + 1] * n, input_split_sizes=splits)
        right, left = (rank + 1) % n, (rank - 1) % n
        ops = [dist.P2POp(dist.isend, torch.full((5,), float(rank)), right),
               dist.P2POp(dist.irecv, torch.empty(5), left)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        w = torch.ones(4, requires_grad=True)
        with label("step"):
            _SumInBackward.apply(w).sum().backward()
    outside = len(log.records)
    dist.all_reduce(torch.ones(1))                 # after the block: not recorded
    after = ProcessGroup.__dict__["allreduce"]
    rows = [(r.op, r.peer, r.numel, r.nbytes, r.label, r.backward, r.group_size, r.group_rank,
             r.end is not None and r.end >= r.start) for r in log.records]
    return rows, outside == len(log.records), before is after, log.total("nbytes", backward=True)


def test_every_call_is_recorded_with_its_bytes_peer_label_and_phase():
    n = 3
    for rank, (rows, nothing_after, restored, backward_bytes) in enumerate(launch(_observed_rank, n)):
        assert nothing_after and restored
        ops = [r[0] for r in rows]
        assert ops[0] == "allreduce" and rows[0][3] == 7 * 4 and rows[0][4] == "outer"
        gather = next(r for r in rows if r[0] in ("_allgather_base", "all_gather_single"))
        assert gather[2] == 3 and gather[4] == "outer/inner"                         # the input: 3 elements
        scatter = next(r for r in rows if r[0] in ("_reduce_scatter_base", "reduce_scatter_single"))
        assert scatter[2] == 2 * n and scatter[4] == ""
        a2a = next(r for r in rows if r[0] in ("alltoall_base", "all_to_all_single"))
        assert a2a[2] == sum(r + 1 for r in range(n))
        sends = [r for r in rows if r[0] == "send"]
        recvs = [r for r in rows if r[0] == "recv"]
        assert [(s[1], s[3]) for s in sends] == [((rank + 1) % n, 20)]             # who talks to whom, and bytes
        assert [(s[1], s[3]) for s in recvs] == [((rank - 1) % n, 20)]
        backward = [r for r in rows if r[5]]
        assert [(r[0], r[4]) for r in backward] == [("allreduce", "step")] and backward_bytes == 16
        assert all(r[6] == n and r[7] == rank and r[8] for r in rows)              # ended, after it started


class _Column(torch.nn.Linear):                    # f, then the matmul: an all-reduce in backward
    def forward(self, x):
        return super().forward(_SumInBackward.apply(x))


class _Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = _Column(4, 4), _Column(4, 4)

    def forward(self, x):
        return self.second(self.first(x))


def _labelled_rank():
    model = _Two()
    x = torch.ones(2, 4, requires_grad=True)
    with observe() as log:
        with labelled(model):
            y = model(x)
        def queue(_):                                       # a call queued for the end of backward, as DDP's
            torch.autograd.Variable._execution_engine.queue_callback(lambda: dist.all_reduce(torch.ones(3)))
        y.register_hook(queue)
        with label("after"):
            y.sum().backward()
    return [(r.label, r.backward, r.numel) for r in log.records]


def test_a_backward_call_carries_the_label_its_forward_node_was_created_under():
    for rows in launch(_labelled_rank, 2):
        # backward runs second's node first; the queued call has no node: the labels around backward()
        assert rows == [("second", True, 8), ("first", True, 8), ("after", True, 3)]


def test_labelled_refuses_a_submodule_the_model_does_not_have():
    import pytest
    with pytest.raises(ValueError, match="no submodule 'third'"):
        with labelled(_Two(), {"third": "x"}):
            pass
