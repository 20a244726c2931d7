"""Sampling sessions and ``asample``: a sampler samples the snapshot it names.

A sampling session (``create_sampling_session``, or the unnamed
``save_weights_for_sampler`` behind ``save_weights_and_get_sampling_client``) pins a
slot-store entry at creation: a weights-only (sampler) checkpoint or a training
checkpoint's adapter, or nothing (the base alone). ``asample`` requests run on the
worker: the snapshot is loaded (``load_slot`` without optimizer, all of its validation)
into a free slot that is then kept as a cache for that snapshot; training never writes
a sampler slot, so a later ``optim_step`` of the training slot never changes what an
earlier snapshot samples. Cached snapshot slots give way (least recently used first)
when a training model or another snapshot needs a slot, and are freed when no live
session samples them. The heads of the queue that sample (several requests, tenants
and snapshots) run as one batch of rows, a
:class:`~veoptim.slots.tokens.Generation` (a KV cache, each row through its own
slot's adapter; base-model requests batch among themselves), decoded
about ``serve.slice_s`` seconds at a time so that the worker can run other tenants'
training requests between the slices.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tinker import types

from veoptim.service import paths
from veoptim.service.db import Database
from veoptim.service.engine import Engine, Op
from veoptim.service.errors import NotFound, ServiceError
from veoptim.service.futures import queued
from veoptim.service.metrics import MetricsLog
from veoptim.service.ranks import ServedTrainer
from veoptim.service.served import ServedModel
from veoptim.service.slots import Slots
from veoptim.service.wire import encode_sample_response
from veoptim.slots import SampleRow

log = logging.getLogger("veoptim.service")
MAX_SAMPLES = 64
UNSUPPORTED = ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k")


@dataclass
class SampleRequest:
    tenant_id: int
    sampler: str
    store_ref: str | None  # None: the base model
    prompt: list[int]
    num_samples: int
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    prompt_logprobs: bool
    last_n: int | None


class SampleBatch:
    """One asample request, ready to join others in one sampling batch."""

    def __init__(self, request: SampleRequest) -> None:
        self.request = request

    @property
    def rows(self) -> int:
        return self.request.num_samples

    @property
    def base(self) -> bool:
        return self.request.store_ref is None

    def joins(self, other: Any) -> bool:
        return isinstance(other, SampleBatch) and other.base == self.base


def prompt_tokens(prompt: types.ModelInput) -> list[int]:
    """The tokens of a ``ModelInput`` (every chunk, in order; text chunks only)."""
    tokens: list[int] = []
    for j, chunk in enumerate(prompt.chunks):
        if not isinstance(chunk, types.EncodedTextChunk):
            raise ServiceError(
                f"prompt.chunks[{j}] is a {chunk.type} chunk; only encoded_text (tokens) is "
                "supported."
            )
        tokens += chunk.tokens
    return tokens


def _finite(params: types.SamplingParams, key: str) -> float:
    value = float(getattr(params, key))
    if not math.isfinite(value):
        raise ServiceError(f"sampling_params.{key} must be a finite number, got {value!r}.")
    return value


class Samplers:
    """The samplers of one server: sessions in the database, snapshot slots in
    :class:`~veoptim.service.slots.Slots`."""

    def __init__(self, trainer: ServedTrainer, database: Database, engine: Engine, slots: Slots,
                 served: ServedModel, metrics: MetricsLog, slice_s: float = 0.0,
                 ) -> None:  # fmt: skip
        self.trainer, self.db, self.engine, self.slots = trainer, database, engine, slots
        self.served, self.metrics = served, metrics
        #: About how long one slice of a sampling batch decodes (0: the whole generation).
        self.slice_s = slice_s

    # ------------------------------------------------------------------ sessions
    def create(self, tenant_id: int, session_id: str,
               request: types.CreateSamplingSessionRequest) -> str:  # fmt: skip
        """A sampling session of ``model_path`` (a tinker:// checkpoint of this tenant) or
        of the base model alone; its id."""
        self.engine.check_open()
        seq = request.sampling_session_seq_id
        if seq < 0:
            raise ServiceError(f"sampling_session_seq_id must be >= 0, got {seq}.")
        self.served.check_name(request.base_model)
        store_ref, model_path = None, request.model_path
        if model_path is not None:
            ref = paths.parse(model_path, "model_path")
            store_ref, model_path = (
                paths.find(self.db, tenant_id, ref, "model_path").store_ref,
                ref.path,
            )
        elif request.base_model is None:
            raise ServiceError("model_path or base_model is required to create a sampler.")
        sid = paths.sampler_id(session_id, seq)
        if not self.db.add_sampler(tenant_id, sid, session_id, self.served.name, model_path,
                                   store_ref):  # fmt: skip
            raise ServiceError(f"sampling_session_seq_id {seq} was already used in this session.")
        return sid

    def get(self, tenant_id: int, sid: str, field: str = "sampler") -> Any:
        found = self.db.sampler(tenant_id, sid)
        if found is None:
            raise NotFound(f"{field} {sid!r} was not found.")
        return found

    # ------------------------------------------------------------------ asample
    def submit(self, tenant_id: int, request: types.SampleRequest) -> dict[str, Any]:
        """Queue an asample request; the answer carries its samples' ids."""
        ids: list[str] = []

        def prepare() -> Op:
            op, sample_ids = self.prepare(tenant_id, request)
            ids.extend(sample_ids)
            return op

        future = self.engine.submit(tenant_id, None, None, "sample", prepare)
        return {**queued(future), "sample_sequence_ids": ids}

    def _target(self, tenant_id: int, request: types.SampleRequest) -> tuple[str, str | None]:
        """(sampler id, the store entry it samples; None: the base) of a request."""
        if request.sampling_session_id is not None:
            found = self.get(tenant_id, request.sampling_session_id, "sampling_session_id")
            if not found.live:
                raise NotFound(
                    f"sampling_session_id {found.id!r} samples {found.model_path}, which was "
                    "deleted or overwritten since; create a sampling client of a checkpoint "
                    "that exists."
                )
            return found.id, found.store_ref
        if request.model_path is None and request.base_model is None:
            raise ServiceError("sampling_session_id (or model_path / base_model) is required.")
        self.served.check_name(request.base_model)
        store_ref = None
        if request.model_path is not None:
            ref = paths.parse(request.model_path, "model_path")
            store_ref = paths.find(self.db, tenant_id, ref, "model_path").store_ref
        return paths.sampler_id(f"direct{secrets.token_hex(6)}", 0), store_ref

    def prepare(self, tenant_id: int, request: types.SampleRequest) -> tuple[Op, list[str]]:
        """Validate an asample request; the op and the ids of its samples."""
        sid, store_ref = self._target(tenant_id, request)
        for key in UNSUPPORTED:
            if getattr(request, key):
                raise ServiceError(f"{key} is not supported by this server; send 0.")
        if request.target_prompt_logprobs is not None:
            raise ServiceError("target_prompt_logprobs is not supported by this server.")
        prompt = prompt_tokens(request.prompt)
        if not prompt:
            raise ServiceError("prompt has no tokens.")
        self.served.check_tokens(prompt, "prompt")
        num = request.num_samples
        if not 1 <= num <= MAX_SAMPLES:
            raise ServiceError(f"num_samples must be in [1, {MAX_SAMPLES}], got {num}.")
        last_n = request.prompt_logprobs_last_n
        if last_n is not None and not 1 <= last_n <= len(prompt) - 1:
            raise ServiceError(
                f"prompt_logprobs_last_n must be in [1, {len(prompt) - 1}], got {last_n}."
            )
        sample = SampleRequest(tenant_id, sid, store_ref, prompt, num,
                               **self._params(request.sampling_params, len(prompt)),
                               prompt_logprobs=bool(request.prompt_logprobs), last_n=last_n)  # fmt: skip
        tag = secrets.token_hex(6)
        return Op("sample", None, batch=SampleBatch(sample)), [
            f"{sid}:{tag}:{i}" for i in range(num)
        ]

    def _params(self, params: types.SamplingParams, prompt: int) -> dict[str, Any]:
        """The checked ``sampling_params`` of a prompt of ``prompt`` tokens."""
        context = self.served.max_tokens
        room = context - prompt
        if room < 1:
            raise ServiceError(
                f"prompt has {prompt} tokens: no room to sample in the model's context of "
                f"{context} (data.max_seq_len)."
            )
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if not 1 <= max_tokens <= room:
            raise ServiceError(
                f"sampling_params.max_tokens must be in [1, {room}] (the context of {context} "
                f"tokens, data.max_seq_len, less the prompt's {prompt}), got {max_tokens}."
            )
        temperature, top_p, top_k = (
            _finite(params, "temperature"),
            _finite(params, "top_p"),
            params.top_k,
        )
        if temperature < 0:
            raise ServiceError(f"sampling_params.temperature must be >= 0, got {temperature}.")
        if not 0 < top_p <= 1:
            raise ServiceError(f"sampling_params.top_p must be in (0, 1], got {top_p}.")
        if top_k < -1 or top_k == 0:
            raise ServiceError(f"sampling_params.top_k must be -1 (no limit) or >= 1, got {top_k}.")
        seed = secrets.randbits(63) if params.seed is None else params.seed
        if seed < 0:  # the seed feeds numpy's SeedSequence, which takes non-negative entropy
            raise ServiceError(f"sampling_params.seed must be >= 0, got {seed}.")
        stop_ids, stop_strings = self._stops(params.stop)
        return {"max_tokens": max_tokens, "temperature": temperature, "top_k": top_k,
                "top_p": top_p, "seed": seed, "stop_ids": stop_ids, "stop_strings": stop_strings}  # fmt: skip

    def _stops(self, stop: Any) -> tuple[frozenset[int], tuple[str, ...]]:
        """``None``: the tokenizer's EOS; ``[]``: none; token ids; strings."""
        if stop is None:
            eos = self.served.eos_token_id
            return (frozenset() if eos is None else frozenset({eos})), ()
        stop = [stop] if isinstance(stop, str) else list(stop)
        if all(isinstance(s, str) for s in stop):
            if any(not s for s in stop):
                raise ServiceError("sampling_params.stop holds an empty string.")
            return frozenset(), tuple(stop)
        if any(not 0 <= s < self.served.vocab for s in stop):
            raise ServiceError(
                "sampling_params.stop holds token ids outside the vocabulary "
                f"[0, {self.served.vocab})."
            )
        return frozenset(stop), ()

    # ------------------------------------------------------------------ worker
    def run(self, ops: list[Op]) -> list[Any] | SamplingBatch:
        """The sample requests of ``ops`` as one batch (worker thread), prefilled and then
        decoded a slice at a time; a request that failed before the batch started is its
        exception in the results."""
        results: list[Any] = [None] * len(ops)
        rows: list[SampleRow] = []
        owners: list[tuple[int, SampleRequest, int, int | None]] = []  # op, request, row, slot
        needed = {op.batch.request.store_ref for op in ops} - {None}
        for k, op in enumerate(ops):
            request: SampleRequest = op.batch.request
            try:
                slot = self._slot(request, needed)
            except Exception as exc:
                results[k] = exc
                continue
            owners.append((k, request, len(rows), slot))
            for i in range(request.num_samples):
                seed = int(np.random.SeedSequence([request.seed, i]).generate_state(1)[0])
                rows.append(SampleRow(
                    request.prompt, slot, request.max_tokens, request.temperature,
                    request.top_k, request.top_p, torch.Generator().manual_seed(seed),
                    request.stop_ids, request.stop_strings,
                    prompt_logprobs=request.prompt_logprobs and i == 0,
                ))  # fmt: skip
        if not rows:
            return results
        return SamplingBatch(self, rows, owners, results)

    def _slot(self, request: SampleRequest, needed: set[Any]) -> int | None:
        """The slot holding the request's snapshot (None: the base alone); a snapshot whose
        checkpoint was deleted since the request was queued ends it clearly."""
        if request.store_ref is None:
            return None
        try:
            return self.slots.snapshot(request.store_ref, needed)
        except ServiceError:
            raise
        except Exception as exc:
            raise ServiceError(
                f"{request.sampler}: its snapshot could not be loaded; it was deleted or damaged "
                "since the request was queued."
            ) from exc

    def release_unused(self) -> None:
        """Free the snapshot slots no live session samples (worker thread)."""
        self.slots.keep_snapshots(self.db.sampled_store_refs())


class SamplingBatch:
    """A sampling batch in progress: prefilled when built, then decoded about
    ``serve.slice_s`` seconds per :meth:`advance` (all at once with 0), so that the worker
    can run other tenants' training requests between its slices."""

    def __init__(self, samplers: Samplers, rows: list[SampleRow],
                 owners: list[tuple[int, SampleRequest, int, int | None]],
                 results: list[Any]) -> None:  # fmt: skip
        self.samplers, self.owners, self.rows, self._results = samplers, owners, len(rows), results
        self.trainer = samplers.trainer
        began = time.perf_counter()
        self.trainer.start_sampling(rows)
        #: The seconds the batch itself ran (its slices; not the requests run between them).
        self.seconds = time.perf_counter() - began
        self.first = True

    def advance(self) -> bool:
        """The next slice: about ``serve.slice_s`` seconds, the first one counting the
        prefill (it follows the prefill directly: other requests wait one slice)."""
        slice_s = self.samplers.slice_s
        budget = max(0.0, slice_s - self.seconds) if self.first else slice_s
        self.first = False
        began = time.perf_counter()
        finished = self.trainer.advance_sampling(None, budget if slice_s > 0 else None)
        self.seconds += time.perf_counter() - began
        return finished

    def results(self) -> list[Any]:
        sampled = self.trainer.sampled()
        seconds = round(self.seconds, 6)
        for k, request, first, slot in self.owners:
            mine = sampled[first : first + request.num_samples]
            prompt_lp = mine[0].prompt_logprobs
            if prompt_lp is not None and request.last_n is not None:
                prompt_lp[: len(request.prompt) - request.last_n] = float("nan")
            self._results[k] = encode_sample_response(
                [(s.tokens, s.logprobs, s.stopped) for s in mine],
                None if prompt_lp is None else prompt_lp.numpy(),
            )
            self.samplers.metrics.write(request.sampler, request.tenant_id, slot, "sample",
                                        samples=request.num_samples,
                                        tokens=sum(len(s.tokens) for s in mine),
                                        rows_in_batch=self.rows, seconds=seconds)  # fmt: skip
        log.info("sampled %d rows of %d requests in %.3f s", self.rows, len(self.owners), seconds)
        return self._results

    def abandon(self) -> None:
        self.trainer.drop_sampling()
