"""Write-back rounding: round-to-nearest by default, seeded stochastic rounding as an opt-in."""

from __future__ import annotations

import copy

import torch

from tests.optim.helpers import HYPER, make_params, run_variant, set_grads
from veoptim.optim import MASTER_WEIGHT, CPUOffloadAdamW, FullFP32AdamW
from veoptim.optim.rounding import noise_key, stochastic_round_bf16_


def _sr(groups, **kw):
    return FullFP32AdamW(groups, stochastic_rounding=True, **kw, **HYPER)


def test_stochastic_rounding_picks_one_of_the_two_bf16_neighbours():
    params, opt = run_variant(_sr, 5, torch.bfloat16)
    for p in params:
        master = opt.state[p][MASTER_WEIGHT]
        down = (master.view(torch.int32) & ~0xFFFF).view(torch.float32)
        up = torch.nextafter(down.bfloat16(), down.bfloat16() + torch.sign(down).bfloat16())
        assert bool(((p.detach() == down.bfloat16()) | (p.detach() == up)).all())


def test_stochastic_rounding_differs_from_round_to_nearest():
    params, opt = run_variant(_sr, 5, torch.bfloat16)
    rne = [opt.state[p][MASTER_WEIGHT].bfloat16() for p in params]
    differing = sum(int((p.detach() != r).sum()) for p, r in zip(params, rne, strict=True))
    assert differing > 0.1 * sum(p.numel() for p in params)


def test_stochastic_rounding_is_unbiased():
    value = torch.full((200_000,), 1.0 + 2**-9)  # a quarter of the way between BF16 neighbours
    out = torch.empty(value.shape, dtype=torch.bfloat16)
    stochastic_round_bf16_(out, value, noise_key(0, 1, 0), 0)
    assert abs(float(out.float().mean()) - (1.0 + 2**-9)) < 2e-5


def test_stochastic_rounding_is_reproducible_with_the_same_seed():
    a, _ = run_variant(lambda g: _sr(g, sr_seed=3), 4, torch.bfloat16)
    b, _ = run_variant(lambda g: _sr(g, sr_seed=3), 4, torch.bfloat16)
    c, _ = run_variant(lambda g: _sr(g, sr_seed=4), 4, torch.bfloat16)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))


def test_stochastic_rounding_continues_identically_after_a_state_dict_resume():
    params, opt = run_variant(_sr, 3, torch.bfloat16)
    saved = ([p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()))
    for step in range(3, 5):
        set_grads(params, step, torch.bfloat16)
        opt.step()
    resumed = make_params(torch.bfloat16)
    with torch.no_grad():
        for p, v in zip(resumed, saved[0], strict=True):
            p.copy_(v)
    ropt = _sr([{"params": resumed}])
    ropt.load_state_dict(saved[1])
    for step in range(3, 5):
        set_grads(resumed, step, torch.bfloat16)
        ropt.step()
    assert all(torch.equal(x, y) for x, y in zip(params, resumed, strict=True))


def test_stochastic_rounding_is_the_same_offloaded_and_resident():
    resident, _ = run_variant(_sr, 4, torch.bfloat16)
    offloaded, _ = run_variant(
        lambda g: CPUOffloadAdamW(g, stochastic_rounding=True, chunk_size=128, **HYPER),
        4,
        torch.bfloat16,
        offload_first=5,
    )
    assert all(torch.equal(x, y) for x, y in zip(resident, offloaded, strict=True))
