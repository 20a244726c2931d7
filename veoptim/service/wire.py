"""Protobuf bodies, read and written with the SDK's own generated schema
(``tinker.proto.tinker_public_pb2``): the ``forward_backward`` request, the
``ForwardBackwardOutput`` result and the ``SampleResponse``. Nothing here parses bytes by
hand: protobuf decodes the messages, numpy views their packed arrays."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import zstandard
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from veoptim.service.errors import ServiceError, TooLarge

PROTOBUF = "application/x-protobuf"
_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


@dataclass
class Datum:
    tokens: np.ndarray  # int64 [N]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ForwardBackwardRequest:
    """A decoded ``ForwardBackwardRequest``: its header at once, its datums on demand
    (:meth:`data` refuses what this server cannot take, naming the datum), so that a
    request with a bad datum is refused in its model's order and uses its ``seq_id``."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    message: pb.ForwardBackwardRequest

    def data(self) -> list[Datum]:
        return [_datum(i, d) for i, d in enumerate(self.message.data)]


def decompress(body: bytes, encoding: str, limit: int) -> bytes:
    if not encoding or encoding == "identity":
        return body
    if encoding != "zstd":
        raise ServiceError(f"Content-Encoding {encoding!r} is not supported (zstd or none).")
    try:
        out = zstandard.ZstdDecompressor().decompress(body, max_output_size=limit)
    except zstandard.ZstdError as exc:
        raise ServiceError(f"body is not valid zstd data ({exc}).") from exc
    if len(out) > limit:
        raise TooLarge(f"the decompressed body exceeds {limit} bytes (serve.max_request_bytes).")
    return out


def _array(tensor: pb.Tensor, where: str) -> np.ndarray:
    dtype = _DTYPES.get(tensor.dtype)
    if dtype is None:
        raise ServiceError(f"{where}: dtype {tensor.dtype} is not float32, int64 or int32.")
    if tensor.HasField("sparse_csr"):
        raise ServiceError(f"{where}: sparse tensors are not supported; send it dense.")
    size = np.dtype(dtype).itemsize
    if len(tensor.dense) % size:
        raise ServiceError(f"{where}: {len(tensor.dense)} bytes are not whole {dtype.__name__}s.")
    array = np.frombuffer(tensor.dense, dtype=dtype)
    shape = list(tensor.shape)
    if shape and int(np.prod(shape)) != array.size:
        raise ServiceError(f"{where}: shape {shape} does not hold {array.size} values.")
    return array.reshape(shape) if shape else array


def decode_forward_backward(body: bytes) -> ForwardBackwardRequest:
    """The request of a protobuf ``ForwardBackwardRequest`` body (malformed: refused)."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise ServiceError(
            f"body is not a valid tinker_public.ForwardBackwardRequest protobuf ({exc})."
        ) from exc
    config: dict[str, float | str] = dict(msg.loss_fn_config)
    for key, value in msg.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    return ForwardBackwardRequest(
        msg.model_id, int(msg.seq_id), msg.loss_fn, config, bool(msg.forward_only), msg
    )


def _datum(i: int, d: pb.Datum) -> Datum:
    """Datum ``i``: the tokens of its chunks, in order, and its loss inputs."""
    tokens = []
    for j, chunk in enumerate(d.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise ServiceError(
                f"data[{i}].model_input[{j}] is a {kind} chunk; only encoded_text (tokens) is "
                "supported."
            )
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise ServiceError(f"data[{i}].model_input[{j}].tokens is not packed int32s.")
        tokens.append(np.frombuffer(raw, dtype=np.int32))
    joined = np.concatenate(tokens).astype(np.int64) if tokens else np.zeros(0, np.int64)
    inputs = {
        name: _array(t, f"data[{i}].loss_fn_inputs[{name!r}]")
        for name, t in d.loss_fn_inputs.items()
    }
    return Datum(joined, inputs)


def encode_forward_backward_output(
    outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]
) -> bytes:
    """A ``ForwardBackwardOutput``: one ArrayRecord of every datum's 1-D float32 fields."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        msg.metrics[key] = float(value)
    record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in outputs[0] if outputs else ():
        arrays = [np.ascontiguousarray(o[name], dtype=np.float32).reshape(-1) for o in outputs]
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([a.nbytes for a in arrays])
        batched = record.fields[name]
        batched.data = b"".join(a.tobytes() for a in arrays)
        batched.offsets = offsets.tobytes()
        batched.dtype = pb.DTYPE_FLOAT32
    return msg.SerializeToString()


def encode_sample_response(
    sequences: list[tuple[list[int], list[float], bool]], prompt_logprobs: np.ndarray | None
) -> bytes:
    """A ``SampleResponse``: each sequence's tokens (int32), their logprobs (float32) and
    stop reason (``stop`` when True, else ``length``); the prompt's logprobs (float32,
    NaN where none) when asked for."""
    msg = pb.SampleResponse()
    for tokens, logprobs, stopped in sequences:
        msg.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if stopped else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(logprobs, dtype=np.float32).tobytes(),
        )
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.ascontiguousarray(prompt_logprobs, dtype=np.float32).tobytes()
    return msg.SerializeToString()
