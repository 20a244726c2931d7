"""The training service's overhead: the SDK through ``python -m tasks.serve`` vs the same
calls on ``SlotTrainer`` in this process.

The slot benchmark's model (dense Qwen2, ``--hidden`` / ``--layers`` / ``--intermediate``,
head dim 64, BF16 adapters of rank ``--rank`` on every projection, FP32 masters and
moments), ``lora.num_slots=16``, CPU. A server subprocess on a free 127.0.0.1 port; each
client is its own process (the pinned ``tinker`` SDK) with its own slot and
``--rows`` bundled SFT examples (a seeded sample per client) as datums; a round is one
``forward_backward(cross_entropy)`` + ``optim_step``.

- Round trip: one client's round through the SDK, each round waiting for the last, vs
  the same round in process (``forward_tokens`` + ``optim_step_clipped`` of one slot on
  the same rows). Goal <= 1.25x.
- Throughput: input tokens/s of 1, 4 and 16 concurrent clients (wall time from a common
  start to the last client's end), each client submitting ``--submit-ahead`` rounds beyond
  the one it waits for (default 1, the cookbook's training loop), vs the 16 slots stepped
  in process on the same rows (one mixed batch of all 16 clients' rows, then 16 optimizer
  steps). Goal: 16 clients >= 0.8x in process: the server's batching across tenants must
  carry the API's cost. Each run also reports the CPU seconds of the server and of the
  clients (they share the machine's cores with the server).
- Each ratio's in-process figure is measured just before and just after the SDK run it
  divides (both reported; the ratio uses their mean): the speed of a shared VM drifts by
  10-15% over minutes.

- Sampling: sampled tokens/s of 1, 4 and 16 concurrent sampling clients, each sampling
  its own sampler snapshot (``--max-tokens`` per request, one sample, temperature 1,
  seeded; ``--submit-ahead`` requests kept in flight). Goal: 16 clients >= 6x one (the
  server batches the requests of every snapshot into one KV-cached generation). The same
  generation in process (``sample_tokens`` of 1 and of 16 snapshot slots) for reference.
- RL step: one tenant's step as the cookbook's RL loop makes it (a sampler snapshot of the
  current weights, ``--group`` samples of one prompt, ``forward_backward`` with
  ``importance_sampling`` on them with group-centred advantages, ``optim_step``), each step
  waiting for the last, vs the same calls on ``SlotTrainer`` in process (``save_slot``
  without optimizer + ``export_slot`` + ``load_slot`` into a sampler slot, ``sample_tokens``,
  ``forward_tokens``, ``optim_step_clipped``).
- HTTP: the server's CPU per request of three calls with no model work (``healthz``,
  ``get_server_capabilities``, ``session_heartbeat``), ``--requests`` of each in a row.

- Threads (``--parts threads``, not in the default parts: it starts a server per
  setting): training rounds/s of 1, 4 and 16 concurrent SDK clients (on this machine,
  sharing its cores) against servers of each thread setting in one run: the default
  (``serve.threads`` auto, no ``OMP_NUM_THREADS``), ``OMP_NUM_THREADS=1``, torch's own
  default (a thread per physical core) and every other count up to the cores. Goal: the
  default >= 0.9x the best setting, and 4 clients >= 1 client.

``--parts`` picks among ``http``, ``train``, ``sample``, ``rl`` and ``threads`` (default
all but ``threads``). Prints one
JSON line (medians over ``--rounds`` after ``--warmup``).

    .venv/bin/python scripts/bench/service.py [--hidden 384] [--layers 4] [--rank 16] [--rows 4] [--rounds 8] [--clients 1,4,16] [--submit-ahead 1] [--parts http,train,sample,rl,threads] [--max-tokens 16] [--group 4] [--requests 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean, median
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
HEAD_DIM = 64
SLOTS = 16
LR = 1e-3
TARGET_ROUND_TRIP = 1.25
TARGET_THROUGHPUT = 0.8
TARGET_SAMPLING = 6.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def overrides(args: argparse.Namespace) -> list[str]:
    heads = args.hidden // HEAD_DIM
    return [
        f"model.hidden_size={args.hidden}", f"model.intermediate_size={args.intermediate}",
        f"model.num_hidden_layers={args.layers}", f"model.num_attention_heads={heads}",
        f"model.num_key_value_heads={max(1, heads // 2)}", "model.dtype=bf16",
        f"lora.num_slots={SLOTS}", f"lora.r={args.rank}", f"lora.alpha={2 * args.rank}",
        f"lora.target_modules=[{','.join(TARGETS)}]", "data.max_seq_len=128",
        "checkpoint.fsync=false", "logging.progress=false", "serve.poll_timeout_s=20",
        "serve.tokenizer_cache=",
    ]  # fmt: skip


def examples(client: int, rows: int) -> list[tuple[list[int], list[int], list[float]]]:
    """(tokens, targets, weights) of ``rows`` bundled SFT examples, seeded by ``client``."""
    import torch

    from veoptim.data import IGNORE_INDEX, load_sft_dataset, load_tokenizer

    dataset = load_sft_dataset("", load_tokenizer(), 128, False)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(client))
    out = []
    for i in order[:rows].tolist():
        ids, labels = dataset[i]["input_ids"].tolist(), dataset[i]["labels"].tolist()
        weights = [float(label != IGNORE_INDEX) for label in labels[1:]]
        out.append((ids[:-1], ids[1:], weights))
    return out


# ------------------------------------------------------------------ one client process
def client_main(url: str, key: str, client: int, rows: int, rounds: int, rank: int,
                ahead: int, start_file: str, out_file: str) -> None:  # fmt: skip
    """One tenant: ``rounds`` rounds after a warm-up, keeping ``ahead`` rounds submitted
    beyond the one it waits for (0: each round waits for the last; 1: the cookbook's
    ``submit_ahead`` default, round k+1 is submitted before round k's results are read)."""
    import numpy as np
    import tinker
    from tinker import types

    sc = tinker.ServiceClient(base_url=url, api_key=key)
    tc = sc.create_lora_training_client(base_model="tiny_dense", rank=rank, seed=client,
                                        train_unembed=False).result()  # fmt: skip
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(t),
            loss_fn_inputs={
                "target_tokens": np.array(y, np.int64),
                "weights": np.array(w, np.float32),
            },
        )  # fmt: skip
        for t, y, w in examples(client, rows)
    ]
    tokens = sum(len(t) for t, _, _ in examples(client, rows))

    def submit() -> tuple[float, Any, Any]:
        fb = tc.forward_backward(data, "cross_entropy")
        return time.perf_counter(), fb, tc.optim_step(types.AdamParams(learning_rate=LR))

    def finish(submitted: tuple[float, Any, Any]) -> float:
        began, fb, step = submitted
        fb.result()
        step.result()
        return time.perf_counter() - began

    finish(submit())  # warm up
    Path(out_file + ".ready").touch()
    wait_for_start(start_file)
    began, cpu = time.time(), time.process_time()
    in_flight, times = [], []
    for _ in range(rounds):
        in_flight.append(submit())
        if len(in_flight) > ahead:
            times.append(finish(in_flight.pop(0)))
    times += [finish(s) for s in in_flight]
    ended = time.time()
    Path(out_file).write_text(json.dumps({"tokens": tokens * rounds, "times": times,
                                          "start": began, "end": ended,
                                          "cpu_s": time.process_time() - cpu}))  # fmt: skip
    sc.close("success").result()


def wait_for_start(start_file: str) -> None:
    deadline = time.monotonic() + 600
    while not os.path.exists(start_file) and time.monotonic() < deadline:
        time.sleep(0.005)


def sampling_prompt(client: int) -> list[int]:
    """The prompt part of a bundled example (everything before its first trained token)."""
    tokens, _, weights = examples(client, 1)[0]
    return tokens[: weights.index(1.0) + 1] if 1.0 in weights else tokens[:16]


def publish_main(url: str, key: str, count: int, rank: int, out_file: str) -> None:
    """``count`` sampler snapshots (one training client each, seeded by its index), then the
    session's end, which frees their slots for the snapshots; their paths to ``out_file``."""
    import tinker

    sc = tinker.ServiceClient(base_url=url, api_key=key)
    paths = []
    for i in range(count):
        tc = sc.create_lora_training_client(base_model="tiny_dense", rank=rank, seed=i,
                                            train_unembed=False).result()  # fmt: skip
        paths.append(tc.save_weights_for_sampler(f"bench_{i}").result().path)
    sc.close("success").result()
    Path(out_file).write_text(json.dumps(paths))


def sampler_main(url: str, key: str, client: int, path: str, rounds: int, max_tokens: int,
                 ahead: int, start_file: str, out_file: str) -> None:  # fmt: skip
    """One sampling client: ``rounds`` requests of one sample from snapshot ``path``."""
    import tinker
    from tinker import types

    sc = tinker.ServiceClient(base_url=url, api_key=key)
    sampler = sc.create_sampling_client(model_path=path).result()
    prompt = types.ModelInput.from_ints(sampling_prompt(client))

    def submit(k: int) -> tuple[float, Any]:
        params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=k)
        return time.perf_counter(), sampler.sample(prompt, 1, params)

    def finish(submitted: tuple[float, Any]) -> tuple[float, int]:
        began, future = submitted
        tokens = sum(len(seq.tokens) for seq in future.result().sequences)
        return time.perf_counter() - began, tokens

    finish(submit(10**9 + client))  # warm up: the snapshot is in a slot
    Path(out_file + ".ready").touch()
    wait_for_start(start_file)
    began, cpu = time.time(), time.process_time()
    in_flight, done = [], []
    for k in range(rounds):
        in_flight.append(submit(client * 100_000 + k))
        if len(in_flight) > ahead:
            done.append(finish(in_flight.pop(0)))
    done += [finish(s) for s in in_flight]
    ended = time.time()
    Path(out_file).write_text(json.dumps({"tokens": sum(n for _, n in done),
                                          "times": [t for t, _ in done], "start": began,
                                          "end": ended, "cpu_s": time.process_time() - cpu}))  # fmt: skip
    sc.close("success").result()


def rl_datums(prompt: list[int], samples: list[tuple[list[int], list[float]]],
              ) -> list[tuple[list[int], dict[str, list]]]:  # fmt: skip
    """``importance_sampling`` inputs of a group of samples of one prompt: the sequence
    shifted by one, the sampler's log-probabilities and the reward minus the group's mean
    on the sampled tokens (reward: the share of even token ids, deterministic)."""
    rewards = [sum(t % 2 == 0 for t in tokens) / max(1, len(tokens)) for tokens, _ in samples]
    mean = sum(rewards) / len(rewards)
    out = []
    for (tokens, logprobs), reward in zip(samples, rewards, strict=True):
        sequence = prompt + tokens
        pad = [0.0] * (len(prompt) - 1)
        out.append((sequence[:-1], {"target_tokens": sequence[1:],
                                    "logprobs": pad + list(logprobs),
                                    "advantages": pad + [reward - mean] * len(tokens)}))  # fmt: skip
    return out


def rl_main(url: str, key: str, rounds: int, warmup: int, rank: int, max_tokens: int,
            group: int, out_file: str) -> None:  # fmt: skip
    """One tenant's RL steps through the SDK, each waiting for the last."""
    import numpy as np
    import tinker
    from tinker import types

    sc = tinker.ServiceClient(base_url=url, api_key=key)
    tc = sc.create_lora_training_client(base_model="tiny_dense", rank=rank, seed=0,
                                        train_unembed=False).result()  # fmt: skip
    prompt = sampling_prompt(0)
    times = []
    for k in range(warmup + rounds):
        began = time.perf_counter()
        sampler = tc.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=k)
        response = sampler.sample(types.ModelInput.from_ints(prompt), group, params).result()
        samples = [(list(s.tokens), list(s.logprobs)) for s in response.sequences]
        data = [
            types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs={
                "target_tokens": np.array(inputs["target_tokens"], np.int64),
                "logprobs": np.array(inputs["logprobs"], np.float32),
                "advantages": np.array(inputs["advantages"], np.float32)})
            for tokens, inputs in rl_datums(prompt, samples)
        ]  # fmt: skip
        fb = tc.forward_backward(data, "importance_sampling")
        step = tc.optim_step(types.AdamParams(learning_rate=LR))
        fb.result()
        step.result()
        if k >= warmup:
            times.append(time.perf_counter() - began)
    Path(out_file).write_text(json.dumps({"times": times}))
    sc.close("success").result()


# ------------------------------------------------------------------ in process
ADAM = {"lr": LR, "betas": (0.9, 0.95), "eps": 1e-12, "weight_decay": 0.0}  # the SDK's defaults


def in_process(
    args: argparse.Namespace, run_dir: Path, parts: set[str]
) -> tuple[dict[str, Any], Any]:
    """The benchmark's parts on ``SlotTrainer`` in this process, 16 slots seeded 0..15: the
    sampling and RL figures, and the training rounds (measured later, around the SDK runs
    they are compared with)."""
    from tasks.compose import load_config
    from veoptim.slots import SlotTrainer

    if not parts & {"train", "sample", "rl"}:
        return {}, None
    cfg = load_config("serve", [f"run.dir={run_dir}", *overrides(args)])
    trainer = SlotTrainer.from_config(cfg)
    for s in range(SLOTS):
        trainer.create_slot(s, r=args.rank, seed=s)
    out: dict[str, Any] = {}
    training = TrainingRounds(args, trainer) if "train" in parts else None
    if "sample" in parts:
        out["sample"] = in_process_sampling(args, trainer)
    if "rl" in parts:
        out["rl"] = in_process_rl(args, trainer)
    return out, training


class TrainingRounds:
    """The training rounds of the clients, in process: one slot's rows, and the 16 slots'
    rows as one batch followed by 16 optimizer steps. A ratio's baseline is measured just
    before and just after the SDK run it divides (their mean), as this VM's speed drifts
    by 10-15% over minutes."""

    def __init__(self, args: argparse.Namespace, trainer: Any) -> None:
        import numpy as np

        from veoptim.service.losses import get_loss
        from veoptim.service.wire import Datum

        self.args, self.trainer = args, trainer
        self.loss = get_loss("cross_entropy", {})
        self.rows = {s: [Datum(np.array(t, np.int64), {"target_tokens": np.array(y, np.int64),
                                                       "weights": np.array(w, np.float32)})
                         for t, y, w in examples(s, args.rows)]
                     for s in range(SLOTS)}  # fmt: skip
        for _ in range(args.warmup):
            self.run([0])
            self.run(list(range(SLOTS)))

    def run(self, slots: list[int]) -> tuple[float, int]:
        from veoptim.service.backend import build_batch
        from veoptim.slots.tokens import forward_tokens, optim_step_clipped

        start = time.perf_counter()
        batch = build_batch([(s, d) for s in slots for d in self.rows[s]], self.loss)
        forward_tokens(self.trainer, batch, self.loss.row_losses, backward=True)
        for s in slots:
            optim_step_clipped(self.trainer, s, 0.0, **ADAM)
        tokens = sum(d.tokens.shape[0] for s in slots for d in self.rows[s])
        return time.perf_counter() - start, tokens

    def one_slot_round_s(self) -> float:
        return median(self.run([0])[0] for _ in range(self.args.rounds))

    def sixteen_slots_tokens_per_s(self) -> float:
        many = [self.run(list(range(SLOTS))) for _ in range(self.args.rounds)]
        return many[0][1] / median(t for t, _ in many)


def in_process_sampling(args: argparse.Namespace, trainer: Any) -> dict[str, Any]:
    """Tokens/s of one generation of one slot's row, and of 16 slots' rows together."""
    import torch

    from veoptim.slots.tokens import SampleRow, sample_tokens

    prompts = {s: sampling_prompt(s) for s in range(SLOTS)}

    def run(slots: list[int], k: int) -> float:
        rows = [SampleRow(prompts[s], s, args.max_tokens, 1.0,
                          generator=torch.Generator().manual_seed(s * 100_000 + k))
                for s in slots]  # fmt: skip
        start = time.perf_counter()
        tokens = sum(len(r.tokens) for r in sample_tokens(trainer, rows))
        return tokens / (time.perf_counter() - start)

    for k in range(args.warmup):
        run([0], k)
        run(list(range(SLOTS)), k)
    one = median(run([0], k) for k in range(args.rounds))
    many = median(run(list(range(SLOTS)), k) for k in range(args.rounds))
    return {"one_slot_tokens_per_s": round(one, 1), "sixteen_slots_tokens_per_s": round(many, 1),
            "ratio_16_vs_1": round(many / one, 2)}  # fmt: skip


def in_process_rl(args: argparse.Namespace, trainer: Any) -> dict[str, Any]:
    """The RL step of ``rl_main`` on slot 0, its snapshot sampled from slot 1."""
    import numpy as np
    import torch

    from veoptim.service.backend import build_batch
    from veoptim.service.losses import get_loss
    from veoptim.service.wire import Datum
    from veoptim.slots import tokens as slot_tokens

    loss = get_loss("importance_sampling", {})
    prompt = sampling_prompt(0)
    dtypes = {"target_tokens": np.int64, "logprobs": np.float32, "advantages": np.float32}

    def step(k: int) -> float:
        start = time.perf_counter()
        trainer.save_slot(0, "bench_rl", with_optimizer=False)
        trainer.export_slot(0, "bench_rl")
        trainer.load_slot(1, "bench_rl", load_optimizer=False)
        rows = [slot_tokens.SampleRow(prompt, 1, args.max_tokens, 1.0,
                                      generator=torch.Generator().manual_seed(k * 1000 + i))
                for i in range(args.group)]  # fmt: skip
        samples = [(r.tokens, r.logprobs) for r in slot_tokens.sample_tokens(trainer, rows)]
        data = [(0, Datum(np.array(tokens, np.int64),
                          {name: np.array(v, dtypes[name]) for name, v in inputs.items()}))
                for tokens, inputs in rl_datums(prompt, samples)]  # fmt: skip
        slot_tokens.forward_tokens(trainer, build_batch(data, loss), loss.row_losses,
                                   backward=True)  # fmt: skip
        slot_tokens.optim_step_clipped(trainer, 0, 0.0, **ADAM)
        return time.perf_counter() - start

    for k in range(args.warmup):
        step(k)
    return {"step_s": round(median(step(args.warmup + k) for k in range(args.rounds)), 4)}


# ------------------------------------------------------------------ the server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def client_env() -> dict[str, str]:
    """A client process's environment: offline, no telemetry, the repository importable."""
    return {**os.environ, "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}


def run_clients(commands: list[list[str]], outs: list[Path], start_file: Path,
                server_pid: int) -> tuple[list[dict[str, Any]], float]:  # fmt: skip
    """Start one client process per command, wait until each is warm (``OUT.ready``), start
    them together; their results and the server's CPU seconds meanwhile."""
    procs = [subprocess.Popen([sys.executable, __file__, *c], env=client_env()) for c in commands]
    deadline = time.monotonic() + 600
    while not all(Path(f"{o}.ready").exists() for o in outs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            raise RuntimeError("a client process failed")
        time.sleep(0.05)
    server_cpu = cpu_seconds(server_pid)
    start_file.touch()
    deadline = time.monotonic() + 600
    while not all(o.exists() for o in outs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            raise RuntimeError("a client process failed")
        time.sleep(0.05)
    server_cpu = cpu_seconds(server_pid) - server_cpu
    for p in procs:  # the SDK's close can leave a heartbeat thread running: not measured
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return [json.loads(o.read_text()) for o in outs], server_cpu


def summary(results: list[dict[str, Any]], server_cpu: float) -> dict[str, Any]:
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    return {"tokens_per_s": round(sum(r["tokens"] for r in results) / wall, 1),
            "rounds_per_s": round(sum(len(r["times"]) for r in results) / wall, 2),
            "round_s_median": round(median(t for r in results for t in r["times"]), 4),
            "wall_s": round(wall, 2), "server_cpu_s": round(server_cpu, 2),
            "clients_cpu_s": round(sum(r["cpu_s"] for r in results), 2)}  # fmt: skip


def training_clients(args: argparse.Namespace, url: str, key: str, count: int, ahead: int,
                     work: Path, server_pid: int) -> dict[str, Any]:  # fmt: skip
    start_file = work / f"start_{count}_{ahead}"
    outs = [work / f"client_{count}_{ahead}_{i}.json" for i in range(count)]
    commands = [["--client", url, key, str(i), str(args.rows), str(args.rounds), str(args.rank),
                 str(ahead), str(start_file), str(out)] for i, out in enumerate(outs)]  # fmt: skip
    results, server_cpu = run_clients(commands, outs, start_file, server_pid)
    return {"clients": count, "submit_ahead": ahead, **summary(results, server_cpu)}


def sampling_clients(args: argparse.Namespace, url: str, key: str, paths: list[str], count: int,
                     work: Path, server_pid: int) -> dict[str, Any]:  # fmt: skip
    start_file = work / f"sample_start_{count}"
    outs = [work / f"sampler_{count}_{i}.json" for i in range(count)]
    commands = [["--sampler", url, key, str(i), paths[i], str(args.rounds), str(args.max_tokens),
                 str(args.submit_ahead), str(start_file), str(out)]
                for i, out in enumerate(outs)]  # fmt: skip
    results, server_cpu = run_clients(commands, outs, start_file, server_pid)
    return {"clients": count, "submit_ahead": args.submit_ahead, **summary(results, server_cpu)}


def training_runs(args: argparse.Namespace, rounds: TrainingRounds, url: str, key: str,
                  counts: list[int], work: Path, server_pid: int) -> dict[str, Any]:  # fmt: skip
    """The round trip and the throughput runs, each ratio against the in-process rounds
    measured just before and after its run."""
    one = [rounds.one_slot_round_s()]
    latency = training_clients(args, url, key, 1, 0, work, server_pid)
    one.append(rounds.one_slot_round_s())
    runs, many = [], []
    for n in counts:
        if n == SLOTS:
            many.append(rounds.sixteen_slots_tokens_per_s())
        runs.append(training_clients(args, url, key, n, args.submit_ahead, work, server_pid))
        if n == SLOTS:
            many.append(rounds.sixteen_slots_tokens_per_s())
    by_count = {r["clients"]: r for r in runs}
    direct = {"one_slot_round_s_before_after": [round(t, 4) for t in one],
              "sixteen_slots_tokens_per_s_before_after": [round(t, 1) for t in many]}  # fmt: skip
    return {
        "in_process_train": direct, "sdk_round_trip": latency, "sdk": runs,
        "round_trip_ratio_sdk_vs_in_process": round(latency["round_s_median"] / mean(one), 3),
        "throughput_ratio_16_clients_vs_in_process": (
            round(by_count[SLOTS]["tokens_per_s"] / mean(many), 3) if many else None),
    }  # fmt: skip


def http_costs(url: str, key: str, requests: int, server_pid: int) -> dict[str, Any]:
    """The server's CPU and the wall time per request of three calls without model work,
    ``requests`` of each in a row from one keep-alive connection: ``healthz`` (no key),
    ``get_server_capabilities`` (the key looked up), ``session_heartbeat`` (a database
    write)."""
    import httpx

    with httpx.Client(base_url=f"{url}/api/v1", headers={"X-API-Key": key}) as http:
        session = http.post("/create_session", json={"tags": []}).json()["session_id"]
        calls = {
            "healthz": lambda: http.get("/healthz"),
            "get_server_capabilities": lambda: http.get("/get_server_capabilities"),
            "session_heartbeat": lambda: http.post("/session_heartbeat",
                                                   json={"session_id": session}),
        }  # fmt: skip
        out = {}
        for name, call in calls.items():
            for _ in range(50):
                call().raise_for_status()
            cpu, start = cpu_seconds(server_pid), time.perf_counter()
            for _ in range(requests):
                call()
            wall, cpu = time.perf_counter() - start, cpu_seconds(server_pid) - cpu
            out[name] = {"server_cpu_us_per_request": round(1e6 * cpu / requests),
                         "wall_us_per_request": round(1e6 * wall / requests)}  # fmt: skip
        http.post(f"/sessions/{session}/finish", json={"reason": "success"})
    return out


def start_server(args: argparse.Namespace, work: Path, name: str, extra: list[str],
                 env: dict[str, str]) -> tuple[subprocess.Popen, str]:  # fmt: skip
    """A server process on a free 127.0.0.1 port (``extra`` overrides, ``env`` on top of
    this process's environment, None values removed), answering ``healthz``; its URL."""
    port = free_port()
    environ = {**os.environ, "PYTHONPATH": str(REPO), **env}
    server = subprocess.Popen(
        [sys.executable, "-m", "tasks.serve", f"run.dir={work / name}", f"serve.port={port}",
         f"serve.keys_file={work / 'keys.txt'}", *overrides(args), *extra],
        cwd=REPO, env={k: v for k, v in environ.items() if v is not None},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                return server, url
        except httpx.HTTPError:
            time.sleep(0.2)
        if server.poll() is not None:
            break
    server.kill()
    raise RuntimeError(f"the {name} server did not start")


def thread_variants() -> dict[str, tuple[list[str], dict[str, Any]]]:
    """The servers' thread settings compared by ``--parts threads``: the default (auto,
    no ``OMP_NUM_THREADS``), ``OMP_NUM_THREADS=1``, torch's own default (a thread per
    physical core, what a server that leaves it to chance gets) and every other explicit
    count up to the cores."""
    import torch

    torch_default = torch.get_num_threads() if "OMP_NUM_THREADS" not in os.environ else None
    if torch_default is None:  # this process runs under OMP_NUM_THREADS: ask a fresh one
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                             env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"},
                             capture_output=True, text=True, check=True)  # fmt: skip
        torch_default = int(out.stdout)
    variants = {
        "default": ([], {"OMP_NUM_THREADS": None}),
        "omp_num_threads_1": ([], {"OMP_NUM_THREADS": "1"}),
        f"torch_default_{torch_default}": ([f"serve.threads={torch_default}"],
                                           {"OMP_NUM_THREADS": None}),
    }  # fmt: skip
    for n in range(2, (os.cpu_count() or 1) + 1):
        if n != torch_default:
            variants[f"explicit_{n}"] = ([f"serve.threads={n}"], {"OMP_NUM_THREADS": None})
    return variants


def thread_runs(
    args: argparse.Namespace, key: str, counts: list[int], work: Path
) -> dict[str, Any]:
    """Training rounds/s of ``counts`` concurrent SDK clients (on this machine) against a
    server of each thread variant, in one run; the default against the others."""
    out: dict[str, Any] = {}
    for name, (extra, env) in thread_variants().items():
        server, url = start_server(args, work, f"threads_{name}", extra, env)
        try:
            out[name] = {str(n): training_clients(args, url, key, n, args.submit_ahead, work,
                                                  server.pid)["rounds_per_s"]
                         for n in counts}  # fmt: skip
        finally:
            server.terminate()
            server.wait(120)
    best = {n: max(v[str(n)] for v in out.values()) for n in counts}
    default = out["default"]
    return {
        "rounds_per_s": out,
        "default_vs_best": {str(n): round(default[str(n)] / best[n], 3) for n in counts},
        "default_vs_omp_num_threads_1": {
            str(n): round(default[str(n)] / out["omp_num_threads_1"][str(n)], 3) for n in counts},
        "default_vs_torch_default": {
            str(n): round(default[str(n)] / v[str(n)], 3) for n in counts
            for k, v in out.items() if k.startswith("torch_default")},
        "default_4_vs_1_client": round(default["4"] / default["1"], 2)
        if "4" in default and "1" in default else None,
    }  # fmt: skip


def server_parts(args: argparse.Namespace, parts: set[str], report: dict[str, Any],
                 direct: dict[str, Any], training: Any, key: str, counts: list[int],
                 work: Path) -> None:  # fmt: skip
    """The parts measured on one default server: http, train, sample, rl."""
    server, url = start_server(args, work, "serve", [], {})
    try:
        if "http" in parts:
            report["http"] = http_costs(url, key, args.requests, server.pid)
        if "train" in parts:
            report.update(training_runs(args, training, url, key, counts, work, server.pid))
        if "sample" in parts:
            one_client("--publish", url, key, str(max(counts)), str(args.rank),
                       str(work / "snapshots.json"))  # fmt: skip
            paths = json.loads((work / "snapshots.json").read_text())
            sampling = [sampling_clients(args, url, key, paths, n, work, server.pid)
                        for n in counts]  # fmt: skip
            by_count = {r["clients"]: r for r in sampling}
            report.update({"sdk_sampling": sampling,
                "sampling_ratio_16_vs_1_client": round(
                    by_count[SLOTS]["tokens_per_s"] / by_count[1]["tokens_per_s"], 2)
                if SLOTS in by_count and 1 in by_count else None})  # fmt: skip
        if "rl" in parts:
            one_client("--rl", url, key, str(args.rounds), str(args.warmup), str(args.rank),
                       str(args.max_tokens), str(args.group), str(work / "rl.json"))  # fmt: skip
            step = median(json.loads((work / "rl.json").read_text())["times"])
            report.update({"sdk_rl_step_s": round(step, 4),
                           "rl_step_ratio_sdk_vs_in_process": round(
                               step / direct["rl"]["step_s"], 3)})  # fmt: skip
    finally:
        server.terminate()
        server.wait(120)


def one_client(*command: str) -> None:
    subprocess.run([sys.executable, __file__, *command], env=client_env(), check=True, timeout=1200)


def main() -> None:
    roles = {"--client": (client_main, (str, str, int, int, int, int, int, str, str)),
             "--publish": (publish_main, (str, str, int, int, str)),
             "--sampler": (sampler_main, (str, str, int, str, int, int, int, str, str)),
             "--rl": (rl_main, (str, str, int, int, int, int, int, str))}  # fmt: skip
    if sys.argv[1:2] and sys.argv[1] in roles:
        function, types_ = roles[sys.argv[1]]
        function(*(cast(a) for cast, a in zip(types_, sys.argv[2:], strict=True)))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rows", type=int, default=4, help="datums per client per round")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--submit-ahead", type=int, default=1,
                        help="requests each client keeps submitted in the throughput runs")  # fmt: skip
    parser.add_argument("--parts", default="http,train,sample,rl")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per sample")
    parser.add_argument("--group", type=int, default=4, help="samples per RL step")
    parser.add_argument("--requests", type=int, default=2000, help="per call of --parts http")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if not parts <= {"http", "train", "sample", "rl", "threads"}:
        parser.error(f"--parts takes http, train, sample, rl and threads; got {args.parts}")
    counts = [int(n) for n in args.clients.split(",")]
    if max(counts) > SLOTS:
        parser.error(f"--clients: at most {SLOTS} (the server's slots)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = Path(tempfile.mkdtemp(prefix="veoptim-service-bench-"))
    load_start = os.getloadavg()[0]
    direct, training = in_process(args, work / "in_process", parts)
    key = "tml-bench-" + os.urandom(16).hex()
    (work / "keys.txt").write_text(f"bench {key}\n")
    report: dict[str, Any] = {
        "bench": "service", "dir": str(work),
        "model": {"hidden_size": args.hidden, "intermediate_size": args.intermediate,
                  "num_hidden_layers": args.layers, "dtype": "bf16"},
        "lora_r": args.rank, "slots": SLOTS, "rows_per_client": args.rows, "rounds": args.rounds,
        "max_tokens": args.max_tokens, "rl_group": args.group, "in_process": direct,
    }  # fmt: skip
    if "threads" in parts:
        report["threads"] = thread_runs(args, key, counts, work)
    if parts - {"threads"}:
        server_parts(args, parts, report, direct, training, key, counts, work)
    report["targets"] = {"round_trip": f"<= {TARGET_ROUND_TRIP}",
                         "throughput": f">= {TARGET_THROUGHPUT}",
                         "sampling_16_vs_1": f">= {TARGET_SAMPLING}"}  # fmt: skip
    report["loadavg_1min_start_end"] = [round(load_start, 2), round(os.getloadavg()[0], 2)]
    report["cpus"] = os.cpu_count()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
