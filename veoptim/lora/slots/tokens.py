"""Per-token passes over a :class:`SlotTrainer`: explicit targets, a caller's loss.

``SlotTrainer.forward_backward`` trains the token mean of next-token cross-entropy over
``labels``. A training service needs the other convention of hosted LoRA APIs: each
position ``t`` of a row names its own target token (``target_tokens[t]``, predicted from
``input_ids[: t + 1]``), the log-probability of every target is returned, and the loss is
whatever the caller computes from them (cross-entropy with per-token weights, or the RL
losses), its gradient accumulated as a *sum* that the next step applies unscaled.

Both calls hold the trainer's lock, route rows to their slots like ``forward_backward``
and check every slot exists before the first change. Under ``torchrun`` every rank calls
them together, each with its own rows (at least one: the sharded model's collectives
need every rank); the slots present on any rank are checked, and take the gradients, on
all of them.

``sample_tokens`` generates from the slots (or the base alone) with a KV cache, every
row through its own slot's adapter: what a sampler of the service runs.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any

import torch

from veoptim.data.fields import ATTENTION_MASK, INPUT_IDS
from veoptim.errors import DataError, SlotError
from veoptim.lora.slots.routing import slot_layers
from veoptim.lora.slots.trainer import SLOT_IDS, SlotTrainer

TARGET_TOKENS = "target_tokens"
#: loss(logprobs [rows, T] FP32, batch) -> per-row loss [rows] (differentiable).
TokenLoss = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class TokenPass:
    """One pass: every target's log-probability and each row's loss (CPU, detached)."""

    logprobs: torch.Tensor
    row_losses: torch.Tensor


def forward_tokens(
    trainer: SlotTrainer,
    batch: dict[str, torch.Tensor],
    loss_fn: TokenLoss | None = None,
    *,
    backward: bool = False,
    train_slots: Collection[int] | None = None,
) -> TokenPass:
    """Forward (and with ``backward`` a backward of the summed ``loss_fn``) over a batch of
    ``input_ids``, ``target_tokens`` (same shape), optional ``attention_mask`` and
    ``slot_ids``. With ``backward`` the gradient of the loss sum accumulates into each slot
    present, and that slot's next ``optim_step`` applies it unscaled (do not mix with
    ``SlotTrainer.forward_backward``'s token mean before that step). ``train_slots``: only
    these slots train; the rows of the others are a forward only (their losses are not
    back-propagated, their slots' gradients stay exactly as they were)."""
    if backward and loss_fn is None:
        raise ValueError("a backward pass needs a loss_fn")
    with trainer._lock:
        if INPUT_IDS not in batch or TARGET_TOKENS not in batch or SLOT_IDS not in batch:
            raise DataError(
                f"a token batch needs {INPUT_IDS!r}, {TARGET_TOKENS!r} and {SLOT_IDS!r}; "
                f"got {sorted(batch)}."
            )
        inputs, targets = batch[INPUT_IDS], batch[TARGET_TOKENS]
        if targets.shape != inputs.shape:
            raise DataError(
                f"{TARGET_TOKENS!r} must have the shape of {INPUT_IDS!r} "
                f"{tuple(inputs.shape)}; got {tuple(targets.shape)}."
            )
        slot_ids = trainer._slot_ids({**batch, "labels": targets})
        present = trainer._present(slot_ids)
        for s in present:
            trainer._slot(s)
        device = trainer.ctx.device
        model_inputs = {INPUT_IDS: inputs.to(device)}
        if ATTENTION_MASK in batch:
            model_inputs[ATTENTION_MASK] = batch[ATTENTION_MASK].to(device)
        trainer.router.route(slot_ids.to(device), present)
        try:
            with torch.set_grad_enabled(backward):
                logits = trainer.model(**model_inputs, use_cache=False).logits.float()
                logprobs = logits.log_softmax(-1).gather(-1, targets.to(device).unsqueeze(-1))
                logprobs = logprobs.squeeze(-1)
                moved = {k: v.to(device) for k, v in batch.items()}
                row_losses = (
                    loss_fn(logprobs, moved)
                    if loss_fn is not None
                    else torch.zeros(len(slot_ids), device=device)
                )
                if backward:
                    _backward(trainer, row_losses, slot_ids.to(device), present, train_slots)
        finally:
            trainer.router.clear()
            if not backward:
                trainer.plan.reshard(trainer.model)
        if backward:
            for s in present:
                if train_slots is None or s in train_slots:
                    trainer.slots[s].optimizer.pending_tokens = 1.0
        return TokenPass(logprobs.detach().cpu(), row_losses.detach().cpu())


def _backward(trainer: SlotTrainer, row_losses: torch.Tensor, slot_ids: torch.Tensor,
              present: list[int], train_slots: Collection[int] | None) -> None:  # fmt: skip
    """Back-propagate the loss of the training rows; the gradients of the slots that only
    run forward are set aside meanwhile and put back untouched."""
    if train_slots is None:
        row_losses.sum().backward()
        return
    trains = torch.tensor(
        [int(s) in train_slots for s in slot_ids.tolist()], device=row_losses.device
    )
    kept = [
        (p, p.grad)
        for s in present
        if s not in train_slots
        for p in trainer.slots[s].params.parameters()
    ]
    for p, _ in kept:
        p.grad = None
    try:
        row_losses[trains].sum().backward()
    finally:
        for p, grad in kept:
            p.grad = grad


def optim_step_clipped(
    trainer: SlotTrainer, slot: int, grad_clip: float, **adam_params: Any
) -> dict[str, float]:
    """``SlotTrainer.optim_step`` with this call's gradient-norm clip (0 = none) instead of
    ``train.grad_clip``."""
    if grad_clip < 0:
        raise SlotError(slot, f"grad_clip must be >= 0 (0 = no clipping), got {grad_clip}.")
    with trainer._lock:
        train = trainer.cfg.train
        configured = train.grad_clip
        train.grad_clip = grad_clip
        try:
            return trainer.optim_step(slot, **adam_params)
        finally:
            train.grad_clip = configured


@dataclass
class SampleRow:
    """One sequence to generate: its prompt, the slot whose adapter it uses (None: the
    base alone) and its sampling parameters."""

    prompt: list[int]
    slot: int | None
    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1  # <= 0: no limit
    top_p: float = 1.0
    generator: torch.Generator | None = None
    stop_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    prompt_logprobs: bool = False


@dataclass
class SampledRow:
    tokens: list[int]
    #: log-probability of each sampled token under the model (the logits' log_softmax,
    #: before temperature, top_k and top_p).
    logprobs: list[float]
    #: True: a stop token or string ended it; False: max_tokens did.
    stopped: bool
    #: [len(prompt)] float32, NaN at position 0 (with SampleRow.prompt_logprobs).
    prompt_logprobs: torch.Tensor | None = None


def sample_tokens(
    trainer: SlotTrainer, rows: list[SampleRow], pad_with: SampleRow | None = None
) -> list[SampledRow]:
    """Generate every row at once with a KV cache (the model's ``past_key_values``):
    prompts left-padded to the longest, each row through its slot's adapter (rows of
    ``slot=None`` through the base alone; a batch is all one or all the other), one
    token per row per step until each row stops. ``temperature == 0`` is greedy
    (argmax); otherwise each row draws from its own ``generator``. No gradients, no
    change to any slot.

    Under ``torchrun`` every rank calls it with its own rows (of one kind: slot or base)
    and steps until the rows of every rank stop; a rank without rows runs ``pad_with``
    (a row of the same kind) and returns nothing."""
    with trainer._lock:
        world = trainer.ctx.world_size
        real = len(rows)
        if not rows:
            if world == 1 or pad_with is None:
                return []
            rows = [replace(pad_with, max_tokens=0, prompt_logprobs=False)]
        slots = [r.slot for r in rows]
        base = all(s is None for s in slots)
        if not base and any(s is None for s in slots):
            raise DataError("a sampling batch is either all base-model rows or all slot rows.")
        present = [] if base else trainer._present(torch.tensor(slots))
        for s in present:
            trainer._slot(s)
        device = trainer.ctx.device
        n, length = len(rows), max(len(r.prompt) for r in rows)
        ids = torch.zeros(n, length, dtype=torch.long)
        mask = torch.zeros(n, length, dtype=torch.long)
        for i, r in enumerate(rows):
            if r.prompt:
                ids[i, length - len(r.prompt) :] = torch.tensor(r.prompt)
                mask[i, length - len(r.prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        layers = slot_layers(trainer.model)
        if base:
            for layer in layers.values():
                layer.router = None
        else:
            trainer.router.route(torch.tensor(slots), present)
        out = [SampledRow([], [], False) for _ in rows]
        try:
            with torch.no_grad():
                result = trainer.model(input_ids=ids.to(device), attention_mask=mask.to(device),
                                       position_ids=positions.to(device), use_cache=True)  # fmt: skip
                logits = result.logits.float()
                for i, r in enumerate(rows):
                    if r.prompt_logprobs:
                        k = len(r.prompt)
                        lp = torch.full((k,), float("nan"))
                        if k > 1:
                            row = logits[i, length - k : length - 1].log_softmax(-1)
                            target = ids[i, length - k + 1 :].to(device).unsqueeze(-1)
                            lp[1:] = row.gather(-1, target).squeeze(-1).cpu()
                        out[i].prompt_logprobs = lp
                cache, last = result.past_key_values, logits[:, -1]
                done = [r.max_tokens <= 0 for r in rows]
                next_pos = positions[:, -1:] + 1
                finished = _all_done(trainer, done)
                while not finished:
                    chosen = torch.zeros(n, 1, dtype=torch.long)
                    logp_all = last.log_softmax(-1).cpu()
                    for i, r in enumerate(rows):
                        if done[i]:
                            continue
                        token = _pick(last[i], r)
                        chosen[i, 0] = token
                        out[i].tokens.append(token)
                        out[i].logprobs.append(float(logp_all[i, token]))
                        if token in r.stop_ids or (
                            r.stop_strings
                            and any(
                                s in trainer.tokenizer.decode(out[i].tokens) for s in r.stop_strings
                            )
                        ):
                            done[i] = out[i].stopped = True
                        elif len(out[i].tokens) >= r.max_tokens:
                            done[i] = True
                    finished = _all_done(trainer, done)
                    if finished:
                        break
                    mask = torch.cat([mask, torch.ones(n, 1, dtype=torch.long)], dim=1)
                    result = trainer.model(input_ids=chosen.to(device), attention_mask=mask.to(device),
                                           position_ids=next_pos.to(device), past_key_values=cache,
                                           use_cache=True)  # fmt: skip
                    cache, last = result.past_key_values, result.logits[:, -1].float()
                    next_pos = next_pos + 1
        finally:
            if base:
                for layer in layers.values():
                    layer.router = trainer.router
            trainer.router.clear()
            trainer.plan.reshard(trainer.model)
        return out[:real]


def _all_done(trainer: SlotTrainer, done: list[bool]) -> bool:
    """Every row of every rank stopped (collective under torchrun: one small sum)."""
    left = torch.tensor([float(sum(not d for d in done))])
    if trainer.ctx.world_size > 1:
        left = trainer.plan.all_reduce_sum(left.to(trainer.ctx.device)).cpu()
    return bool(left.item() == 0)


def _pick(logits: torch.Tensor, row: SampleRow) -> int:
    """The next token of one row: argmax at temperature 0, else a draw from the
    temperature-scaled distribution cut to ``top_k`` and the ``top_p`` nucleus."""
    if row.temperature == 0:
        return int(torch.argmax(logits))
    scaled = (logits / row.temperature).cpu()
    if 0 < row.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, row.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if row.top_p < 1.0:
        order = torch.argsort(scaled, descending=True)
        probs = torch.softmax(scaled[order], dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above
        drop = order[before >= row.top_p]
        drop = drop[drop != order[0]]  # the most likely token always stays
        scaled = scaled.index_fill(0, drop, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=row.generator))
