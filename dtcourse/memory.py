"""The memory of one training step, by kind: parameters, gradients, optimizer states, activations.

Everything here is measured on real tensors, then set beside a formula:

* **Model states** (Rajbhandari et al. 2019, ZeRO, arXiv 1910.02054). With Adam a
  parameter costs 16 bytes, with or without mixed precision:

  precision      param  grad  optimizer states (K)       total
  fp32           4      4     8  (Adam m, v)             16
  mixed (bf16)   2      2     12 (fp32 master, m, v)     16

  plus 4 bytes per parameter *tensor*: Adam's step count, a 0-dim fp32 tensor. Other
  optimizers keep other states (``OPTIMIZER_STATE_BYTES``).
* **Activations**: what autograd saves for backward, seen by a ``saved_tensors_hooks``
  during the forward. Each storage counts once (a view of one saved adds nothing);
  parameters and buffers are model state, not activations. ``mlp_activation_bytes`` and
  ``gpt_activation_bytes`` predict the count exactly; ``korthikanti_layer_bytes`` is the
  reference formula of Korthikanti et al. 2022 (arXiv 2205.05198).

Example::

    m = measure_step(MLP(), regression_batch(64), torch.nn.functional.mse_loss)

These counts are bookkeeping of tensor sizes at the end of each phase, on the CPU, where
no caching allocator rounds or keeps blocks. The *peak* of a step, temporaries included,
is ``HeldBytes``'s: it follows every storage alive, op by op (``measure_step``'s ``mark``
cuts its trace into phases). On CUDA, ``by="allocator"`` reads ``memory_allocated``
deltas instead (blocks are rounded up to 512 bytes, so it reads a little higher).
``dtcourse.lab.memory`` draws and tabulates these numbers for lesson 00; exercise 00 asks for them.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Container, Iterable, Sequence

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

if TYPE_CHECKING:
    from dtcourse.models import GPTConfig

__all__ = ["StepMemory", "measure_step", "PHASES", "storage_bytes", "SavedTensors", "HeldBytes", "new_storages",
           "predict_step",
           "OPTIMIZER_STATE_BYTES", "adam_model_state_bytes", "predict_adam_step",
           "mlp_activation_bytes", "gpt_layer_activation_bytes", "gpt_activation_bytes", "korthikanti_layer_bytes"]

# What torch.optim keeps in `optimizer.state`, in fp32: (bytes per parameter, bytes per parameter tensor).
OPTIMIZER_STATE_BYTES = {
    "sgd": (0, 0),                 # SGD(momentum=0): nothing
    "sgd_momentum": (4, 0),        # SGD(momentum > 0): momentum_buffer
    "adam": (8, 4),                # Adam and AdamW: exp_avg, exp_avg_sq; `step`, a 0-dim fp32 tensor
}
# Where measure_step's ``mark`` is called, in order: the end of each phase of the step.
PHASES = ("model", "master", "optimizer", "batch", "forward", "backward", "upcast", "step", "end")
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class StepMemory:
    """Bytes held by one training step, by kind (measured or predicted).

    ``optimizer_states`` is ZeRO's K, so in mixed precision it includes the fp32 master weights;
    ``master_weights`` is that part of it (0 in fp32), for tables and figures that show it apart.
    """

    params: int
    grads: int
    optimizer_states: int
    activations: int
    master_weights: int = 0

    KINDS = ("params", "grads", "optimizer_states", "activations")

    @property
    def model_states(self) -> int:
        """Parameters + gradients + optimizer states: what ZeRO shards."""
        return self.params + self.grads + self.optimizer_states

    @property
    def total(self) -> int:
        return self.model_states + self.activations

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``: views and repeats count once."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[_storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


class SavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """Within ``with SavedTensors(model) as saved:``, record every tensor autograd saves for backward.

    ``saved.nbytes`` sums distinct storages, leaving out the model's parameters and
    buffers. References to the saved tensors are held only inside the ``with``
    block, so that no storage is freed and its address reused while counting. Regions
    under ``torch.utils.checkpoint`` push their own hooks: what they decline to save is not counted.
    With ``classify``, ``saved.by_kind[classify(t)]`` also sums each storage under its kind.
    """

    def __init__(self, model: nn.Module | None = None, classify: Callable[[torch.Tensor], str] | None = None):
        state = [*model.parameters(), *model.buffers()] if model is not None else []
        self._excluded = {_storage_key(t) for t in state}
        self._saved: dict[tuple[str, int], torch.Tensor] = {}
        self.nbytes, self.classify, self.by_kind = 0, classify, {}
        super().__init__(self._pack, lambda t: t)

    def __enter__(self) -> "SavedTensors":
        super().__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        super().__exit__(*exc_info)
        self._saved.clear()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in self._excluded and key not in self._saved:
            self._saved[key], nbytes = t, t.untyped_storage().nbytes()
            self.nbytes += nbytes
            if self.classify is not None:
                self.by_kind[kind] = self.by_kind.get(kind := self.classify(t), 0) + nbytes
        return t


def _run_step(model: nn.Module, batch: Sequence[torch.Tensor], loss_fn: LossFn,
              make_optimizer: OptimizerFactory, mixed_dtype: torch.dtype | None,
              device: torch.device, mark: Callable[[str], None]) -> StepMemory:
    # The working model runs forward and backward; in mixed precision it is 16-bit and fp32 master weights step.
    work = copy.deepcopy(model).to(device=device, dtype=mixed_dtype)
    mark("model")
    master = work if mixed_dtype is None else copy.deepcopy(model).to(device)
    mark("master")
    optimizer = make_optimizer(master.parameters())      # its state is allocated by the first step()
    mark("optimizer")
    inputs, targets = (t.to(device, mixed_dtype if mixed_dtype and t.is_floating_point() else None)
                       for t in batch)
    mark("batch")
    with SavedTensors(work) as saved:
        loss = loss_fn(work(inputs), targets)
    mark("forward")
    loss.backward()
    del loss
    mark("backward")
    grads = storage_bytes(p.grad for p in work.parameters())
    if mixed_dtype is not None:
        # fp32 copies of the 16-bit grads for the step (real implementations upcast bucket by bucket)
        for pm, pw in zip(master.parameters(), work.parameters()):
            pm.grad = pw.grad.float()
    mark("upcast")
    optimizer.step()
    mark("step")
    if mixed_dtype is not None:
        with torch.no_grad():
            for pm, pw in zip(master.parameters(), work.parameters()):
                pm.grad = None
                pw.copy_(pm)                # the updated master weights, rounded to 16 bits
    mark("end")
    state = [t for s in optimizer.state.values() for t in s.values()]
    masters = storage_bytes(master.parameters()) if mixed_dtype is not None else 0
    return StepMemory(params=storage_bytes(work.parameters()), grads=grads,
                      optimizer_states=storage_bytes(state) + masters, activations=saved.nbytes,
                      master_weights=masters)


def measure_step(model: nn.Module, batch: Sequence[torch.Tensor], loss_fn: LossFn,
                 make_optimizer: OptimizerFactory = torch.optim.Adam, *,
                 mixed_dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                 by: str = "tensors", mark: Callable[[str], None] | None = None) -> StepMemory:
    """Run one step, ``loss_fn(model(inputs), targets)``, backward, ``optimizer.step()``; return its bytes.

    ``batch`` is ``(inputs, targets)``; the step runs on a deep copy, leaving ``model`` untouched.
    ``make_optimizer(params)`` builds the optimizer. With ``mixed_dtype=torch.bfloat16`` (or
    float16) a 16-bit copy of the model does forward and backward, and the optimizer steps fp32
    master weights, which count as optimizer state (ZeRO's K = 12 for Adam). ``by="tensors"``
    counts the tensors' bytes, and calls ``mark(phase)`` as each phase of ``PHASES`` ends (under
    ``HeldBytes``, to cut its trace); ``by="allocator"`` (CUDA) reads ``memory_allocated`` deltas. Those also
    hold what the forward keeps that autograd does not save: ``F.mse_loss``'s 0-dim loss keeps a storage the
    size of its inputs until it is freed after backward.
    """
    device = torch.device(device)
    if by not in ("tensors", "allocator"):
        raise ValueError(f"measure_step: by must be 'tensors' or 'allocator', got {by!r}.")
    if by == "allocator" and device.type != "cuda":
        raise ValueError("measure_step: by='allocator' reads torch.cuda.memory_allocated, so it needs "
                         "device='cuda'; on CPU use by='tensors'.")
    if by == "tensors":
        return _run_step(model, batch, loss_fn, make_optimizer, mixed_dtype, device, mark or (lambda _: None))
    # A throwaway step first: the CUDA context, cuBLAS workspaces (one per stream, and
    # backward runs on its own thread) and allocator pools would otherwise show in the deltas.
    _run_step(model, batch, loss_fn, make_optimizer, mixed_dtype, device, lambda _: None)
    at = {"start": torch.cuda.memory_allocated(device)}
    _run_step(model, batch, loss_fn, make_optimizer, mixed_dtype, device,
              lambda phase: at.__setitem__(phase, torch.cuda.memory_allocated(device)))
    # Deltas between the marks; the batch moves inside the forward's window, as the count includes what ops save of it.
    master = at["master"] - at["model"]
    return StepMemory(params=at["model"] - at["start"], grads=at["backward"] - at["batch"],
                      optimizer_states=at["end"] - at["backward"] + master,
                      activations=at["forward"] - at["optimizer"], master_weights=master)


# ---- Predictions -----------------------------------------------------------
def adam_model_state_bytes(n_params: int, mixed: bool = False) -> int:
    """ZeRO's (2 + 2 + K)Ψ for mixed precision, (4 + 4 + 8)Ψ for fp32: 16Ψ both ways."""
    return ((2 + 2 + 12) if mixed else (4 + 4 + 8)) * n_params


def predict_step(model: nn.Module, activations: int = 0, *, optimizer: str = "adam",
                 mixed: bool = False) -> StepMemory:
    """The model-state bytes a step holds for ``model`` under ``optimizer``, a key of ``OPTIMIZER_STATE_BYTES``.

    fp32: 4 bytes of parameter and 4 of gradient per parameter, plus the optimizer's state.
    Mixed: 2 + 2 in 16 bits, 4 of fp32 master weights, and the state (fp32: it steps the master).
    """
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"predict_step: optimizer must be one of {sorted(OPTIMIZER_STATE_BYTES)}, "
                         f"got {optimizer!r}.")
    params = {_storage_key(p): p for p in model.parameters()}.values()   # tied weights count once
    n_params, n_tensors = sum(p.numel() for p in params), len(params)
    per_param, per_tensor = OPTIMIZER_STATE_BYTES[optimizer]
    width, master = (2, 4 * n_params) if mixed else (4, 0)
    return StepMemory(params=width * n_params, grads=width * n_params,
                      optimizer_states=master + per_param * n_params + per_tensor * n_tensors,
                      activations=activations, master_weights=master)


def predict_adam_step(model: nn.Module, activations: int = 0, *, mixed: bool = False) -> StepMemory:
    """The model-state bytes an Adam step must hold for ``model``, from the table above."""
    return predict_step(model, activations, optimizer="adam", mixed=mixed)


def mlp_activation_bytes(sizes: Sequence[int], batch_size: int, loss: str = "mse",
                         dtype: torch.dtype = torch.float32) -> int:
    """Exact saved bytes for ``models.MLP(sizes)`` on a batch of ``batch_size``.

    The first Linear saves its input x (for its weight's gradient). Each ReLU
    saves its output, which the next Linear saves too (one storage). MSE saves
    the output and the target; cross-entropy saves log-probabilities, the int64
    labels and a 0-dim total weight.
    """
    B, e = batch_size, dtype.itemsize
    hidden = B * e * sum(sizes[:-1])               # x and every ReLU output
    if loss == "mse":
        return hidden + 2 * B * sizes[-1] * e
    if loss == "cross_entropy":
        return hidden + B * sizes[-1] * e + 8 * B + e
    raise ValueError(f"mlp_activation_bytes: loss must be 'mse' or 'cross_entropy', got {loss!r}.")


def gpt_layer_activation_bytes(config: GPTConfig, batch_size: int, seq_len: int,
                               dtype: torch.dtype = torch.float32) -> int:
    """Saved bytes of one ``models.Block`` (dropout 0), derived op by op.

    With s = seq_len, b = batch_size, h = d_model, a = n_head and e bytes per element:

    * ln_1 and ln_2 save their input (sbh each) and a mean and 1/std per token (2sb each);
    * c_attn saves ln_1's output (sbh); q @ k^T saves q and k, and att @ v saves v,
      as contiguous copies (3sbh) that matmul makes of the transposed head views;
    * softmax saves its output (a s^2 b), which att @ v saves again (same storage);
    * c_proj saves the re-joined heads (sbh); c_fc saves ln_2's output (sbh);
    * GELU saves its input (4sbh) and the MLP's second Linear saves GELU's output (4sbh).

    Total: e * (16 sbh + a s^2 b + 4 sb) = sbh(64 + 4as/h) + 16sb bytes in fp32.
    """
    if config.dropout:
        raise ValueError("gpt_layer_activation_bytes is derived for dropout=0; dropout also saves "
                         "masks. Use a GPTConfig with dropout=0.0.")
    s, b, h, a, e = seq_len, batch_size, config.d_model, config.n_head, dtype.itemsize
    return e * (16 * s * b * h + a * s * s * b + 4 * s * b)


def gpt_activation_bytes(config: GPTConfig, batch_size: int, seq_len: int | None = None,
                         dtype: torch.dtype = torch.float32) -> int:
    """Exact saved bytes for a ``models.GPT`` forward plus ``lm_loss``: layers, embeddings and head.

    Outside the layers: the embeddings save the int64 token ids (8sb) and positions
    (8s); ln_f saves sbh + 2sb; lm_head saves ln_f's output (sbh); the loss saves
    log-probabilities (sbV), the int64 targets (8sb) and a 0-dim total weight.
    """
    s = config.block_size if seq_len is None else seq_len
    b, h, V, e = batch_size, config.d_model, config.vocab_size, dtype.itemsize
    layers = config.n_layer * gpt_layer_activation_bytes(config, b, s, dtype)
    outside = 8 * s * b + 8 * s + e * (2 * s * b * h + 2 * s * b + s * b * V) + 8 * s * b + e
    return layers + outside


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int) -> float:
    """Korthikanti et al. 2022 (arXiv 2205.05198): sbh(34 + 5as/h) bytes per transformer layer.

    Their layer is 16-bit with dropout. Dropping its three dropout masks (sbh +
    sbh + as^2b) and the dropped-out attention copy (2as^2b) leaves sbh(32 + 2as/h);
    fp32 doubles that to sbh(64 + 4as/h), our layer's count apart from the LayerNorm
    statistics (16sb), which the paper neglects.
    """
    return s * b * h * (34 + 5 * a * s / h)


# ---- Every storage alive, op by op -----------------------------------------
def new_storages(inputs: object, out: object, known: Container[int]) -> list[torch.UntypedStorage]:
    """The storages an op allocated: those its outputs hold that none of its ``inputs`` held (a view or an
    in-place op returns an input's storage) and whose ``id`` is not in ``known``; empty ones left out."""
    held = {t.untyped_storage().data_ptr() for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)}
    found = []
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            if storage.data_ptr() not in held and id(storage) not in known and storage.nbytes() > 0:
                found.append(storage)
    return found


class HeldBytes(TorchDispatchMode):
    """Within ``with HeldBytes() as held:``, the bytes of the storages that ops allocated and that are alive.

    ``held.now`` is the current total, ``held.peak`` its largest value, ``held.trace`` the
    total after every op, in order, and ``held.mark()`` the trace's length so far (to find
    the end of the forward in it later).
    """

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        self.trace: list[int] = []
        self._live: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for storage in new_storages((args, kwargs), out, self._live):
            self._live[id(storage)] = weakref.ref(storage, self._on_free(id(storage), storage.nbytes()))
            self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        self.trace.append(self.now)
        return out

    def _on_free(self, key: int, nbytes: int) -> Callable[[Any], None]:
        def freed(_: Any) -> None:
            self._live.pop(key, None)
            self.now -= nbytes
        return freed

    def mark(self) -> int:
        return len(self.trace)
