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
and snapshots) run as one batch of rows through :func:`sample_tokens` (a KV cache,
each row through its own slot's adapter; base-model requests batch among themselves).
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from veoptim.lora.slots.tokens import SampleRow
from veoptim.service import paths
from veoptim.service.engine import Op
from veoptim.service.errors import NotFound, ServiceError
from veoptim.service.wire import encode_sample_response

if TYPE_CHECKING:
    from veoptim.service.backend import Backend

log = logging.getLogger("veoptim.service")
MAX_SAMPLES = 64
#: Requests whose rows one sampling batch holds at most.
MAX_BATCH_ROWS = 64
UNSUPPORTED = {
    "topk_prompt_logprobs": 0,
    "topk_sample_logprobs": 0,
    "prompt_alt_tokens_k": 0,
}


def sampler_id(session_id: str, seq_id: int) -> str:
    return f"{session_id}:sample:{seq_id}"


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
    def base(self) -> bool:
        return self.request.store_ref is None

    def joins(self, other: Any) -> bool:
        return isinstance(other, SampleBatch) and other.base == self.base


def _number(params: dict[str, Any], key: str, default: float) -> float:
    value = params.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ServiceError(f"sampling_params.{key} must be a finite number, got {value!r}.")
    return float(value)


def _integer(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ServiceError(f"{field} must be an integer, got {value!r}.")
    return value


def prompt_tokens(prompt: Any) -> list[int]:
    """The tokens of a JSON ``ModelInput`` (every chunk, in order; text chunks only)."""
    chunks = prompt.get("chunks") if isinstance(prompt, dict) else None
    if not isinstance(chunks, list):
        raise ServiceError(f"prompt must be a ModelInput object with chunks, got {prompt!r:.80}.")
    tokens: list[int] = []
    for j, chunk in enumerate(chunks):
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind != "encoded_text":
            raise ServiceError(
                f"prompt.chunks[{j}] is a {kind} chunk; only encoded_text (tokens) is supported."
            )
        ids = chunk.get("tokens")
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise ServiceError(f"prompt.chunks[{j}].tokens must be a list of token ids.")
        tokens += ids
    return tokens


class Samplers:
    """The samplers of one server: sessions in the database, snapshot slots in memory."""

    def __init__(self, backend: Backend) -> None:
        self.backend, self.db, self.trainer = backend, backend.db, backend.trainer
        #: snapshot store entry -> the slot it is loaded in; slot -> last use.
        self.slots: dict[str, int] = {}
        self.last_use: dict[int, float] = {}

    # ------------------------------------------------------------------ sessions
    def create(self, tenant_id: int, session_id: str, seq_id: Any, model_path: Any,
               base_model: Any) -> str:  # fmt: skip
        """A sampling session of ``model_path`` (a tinker:// checkpoint of this tenant) or
        of the base model alone; its id."""
        seq = _integer(seq_id, "sampling_session_seq_id")
        if seq < 0:
            raise ServiceError(f"sampling_session_seq_id must be >= 0, got {seq}.")
        self.backend.check_base_model(base_model)
        store_ref = None
        if model_path is not None:
            ref = paths.parse(model_path, "model_path")
            record = self.backend._checkpoint(tenant_id, ref)
            store_ref, model_path = str(record["store_ref"]), ref.path
        elif base_model is None:
            raise ServiceError("model_path or base_model is required to create a sampler.")
        return self.record(tenant_id, session_id, seq, model_path, store_ref)

    def record(self, tenant_id: int, session_id: str, seq: int, model_path: str | None,
               store_ref: str | None) -> str:  # fmt: skip
        sid = sampler_id(session_id, seq)
        old = self.db.one("SELECT * FROM samplers WHERE id = ?", (sid,))
        if old is not None:
            # The SDK retries a create whose answer it lost: the same request, same session.
            if (old["tenant_id"], old["model_path"], old["store_ref"]) == (
                tenant_id, model_path, store_ref
            ):  # fmt: skip
                return sid
            raise ServiceError(f"sampling_session_seq_id {seq} was already used in this session.")
        self.db.execute(
            "INSERT INTO samplers (id, tenant_id, session_id, base_model, model_path, store_ref, "
            "created) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (sid, tenant_id, session_id, self.backend.base_model, model_path, store_ref,
             time.time()),
        )  # fmt: skip
        return sid

    def get(self, sid: str, tenant_id: int) -> Any:
        row = self.db.one("SELECT * FROM samplers WHERE id = ? AND tenant_id = ?", (sid, tenant_id))
        if row is None:
            raise NotFound(f"sampler {sid!r} was not found.")
        return row

    # ------------------------------------------------------------------ asample
    def prepare(self, tenant_id: int, body: dict[str, Any]) -> tuple[Op, list[str]]:
        """Validate an asample body; the op and the ids of its samples."""
        b = self.backend
        if body.get("sampling_session_id") is not None:
            row = self.get(str(body["sampling_session_id"]), tenant_id)
            sid, store_ref = str(row["id"]), row["store_ref"]
        elif body.get("model_path") is not None or body.get("base_model") is not None:
            session = f"direct{secrets.token_hex(6)}"
            sid = sampler_id(session, 0)
            store_ref = None
            if body.get("model_path") is not None:
                ref = paths.parse(body["model_path"], "model_path")
                store_ref = str(b._checkpoint(tenant_id, ref)["store_ref"])
            b.check_base_model(body.get("base_model"))
        else:
            raise ServiceError("sampling_session_id (or model_path / base_model) is required.")
        for key, allowed in UNSUPPORTED.items():
            if body.get(key, allowed) not in (allowed, None):
                raise ServiceError(f"{key} is not supported by this server; send {allowed}.")
        if body.get("target_prompt_logprobs") is not None:
            raise ServiceError("target_prompt_logprobs is not supported by this server.")
        prompt = prompt_tokens(body.get("prompt"))
        if not prompt:
            raise ServiceError("prompt has no tokens.")
        if min(prompt) < 0 or max(prompt) >= b.vocab:
            raise ServiceError(f"prompt holds token ids outside the vocabulary [0, {b.vocab}).")
        num = _integer(body.get("num_samples", 1), "num_samples")
        if not 1 <= num <= MAX_SAMPLES:
            raise ServiceError(f"num_samples must be in [1, {MAX_SAMPLES}], got {num}.")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise ServiceError(f"sampling_params must be an object, got {params!r}.")
        room = b.max_tokens - len(prompt)
        if room < 1:
            raise ServiceError(
                f"prompt has {len(prompt)} tokens: no room to sample in the model's context of "
                f"{b.max_tokens} (data.max_seq_len)."
            )
        max_tokens = params.get("max_tokens")
        max_tokens = (
            room if max_tokens is None else _integer(max_tokens, "sampling_params.max_tokens")
        )
        if not 1 <= max_tokens <= room:
            raise ServiceError(
                f"sampling_params.max_tokens must be in [1, {room}] (the context of {b.max_tokens} "
                f"tokens, data.max_seq_len, less the prompt's {len(prompt)}), got {max_tokens}."
            )
        temperature = _number(params, "temperature", 1.0)
        top_p = _number(params, "top_p", 1.0)
        top_k = params.get("top_k", -1)
        top_k = -1 if top_k is None else _integer(top_k, "sampling_params.top_k")
        if temperature < 0:
            raise ServiceError(f"sampling_params.temperature must be >= 0, got {temperature}.")
        if not 0 < top_p <= 1:
            raise ServiceError(f"sampling_params.top_p must be in (0, 1], got {top_p}.")
        if top_k < -1 or top_k == 0:
            raise ServiceError(f"sampling_params.top_k must be -1 (no limit) or >= 1, got {top_k}.")
        seed = params.get("seed")
        seed = secrets.randbits(63) if seed is None else _integer(seed, "sampling_params.seed")
        if seed < 0:  # the seed feeds numpy's SeedSequence, which takes non-negative entropy
            raise ServiceError(f"sampling_params.seed must be >= 0, got {seed}.")
        stop_ids, stop_strings = self._stops(params.get("stop", None), "stop" in params)
        last_n = body.get("prompt_logprobs_last_n")
        if last_n is not None:
            last_n = _integer(last_n, "prompt_logprobs_last_n")
            if not 1 <= last_n <= len(prompt) - 1:
                raise ServiceError(
                    f"prompt_logprobs_last_n must be in [1, {len(prompt) - 1}], got {last_n}."
                )
        request = SampleRequest(tenant_id, sid, store_ref, prompt, num, max_tokens, temperature, top_k, top_p,
                                seed, stop_ids, stop_strings, bool(body.get("prompt_logprobs")),
                                last_n)  # fmt: skip
        tag = secrets.token_hex(6)
        return Op("sample", None, batch=SampleBatch(request)), [
            f"{sid}:{tag}:{i}" for i in range(num)
        ]

    def _stops(self, stop: Any, given: bool) -> tuple[frozenset[int], tuple[str, ...]]:
        """``None``: the tokenizer's EOS; ``[]``: none; token ids; strings."""
        if stop is None:
            eos = self.trainer.tokenizer.eos_token_id
            return (frozenset() if eos is None else frozenset({int(eos)})), ()
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list):
            raise ServiceError(f"sampling_params.stop must be a string or a list, got {stop!r}.")
        if all(isinstance(s, str) for s in stop):
            if any(not s for s in stop):
                raise ServiceError("sampling_params.stop holds an empty string.")
            return frozenset(), tuple(stop)
        if all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
            if any(not 0 <= s < self.backend.vocab for s in stop):
                raise ServiceError(
                    f"sampling_params.stop holds token ids outside the vocabulary "
                    f"[0, {self.backend.vocab})."
                )
            return frozenset(stop), ()
        raise ServiceError("sampling_params.stop must be all strings or all token ids.")

    # ------------------------------------------------------------------ worker
    def run(self, ops: list[Op]) -> list[Any]:
        """Run the sample requests of ``ops`` as one batch (worker thread); each result is
        a SampleResponse protobuf, or the exception that failed that request alone."""
        results: list[Any] = [None] * len(ops)
        rows: list[SampleRow] = []
        owners: list[tuple[int, SampleRequest, int, int | None]] = []  # op, request, row, slot
        needed = {op.batch.request.store_ref for op in ops} - {None}
        for k, op in enumerate(ops):
            request: SampleRequest = op.batch.request
            try:
                slot = (
                    None if request.store_ref is None else self.slot_for(request.store_ref, needed)
                )
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
        began = time.perf_counter()
        sampled = self.trainer.sample(rows)
        seconds = round(time.perf_counter() - began, 6)
        for k, request, first, slot in owners:
            mine = sampled[first : first + request.num_samples]
            prompt_lp = mine[0].prompt_logprobs
            if prompt_lp is not None and request.last_n is not None:
                prompt_lp[: len(request.prompt) - request.last_n] = float("nan")
            results[k] = encode_sample_response(
                [(s.tokens, s.logprobs, s.stopped) for s in mine],
                None if prompt_lp is None else prompt_lp.numpy(),
            )
            self.backend.write_metric(request.sampler, request.tenant_id, slot, "sample",
                                      samples=request.num_samples,
                                      tokens=sum(len(s.tokens) for s in mine),
                                      rows_in_batch=len(rows), seconds=seconds)  # fmt: skip
        log.info("sampled %d rows of %d requests in %.3f s", len(rows), len(owners), seconds)
        return results

    def slot_for(self, store_ref: str, keep: set[Any]) -> int:
        """The slot holding snapshot ``store_ref``, loading it into a free slot first."""
        slot = self.slots.get(store_ref)
        if slot is None:
            slot = self.take_slot(keep)
            try:
                self.trainer.load_slot(slot, store_ref, load_optimizer=False)
            except Exception:
                if slot in self.trainer.slots:
                    self.trainer.release_slot(slot)
                raise
            self.slots[store_ref] = slot
            log.info("sampler snapshot %s loaded into slot %d", store_ref, slot)
        self.last_use[slot] = time.monotonic()
        return slot

    def take_slot(self, keep: set[Any] | frozenset[Any] = frozenset()) -> int:
        """A slot no training model and no snapshot holds, evicting the least recently used
        snapshot not in ``keep`` when there is none; None when every slot trains."""
        busy = self.backend.used_slots() | set(self.slots.values())
        free = sorted(set(range(self.trainer.num_slots)) - busy)
        if free:
            return free[0]
        evictable = [(self.last_use.get(s, 0.0), ref) for ref, s in self.slots.items()
                     if ref not in keep]  # fmt: skip
        if not evictable:
            raise ServiceError(
                f"all {self.trainer.num_slots} slots are in use (lora.num_slots="
                f"{self.trainer.num_slots}) by training models and the snapshots this batch "
                "samples; unload a model or start the server with more lora.num_slots."
            )
        _, ref = min(evictable)
        return self.evict(ref)

    def evict(self, store_ref: str) -> int:
        slot = self.slots.pop(store_ref)
        self.last_use.pop(slot, None)
        if slot in self.trainer.slots:
            self.trainer.release_slot(slot)
        log.info("sampler snapshot %s left slot %d", store_ref, slot)
        return slot

    def release_unused(self) -> None:
        """Free the snapshot slots no live session samples (worker thread)."""
        live = {
            r["store_ref"]
            for r in self.db.all(
                "SELECT s.store_ref FROM samplers s JOIN sessions x ON x.id = s.session_id "
                "WHERE x.finished IS NULL AND s.store_ref IS NOT NULL"
            )
        }
        for ref in [ref for ref in self.slots if ref not in live]:
            self.evict(ref)
