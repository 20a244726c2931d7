"""A frozen base in 4-bit NF4 (``model.quant=nf4``): QLoRA's memory lever.

Every ``nn.Linear`` of the decoder (not the LM head, not the embeddings) becomes an
:class:`NF4Linear`: its weight stored as bitsandbytes' NF4 codes (two per byte) with one
FP32 scale per block of :data:`BLOCK_SIZE` weights, 4.5 bits per weight, dequantized into
the model's dtype by bitsandbytes' native kernel (CPU or CUDA) in every forward and again
in the backward (nothing of the full weight is kept between them). It is dequantized a
slice at a time, about :data:`SLICE_WEIGHTS` weights each (rows of the weight in the
forward, columns in the backward), so a layer never holds its whole full-precision
weight: the transient memory of a step stays a few MB whatever the layer's size, and
the allocator reuses it (whole-weight temporaries of up to tens of MB each made glibc's
heap grow by hundreds of MB). Each output element is still one dot product over the
whole reduction dimension, as in one matrix product. Adapters, their FP32 masters and
moments stay full precision: only frozen weights are quantized.

The codes and scales are non-persistent buffers, not parameters: no optimizer, state dict
or adapter checkpoint sees them, and FSDP2 does not shard them (each rank holds the whole
4-bit base: a quarter of the BF16 one); the parallel plan broadcasts them from rank 0 like
every buffer. A base loaded from ``model.path`` is quantized tensor by tensor as it is
read (:func:`load_quantized`): the full-precision model never exists in memory at once.

Quantization runs on the host, once, when the model is loaded, and is deterministic: a
resumed run and an offline export quantize the same weights to the same bytes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from veoptim.errors import ConfigError
from veoptim.models.experts import find_fused_experts

NF4 = "nf4"
#: Weights per FP32 absmax scale (bitsandbytes' and torchao's NF4 default).
BLOCK_SIZE = 64
#: Modules never quantized: the output projection (its logits set the loss).
SKIPPED = ("lm_head",)
#: Weights quantized per call (a multiple of BLOCK_SIZE): bitsandbytes' CPU quantizer holds
#: about 20 bytes of temporaries per weight, so a large layer is quantized in slices of
#: this many weights (blocks are independent: the codes are those of one call).
QUANTIZE_CHUNK = 1 << 18
#: Weights dequantized at once in a forward or backward (2 MB in BF16).
SLICE_WEIGHTS = 1 << 20


@functools.cache
def _bnb_functional():
    """bitsandbytes' quantize/dequantize functions, imported on first use (an optional
    dependency: ``pip install -e '.[quant]'``). Its CPU backend logs a warning that a Hub
    kernel (the ``kernels`` package) is missing; veoptim never fetches code at run time,
    and the built-in kernels are used, so that one logger is quietened during the import."""
    quiet = logging.getLogger("bitsandbytes.backends.cpu.ops")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        import bitsandbytes.functional as bnb_functional
    except ImportError as error:
        raise ConfigError(
            "model.quant=nf4 needs the bitsandbytes package, which is not installed; install "
            "it with pip install -e '.[quant]' (or set model.quant=none)."
        ) from error
    finally:
        quiet.setLevel(level)
    return bnb_functional


def _dequantize(
    codes: torch.Tensor, absmax: torch.Tensor, shape: torch.Size, dtype: torch.dtype
) -> torch.Tensor:
    """bitsandbytes' NF4 dequantization of ``codes`` (with one scale in ``absmax`` per
    :data:`BLOCK_SIZE` weights) into a fresh ``shape`` tensor of ``dtype``: its registered
    operator, called directly (the functional wrapper builds a code table and a
    ``QuantState`` per call: 0.25 ms against the operator's 0.09 ms for 1M weights)."""
    _bnb_functional()  # registers the operator
    return torch.ops.bitsandbytes.dequantize_4bit(codes, absmax, BLOCK_SIZE, NF4, shape, dtype)


class _NF4Matmul(torch.autograd.Function):
    """``x @ dequant(W).T``, a slice of W's rows at a time; the backward dequantizes again
    (no weight kept), a slice of W's columns at a time, and gives the input's gradient
    only: the base is frozen."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: NF4Linear) -> torch.Tensor:  # type: ignore[override]
        ctx.layer = layer
        spans = layer.row_spans()
        if len(spans) == 1:
            return F.linear(x, layer.dequantized())
        out = x.new_empty(*x.shape[:-1], layer.out_features)
        for start, stop in spans:
            out[..., start:stop] = F.linear(x, layer.dequantized_rows(start, stop))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        layer: NF4Linear = ctx.layer
        spans = layer.column_spans()
        if len(spans) == 1:
            return grad @ layer.dequantized(), None
        grad_x = grad.new_empty(*grad.shape[:-1], layer.in_features)
        for start, stop in spans:
            grad_x[..., start:stop] = grad @ layer.dequantized_columns(start, stop)
        return grad_x, None


class NF4Linear(nn.Module):
    """A frozen Linear layer whose weight is 4-bit NF4 codes and per-block FP32 scales."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        dtype: torch.dtype,
        bias: nn.Parameter | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.compute_dtype = in_features, out_features, dtype
        numel = in_features * out_features
        if numel % BLOCK_SIZE:
            raise ConfigError(
                f"model.quant=nf4 quantizes blocks of {BLOCK_SIZE} weights, but a Linear layer "
                f"of {out_features}x{in_features} weights does not divide into them."
            )
        self.register_buffer(
            "nf4_codes", torch.empty(numel // 2, dtype=torch.uint8, device=device), persistent=False
        )
        self.register_buffer(
            "nf4_absmax",
            torch.empty(numel // BLOCK_SIZE, dtype=torch.float32, device=device),
            persistent=False,
        )
        self.bias = bias
        if bias is not None:
            bias.requires_grad_(False)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @torch.no_grad()
    def quantize_(self, weight: torch.Tensor) -> None:
        """Store ``weight`` (its values in ``compute_dtype``, as the model would hold them)."""
        if tuple(weight.shape) != tuple(self.shape):
            raise ConfigError(
                f"an NF4 layer of shape {tuple(self.shape)} was given a weight of shape "
                f"{tuple(weight.shape)}."
            )
        self._quantize_flat(0, weight.detach().reshape(-1))

    @torch.no_grad()
    def quantize_rows_(self, start: int, rows: torch.Tensor) -> None:
        """Store ``rows`` as rows ``start:start + len(rows)`` of the weight (whole blocks:
        the layer is sliceable, :meth:`row_spans`); the codes are those that quantizing the
        whole weight gives, since blocks are independent."""
        stop = start + rows.shape[0]
        if rows.shape[1:] != (self.in_features,) or not (0 <= start < stop <= self.out_features):
            raise ConfigError(
                f"an NF4 layer of shape {tuple(self.shape)} was given rows {start}:{stop} of "
                f"shape {tuple(rows.shape)}."
            )
        if not self._sliceable():
            raise ConfigError(
                f"an NF4 layer of {self.in_features} columns has blocks of {BLOCK_SIZE} "
                "weights that straddle rows: it is quantized whole, not by rows."
            )
        self._quantize_flat(start * self.in_features, rows.detach().reshape(-1))

    def _quantize_flat(self, offset: int, flat: torch.Tensor) -> None:
        """Quantize ``flat``, the weights from flat position ``offset`` (a whole block)."""
        bnb = _bnb_functional()
        for start in range(0, flat.numel(), QUANTIZE_CHUNK):
            part = flat[start : start + QUANTIZE_CHUNK]
            source = part.to(device=self.nf4_codes.device, dtype=self.compute_dtype).contiguous()
            codes, state = bnb.quantize_4bit(
                source, blocksize=BLOCK_SIZE, compress_statistics=False, quant_type=NF4
            )
            first = offset + start
            self.nf4_codes[first // 2 : (first + part.numel()) // 2].copy_(codes.view(-1))
            blocks = slice(first // BLOCK_SIZE, (first + part.numel()) // BLOCK_SIZE)
            self.nf4_absmax[blocks].copy_(state.absmax)

    def dequantized(self) -> torch.Tensor:
        """The weight as the forward uses it: NF4 codes times their block scale, in
        ``compute_dtype`` (a fresh tensor each call)."""
        return _dequantize(self.nf4_codes, self.nf4_absmax, self.shape, self.compute_dtype)

    def _sliceable(self) -> bool:
        """Whether no block of :data:`BLOCK_SIZE` weights straddles two rows, so that a
        range of rows or of (block-aligned) columns has codes and scales of its own."""
        return self.in_features % BLOCK_SIZE == 0

    def row_spans(self) -> list[tuple[int, int]]:
        """Ranges of rows dequantized together in the forward (one range: the whole weight)."""
        if not self._sliceable():
            return [(0, self.out_features)]
        rows = max(1, SLICE_WEIGHTS // self.in_features)
        return [(a, min(a + rows, self.out_features)) for a in range(0, self.out_features, rows)]

    def column_spans(self) -> list[tuple[int, int]]:
        """Ranges of columns (whole blocks) dequantized together in the backward."""
        if not self._sliceable():
            return [(0, self.in_features)]
        cols = max(BLOCK_SIZE, SLICE_WEIGHTS // self.out_features // BLOCK_SIZE * BLOCK_SIZE)
        return [(a, min(a + cols, self.in_features)) for a in range(0, self.in_features, cols)]

    def dequantized_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of :meth:`dequantized`, from their own codes and scales."""
        per_row = self.in_features
        codes = self.nf4_codes[start * per_row // 2 : stop * per_row // 2]
        absmax = self.nf4_absmax[start * per_row // BLOCK_SIZE : stop * per_row // BLOCK_SIZE]
        shape = torch.Size((stop - start, self.in_features))
        return _dequantize(codes, absmax, shape, self.compute_dtype)

    def dequantized_columns(self, start: int, stop: int) -> torch.Tensor:
        """Columns ``start:stop`` (multiples of :data:`BLOCK_SIZE`, or the end) of
        :meth:`dequantized`, from a copy of their codes and scales (a few KB per slice)."""
        rows = self.out_features
        codes = self.nf4_codes.view(rows, -1)[:, start // 2 : stop // 2].contiguous()
        absmax = self.nf4_absmax.view(rows, -1)[:, start // BLOCK_SIZE : stop // BLOCK_SIZE]
        shape = torch.Size((rows, stop - start))
        return _dequantize(codes.view(-1), absmax.contiguous().view(-1), shape, self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _NF4Matmul.apply(x.to(self.compute_dtype), self)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, nf4 blocks of {BLOCK_SIZE}"
        )


def check_quantizable(model: nn.Module, quant: str) -> None:
    """Refuse what NF4 does not cover: MoE experts are fused 3-D weights, not Linear layers."""
    if quant == NF4 and find_fused_experts(model):
        raise ConfigError(
            "model.quant=nf4 quantizes Linear layers, but this model's MoE experts are fused "
            "3-D weights that it cannot hold in 4 bits; use model.quant=none for MoE models."
        )


def quantized_names(model: nn.Module) -> list[str]:
    """Full names of the Linear layers ``model.quant=nf4`` stores in 4 bits."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in SKIPPED
    ]


def replace_linears(
    model: nn.Module, dtype: torch.dtype, fill: Callable[[str, nn.Linear, NF4Linear], None]
) -> list[str]:
    """Swap every quantized Linear for an :class:`NF4Linear` (on the Linear's device: meta
    stays meta), calling ``fill(name, linear, nf4)`` to give it its weight; the Linear's
    weight is dropped as soon as it is quantized."""
    names = quantized_names(model)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        device = linear.weight.device
        nf4 = NF4Linear(linear.in_features, linear.out_features, dtype, linear.bias, device)
        fill(name, linear, nf4)
        setattr(parent, child, nf4)
    return names


def quantize_model(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """Quantize a materialised model in place, layer by layer (a meta model gets meta
    NF4 layers of the right shapes: another rank's weights fill them)."""
    check_quantizable(model, NF4)

    def fill(name: str, linear: nn.Linear, nf4: NF4Linear) -> None:
        if not linear.weight.is_meta:
            nf4.quantize_(linear.weight)

    return replace_linears(model, dtype, fill)


def load_quantized(
    model: nn.Module, read_rows: Callable[[str, int, int], torch.Tensor]
) -> list[str]:
    """Quantize every :class:`NF4Linear` of ``model`` (materialised on the host) from
    ``read_rows(key, start, stop)``, rows ``start:stop`` of the tensor stored under
    ``key``, about :data:`QUANTIZE_CHUNK` weights at a time: no full-precision weight is
    ever whole in memory (whole-weight reads of tens of MB each, freed between long-lived
    codes, grew glibc's heap by a few hundred MB on a 0.5B model)."""
    names = [name for name, m in model.named_modules() if isinstance(m, NF4Linear)]
    for name in names:
        layer: NF4Linear = model.get_submodule(name)
        key = f"{name}.weight"
        if not layer._sliceable():
            layer.quantize_(read_rows(key, 0, layer.out_features))
            continue
        rows = max(1, QUANTIZE_CHUNK // layer.in_features)
        for start in range(0, layer.out_features, rows):
            stop = min(start + rows, layer.out_features)
            layer.quantize_rows_(start, read_rows(key, start, stop))
    return names
