"""Sampling at batch scale: the service's sampler against the same decode in process, and
one long-prompt decode against ``transformers`` ``generate``.

- ``clients``: the service benchmark's server (``python -m tasks.serve`` on a free
  127.0.0.1 port, the model of ``scripts/bench/service.py``: dense Qwen2, ``--hidden`` /
  ``--layers`` / ``--intermediate``, BF16 adapters of rank ``--rank`` on every projection,
  ``lora.num_slots=16``), one sampler snapshot per client, and 1, 4 and 16 concurrent SDK
  client processes, each sending ``--rounds`` requests of one sample (``--max-tokens``,
  temperature 1, seeded, the EOS stop) to its own snapshot with ``--submit-ahead``
  requests in flight beyond the one it waits for. Sampled tokens/s from a common start to
  the last client's end. Against it, in this process: the function the server's worker
  calls, ``sample_tokens`` (the generation the server's worker runs on one process, there
  in slices of about ``serve.slice_s`` seconds, here whole), of the
  same N clients' rows as one batch (each row its own slot, its client's prompt and
  parameters), measured just before and just after the SDK run (the ratio uses their
  mean: this VM's speed drifts within minutes).
- ``decode``: one prompt of ``--prompt-tokens`` random tokens (seeded), ``--new-tokens``
  greedy tokens, no stop, through ``sample_tokens`` (the base alone, and one slot's
  adapter) against ``transformers`` ``generate`` (its KV cache, greedy,
  ``min_new_tokens = max_new_tokens``) on a plain ``Qwen2ForCausalLM`` holding the served
  base's weights; the greedy tokens are compared (``same_tokens``). Then a group:
  ``--group`` samples of that prompt (temperature 1, seeded) from one slot, against
  ``generate(do_sample=True, num_return_sequences=group)``. On the bundled tiny model and on
  a Qwen2 of 26 M parameters built on the fly (per-token overhead against compute).
  ``generate`` copies the prompt to every sequence before its prefill; ``sample_tokens``
  prefills it once (``group``; ``group_unshared``: one prefill per sample, for
  comparison). The slot's rows also against ``generate`` of the same adapter as an
  unmerged PEFT LoRA in the model's dtype (``generate_peft``: the same adapter products,
  one adapter). Each figure is the median of ``--repeats`` runs after one warm-up, the
  calls interleaved.

Prints one JSON line with the ratios of this run. ``--smoke``: the decode part on the tiny
model only, short (the test).

    .venv/bin/python scripts/bench/sampling.py [--parts clients,decode] [--clients 1,4,16]
        [--rounds 16] [--max-tokens 16] [--submit-ahead 1] [--models tiny,qwen2_26m]
        [--prompt-tokens 300] [--new-tokens 128] [--group 16] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean, median
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
import service as service_bench  # noqa: E402  (the sibling benchmark: its server and clients)

#: Models of the decode part: config overrides over the bundled tiny preset.
MODELS: dict[str, list[str]] = {
    "tiny": [],
    "qwen2_26m": [
        "model.hidden_size=512",
        "model.intermediate_size=1600",
        "model.num_hidden_layers=8",
        "model.num_attention_heads=8",
        "model.num_key_value_heads=4",
    ],
}
DECODE_SLOTS = 4
DECODE_RANK = 16


# ------------------------------------------------------------------ clients
def in_process_rows(count: int, max_tokens: int, eos: int | None, k: int) -> list[Any]:
    """The rows of ``count`` clients' requests as the server's worker builds them."""
    import torch

    from veoptim.slots.tokens import SampleRow

    stop = frozenset() if eos is None else frozenset({eos})
    return [SampleRow(service_bench.sampling_prompt(i), i, max_tokens, 1.0,
                      generator=torch.Generator().manual_seed(i * 100_000 + k), stop_ids=stop)
            for i in range(count)]  # fmt: skip


def in_process_rate(trainer: Any, count: int, args: argparse.Namespace, repeats: int) -> float:
    """Median tokens/s of ``sample_tokens`` over ``count`` clients' rows in one batch."""
    from veoptim.slots.tokens import sample_tokens

    eos = trainer.tokenizer.eos_token_id
    rates = []
    for k in range(repeats + 1):
        rows = in_process_rows(count, args.max_tokens, eos, k)
        start = time.perf_counter()
        tokens = sum(len(r.tokens) for r in sample_tokens(trainer, rows))
        if k:  # the first is a warm-up
            rates.append(tokens / (time.perf_counter() - start))
    return median(rates)


def clients_part(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The SDK clients' tokens/s against ``sample_tokens`` of the same rows in process."""
    from tasks.compose import load_config
    from veoptim.slots import SlotTrainer

    counts = [int(n) for n in args.clients.split(",")]
    cfg = load_config("serve", [f"run.dir={work / 'in_process'}",
                                *service_bench.overrides(args)])  # fmt: skip
    trainer = SlotTrainer.from_config(cfg)
    for s in range(max(counts)):
        trainer.create_slot(s, r=args.rank, seed=s)
    repeats = max(3, args.rounds // 4)
    key = "tml-bench-" + os.urandom(16).hex()
    (work / "keys.txt").write_text(f"bench {key}\n")
    port = service_bench.free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tasks.serve", f"run.dir={work / 'serve'}", f"serve.port={port}",
         f"serve.keys_file={work / 'keys.txt'}", *service_bench.overrides(args)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    runs = []
    try:
        wait_healthy(url)
        service_bench.one_client("--publish", url, key, str(max(counts)), str(args.rank),
                                 str(work / "snapshots.json"))  # fmt: skip
        paths = json.loads((work / "snapshots.json").read_text())
        for n in counts:
            before = in_process_rate(trainer, n, args, repeats)
            sdk = service_bench.sampling_clients(args, url, key, paths, n, work, server.pid)
            after = in_process_rate(trainer, n, args, repeats)
            runs.append({**sdk, "in_process_tokens_per_s_before_after": [round(before, 1),
                                                                          round(after, 1)],
                         "ratio_sdk_vs_in_process": round(
                             sdk["tokens_per_s"] / mean([before, after]), 3)})  # fmt: skip
    finally:
        server.terminate()
        server.wait(120)
    by_count = {r["clients"]: r for r in runs}
    return {
        "model": {"hidden_size": args.hidden, "intermediate_size": args.intermediate,
                  "num_hidden_layers": args.layers, "dtype": "bf16", "lora_r": args.rank},
        "rounds": args.rounds, "max_tokens": args.max_tokens, "submit_ahead": args.submit_ahead,
        "runs": runs,
        "sdk_ratio_16_vs_1_client": (round(by_count[16]["tokens_per_s"]
                                           / by_count[1]["tokens_per_s"], 2)
                                     if 16 in by_count and 1 in by_count else None),
    }  # fmt: skip


def wait_healthy(url: str) -> None:
    import httpx

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server at {url} did not answer healthz within 180 s")


# ------------------------------------------------------------------ decode
def plain_copy(trainer: Any) -> Any:
    """A plain ``Qwen2ForCausalLM`` holding the served base's weights (no adapters)."""
    from transformers import Qwen2ForCausalLM

    model = trainer.model
    plain = Qwen2ForCausalLM(copy.deepcopy(model.config)).to(model.dtype).eval()
    weights = {k.replace(".base_layer", ""): v for k, v in model.state_dict().items()
               if ".lora_" not in k}  # fmt: skip
    plain.load_state_dict(weights, strict=True)
    return plain


def peft_copy(trainer: Any, slot: int) -> Any:
    """The plain copy with ``slot``'s adapter as an unmerged PEFT LoRA in the model's dtype
    (the products ``sample_tokens`` computes for that slot, one adapter)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from veoptim.slots.routing import slot_adapter_name, slot_layers

    layers, name = slot_layers(trainer.model), slot_adapter_name(slot)
    spec = next(iter(layers.values())).specs[name]
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=0.0,
                        target_modules=list(layers))  # fmt: skip
    model = get_peft_model(plain_copy(trainer), config, autocast_adapter_dtype=False)
    with torch.no_grad():
        for fqn, layer in layers.items():
            peft_layer = model.base_model.model.get_submodule(fqn)
            peft_layer.lora_A["default"].weight.copy_(layer.lora_A[name].weight[: spec.r])
            peft_layer.lora_B["default"].weight.copy_(layer.lora_B[name].weight[:, : spec.r])
    return model.eval()


def decode_model(name: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One model's long-prompt decode and group against ``generate``."""
    import torch

    from tasks.compose import load_config
    from veoptim.slots import SlotTrainer
    from veoptim.slots.tokens import SampleRow, sample_tokens

    context = args.prompt_tokens + args.new_tokens
    cfg = load_config("serve", [f"run.dir={work / name}", *MODELS[name], "model.dtype=bf16",
                                f"lora.num_slots={DECODE_SLOTS}", f"lora.r={DECODE_RANK}",
                                f"lora.alpha={2 * DECODE_RANK}", f"data.max_seq_len={context}",
                                f"model.max_position_embeddings={max(context, 512)}",
                                "checkpoint.fsync=false", "logging.progress=false",
                                "serve.tokenizer_cache="])  # fmt: skip
    trainer = SlotTrainer.from_config(cfg)
    trainer.create_slot(0, r=DECODE_RANK, seed=0)
    plain, adapted = plain_copy(trainer), peft_copy(trainer, 0)
    vocab = trainer.model.config.vocab_size
    prompt = torch.randint(3, vocab, (args.prompt_tokens,),
                           generator=torch.Generator().manual_seed(0)).tolist()  # fmt: skip
    n, group = args.new_tokens, args.group
    ids = torch.tensor([prompt])

    def ours(slot: int | None) -> tuple[float, list[int]]:
        start = time.perf_counter()
        [row] = sample_tokens(trainer, [SampleRow(prompt, slot, n, temperature=0.0)])
        return time.perf_counter() - start, row.tokens

    def ours_group(k: int, **options: bool) -> tuple[float, int]:
        rows = [SampleRow(prompt, 0, n, 1.0, generator=torch.Generator().manual_seed(k * 100 + i))
                for i in range(group)]  # fmt: skip
        start = time.perf_counter()
        tokens = sum(len(r.tokens) for r in sample_tokens(trainer, rows, **options))
        return time.perf_counter() - start, tokens

    calls = {"generate": lambda k: generate(0), "base": lambda k: ours(None),
             "generate_peft": lambda k: generate(0, adapted), "slot": lambda k: ours(0),
             "generate_group": lambda k: generate(group),
             "generate_peft_group": lambda k: generate(group, adapted),
             "group": ours_group}  # fmt: skip
    if "share_prefill" in inspect.signature(sample_tokens).parameters:
        calls["group_unshared"] = lambda k: ours_group(k, share_prefill=False)

    def generate(sampled: int, model: Any = plain) -> tuple[float, list[int]]:
        extra = ({"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                  "num_return_sequences": sampled} if sampled else
                 {"do_sample": False, "temperature": None, "top_k": None, "top_p": None})  # fmt: skip
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
                                 use_cache=True, **extra)  # fmt: skip
        return time.perf_counter() - start, out[0, len(prompt) :].tolist()

    times: dict[str, list[float]] = {label: [] for label in calls}
    tokens: dict[str, list[int]] = {}
    for k in range(args.repeats + 1):  # the first is a warm-up
        for label, call in calls.items():
            seconds, out = call(k)
            if k:
                times[label].append(seconds)
            if isinstance(out, list):
                tokens[label] = out
    s = {label: median(v) for label, v in times.items()}
    return {
        "parameters": sum(p.numel() for p in plain.parameters()),
        "prompt_tokens": args.prompt_tokens, "new_tokens": n, "group": group,
        "same_tokens": tokens["base"] == tokens["generate"] == tokens["slot"]
                       == tokens["generate_peft"],
        "seconds": {label: round(v, 4) for label, v in s.items()},
        "tokens_per_s": {label: round((group if "group" in label else 1) * n / v, 1)
                         for label, v in s.items()},
        "time_ratio_vs_generate": {"base": round(s["base"] / s["generate"], 3),
                                   "slot": round(s["slot"] / s["generate"], 3),
                                   **{label: round(s[label] / s["generate_group"], 3)
                                      for label in s if label.startswith("group")}},
        "time_ratio_vs_peft_generate": {
            "slot": round(s["slot"] / s["generate_peft"], 3),
            **{label: round(s[label] / s["generate_peft_group"], 3)
               for label in s if label.startswith("group")}},
    }  # fmt: skip


# ------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="clients,decode")
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--rounds", type=int, default=16, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per client sample")
    parser.add_argument("--submit-ahead", type=int, default=1)
    parser.add_argument("--models", default="tiny,qwen2_26m")
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads here and in the server (0: torch's default)")  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="tiny decode only, short")
    parser.add_argument("--out", default="", help="also write the JSON to this file")
    args = parser.parse_args()
    if args.smoke:
        args.parts, args.models, args.prompt_tokens, args.new_tokens = "decode", "tiny", 40, 8
        args.group, args.repeats = 4, 1
    parts = set(args.parts.split(","))
    if not parts <= {"clients", "decode"}:
        parser.error(f"--parts takes clients and decode; got {args.parts}")
    if max(int(n) for n in args.clients.split(",")) > service_bench.SLOTS:
        parser.error(f"--clients: at most {service_bench.SLOTS} (the server's slots)")
    if set(args.models.split(",")) - set(MODELS):
        parser.error(f"--models takes {sorted(MODELS)}; got {args.models}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    if args.threads:  # this process's torch, and the server's (OMP_NUM_THREADS)
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    work = Path(tempfile.mkdtemp(prefix="veoptim-sampling-bench-"))
    report: dict[str, Any] = {"bench": "sampling", "dir": str(work),
                              "torch_threads": torch.get_num_threads()}  # fmt: skip
    load_start = os.getloadavg()[0]
    if "decode" in parts:
        report["decode"] = {m: decode_model(m, args, work) for m in args.models.split(",")}
    if "clients" in parts:
        report["clients"] = clients_part(args, work)
    report["loadavg_1min_start_end"] = [round(load_start, 2), round(os.getloadavg()[0], 2)]
    report["cpus"] = os.cpu_count()
    line = json.dumps(report)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
