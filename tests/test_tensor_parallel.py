"""Tensor and sequence parallelism: parity with one process at t = 1, 2, 3, 4, with and without sequence
parallelism; against PyTorch's DTensor plan (ColwiseParallel, RowwiseParallel, SequenceParallel,
loss_parallel) at t = 2; the bytes each layer sends against the formula; the errors.

Every case of one world size runs inside one launch, so the file stays fast on 2 cores.
"""

import functools

import pytest
import torch
import torch.nn as nn

from dtcourse import RankError, launch
from dtcourse.models import GPT, GPTConfig, lm_loss, token_batch
from dtcourse.parity import DTensorPlan, Tolerance, check_parity, whole_batch
from dtcourse.lab.tensor_parallel import Traffic, step_traffic
from dtcourse.tensor_parallel import ColumnParallelLinear, TensorParallel, check_divides

# d_model 48, 6 heads, vocabulary 48, 4 d_model = 192, sequence 12: every size divides by 1, 2, 3 and 4
# except the heads at t = 4, so t = 4 uses CFG4.
CFG = GPTConfig(vocab_size=48, block_size=12, n_layer=2, n_head=6, d_model=48)
CFG4 = GPTConfig(vocab_size=48, block_size=12, n_layer=2, n_head=4, d_model=48)
B, STEPS, LR = 4, 3, 1e-3
adamw = functools.partial(torch.optim.AdamW, lr=LR)
# float32; `pytest -s` prints the largest differences measured.
ONE_PROCESS = Tolerance(1e-5, 0, (
    "the row layers' all-reduce sums t partial matmuls that one process sums in one, and the vocab-parallel "
    "loss takes its max, sum of exponentials and target logit in another order than F.cross_entropy: "
    "outputs and gradients differ by a few ulps (below 1e-6 measured). AdamW's first step is "
    "lr * g / (|g| + eps) with eps = 1e-8, so where a gradient is ~eps (4e-8 in c_fc) a 1e-9 difference "
    "moves that parameter by ~5e-6 (6.3e-6 at most measured, t = 3 with SP)"))
TORCH = Tolerance(1e-5, 0, (
    "DTensor's plan runs the same shards' matmuls; its all-reduces and loss_parallel's reductions may add in "
    "another order: a few ulps, amplified by AdamW's first step as above"))


def _batches(cfg):
    return [token_batch(cfg, B, seed=s) for s in range(STEPS)]


def _tp(sp):
    return lambda model, group: TensorParallel(model, group, adamw, sequence_parallel=sp)


def _traffic(cfg, sp, **kwargs):
    """Every collective of STEPS training steps, as the observer records them (dtcourse.runtime.observe)."""
    tp, log = TensorParallel(GPT(cfg, seed=0), None, adamw, sequence_parallel=sp, **kwargs), Traffic()
    for x, y in _batches(cfg):
        log += step_traffic(tp, x, y)
        tp.step()
        tp.zero_grad()
    return log


def _parity_cases(cfg):
    """Both layouts side by side against one process; then each one's traffic."""
    report = check_parity(lambda: GPT(cfg, seed=0), {"TP": _tp(False), "TP+SP": _tp(True)},
                          _batches(cfg), lm_loss, adamw, tolerance=ONE_PROCESS, split=whole_batch)
    return report, {sp: _traffic(cfg, sp) for sp in (False, True)}


@pytest.mark.parametrize("t", [1, 2, 3, 4])
def test_matches_one_process(t):
    cfg = CFG4 if t == 4 else CFG
    report, logs = launch(_parity_cases, t, cfg, timeout=120)[0]    # check_parity raised in the ranks if not
    assert report.steps == STEPS
    if t > 1:
        assert report.worst("ranks") == 0.0                          # every rank holds the same full tensors
    print(f"t={t}: vs one process", report)


CFG_DROP = GPTConfig(vocab_size=48, block_size=12, n_layer=2, n_head=6, d_model=48, dropout=0.2)


def _reseeded():
    """The GPT, reseeded before each forward: the one process and every rank draw each step's masks alike."""
    model = GPT(CFG_DROP, seed=0)

    def reseed(module, args):
        torch.manual_seed(1000 + module.forwards)
        module.forwards += 1

    model.forwards = 0
    model.register_forward_pre_hook(reseed)          # deep-copied with the model, counter and all
    return model


# SGD here, not AdamW: parameters move by lr * g, so gradient ulps stay ulps. AdamW's first step amplifies them
# where a gradient is near its eps, and dropout's zeroed units leave more of those (1.24e-5 measured at t = 2).
sgd = functools.partial(torch.optim.SGD, lr=1e-2)


def _dropout_parity():
    tp = {sp: lambda model, group, sp=sp: TensorParallel(model, group, sgd, sequence_parallel=sp) for sp in (False, True)}
    return check_parity(_reseeded, {"TP": tp[False], "TP+SP": tp[True]}, _batches(CFG_DROP), lm_loss, sgd,
                        tolerance=ONE_PROCESS, split=whole_batch)


@pytest.mark.parametrize("t", [2, 3])
def test_dropout_masks_are_the_serial_models_under_tp_and_sp(t):
    """Attention's dropout on this rank's heads, and under SP the residual dropouts on its positions: each
    rank keeps its slice of the full mask (ShardedDropout), so training matches one process with dropout on."""
    report = launch(_dropout_parity, t, timeout=120)[0]
    assert report.steps == STEPS and report.worst("ranks") == 0.0
    print(f"t={t} with dropout 0.2: vs one process", report)


def _on_a_mesh():
    from dtcourse.mesh import ParallelDims, build_groups
    from dtcourse.tensor_parallel import parallelize
    mesh = build_groups(ParallelDims(dp=2, pp=1, tp=2))             # tp groups [0, 1] and [2, 3]
    report = check_parity(lambda: GPT(CFG, seed=0),
                          lambda model, group: TensorParallel(model, None, adamw, mesh=mesh),
                          _batches(CFG), lm_loss, adamw, tolerance=ONE_PROCESS, split=whole_batch,
                          group=mesh.group("tp"))
    logs = _traffic(CFG, False, mesh=mesh)
    try:
        parallelize(GPT(CFG, seed=0), group=torch.distributed.group.WORLD, mesh=mesh)   # not this rank's tp group
    except ValueError as err:
        error = str(err)
    return report, {r.sent for r in logs.records if r.op == "all_reduce" and r.where.startswith("blocks")}, error


def test_tensor_parallelism_on_a_mesh_uses_its_tp_group_and_refuses_another():
    out = launch(_on_a_mesh, 4, timeout=120)
    sbh = B * CFG.block_size * CFG.d_model
    for rank, (report, sent, error) in enumerate(out):
        assert report.steps == STEPS and report.worst("ranks") == 0.0
        assert sent == {sbh * 4}                                   # t = 2: 2(t-1)/t of s·b·h float32s, not 4 ranks'
        mine = [0, 1] if rank < 2 else [2, 3]
        assert error.startswith(f"group holds ranks [0, 1, 2, 3], but this rank's tensor-parallel group in the "
                                f"mesh (ParallelDims(dp=2, pp=1, tp=2, ep=1)) is {mine}: pass group=mesh.group('tp')")


def test_bytes_per_layer_match_the_formula():
    t = 2
    _, logs = launch(_parity_cases, t, CFG, timeout=120)[0]
    tp, sp = logs[False], logs[True]
    sbh, elt = B * CFG.block_size * CFG.d_model, 4          # s·b·h elements of float32
    for i in range(CFG.n_layer):
        layer = f"blocks.{i}"
        for phase in ("forward", "backward"):
            # Megatron: 2 all-reduces of s·b·h per layer forward (g after attention and after the MLP), 2 backward (f)
            assert tp.total(where=layer, phase=phase, op="all_reduce") == STEPS * 2 * sbh
            assert tp.total(where=layer, phase=phase) == STEPS * 2 * sbh
            # sequence parallelism: 2 all-gathers and 2 reduce-scatters of s·b·h per layer and direction
            assert sp.total(where=layer, phase=phase, op="all_gather") == STEPS * 2 * sbh
            assert sp.total(where=layer, phase=phase, op="reduce_scatter") == STEPS * 2 * sbh
            # ... which send the same bytes: 2 × 2(t-1)/t · s·b·h·4 per rank
            want = STEPS * 2 * 2 * (t - 1) * sbh * elt // t
            assert tp.total("sent", where=layer, phase=phase) == sp.total("sent", where=layer, phase=phase) == want
    # the embedding's g forward; the head's f backward; the loss's 3 all-reduces of one number per token
    assert tp.total(where="wte", phase="forward") == tp.total(where="lm_head", phase="backward") == STEPS * sbh
    assert tp.total(where="loss") == sp.total(where="loss") == STEPS * 3 * B * CFG.block_size
    # SP only: the LayerNorm weights and biases, row biases and wpe, all-reduced once per step
    ln = CFG.n_layer * 2 * 2 * CFG.d_model + 2 * CFG.d_model + CFG.n_layer * 2 * CFG.d_model
    assert sp.total(where="sequence_parallel_grads") == STEPS * (ln + CFG.block_size * CFG.d_model)
    assert tp.total(where="sequence_parallel_grads") == 0


# --------------------------------------------------------------------------- #
# PyTorch's own tensor parallelism as a second reference
# --------------------------------------------------------------------------- #
def _torch_cases():
    return [check_parity(lambda: GPT(CFG, seed=0), _tp(sp), _batches(CFG), lm_loss, adamw, tolerance=ONE_PROCESS,
                         reference=lambda m, g: DTensorPlan(m, g, adamw, sp), reference_tolerance=TORCH, split=whole_batch)
            for sp in (False, True)]


def test_matches_pytorch_dtensor_plan():
    reports = launch(_torch_cases, 2, timeout=120)[0]
    for report in reports:
        assert report.worst("ranks") == 0.0
    print("vs DTensor (TP, TP+SP):", *reports, sep="\n")


# --------------------------------------------------------------------------- #
# Errors
# --------------------------------------------------------------------------- #
def test_check_divides_names_the_sizes_that_fit():
    with pytest.raises(ValueError, match=r"tensor-parallel size 3 does not divide hidden size 64; use a "
                                         r"tensor-parallel size among \[1, 2, 4, 8, 16\]"):
        check_divides(3, 64, "hidden size")
    check_divides(4, 64, "hidden size")


def _bad_inputs():
    errors = []
    for make in (lambda: ColumnParallelLinear(nn.Linear(16, 64), None),                  # hidden size 64
                 lambda: TensorParallel(GPT(CFG4, seed=0), None, adamw),                 # 4 heads
                 lambda: TensorParallel(GPT(GPTConfig(vocab_size=32, n_head=3, d_model=48), seed=0), None, adamw),
                 lambda: TensorParallel(GPT(CFG, seed=0), None, adamw, sequence_parallel=True).forward_backward(
                     *token_batch(CFG, 2, seq_len=10), lm_loss)):                          # sequence 10
        try:
            make()
        except ValueError as err:
            errors.append(str(err))
        else:
            errors.append("no error")
    return errors


def test_bad_inputs_are_refused_clearly():
    errors = launch(_bad_inputs, 3, timeout=60)[0]
    assert errors[0].startswith("tensor-parallel size 3 does not divide hidden size 64; use")
    assert errors[1].startswith("tensor-parallel size 3 does not divide number of heads 4; use")
    assert errors[2].startswith("tensor-parallel size 3 does not divide vocabulary size 32; use")
    assert "sequence of length 10 over 3 ranks; use a sequence length divisible by 3" in errors[3]


def test_other_loss_is_refused():
    with pytest.raises(RankError, match="trains with lm_loss"):
        launch(lambda: TensorParallel(GPT(CFG, seed=0), None, adamw).forward_backward(
            *token_batch(CFG, 2), torch.nn.functional.mse_loss), 2, timeout=60)


# --------------------------------------------------------------------------- #
# Sequence parallelism's LayerNorm gradients, and the loss itself
# --------------------------------------------------------------------------- #
def _padded_batches(cfg):
    """The usual batches with some targets set to -100, F.cross_entropy's ignore_index (padding)."""
    out = []
    for x, y in _batches(cfg):
        y = y.clone()
        y[0, 3:] = -100                                       # a padded tail
        y[-1, 0] = -100                                       # and one position alone
        out.append((x, y))
    return out


def _padded_parity():
    return check_parity(lambda: GPT(CFG, seed=0), {"TP": _tp(False), "TP+SP": _tp(True)}, _padded_batches(CFG),
                        lm_loss, adamw, tolerance=ONE_PROCESS, split=whole_batch)


@pytest.mark.parametrize("t", [2, 3])
def test_padded_targets_are_ignored_as_f_cross_entropy_ignores_them(t):
    """Before the fix a target of -100 was an ordinary id: the loss differed from lm_loss at the first step."""
    report = launch(_padded_parity, t, timeout=120)[0]
    assert report.steps == STEPS and report.worst("ranks") == 0.0


def _per_token_losses():
    import torch.nn.functional as F
    from dtcourse.tensor_parallel import parallelize, vocab_parallel_cross_entropy, vocab_parallel_lm_loss
    x, y = _padded_batches(CFG)[0]
    serial = GPT(CFG, seed=0)(x)
    logits = parallelize(GPT(CFG, seed=0), None)(x)                           # (B, T, V/t)
    start = torch.distributed.get_rank() * logits.shape[-1]
    mine = vocab_parallel_cross_entropy(logits, y, start, None)
    theirs = F.cross_entropy(serial.flatten(0, 1), y.flatten(), reduction="none").view_as(y)
    all_ignored = vocab_parallel_lm_loss(logits, torch.full_like(y, -100), None)
    return (mine - theirs).abs().max().item(), mine[y == -100].abs().max().item(), all_ignored.isnan().item()


def test_per_token_losses_are_zero_where_ignored_and_nan_when_all_are():
    for diff, ignored, nan in launch(_per_token_losses, 2, timeout=60):
        assert ignored == 0.0 and nan                 # F.cross_entropy: 0 per ignored token, NaN mean of none
        assert diff < 1e-5                            # three reductions in another order: a few ulps of ~3.9


def _out_of_vocabulary():
    from dtcourse.tensor_parallel import parallelize, vocab_parallel_lm_loss
    x, y = token_batch(CFG, 2)
    model = parallelize(GPT(CFG, seed=0), None)
    errors = []
    for idx, targets in ((x.masked_fill(x == x[0, 0], CFG.vocab_size), y), (x, y.masked_fill(y == y[0, 0], 48)),
                         (x, y.masked_fill(y == y[0, 0], -5))):
        try:
            vocab_parallel_lm_loss(model(idx), targets, None)
        except IndexError as err:
            errors.append(str(err))
        else:
            errors.append("no error")
    return errors


def test_out_of_vocabulary_ids_raise_as_nn_embedding_and_f_cross_entropy_do():
    """Before the fix the embedding looked up zeros for id 48 and the loss accepted 48 and -5."""
    serial = GPT(CFG, seed=0)
    x, y = token_batch(CFG, 2)
    with pytest.raises(IndexError):                                    # what one process does
        serial(x.masked_fill(x == x[0, 0], CFG.vocab_size))
    with pytest.raises(IndexError):
        lm_loss(serial(x), y.masked_fill(y == y[0, 0], 48))
    for embedding, target, negative in launch(_out_of_vocabulary, 2, timeout=60):
        assert embedding.startswith("token id 48 is out of range for the embedding of vocabulary size 48: every "
                                    "token id must be in [0, 47]"), embedding
        assert target.startswith("target 48 is out of range for the loss of vocabulary size 48"), target
        assert "(or -100, the ignore_index, to leave a position out)" in target
        assert negative.startswith("target -5 is out of range"), negative


def _sp_grads_without_being_asked():
    import copy
    from dtcourse.tensor_parallel import all_reduce_sequence_parallel_grads, parallelize, vocab_parallel_lm_loss
    serial = GPT(CFG, seed=0)
    parallel = parallelize(copy.deepcopy(serial), None, sequence_parallel=True)
    batches = _batches(CFG)[:2]
    for x, y in batches:                                   # two backwards, accumulated: the gradients of both
        lm_loss(serial(x), y).backward()
        vocab_parallel_lm_loss(parallel(x), y, None).backward()     # nothing else: the model sums its SP grads
    replicated = dict(parallel.named_parameters())
    worst = max((replicated[n].grad - p.grad).abs().max().item() for n, p in serial.named_parameters()
                if getattr(replicated[n], "sequence_parallel", False))
    try:
        all_reduce_sequence_parallel_grads(parallel, None)
    except ValueError as err:
        return worst, str(err)
    return worst, "no error"


def test_a_sequence_parallel_model_sums_its_replicated_grads_after_every_backward():
    """Before the fix, a backward without all_reduce_sequence_parallel_grads left each rank its partial sums."""
    for worst, error in launch(_sp_grads_without_being_asked, 3, timeout=60):
        assert worst < 1e-5                   # t partial sums added in another order than one process adds them
        assert error.startswith("this model comes from parallelize(..., sequence_parallel=True), which already "
                                "sums"), error


def _hand_built():
    """LayerNorm, then a column and a row layer under SP, built by hand: the function sums the LayerNorm's grads."""
    import copy
    from dtcourse.tensor_parallel import RowParallelLinear, all_reduce_sequence_parallel_grads
    torch.manual_seed(0)
    ln, fc, proj = nn.LayerNorm(8), nn.Linear(8, 12), nn.Linear(12, 8)
    x = torch.randn(2, 6, 8)                                            # (B, T, C)
    proj(fc(ln(x))).square().sum().backward()
    rank, t = torch.distributed.get_rank(), torch.distributed.get_world_size()
    mine = copy.deepcopy(ln)
    for p in mine.parameters():
        p.grad, p.sequence_parallel = None, True
    model = nn.Sequential(mine, ColumnParallelLinear(fc, None, sequence_parallel=True),
                          RowParallelLinear(proj, None, sequence_parallel=True))
    out = model(x.chunk(t, dim=1)[rank])                                # (B, T/t, C)
    out.square().sum().backward()
    partial = (mine.weight.grad - ln.weight.grad).abs().max().item()
    all_reduce_sequence_parallel_grads(model, None)
    return partial, (mine.weight.grad - ln.weight.grad).abs().max().item()


def test_the_function_still_sums_the_grads_of_hand_built_layers():
    for partial, summed in launch(_hand_built, 2, timeout=60):
        assert partial > 1e-3 and summed < 1e-5


def _forgetful():
    # Megatron's easy mistake: sum the row biases' partial gradients but forget the LayerNorms'
    import importlib
    tp_module = importlib.import_module("dtcourse.tensor_parallel.parallelize")   # the package's name is the function
    chosen = tp_module.sequence_parallel_parameters
    norms = lambda model: {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
    tp_module.sequence_parallel_parameters = lambda model: [p for p in chosen(model) if id(p) not in norms(model)]
    try:                                                                # in this rank's process only
        check_parity(lambda: GPT(CFG, seed=0), _tp(True), _batches(CFG), lm_loss, adamw, tolerance=ONE_PROCESS,
                     split=whole_batch)
    except AssertionError as err:
        return str(err)
    return "no error"


def test_parity_catches_layernorm_grads_left_out_of_the_sum():
    message = launch(_forgetful, 2, timeout=60)[0]
    assert message.startswith("parity fails at step 1 of 3: gradient '") and "ln_" in message.split(" on ")[0], message
