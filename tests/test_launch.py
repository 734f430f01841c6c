"""dtcourse.launch: results, output, failures, hangs, bad input, and no processes left behind."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import dtcourse
from dtcourse import LaunchError, LaunchTimeout, RankError, launch
from dtcourse.runtime import processes, results
from dtcourse.runtime import rank as rank_module
from dtcourse.runtime.device import choose_backend, gpu_count


def _children(parent: int | None = None) -> list[int]:
    """PIDs of live (non-zombie) processes whose parent is this test process (or ``parent``), the ranks' starter
    excepted (``fresh.py``: it stays, to start the next launch's ranks) but not the ranks it started."""
    from dtcourse.runtime import fresh
    me, found = parent or os.getpid(), []
    starter = fresh._STARTER.proc.pid if fresh._STARTER is not None and parent is None else None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z" and int(pid) != starter:
            found.append(int(pid))
    return found + (_children(starter) if starter else [])


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(autouse=True)
def no_leftovers():
    assert _children() == [], "a process was left over before this test"
    yield
    assert _children() == [], "launch left a child process behind"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_results_come_back_in_rank_order(world_size):
    def fn(offset):
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return dist.get_rank(), dist.get_world_size(), t.item() + offset

    got = launch(fn, world_size, 0.5)
    total = sum(range(world_size)) + 0.5
    assert got == [(r, world_size, total) for r in range(world_size)]


def test_closures_kwargs_and_torchrun_variables():
    captured = {"scale": 3}  # a local closure: mp.spawn could not pickle this

    def fn(a, *, b):
        env = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
        return a * captured["scale"] + b, env, torch.get_num_threads()

    got = launch(fn, 2, 2, b=1)
    assert [g[0] for g in got] == [7, 7]
    assert [g[1] for g in got] == [{"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2"} for r in range(2)]
    assert [g[2] for g in got] == [1, 1]  # one intra-op thread per rank by default


def test_output_is_prefixed_by_rank(capsys):
    def fn():
        print(f"hello from {dist.get_rank()}")
        print("no newline at the end", end="")
        print("to stderr", file=sys.stderr)

    launch(fn, 3)
    out, err = capsys.readouterr()
    for r in range(3):
        assert f"[rank {r}] hello from {r}\n" in out
        assert f"[rank {r}] no newline at the end\n" in out
        assert f"[rank {r}] to stderr\n" in err


def test_gloo_listens_only_on_loopback():
    def listening_addresses():
        inodes = set()
        for fd in os.listdir("/proc/self/fd"):
            link = os.readlink(f"/proc/self/fd/{fd}") if os.path.islink(f"/proc/self/fd/{fd}") else ""
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
        addresses = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                for row in f.readlines()[1:]:
                    cols = row.split()
                    if cols[9] in inodes and cols[3] == "0A":  # 0A == LISTEN
                        addresses.append(cols[1].split(":")[0])
        return addresses

    for addresses in launch(listening_addresses, 2):
        assert addresses, "expected gloo to listen on a socket"
        assert set(addresses) <= {"0100007F"}, f"gloo listened on {addresses}, not only 127.0.0.1"


def test_a_rank_that_raises_is_reported_with_its_traceback():
    def fn():
        if dist.get_rank() == 2:
            raise ValueError("bad shard 42")
        dist.barrier()  # the others wait here until launch ends them

    start = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(fn, 3, timeout=30)
    assert time.monotonic() - start < 10, "an error should end the launch at once, not at the timeout"
    assert info.value.rank == 2
    assert "ValueError: bad shard 42" in str(info.value)
    assert "in fn" in info.value.remote_traceback


@pytest.fixture(params=["forked", "starter"])
def ranks_from(request, monkeypatch):
    """Run the test with ranks forked by this process, and again forked by the starter (fresh.py).

    The starter is started before the test: its first start imports torch and the course (18 s on the
    GPU machine of 2026-11-27, with 14 pytest workers), which a test timing its launch should not count."""
    monkeypatch.setenv("DTCOURSE_FRESH_RANKS", "1" if request.param == "starter" else "0")
    if request.param == "starter":
        assert launch(_rank_number, 2, backend="gloo", timeout=60) == [0, 1]
    return request.param


def _rank_number() -> int:
    return dist.get_rank()


def test_a_hang_raises_timeout_naming_the_stuck_ranks_and_where_they_were(ranks_from):
    def fn():
        if dist.get_rank() != 0:  # rank 0 skips the collective
            dist.barrier()
        return "done"

    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        launch(fn, 3, timeout=2)
    elapsed = time.monotonic() - start
    assert 2 <= elapsed < 8
    error = info.value
    assert isinstance(error, LaunchTimeout) and error.timeout == 2
    assert error.stuck == [1, 2]                      # read as data, not parsed from the message
    assert sorted(error.stacks) == [1, 2]
    for rank in (1, 2):
        assert "in barrier" in processes.frames(error.stacks[rank])[0]   # innermost frame first
    message = str(error)
    assert "rank(s) [1, 2] still running" in message
    assert "rank 1 was at" in message and "in barrier" in message
    # the kernel (here: this process) stays usable for the next launch
    assert launch(lambda: dist.get_rank(), 2) == [0, 1]


def test_processes_a_rank_started_are_ended_too(ranks_from):
    def fn():
        return subprocess.Popen(["sleep", "60"]).pid

    pids = launch(fn, 2)
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), "a grandchild process outlived the launch"


def test_keyboard_interrupt_ends_every_rank():
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    try:
        with pytest.raises(KeyboardInterrupt):
            launch(lambda: time.sleep(30), 3, timeout=60)
    finally:
        signal.signal(signal.SIGALRM, old)


def test_a_rank_that_dies_is_reported(ranks_from):
    def fn():
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(30)

    with pytest.raises(LaunchError, match="rank 1 was killed by signal 9"):
        launch(fn, 2, timeout=20)


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), "10", None, True])
def test_bad_timeout_says_what_to_pass(timeout):
    with pytest.raises(ValueError, match=r"timeout must be a positive number of seconds.*got"):
        launch(lambda: None, 2, timeout=timeout)


@pytest.mark.parametrize("threads", [-1, 1.5, "2"])
def test_bad_threads(threads):
    with pytest.raises(ValueError, match="threads must be an integer >= 0"):
        launch(lambda: None, 2, threads=threads)


def test_large_results_come_back_at_pipe_speed():
    """A 64 MB tensor per rank (128 MB in all) used to take longer than 20 s, quadratic in its size."""
    start = time.monotonic()
    results = launch(lambda: torch.full((16 * 2**20,), float(dist.get_rank())), 2, timeout=20)
    elapsed = time.monotonic() - start
    assert [r.shape for r in results] == [(16 * 2**20,)] * 2
    assert [r[0].item() for r in results] == [0.0, 1.0] and results[1][-1].item() == 1.0
    assert elapsed < 15, f"two 64 MB results took {elapsed:.1f} s"     # ~1 s measured; the old code, > 20 s


def test_an_error_in_a_rank_set_up_never_runs_the_parent_code(tmp_path, monkeypatch):
    """A child that fails before reaching fn (here: Ctrl-C during set-up) ends with os._exit.

    Without that, the exception would unwind through launch's own frames inside the forked
    child: its finally blocks would kill the other ranks and it would go on running the caller.
    """
    parent = os.getpid()

    def interrupted_set_up():
        raise KeyboardInterrupt

    monkeypatch.delenv("DTCOURSE_FRESH_RANKS", raising=False)        # forked ranks: they see this monkeypatch
    monkeypatch.setattr(rank_module, "_set_parent_death_signal", interrupted_set_up)
    try:
        with pytest.raises(LaunchError, match=r"rank \d exited with code 70 while setting itself up"):
            launch(lambda: "never runs", 2, timeout=20)
    finally:
        if os.getpid() != parent:                     # only a child that unwound gets here
            (tmp_path / f"leaked-{os.getpid()}").write_text("the child ran the caller's code")
            os._exit(1)
    assert list(tmp_path.iterdir()) == []
    assert _children() == []


def test_device_is_the_cpu_under_gloo():
    assert launch(lambda: str(dtcourse.device()), 2, backend="gloo") == ["cpu", "cpu"]
    assert str(dtcourse.device()) == "cpu"           # outside a process group too


@pytest.mark.parametrize("world_size", [0, -1, 2.0, True, "4"])
def test_bad_world_size(world_size):
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        launch(lambda: None, world_size)


def test_fn_must_be_callable():
    with pytest.raises(TypeError, match="fn must be a function"):
        launch(42, 2)


def test_unpicklable_return_value():
    with pytest.raises(LaunchError, match="cannot be sent back.*Return plain data"):
        launch(lambda: (i for i in range(3)), 2)


def test_nccl_without_enough_gpus():
    gpus = gpu_count()
    with pytest.raises(LaunchError, match=f"needs one GPU per rank.*has {gpus} GPU.*backend='gloo'"):
        launch(lambda: None, gpus + 1, backend="nccl")


def test_unknown_backend():
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'gloo', 'nccl'\), got 'mpi'"):
        launch(lambda: None, 2, backend="mpi")


def test_a_parent_that_used_the_gpu_starts_its_ranks_as_new_interpreters(monkeypatch):
    """A fork cannot use CUDA once the parent initialised it, nor run backward once the parent's autograd
    started its GPU threads (dtcourse/runtime/fresh.py); then each rank execs a new Python."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    scale = 2.0                                           # a closure over the test's own variable travels too

    def rank():
        x = torch.ones(3, requires_grad=True)
        (scale * x).sum().backward()
        t = x.grad.sum().reshape(1)
        dist.all_reduce(t)
        return sys.argv[0], t.item()                    # "-c": a new interpreter, not a fork of pytest
    assert launch(rank, 3, backend="gloo", timeout=120) == [("-c", 18.0)] * 3
    with pytest.raises(LaunchError, match=r"start in fresh interpreters.*must be\s+pickled.*cannot pickle"):
        lock = __import__("threading").Lock()
        launch(lambda: lock, 2, backend="gloo")


def test_a_fresh_interpreters_start_up_does_not_count_against_the_timeout(monkeypatch):
    """Fresh ranks import torch and rebuild fn before it runs (about 2 s each on a GPU node, more on a busy one;
    the exercise checks' 2 s timeouts failed there before fn began). The timeout is fn's: it starts once every
    rank runs fn. Here rebuilding the argument alone takes 1.5 s, longer than the 1 s timeout."""
    monkeypatch.setenv("DTCOURSE_FRESH_RANKS", "1")

    def rebuild_slowly(value):
        time.sleep(1.5)
        return value

    class SlowToRebuild:                                  # defined here, so cloudpickle sends it by value
        def __reduce__(self):
            return rebuild_slowly, (0.2,)

    def nap(slow):
        time.sleep(slow)
        return slow
    assert launch(nap, 2, SlowToRebuild(), backend="gloo", timeout=1.0) == [0.2, 0.2]
    start = time.monotonic()
    with pytest.raises(LaunchTimeout, match=r"timed out after 1 s; rank\(s\) \[0, 1\]"):
        launch(time.sleep, 2, 600, backend="gloo", timeout=1.0)
    assert time.monotonic() - start < 60                 # a hang is still stopped once every rank has started


def test_auto_backend_counts_gpus_without_initialising_cuda(monkeypatch):
    """"auto" asks NVML (torch.cuda.device_count); it must never call torch.cuda.is_available()."""
    def poisoned():
        raise AssertionError("torch.cuda.is_available() initialises CUDA in the parent")
    monkeypatch.setattr(torch.cuda, "is_available", poisoned)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert choose_backend(4) == "nccl" and choose_backend(5) == "gloo"   # one GPU per rank, or CPU
    assert choose_backend(1) == "gloo" and choose_backend(1, "nccl") == "nccl"   # one rank: the GPU when asked
    assert choose_backend(4, "gloo") == "gloo"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert choose_backend(1) == "gloo"
    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"   # a notebook's own is_available() asks NVML too


def test_init_from_env_without_torchrun_says_what_to_do(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(LaunchError, match="torchrun --nproc-per-node"):
        dtcourse.init_from_env()


def test_the_same_function_runs_under_launch_and_torchrun(tmp_path):
    script = tmp_path / "spmd.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        import dtcourse

        def total_of_ranks():
            rank, world = dtcourse.init_from_env()
            t = torch.tensor([float(rank)])
            dist.all_reduce(t)
            return t.item()

        if __name__ == "__main__":
            print(f"total {total_of_ranks()};", flush=True)
            dist.destroy_process_group()
    """))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", str(script)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("total 3.0;") == 3  # ranks share stdout, so lines may interleave

    sys.path.insert(0, str(tmp_path))
    try:
        import spmd
        assert launch(spmd.total_of_ranks, 3) == [3.0, 3.0, 3.0]
    finally:
        sys.path.remove(str(tmp_path))


def test_under_torchrun_destroying_the_group_ends_its_threads_after_an_optimizer_step(tmp_path):
    """An optimizer step imports torch._dynamo; on torch 2.13, done after a gloo group exists, that import keeps the
    group's worker threads alive past destroy_process_group(), and they abort the process as Python exits (exit -6,
    about one run in two for a ZeRO script). init_from_env imports it first: no gloo thread outlives the group."""
    script = tmp_path / "ends.py"
    script.write_text(textwrap.dedent("""
        import os, torch, torch.distributed as dist
        import dtcourse

        rank, world = dtcourse.init_from_env()
        model = torch.nn.Linear(4, 4)
        model(torch.randn(2, 4)).sum().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        torch.optim.AdamW(model.parameters()).step()
        dist.destroy_process_group()
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
        print(f"gloo threads left: {sum(n.startswith(('pt_gloo', 'gloo')) for n in names)};", flush=True)
    """))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("gloo threads left: 0;") == 2, run.stdout


def test_results_keep_every_tensor_exactly_through_the_out_of_band_encoding():
    """Tensors travel as raw bytes beside the pickle: every dtype, shape, view and flag must survive."""
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    values = {"float": torch.randn(3, 5), "bf16": torch.randn(7).to(torch.bfloat16), "bool": torch.tensor([True, False]),
              "int": torch.arange(-3, 4), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3),
              "transposed": base.t(), "slice": base[1:3, ::2], "grad": torch.ones(2, requires_grad=True),
              "parameter": torch.nn.Parameter(torch.full((2,), 3.0)), "nested": [(torch.ones(1), "text", 7)],
              "complex": torch.tensor([1 + 2j])}
    message = bytearray(b"".join(bytes(part) for part in results.encode(values)))
    back = results.decode(message)
    assert back.keys() == values.keys()
    for name, value in values.items():
        got = back[name][0][0] if name == "nested" else back[name]
        want = value[0][0] if name == "nested" else value
        assert type(got) is type(want) and got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got.detach(), want.detach()) and got.requires_grad == want.requires_grad, name
    assert back["nested"][0][1:] == ("text", 7)
    # a view ships only its own elements, not the whole storage it looks into
    assert len(results.encode(base[0, :2])[2]) == 2 * 8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_after_a_backward_on_a_gpu_machine_ranks_still_run_backward():
    """The GPU session of 2026-11-26 found every launch after one backward in the parent failing there."""
    x = torch.ones(3, device="cuda", requires_grad=True)
    (2 * x).sum().backward()                     # starts autograd's GPU threads, and initialises CUDA

    def rank():
        w = torch.ones(2, requires_grad=True)
        (3 * w).sum().backward()
        return w.grad.tolist()
    assert launch(rank, 2, backend="gloo", timeout=120) == [[3.0, 3.0]] * 2


def test_a_parent_whose_cuda_driver_is_initialised_starts_fresh_ranks(monkeypatch):
    """Asking the CUDA runtime anything initialises the driver without torch.cuda.is_initialized() knowing; a
    forked CPU rank's Adam.step() then failed on the H100 ("CUDA error: initialization error"). The driver is
    asked directly (cuDeviceGetCount answers "not initialised" until cuInit); here, with no driver, it is not."""
    from dtcourse.runtime import fresh
    if gpu_count() == 0:
        assert fresh._cuda_driver_initialised() is False
    monkeypatch.delenv("DTCOURSE_FRESH_RANKS", raising=False)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(fresh, "_autograd_threads", lambda: False)
    monkeypatch.setattr(fresh, "_cuda_driver_initialised", lambda: True)
    assert "CUDA driver is initialised" in fresh.why_fresh()

    def rank():
        model = torch.nn.Linear(2, 2)
        model(torch.ones(1, 2)).sum().backward()
        torch.optim.Adam(model.parameters()).step()
        return sys.argv[0]
    assert launch(rank, 2, backend="gloo", timeout=120) == ["-c", "-c"]    # new interpreters, not forks


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() == 0, reason="needs CUDA")
def test_after_the_parent_asked_the_cuda_runtime_forked_cpu_ranks_still_step_adam():
    # A new Python: in this one, an earlier GPU test may have initialised torch.cuda already.
    script = textwrap.dedent("""
        import torch, torch.distributed as dist
        from dtcourse import launch
        torch._C._cuda_getDeviceCount()              # the runtime's own count: initialises the driver
        assert not torch.cuda.is_initialized()       # torch's lazy init has not run: only the driver knows

        def rank():
            model = torch.nn.Linear(2, 2)
            model(torch.ones(1, 2)).sum().backward()
            torch.optim.Adam(model.parameters()).step()
            return dist.get_rank()
        if __name__ == "__main__":
            print("ranks", launch(rank, 2, backend="gloo", timeout=120))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ranks [0, 1]" in done.stdout, done.stdout + done.stderr


def test_ranks_from_the_starter_report_like_forked_ones_and_leave_nothing_behind(monkeypatch, capsys):
    """Where a fork cannot compute, a clean starter process forks the ranks (fresh.py): it stays for the next
    launch, which then starts as fast as a fork, and its ranks get this process's environment, working directory
    and output. (Deaths, hangs and grandchildren: the tests with ``ranks_from``; the fixture looks at the
    starter's children too.)"""
    from dtcourse.runtime import fresh
    monkeypatch.setenv("DTCOURSE_FRESH_RANKS", "1")

    def hello(tag):
        print(f"hello from {dist.get_rank()} in {os.getcwd()}", flush=True)
        return tag, dist.get_rank(), os.environ["TORCHELASTIC_RESTART_COUNT"], sys.argv[0]
    assert launch(hello, 3, "t") == [("t", r, "0", "-c") for r in range(3)]
    assert "[rank 2] hello from 2 in " + os.getcwd() in capsys.readouterr().out
    starter = fresh._STARTER.proc.pid
    start = time.monotonic()
    assert launch(hello, 2, "u")[1] == ("u", 1, "0", "-c")
    assert fresh._STARTER.proc.pid == starter and time.monotonic() - start < 2.0   # no new Python this time
