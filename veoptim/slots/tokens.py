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

import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from veoptim.data.fields import ATTENTION_MASK, INPUT_IDS
from veoptim.errors import DataError, SlotError
from veoptim.slots.routing import slot_layers
from veoptim.slots.trainer import SLOT_IDS, SlotTrainer

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
    with trainer.lock:
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
        slot_ids = trainer.batch_slot_ids({**batch, "labels": targets})
        present = trainer.present_slots(slot_ids)
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
                    trainer.apply_unscaled(s)
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
        (p, p.grad) for s in present if s not in train_slots for p in trainer.slot_parameters(s)
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
    with trainer.lock:
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
    trainer: SlotTrainer,
    rows: list[SampleRow],
    pad_with: SampleRow | None = None,
    *,
    share_prefill: bool = True,
    compact: bool = True,
) -> list[SampledRow]:
    """Generate every row at once with a KV cache: a :class:`Generation` run to its end."""
    generation = Generation(trainer, rows, pad_with, share_prefill=share_prefill, compact=compact)
    generation.advance()
    return generation.results()


class Generation:
    """A sampling batch in progress: every row at once with a KV cache (the model's
    ``past_key_values``), prompts left-padded to the longest, each row through its slot's
    adapter (rows of ``slot=None`` through the base alone; a batch is all one or all the
    other), one token per row per step until each row stops. ``temperature == 0`` is
    greedy (argmax); otherwise each row draws from its own ``generator``. No gradients, no
    change to any slot.

    Built, it has prefilled its prompts; :meth:`advance` decodes a number of steps at a
    time, so that other passes over the trainer (training another slot) may run between
    its steps without changing what it computes: each call takes the trainer's lock, routes
    its rows again, and checks that its slots are the very ones it started with (a slot
    released or replaced meanwhile fails it instead of sampling from another adapter).

    ``share_prefill``: rows with the same prompt and slot (the samples of one request)
    prefill that prompt once, and each row then decodes from its own copy of its KV cache.
    ``compact``: once at most half of the batch's rows are still generating, the stopped
    rows leave the batch (their cache too), so a step computes only the rows that need it.
    Neither changes what a row computes, only the batch it computes in.

    Under ``torchrun`` every rank builds it with its own rows (of one kind: slot or base)
    and advances it by the same steps until the rows of every rank stop; a rank without
    rows runs ``pad_with`` (a row of the same kind) and returns nothing."""

    def __init__(self, trainer: SlotTrainer, rows: list[SampleRow],
                 pad_with: SampleRow | None = None, *, share_prefill: bool = True,
                 compact: bool = True) -> None:  # fmt: skip
        self.trainer, self.compact = trainer, compact
        self.real = len(rows)
        if not rows and trainer.ctx.world_size > 1 and pad_with is not None:
            rows = [replace(pad_with, max_tokens=0, prompt_logprobs=False)]
        self.rows = rows
        self.out = [SampledRow([], [], False) for _ in rows]
        #: Every row of every rank stopped (or there is nothing to generate).
        self.finished = not rows
        if not rows:
            return
        self.slots = [r.slot for r in rows]
        self.base = all(s is None for s in self.slots)
        if not self.base and any(s is None for s in self.slots):
            raise DataError("a sampling batch is either all base-model rows or all slot rows.")
        with trainer.lock:
            self.present = [] if self.base else trainer.present_slots(torch.tensor(self.slots))
            #: The slot states it samples from: the same objects at every step.
            self.states = {s: trainer.slots[s] for s in self.present}
            device = trainer.ctx.device
            firsts, owner = _prefills(rows, share_prefill)
            ids, mask, positions = _left_padded([rows[i].prompt for i in firsts])
            with self._routed(firsts):
                result = trainer.model(input_ids=ids.to(device), attention_mask=mask.to(device),
                                       position_ids=positions.to(device), use_cache=True)  # fmt: skip
                logits = result.logits.float()
                _prompt_logprobs(rows, owner, self.out, logits, ids)
                self.cache, self.mask = result.past_key_values, mask.to(device)
                self.next_pos = positions[:, -1:].to(device) + 1
                if len(firsts) < len(rows):  # every row its own copy of its prompt's cache
                    index = torch.tensor(owner, device=device)
                    self.cache.batch_select_indices(index)
                    self.mask, self.next_pos = self.mask[index], self.next_pos[index]
                    self.last = logits[index, -1]
                else:
                    self.last = logits[:, -1]
                del result, logits
            #: The rows in the batch, in its order.
            self.batch = list(range(len(rows)))
            self.done = [r.max_tokens <= 0 for r in rows]
            self.finished, _ = _all_done(trainer, self.done)

    def advance(self, steps: int | None = None, seconds: float | None = None) -> bool:
        """Decode at most ``steps`` more tokens per row (None: no limit), and stop after the
        step during which ``seconds`` passed on rank 0's clock (None: no limit); whether
        every row of every rank has stopped. Collective under ``torchrun``: every rank calls
        it with the same arguments, and rank 0's "time is up" travels in the per-step sum
        that tells every rank whether all rows stopped, so all ranks stop at the same step."""
        began = time.perf_counter()
        trainer, rows, done = self.trainer, self.rows, self.done
        taken = 0
        if self.finished or steps == 0:
            return self.finished
        with trainer.lock, self._routed(self.batch):
            while steps is None or taken < steps:
                chosen, logprobs = _next_tokens(self.last, [rows[i] for i in self.batch],
                                                [done[i] for i in self.batch])  # fmt: skip
                for k, i in enumerate(self.batch):
                    if not done[i]:
                        _append(trainer, rows[i], self.out[i], chosen[k], logprobs[k], done, i)
                late = seconds is not None and time.perf_counter() - began >= seconds
                self.finished, late = _all_done(trainer, done, late and trainer.ctx.rank == 0)
                if self.finished:
                    break
                step = torch.tensor(chosen, device=trainer.ctx.device).unsqueeze(-1)
                keep = _kept(self.batch, done) if self.compact else None
                if keep is not None:
                    index = torch.tensor(keep, device=trainer.ctx.device)
                    self.cache.batch_select_indices(index)
                    self.mask, self.next_pos = self.mask[index], self.next_pos[index]
                    step = step[index]
                    self.batch = [self.batch[k] for k in keep]
                    if not self.base:
                        trainer.router.route(torch.tensor([self.slots[i] for i in self.batch]),
                                             self.present)  # fmt: skip
                self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.batch), 1)], dim=1)
                result = trainer.model(input_ids=step, attention_mask=self.mask,
                                       position_ids=self.next_pos, past_key_values=self.cache,
                                       use_cache=True)  # fmt: skip
                self.cache, self.last = result.past_key_values, result.logits[:, -1].float()
                self.next_pos = self.next_pos + 1
                taken += 1
                if late:
                    break
        if self.finished:
            self.cache = self.last = None  # type: ignore[assignment]
        return self.finished

    def results(self) -> list[SampledRow]:
        """This rank's rows (not ``pad_with``), once :meth:`advance` says finished."""
        if not self.finished:
            raise RuntimeError("the generation has not finished; advance it first.")
        return self.out[: self.real]

    @contextmanager
    def _routed(self, batch: list[int]) -> Iterator[None]:
        """Under the trainer's lock: the batch's rows routed to their slots (one stack of
        the slots' weights for every step), or every layer on the base alone; undone on
        exit, so that the trainer is as any other pass expects it."""
        trainer = self.trainer
        for s, state in self.states.items():
            if trainer.slots.get(s) is not state:
                raise SlotError(s, "was released or replaced while a generation sampled from it.")
        layers = slot_layers(trainer.model)
        if self.base:
            for layer in layers.values():
                layer.router = None
        try:
            with torch.no_grad():
                if not self.base:
                    trainer.router.route(torch.tensor([self.slots[i] for i in batch]), self.present)
                    trainer.router.hold_weights()
                yield
        finally:
            if self.base:
                for layer in layers.values():
                    layer.router = trainer.router
            trainer.router.clear()
            trainer.plan.reshard(trainer.model)


def _prefills(rows: list[SampleRow], share: bool) -> tuple[list[int], list[int]]:
    """The rows whose prompts are prefilled (with ``share``, the first row of each prompt
    and slot) and, for every row, the index of its prefill among them."""
    if not share:
        return list(range(len(rows))), list(range(len(rows)))
    firsts: list[int] = []
    seen: dict[tuple[tuple[int, ...], int | None], int] = {}
    owner = []
    for i, r in enumerate(rows):
        key = (tuple(r.prompt), r.slot)
        if key not in seen:
            seen[key] = len(firsts)
            firsts.append(i)
        owner.append(seen[key])
    return firsts, owner


def _left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input ids, attention mask and position ids of prompts left-padded to the longest."""
    n, length = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(n, length, dtype=torch.long)
    mask = torch.zeros(n, length, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        if prompt:
            ids[i, length - len(prompt) :] = torch.tensor(prompt)
            mask[i, length - len(prompt) :] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _prompt_logprobs(rows: list[SampleRow], owner: list[int], out: list[SampledRow],
                     logits: torch.Tensor, ids: torch.Tensor) -> None:  # fmt: skip
    """Each asking row's prompt log-probabilities, from its prefill's logits."""
    length = ids.shape[1]
    for i, r in enumerate(rows):
        if not r.prompt_logprobs:
            continue
        u, k = owner[i], len(r.prompt)
        lp = torch.full((k,), float("nan"))
        if k > 1:
            row = logits[u, length - k : length - 1].log_softmax(-1)
            target = ids[u, length - k + 1 :].to(logits.device).unsqueeze(-1)
            lp[1:] = row.gather(-1, target).squeeze(-1).cpu()
        out[i].prompt_logprobs = lp


def _next_tokens(last: torch.Tensor, rows: list[SampleRow], done: list[bool],
                 ) -> tuple[list[int], list[float]]:  # fmt: skip
    """Each row's next token (0 for a row that stopped) and its log-probability under the
    model: the greedy rows' argmax in one call, the others drawn one by one from their own
    generators, the log-probabilities gathered in one call (one copy to the host each)."""
    chosen = [0] * len(rows)
    greedy = [k for k, r in enumerate(rows) if not done[k] and r.temperature == 0]
    if greedy:
        picked = last[torch.tensor(greedy, device=last.device)].argmax(-1).tolist()
        for k, token in zip(greedy, picked, strict=True):
            chosen[k] = token
    drawn = [k for k, r in enumerate(rows) if not done[k] and r.temperature != 0]
    if drawn:  # each row scaled on its device as alone, then one copy to the host
        scaled = torch.stack([last[k] / rows[k].temperature for k in drawn]).cpu()
        for k, row in zip(drawn, scaled, strict=True):
            chosen[k] = _pick(row, rows[k])
    index = torch.tensor(chosen, device=last.device).unsqueeze(-1)
    return chosen, last.log_softmax(-1).gather(-1, index).squeeze(-1).tolist()


def _append(trainer: SlotTrainer, row: SampleRow, out: SampledRow, token: int, logprob: float,
            done: list[bool], i: int) -> None:  # fmt: skip
    """Add a row's token; mark the row done at a stop token, a stop string or its
    ``max_tokens``."""
    out.tokens.append(token)
    out.logprobs.append(logprob)
    if token in row.stop_ids or (
        row.stop_strings
        and any(s in trainer.tokenizer.decode(out.tokens) for s in row.stop_strings)
    ):
        done[i] = out.stopped = True
    elif len(out.tokens) >= row.max_tokens:
        done[i] = True


def _kept(batch: list[int], done: list[bool]) -> list[int] | None:
    """The batch positions to keep once at most half of the batch is generating (at least
    one: under torchrun a rank whose rows stopped steps on with the others); else None."""
    live = [k for k, i in enumerate(batch) if not done[i]]
    if len(batch) == 1 or 2 * len(live) > len(batch):
        return None
    return live or [0]


def _all_done(trainer: SlotTrainer, done: list[bool], stop: bool = False) -> tuple[bool, bool]:
    """Whether every row of every rank stopped, and whether any rank asked to ``stop``
    (collective under torchrun: one small sum)."""
    left = torch.tensor([float(sum(not d for d in done)), float(stop)])
    if trainer.ctx.world_size > 1:
        left = trainer.plan.all_reduce_sum(left.to(trainer.ctx.device)).cpu()
    return bool(left[0].item() == 0), bool(left[1].item() > 0)


def _pick(scaled: torch.Tensor, row: SampleRow) -> int:
    """The next token of one row at a temperature above 0: a draw from its
    temperature-scaled logits (on the host), cut to ``top_k`` and the ``top_p`` nucleus."""
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
