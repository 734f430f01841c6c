"""Benchmark: how long ``dtcourse.launch`` takes to run 4 ranks, and to bring large results back.

    python -m dtcourse.bench.launch              # dtcourse.launch vs a plain fork launch
    python -m dtcourse.bench.launch --spawn      # also torch.multiprocessing.spawn (slow)

Latency: each launcher starts the ranks, forms a gloo group, all-reduces one tensor, returns the
result to the parent and cleans up. The plain fork launch is the simplest correct alternative
(``multiprocessing`` with the fork start method, results through a queue), timed in the same run
so the ratio is fair.

Large results: 2 ranks each return a float32 tensor of 16, 64 and 256 MB. The reference is the
pipe itself: one forked process writing the same bytes into a pipe that the parent reads, the
floor for any launcher that sends results through pipes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dtcourse.runtime.launch import launch


def _all_reduce_rank() -> float:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _plain_rank(rank: int, world: int, path: str, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(path, world), rank=rank, world_size=world)
    queue.put((rank, _all_reduce_rank()))
    dist.barrier()                      # keep the group alive until every rank has reported
    dist.destroy_process_group()


def plain_fork_launch(world: int) -> list[float]:
    ctx = mp.get_context("fork")
    handle, path = tempfile.mkstemp(prefix="dtcourse-bench-")
    os.close(handle)
    queue = ctx.Queue()
    procs = [ctx.Process(target=_plain_rank, args=(r, world, path, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=60) for _ in range(world))
    for p in procs:
        p.join()
    _remove(path)
    return [results[r] for r in range(world)]


def _spawn_rank(rank: int, world: int, path: str) -> None:
    _plain_rank(rank, world, path, _NullQueue())


class _NullQueue:
    def put(self, item) -> None:
        pass


def spawn_launch(world: int) -> None:
    handle, path = tempfile.mkstemp(prefix="dtcourse-bench-")
    os.close(handle)
    mp.spawn(_spawn_rank, args=(world, path), nprocs=world)
    _remove(path)


def _remove(path: str) -> None:
    """The FileStore deletes its file when the last rank leaves; remove it if it is still there."""
    if os.path.exists(path):
        os.unlink(path)


def pipe_floor(nbytes: int, writers: int = 2) -> None:
    """``writers`` forked processes each push ``nbytes`` through a pipe; the parent reads them all."""
    ends, pids = [], []
    for _ in range(writers):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            view = memoryview(bytes(nbytes))
            while view:
                view = view[os.write(write_end, view):]
            os._exit(0)
        os.close(write_end)
        ends.append(read_end)
        pids.append(pid)
    for fd in ends:
        got = bytearray()
        while chunk := os.read(fd, 1 << 20):
            got += chunk
        assert len(got) == nbytes
        os.close(fd)
    for pid in pids:
        os.waitpid(pid, 0)


def large_results(sizes_mb: list[int], repeats: int) -> list[tuple[int, float, float]]:
    """(MB per rank, median s for launch, median s for the pipe floor) with 2 ranks."""
    rows = []
    for mb in sizes_mb:
        numel = mb * 2**20 // 4
        got = launch(lambda: torch.zeros(numel), 2, timeout=300)
        assert [t.numel() for t in got] == [numel, numel]
        del got
        ours = statistics.median(time_it(lambda: launch(lambda: torch.zeros(numel), 2, timeout=300), repeats))
        floor = statistics.median(time_it(lambda: pipe_floor(mb * 2**20), repeats))
        rows.append((mb, ours, floor))
    return rows


def time_it(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--spawn", action="store_true", help="also time mp.spawn (about 14 s per launch here)")
    parser.add_argument("--result-mb", type=int, nargs="*", default=[16, 64, 256],
                        help="sizes (MB per rank) of the large-result runs; none to skip them")
    args = parser.parse_args(argv)
    n = args.world_size
    expected = [float(sum(range(n)))] * n
    assert launch(_all_reduce_rank, n) == expected and plain_fork_launch(n) == expected
    rows = {"dtcourse.launch": time_it(lambda: launch(_all_reduce_rank, n), args.repeats),
            "plain fork (multiprocessing)": time_it(lambda: plain_fork_launch(n), args.repeats)}
    if args.spawn:
        rows["mp.spawn"] = time_it(lambda: spawn_launch(n), 2)
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}; {n} ranks, one all-reduce, "
          f"{args.repeats} repeats\n")
    baseline = statistics.median(rows["plain fork (multiprocessing)"])
    print(f"{'launcher':30} {'median s':>9} {'min s':>8} {'max s':>8} {'vs plain fork':>14}")
    for name, times in rows.items():
        median = statistics.median(times)
        print(f"{name:30} {median:9.3f} {min(times):8.3f} {max(times):8.3f} {median / baseline:13.2f}x")
    if args.result_mb:
        print(f"\n2 ranks each return a float32 tensor; median of {min(args.repeats, 5)} repeats")
        print(f"{'MB per rank':>11} {'launch s':>9} {'launch MB/s':>12} {'pipe floor s':>13} {'vs floor':>9}")
        for mb, ours, floor in large_results(args.result_mb, min(args.repeats, 5)):
            print(f"{mb:11d} {ours:9.3f} {2 * mb / ours:12.0f} {floor:13.3f} {ours / floor:8.2f}x")


if __name__ == "__main__":
    main()
