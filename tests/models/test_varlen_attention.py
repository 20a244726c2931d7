"""``model.attn_implementation=sdpa_varlen``: each document of a packed row attends to
itself alone, exactly as if it were attended alone.

Tolerances (CPU): FP32 outputs within 1e-5 absolute of torch's sdpa over each document
alone (measured 6e-7) and gradients within 1e-5 of the largest (measured 0); BF16 outputs
within 2 BF16 steps at the outputs' magnitude (measured 1) and gradients within 2 % of the
largest (measured 0.9 %): the short path computes the same softmax from scores it
materialises, in another order.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from veoptim.config.schema import ModelConfig
from veoptim.models.build import build_model
from veoptim.models.varlen import SHORT_DOCUMENT, documents, register_varlen, varlen_attention

register_varlen()
HEADS, KV_HEADS, DIM = 8, 4, 16


class Attention(torch.nn.Module):
    """What transformers' sdpa reads from the attention module."""

    num_key_value_groups = HEADS // KV_HEADS
    is_causal = True


def each_alone(q, k, v, lengths):
    outs, start = [], 0
    for n in lengths:
        part = (x[:, :, start : start + n] for x in (q, k, v))
        outs.append(sdpa_attention_forward(Attention(), *part, None, scaling=DIM**-0.5)[0])
        start += n
    return torch.cat(outs, dim=1)


def run(fn, dtype, lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    base = [torch.randn(1, h, total, DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS)]
    upstream = torch.randn(1, total, HEADS, DIM, generator=gen)
    q, k, v = (x.to(dtype).requires_grad_() for x in base)
    out = fn(q, k, v)
    (out.float() * upstream).sum().backward()
    return out.detach().float(), [x.grad.float() for x in (q, k, v)]


def positions(lengths):
    return torch.cat([torch.arange(n) for n in lengths])[None]


def test_documents_index_a_padded_layout():
    index, count, longest = documents(torch.tensor([[0, 1, 2, 0, 1, 0]]))
    assert (count, longest) == (3, 3)
    assert index.tolist() == [0, 1, 2, 3, 4, 6]


@pytest.mark.parametrize(
    "dtype,out_tol,grad_tol", [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, None, 2e-2)]
)
@pytest.mark.parametrize("lengths", [[5, 12, 1, 30], [SHORT_DOCUMENT + 7, 9]])
def test_each_document_attends_as_if_alone(dtype, out_tol, grad_tol, lengths):
    pos = positions(lengths)
    ours = run(lambda q, k, v: varlen_attention(Attention(), q, k, v, None, 0.0, DIM**-0.5,
                                                position_ids=pos)[0], dtype, lengths)  # fmt: skip
    ref = run(lambda q, k, v: each_alone(q, k, v, lengths), dtype, lengths)
    out_err = (ours[0] - ref[0]).abs().max().item()
    if out_tol is None:  # two BF16 steps at the outputs' magnitude
        out_tol = 2 * 2.0 ** (torch.log2(ref[0].abs().max()).floor().item() - 7)
    assert out_err <= out_tol
    for got, want in zip(ours[1], ref[1], strict=True):
        assert (got - want).abs().max().item() <= grad_tol * want.abs().max().item()


def test_a_row_read_as_one_document_is_caught():
    """Negative control: without the restarts the documents attend to each other."""
    lengths = [5, 12, 7]
    one = torch.arange(sum(lengths))[None]
    ours = run(lambda q, k, v: varlen_attention(Attention(), q, k, v, None, 0.0, DIM**-0.5,
                                                position_ids=one)[0], torch.float32, lengths)  # fmt: skip
    ref = run(lambda q, k, v: each_alone(q, k, v, lengths), torch.float32, lengths)
    assert (ours[0] - ref[0]).abs().max().item() > 1e-2


def test_a_padded_batch_runs_sdpa_unchanged():
    cfg = ModelConfig()
    ids = torch.randint(0, 128, (3, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    logits = {}
    for attn in ("sdpa", "sdpa_varlen"):
        model = build_model(replace(cfg, attn_implementation=attn), 128)
        assert model.config._attn_implementation == attn
        logits[attn] = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert torch.equal(logits["sdpa"], logits["sdpa_varlen"])
