"""Benchmark: the course's CUDA and nccl paths on a GPU, each beside PyTorch's own version.

    python -m dtcourse.bench.gpu              # about a minute on one H100 or H200
    python -m dtcourse.bench.gpu --quick      # fewer repeats (too few to quote)
    make gpu-check                            # this, the test suite and every notebook

Needs CUDA. ``launch`` gives nccl one GPU per rank, so with one GPU the nccl sections run at world
size 1 (the code path, the CUDA memory and the step time, not the communication); the multi-rank
lessons run on CPU ranks (gloo) on the same machine. Four sections, the forked one first (a parent
that has touched CUDA starts its ranks as new interpreters, which is slower):

1. ZeRO (lesson 06): stages 0-3 through nccl against FSDP2's ``fully_shard``: step time, the
   allocator's peak, and ``ZeRO.memory()`` against the paper's formula (``paper_bytes``).
2. Memory of one step (lesson 00): ``measure_step`` by the CUDA allocator against the tensor count
   and against ``predict_step``, in fp32 and with a bf16 copy and fp32 masters.
3. Mixed precision (lesson 04): step time and peak of fp32, bf16 autocast, fp16 autocast with
   ``torch.amp.GradScaler("cuda")`` and with the course's ``DynamicLossScaler``, and the bf16 copy.
4. Checkpointing (lesson 05): step time and peak of the GPT with no, selective and full
   recomputation, and the course's ``checkpoint`` against ``torch.utils.checkpoint`` on one stack.

Times are medians of CUDA-synchronised steps; ratios are against the reference in the same run.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Callable

import torch
import torch.nn as nn

from dtcourse.models import GPT, GPTConfig, lm_loss, token_batch

__all__ = ["main", "BENCH_GPT"]

# Big enough that a step is GPU work (tens of milliseconds), small enough for a minute in all.
BENCH_GPT = GPTConfig(vocab_size=4096, block_size=512, n_layer=8, n_head=16, d_model=1024)
BATCH = 8


def _median_ms(step: Callable[[], None], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _peak_mib(step: Callable[[], None]) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**20


# --------------------------------------------------------------------------- #
# 1. ZeRO against FSDP2, through nccl
# --------------------------------------------------------------------------- #
def _zero_rank(config: GPTConfig, repeats: int) -> list[tuple[str, float, float, float, float]]:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from dtcourse import device
    from dtcourse.zero import ZeRO
    from dtcourse.zero.memory import paper_bytes

    dev, world = device(), dist.get_world_size()
    x, y = (t.to(dev) for t in token_batch(config, BATCH, seed=0))
    adam = functools.partial(torch.optim.AdamW, lr=1e-4)
    rows = []
    psi = sum(p.numel() for p in GPT(config, seed=0).parameters())
    for stage in (0, 1, 2, 3):
        model = ZeRO(GPT(config, seed=0).to(dev), stage=stage, optimizer=adam)

        def step(model=model):
            lm_loss(model(x), y).backward()
            model.step()
            model.zero_grad()
        ms = _median_ms(step, repeats)
        peak = _peak_mib(step)
        held = model.memory().model_states
        rows.append((f"ZeRO stage {stage}", ms, peak, held / 2**20, paper_bytes(stage, psi, world, 8, 4, 4) / 2**20))
        del model
        torch.cuda.empty_cache()
    module = GPT(config, seed=0).to(dev)
    for block in module.blocks:
        fully_shard(block)
    fully_shard(module)
    optimizer = adam(module.parameters())

    def fsdp_step():
        lm_loss(module(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    rows.append(("FSDP2 fully_shard", _median_ms(fsdp_step, repeats), _peak_mib(fsdp_step), float("nan"), float("nan")))
    return rows


def zero_section(repeats: int) -> None:
    from dtcourse import launch
    from dtcourse.runtime import gpu_count

    world = gpu_count()
    config = GPTConfig(vocab_size=4096, block_size=256, n_layer=4, n_head=8, d_model=512)
    rows = launch(_zero_rank, world, config, repeats, backend="nccl", timeout=300)[0]
    print(f"\n1. ZeRO against FSDP2: nccl, world size {world}, GPT n_layer={config.n_layer} "
          f"d_model={config.d_model} seq {config.block_size} batch {BATCH}, fp32 AdamW")
    head = f"{'':<20}{'step ms':>9}{'vs FSDP2':>9}{'peak MiB':>10}{'held MiB':>10}{'paper MiB':>10}"
    print(head + "\n" + "-" * len(head))
    fsdp = rows[-1][1]
    for name, ms, peak, held, paper in rows:
        print(f"{name:<20}{ms:>9.2f}{ms / fsdp:>8.2f}x{peak:>10.1f}{held:>10.1f}{paper:>10.1f}")


# --------------------------------------------------------------------------- #
# 2. One step's memory: the CUDA allocator against the tensor count and the formula
# --------------------------------------------------------------------------- #
def memory_section() -> None:
    from dtcourse.memory import gpt_activation_bytes, measure_step, predict_step

    config = GPTConfig(vocab_size=4096, block_size=256, n_layer=4, n_head=8, d_model=512)
    batch = token_batch(config, 4, seed=0)
    print(f"\n2. One Adam step's bytes (lesson 00): GPT n_layer={config.n_layer} d_model={config.d_model} "
          f"seq {config.block_size} batch 4, on cuda")
    head = f"{'':<36}{'params':>10}{'grads':>10}{'opt+master':>11}{'activations':>12}  (MiB)"
    print(head + "\n" + "-" * len(head))
    for mixed in (None, torch.bfloat16):
        model = GPT(config, seed=0)
        label = "fp32" if mixed is None else "bf16 copy + fp32 master"
        predicted = predict_step(model, gpt_activation_bytes(config, 4, dtype=mixed or torch.float32),
                                 mixed=mixed is not None)
        for how, m in (("allocator", measure_step(model, batch, lm_loss, mixed_dtype=mixed, device="cuda",
                                                   by="allocator")),
                       ("tensors", measure_step(model, batch, lm_loss, mixed_dtype=mixed, device="cuda")),
                       ("formula", predicted)):
            print(f"{label + ', ' + how:<36}{m.params / 2**20:>10.2f}{m.grads / 2**20:>10.2f}"
                  f"{m.optimizer_states / 2**20:>11.2f}{m.activations / 2**20:>12.2f}")


# --------------------------------------------------------------------------- #
# 3. Mixed precision: the recipes' step time and peak
# --------------------------------------------------------------------------- #
def mixed_precision_section(repeats: int) -> None:
    from dtcourse.mixed_precision import DynamicLossScaler, Recipe, Trainer

    recipes = {
        "fp32": Recipe(),
        "bf16 autocast": Recipe(torch.bfloat16, autocast=True),
        "fp16 autocast, GradScaler": Recipe(torch.float16, autocast=True,
                                            scaler=functools.partial(torch.amp.GradScaler, "cuda")),
        "fp16 autocast, ours": Recipe(torch.float16, autocast=True, scaler=DynamicLossScaler),
        "bf16 copy + masters": Recipe(torch.bfloat16),
    }
    x, y = (t.cuda() for t in token_batch(BENCH_GPT, BATCH, seed=0))
    c = BENCH_GPT
    print(f"\n3. Mixed precision (lesson 04): GPT n_layer={c.n_layer} d_model={c.d_model} seq {c.block_size} "
          f"batch {BATCH}, Adam, one step = forward, backward, step")
    head = f"{'recipe':<34}{'step ms':>9}{'vs fp32':>9}{'peak MiB':>10}{'skipped':>9}"
    print(head + "\n" + "-" * len(head))
    base = None
    for name, recipe in recipes.items():
        trainer = Trainer(GPT(c, seed=0).cuda(), recipe, lm_loss, functools.partial(torch.optim.Adam, lr=1e-4))
        stepped = []

        def step(trainer=trainer):
            loss = trainer.forward(x, y)
            trainer.backward(loss)
            stepped.append(trainer.step())
        ms = _median_ms(step, repeats)
        peak = _peak_mib(step)
        base = base or ms
        print(f"{name:<34}{ms:>9.2f}{ms / base:>8.2f}x{peak:>10.0f}{stepped.count(False):>9}")
        del trainer
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- #
# 4. Checkpointing: policies on the GPT, and ours against torch.utils.checkpoint
# --------------------------------------------------------------------------- #
def checkpointing_section(repeats: int) -> None:
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    from dtcourse.checkpointing import checkpoint
    from dtcourse.lab.checkpointing import POLICIES, _gpt

    c = BENCH_GPT
    x, y = (t.cuda() for t in token_batch(c, BATCH, seed=0))
    print(f"\n4. Checkpointing (lesson 05): GPT n_layer={c.n_layer} d_model={c.d_model} seq {c.block_size} "
          f"batch {BATCH}, forward + backward")
    head = f"{'policy':<34}{'step ms':>9}{'vs none':>9}{'peak MiB':>10}"
    print(head + "\n" + "-" * len(head))
    base = None
    for policy in POLICIES:
        model = _gpt(c, policy, 0).cuda()

        def step(model=model):
            lm_loss(model(x), y).backward()
            model.zero_grad(set_to_none=True)
        ms, peak = _median_ms(step, repeats), _peak_mib(step)
        base = base or ms
        print(f"{policy:<34}{ms:>9.2f}{ms / base:>8.2f}x{peak:>10.0f}")
        del model
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Sequential(nn.Linear(4096, 4096), nn.GELU()) for _ in range(8)]).cuda()
    h = torch.randn(4096, 4096, device="cuda", requires_grad=True)
    for name, fn in (("dtcourse.checkpointing", checkpoint),
                     ("torch.utils.checkpoint", functools.partial(torch_checkpoint, use_reentrant=False))):
        def step(fn=fn):
            out = h
            for layer in layers:
                out = fn(layer, out)
            out.sum().backward()
        print(f"{name + ', 8 layers':<34}{_median_ms(step, repeats):>9.2f}{'':>9}{_peak_mib(step):>10.0f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="3 repeats: a smoke test, too few to quote")
    args = parser.parse_args(argv)
    from dtcourse.runtime import gpu_count
    if gpu_count() == 0:
        raise SystemExit("dtcourse.bench.gpu needs a CUDA GPU; this machine has none (torch.cuda.device_count() == 0).")
    repeats = 3 if args.quick else args.repeats
    zero_section(repeats)                 # first, while this process has not touched CUDA
    props = torch.cuda.get_device_properties(0)
    nccl = torch.cuda.nccl.version()
    print(f"\nmachine: {props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}, nccl {'.'.join(map(str, nccl)) if isinstance(nccl, tuple) else nccl}")
    memory_section()
    mixed_precision_section(repeats)
    checkpointing_section(repeats)


if __name__ == "__main__":
    main()
