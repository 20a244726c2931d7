"""The losses ``forward_backward`` accepts, by the SDK's ``loss_fn`` name.

A loss names the per-token ``loss_fn_inputs`` it needs (each as long as the datum's
tokens) and computes each row's loss from the target log-probabilities; the engine
turns every datum into rows of one slot batch and returns each datum's ``logprobs``.
Every loss is a *sum* over the datum's tokens (the SDK's convention: the next
``optim_step`` applies the summed gradient unscaled). With ``logp`` the log-probability
of ``target_tokens[t]`` under the training slot, ``q`` the sampler's ``logprobs[t]``,
``A`` the ``advantages[t]`` and ``r = exp(logp - q)``:

- ``cross_entropy``:       ``-sum_t weights[t] * logp``
- ``importance_sampling``: ``-sum_t r * A``
- ``ppo``:                 ``-sum_t min(r * A, clip(r, low, high) * A)``
- ``cispo``:               ``-sum_t sg(clip(r, low, high)) * logp * A``  (sg: no gradient)

``low`` / ``high`` are ``loss_fn_config``'s ``clip_low_threshold`` / ``clip_high_threshold``
(bounds of the ratio itself, default 0.8 and 1.2: the Tinker documentation's epsilon of
0.2). Padding positions carry ``A = 0`` (and weight 0), so they add exact zeros.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from veoptim.service.errors import ServiceError

RL_INPUTS = {"target_tokens": "i", "logprobs": "f", "advantages": "f"}
CLIP_DEFAULTS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
#: The SDK's other loss names (types.LossFnType): refused by name.
UNSUPPORTED = ("dro", "gspo", "stable_reinforce", "custom")


@dataclass(frozen=True)
class Loss:
    name: str
    #: loss_fn_inputs name -> numpy dtype kind ('i' integer, 'f' float).
    inputs: dict[str, str] = field(hash=False)
    #: loss_fn_config key -> value (the defaults filled in).
    config: tuple[tuple[str, float], ...] = ()

    def row_losses(self, logprobs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    @property
    def low(self) -> float:
        return dict(self.config)["clip_low_threshold"]

    @property
    def high(self) -> float:
        return dict(self.config)["clip_high_threshold"]


def ratio(logprobs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.exp(logprobs - batch["logprobs"])


class CrossEntropy(Loss):
    """``-sum_t weights[t] * logprob(target_tokens[t])`` per datum (the SDK's cross_entropy;
    its client-side custom losses send ``weights = -dL/dlogprob`` through it)."""

    def row_losses(self, logprobs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return -(logprobs * batch["weights"]).sum(dim=1)


class ImportanceSampling(Loss):
    """``-sum_t exp(logp - q) * A``."""

    def row_losses(self, logprobs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return -(ratio(logprobs, batch) * batch["advantages"]).sum(dim=1)


class PPO(Loss):
    """``-sum_t min(r * A, clip(r, low, high) * A)``."""

    def row_losses(self, logprobs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        r, advantages = ratio(logprobs, batch), batch["advantages"]
        clipped = torch.clamp(r, self.low, self.high)
        return -torch.minimum(r * advantages, clipped * advantages).sum(dim=1)


class CISPO(Loss):
    """``-sum_t sg(clip(r, low, high)) * logp * A``."""

    def row_losses(self, logprobs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        clipped = torch.clamp(ratio(logprobs, batch), self.low, self.high).detach()
        return -(clipped * logprobs * batch["advantages"]).sum(dim=1)


#: name -> (class, inputs, config defaults).
LOSSES: dict[str, tuple[type[Loss], dict[str, str], dict[str, float]]] = {
    "cross_entropy": (CrossEntropy, {"target_tokens": "i", "weights": "f"}, {}),
    "importance_sampling": (ImportanceSampling, RL_INPUTS, {}),
    "ppo": (PPO, RL_INPUTS, CLIP_DEFAULTS),
    "cispo": (CISPO, RL_INPUTS, CLIP_DEFAULTS),
}


def get_loss(name: str, config: dict[str, float | str]) -> Loss:
    """The loss ``name`` with ``config`` (loss_fn_config) checked and defaulted."""
    entry = LOSSES.get(name)
    if entry is None:
        why = " (a loss of the SDK this server does not implement)" if name in UNSUPPORTED else ""
        raise ServiceError(
            f"loss_fn {name!r} is not supported by this server{why}; supported: {sorted(LOSSES)}."
        )
    cls, inputs, defaults = entry
    unknown = sorted(set(config) - set(defaults))
    if unknown:
        takes = f"it takes {sorted(defaults)}" if defaults else "it takes none"
        raise ServiceError(
            f"loss_fn_config {unknown} is not accepted by loss_fn {name!r} ({takes})."
        )
    values = dict(defaults)
    for key, value in config.items():
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise ServiceError(f"loss_fn_config[{key!r}] must be a finite number, got {value!r}.")
        values[key] = float(value)
    if defaults and not 0 <= values["clip_low_threshold"] <= values["clip_high_threshold"]:
        raise ServiceError(
            "loss_fn_config clip_low_threshold and clip_high_threshold bound the ratio "
            "exp(logp - logprobs): they need 0 <= clip_low_threshold <= clip_high_threshold, got "
            f"{values['clip_low_threshold']} and {values['clip_high_threshold']}."
        )
    return cls(name, inputs, tuple(sorted(values.items())))


def check_inputs(loss: Loss, index: int, tokens: np.ndarray, inputs: dict[str, np.ndarray],
                 vocab: int) -> None:  # fmt: skip
    """Refuse a datum whose loss_fn_inputs do not fit ``loss`` (naming the field)."""
    where = f"data[{index}].loss_fn_inputs"
    unknown = sorted(set(inputs) - set(loss.inputs))
    if unknown:
        raise ServiceError(f"{where} {unknown} are not inputs of loss_fn {loss.name!r}.")
    for name, kind in loss.inputs.items():
        if name not in inputs:
            raise ServiceError(f"{where}[{name!r}] is missing (loss_fn {loss.name!r} needs it).")
        value = inputs[name]
        if value.ndim != 1 or value.shape[0] != tokens.shape[0]:
            raise ServiceError(
                f"{where}[{name!r}] has shape {list(value.shape)}; it must have one value per "
                f"input token ({tokens.shape[0]})."
            )
        if value.dtype.kind != kind:
            wanted = "an integer" if kind == "i" else "a float32"
            raise ServiceError(f"{where}[{name!r}] must be {wanted} tensor, got {value.dtype}.")
        if kind == "i" and value.size and (value.min() < 0 or value.max() >= vocab):
            raise ServiceError(
                f"{where}[{name!r}] holds token ids outside the vocabulary [0, {vocab})."
            )
        if kind == "f" and not np.isfinite(value).all():
            raise ServiceError(f"{where}[{name!r}] holds values that are not finite.")
