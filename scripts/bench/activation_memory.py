"""Activation memory with and without ``model.activation_checkpointing``, on CPU.

One training step (forward, backward) of a model built from config with a long
sequence, measured three ways for each setting in the same run:

* ``held_for_backward_mb``: bytes of the tensors allocated in the forward that are still
  alive when it returns (what autograd keeps for the backward: the activations);
* ``peak_step_mb``: the peak of live tensor bytes allocated during the step (forward,
  recompute, backward and the gradients), tracked per storage by a dispatch mode, so
  it needs no CUDA allocator;
* ``peak_rss_mb``: the growth of the process's peak RSS over the step, each setting in
  a fresh subprocess (the allocator's view, noisier);

plus ``step_s``, the median wall time of an untracked step, the two settings
interleaved in rounds (the recompute's price). Prints one JSON object; ``ratio`` is checkpointed / plain.

    .venv/bin/python scripts/bench/activation_memory.py [--layers 8] [--seq 1024] [--arch qwen2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import weakref
from collections.abc import Iterable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from veoptim.config.schema import ModelConfig
from veoptim.models.build import build_model

VOCAB = 512  # the bundled tokenizer's
MB = 2**20


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the tensor storages created under it that are still alive, and their peak.

    Storages of ``existing`` tensors (parameters, buffers, inputs) are never counted, also
    when an op returns a view of them (``weight.t()``).
    """

    def __init__(self, existing: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for t in existing:
            self._seen[t.untyped_storage()] = 0

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage not in self._seen:
                    nbytes = storage.nbytes()
                    self._seen[storage] = nbytes
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, nbytes)
        return out


def model_config(args: argparse.Namespace, checkpointing: bool) -> ModelConfig:
    moe = args.arch != "qwen2"
    return ModelConfig(
        arch=args.arch,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        max_position_embeddings=args.seq,
        num_experts=8 if moe else 0,
        moe_intermediate_size=args.hidden,
        activation_checkpointing=checkpointing,
    )


def step(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The forward's loss (the SFT objective's shape of call); the caller runs backward."""
    logits = model(input_ids=ids, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])


def inputs(args: argparse.Namespace) -> torch.Tensor:
    return torch.randint(
        0, VOCAB, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)
    )


def measure_tensors(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, float]:
    """Tensor bytes held for the backward and the step's peak (one tracked step)."""
    with LiveTensorBytes([*model.parameters(), *model.buffers(), ids]) as tracker:
        loss = step(model, ids)
        held = tracker.live
        loss.backward()
    model.zero_grad(set_to_none=True)
    return {
        "held_for_backward_mb": round(held / MB, 1),
        "peak_step_mb": round(tracker.peak / MB, 1),
    }


def median_step_s(
    models: dict[str, torch.nn.Module], ids: torch.Tensor, rounds: int
) -> dict[str, float]:
    """Median untracked step time of each model, the settings interleaved in rounds so
    that machine noise hits both alike."""
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            start = time.perf_counter()
            step(model, ids).backward()
            times[name].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    return {name: round(statistics.median(t), 3) for name, t in times.items()}


def _vm_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child_rss(args: argparse.Namespace, checkpointing: bool) -> dict[str, float | None]:
    """In a fresh process: the peak RSS growth of one step over the built model's RSS
    (Linux only: None where the peak cannot be reset)."""
    model = build_model(model_config(args, checkpointing), VOCAB).train()
    ids = inputs(args)
    try:  # reset the peak (VmHWM) to the current RSS
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return {"peak_rss_mb": None}
    before = _vm_kb("VmRSS")
    step(model, ids).backward()
    return {"peak_rss_mb": round((_vm_kb("VmHWM") - before) / 1024, 1)}


def measure_rss(args: argparse.Namespace, checkpointing: bool) -> dict[str, float]:
    argv = [sys.executable, __file__, "--child", "ac" if checkpointing else "plain"]
    argv += [f"--{k}={v}" for k, v in vars(args).items() if k not in ("child", "repeats")]
    proc = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=600)
    return json.loads(proc.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen2", choices=["qwen2", "qwen2_moe", "qwen3_moe"])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds")
    parser.add_argument("--child", choices=["ac", "plain"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.child:
        print(json.dumps(child_rss(args, args.child == "ac")))
        return
    settings = {"plain": False, "checkpointed": True}
    ids = inputs(args)
    models = {n: build_model(model_config(args, c), VOCAB).train() for n, c in settings.items()}
    results = {name: measure_tensors(model, ids) for name, model in models.items()}
    for name, seconds in median_step_s(models, ids, args.repeats).items():
        results[name]["step_s"] = seconds
    for name, checkpointing in settings.items():
        results[name].update(measure_rss(args, checkpointing))
    plain, ac = results["plain"], results["checkpointed"]
    params = sum(
        p.numel() for p in build_model(model_config(args, False), VOCAB, on_meta=True).parameters()
    )
    print(
        json.dumps(
            {
                "bench": "activation_memory",
                "model": {
                    **{k: v for k, v in vars(args).items() if k not in ("child", "repeats")},
                    "params_m": round(params / 1e6, 2),
                    "dtype": "fp32",
                },  # fmt: skip
                **results,
                "ratio": {k: round(ac[k] / plain[k], 3) if plain[k] else None for k in plain},
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
