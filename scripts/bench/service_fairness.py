"""Fairness across tenants: one tenant's backlog against another tenant's small requests,
through the SDK, on a server of each setup in one run: ``fair`` (the defaults: fair
schedule, sampling batches in slices of about ``serve.slice_s`` seconds),
``fair_whole`` (fair, each sampling batch whole: ``serve.slice_s=0``) and ``fifo``
(arrival order, whole batches: the order before fairness).

- Tenant B keeps ``--backlog`` sampling requests queued (``--samples`` samples of
  ``--max-tokens`` tokens each from the base model, temperature 1, seeded); each that
  ends is replaced at once.
- Tenant A sends small requests one after another: a ``forward`` of one short datum on
  its LoRA training client (another kind of work than B's: it cannot join B's batches,
  so only the scheduler decides when it runs).
- On each server: A alone, B alone, then both together (A's requests while B's backlog
  stays queued). Reported: A's latency (median, p95) together vs alone, B's sampled
  tokens/s together vs alone, and the batch time (the median seconds of B's sampling
  batches from the server's ``metrics.jsonl``: the batch's own decode, whole, without
  the requests run between its slices).
- Goals (``fair``): A's p95 together <= 2x its median alone + one batch time; B keeps
  >= 0.9 of its lone throughput.

The model is the service benchmark's (``scripts/bench/service.py``: dense Qwen2 of
``--hidden`` / ``--layers``, BF16, LoRA rank ``--rank``); ``serve.max_batch_rows`` is the
server's default unless ``--max-batch-rows`` is given. Prints one JSON line.

    .venv/bin/python scripts/bench/service_fairness.py [--backlog 16] [--samples 8] [--max-tokens 32] [--requests 40] [--seconds 20]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from scripts.bench import service as bench  # noqa: E402

TARGET_P95 = "A's p95 together <= 2 x A's median alone + one batch"
TARGET_B = 0.9


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


# ------------------------------------------------------------------ the tenants' processes
def tenant_a(url: str, key: str, requests: int, start_file: str, stop_file: str,
             out_file: str) -> None:  # fmt: skip
    """``requests`` forwards of one datum, each after the last (or until ``stop_file``)."""
    import numpy as np
    import tinker
    from tinker import types

    sc = tinker.ServiceClient(base_url=url, api_key=key)
    tc = sc.create_lora_training_client(base_model="tiny_dense", rank=8, seed=1,
                                        train_unembed=False).result()  # fmt: skip
    tokens, targets, weights = bench.examples(0, 1)[0]
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:32]),
                        loss_fn_inputs={"target_tokens": np.array(targets[:32], np.int64),
                                        "weights": np.array(weights[:32], np.float32)})  # fmt: skip
    for _ in range(3):  # warm up
        tc.forward([datum], "cross_entropy").result()
    Path(out_file + ".ready").touch()
    bench.wait_for_start(start_file)
    times = []
    for _ in range(requests):
        if os.path.exists(stop_file):
            break
        began = time.perf_counter()
        tc.forward([datum], "cross_entropy").result()
        times.append(time.perf_counter() - began)
    Path(out_file).write_text(json.dumps({"times": times}))
    sc.close("success").result()


def tenant_b(url: str, key: str, backlog: int, samples: int, max_tokens: int, seconds: float,
             start_file: str, out_file: str) -> None:  # fmt: skip
    """Keep ``backlog`` sampling requests queued for ``seconds``; sampled tokens/s."""
    import tinker
    from tinker import types

    sc = tinker.ServiceClient(base_url=url, api_key=key)
    sampler = sc.create_sampling_client(base_model="tiny_dense").result()
    prompt = types.ModelInput.from_ints(bench.sampling_prompt(1))

    def submit(k: int) -> Any:
        params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=k, stop=[])
        return sampler.sample(prompt, samples, params)

    submit(10**9).result()  # warm up
    Path(out_file + ".ready").touch()
    bench.wait_for_start(start_file)
    began, tokens, k = time.perf_counter(), 0, 0
    in_flight = []
    while time.perf_counter() - began < seconds:
        while len(in_flight) < backlog:
            in_flight.append(submit(k))
            k += 1
        done = in_flight.pop(0).result()
        tokens += sum(len(seq.tokens) for seq in done.sequences)
    wall = time.perf_counter() - began
    for future in in_flight:  # drain: the next phase starts on an empty queue
        future.result()
    Path(out_file).write_text(json.dumps({"tokens": tokens, "wall_s": wall}))
    sc.close("success").result()


# ------------------------------------------------------------------ one server's phases
def launch(role: str, *args: Any) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, role, *map(str, args)],
                            env=bench.client_env())  # fmt: skip


def phase(procs: list[subprocess.Popen], outs: list[Path], start: Path,
          stop: Path | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Wait until every process is warm, start them together; their results. ``stop``
    (if given) is created once the first process (B) ends, so that A stops with it."""
    deadline = time.monotonic() + 600
    while not all(Path(f"{o}.ready").exists() for o in outs):
        if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
            raise RuntimeError("a tenant process failed or did not get ready")
        time.sleep(0.05)
    start.touch()
    procs[0].wait(900)
    if stop is not None:
        stop.touch()
    for p in procs[1:]:
        p.wait(900)
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError("a tenant process failed")
    return [json.loads(o.read_text()) for o in outs]


def batch_seconds(metrics: Path, since: float) -> float:
    """The median seconds of the server's sampling batches logged after ``since``."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    times = [r["seconds"] for r in rows if r.get("op") == "sample" and r.get("time", 0) >= since]
    return median(times) if times else float("nan")


#: The server overrides of each setup.
SETUPS = {
    "fair": [],
    "fair_whole": ["serve.slice_s=0"],
    "fifo": ["serve.schedule=fifo", "serve.slice_s=0"],
}


def measure(args: argparse.Namespace, schedule: str, keys: dict[str, str], work: Path) -> dict:
    extra = [*SETUPS[schedule], "serve.max_futures_per_tenant=4096"]
    if args.slice_s and schedule == "fair":
        extra.append(f"serve.slice_s={args.slice_s}")
    if args.max_batch_rows:
        extra.append(f"serve.max_batch_rows={args.max_batch_rows}")
    server, url = bench.start_server(args, work, f"serve_{schedule}", extra, {})
    run = work / schedule
    run.mkdir()
    b_args = (args.backlog, args.samples, args.max_tokens, args.seconds)
    try:
        a = run / "a_alone.json"
        alone_a = phase([launch("--a", url, keys["a"], args.requests, run / "s1", run / "x1", a)],
                        [a], run / "s1")[0]  # fmt: skip
        b = run / "b_alone.json"
        alone_b = phase([launch("--b", url, keys["b"], *b_args, run / "s2", b)], [b], run / "s2")[0]
        since = time.time()
        a, b = run / "a_with_b.json", run / "b_with_a.json"
        with_b, with_a = phase(
            [launch("--b", url, keys["b"], *b_args, run / "s3", b),
             launch("--a", url, keys["a"], 10**6, run / "s3", run / "x3", a)],
            [b, a], run / "s3", stop=run / "x3",
        )  # fmt: skip
        batch = batch_seconds(work / f"serve_{schedule}" / "metrics.jsonl", since)
    finally:
        server.terminate()
        server.wait(120)
    lone = median(alone_a["times"])
    together = with_a["times"]
    b_alone = alone_b["tokens"] / alone_b["wall_s"]
    b_together = with_b["tokens"] / with_b["wall_s"]
    return {
        "a_alone_s": {
            "median": round(lone, 4),
            "p95": round(p95(alone_a["times"]), 4),
            "requests": len(alone_a["times"]),
        },
        "a_with_b_backlog_s": {
            "median": round(median(together), 4),
            "p95": round(p95(together), 4),
            "requests": len(together),
        },
        "batch_s": round(batch, 4),
        "a_p95_bound_s": round(2 * lone + batch, 4),
        "a_p95_within_bound": p95(together) <= 2 * lone + batch,
        "b_tokens_per_s_alone": round(b_alone, 1),
        "b_tokens_per_s_with_a": round(b_together, 1),
        "b_throughput_ratio": round(b_together / b_alone, 3),
    }


def main() -> None:
    roles = {"--a": (tenant_a, (str, str, int, str, str, str)),
             "--b": (tenant_b, (str, str, int, int, int, float, str, str))}  # fmt: skip
    if sys.argv[1:2] and sys.argv[1] in roles:
        function, types_ = roles[sys.argv[1]]
        function(*(cast(a) for cast, a in zip(types_, sys.argv[2:], strict=True)))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--backlog", type=int, default=16, help="B's queued sampling requests")
    parser.add_argument("--samples", type=int, default=8, help="samples per B request")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per B sample")
    parser.add_argument("--requests", type=int, default=40, help="A's requests when alone")
    parser.add_argument("--seconds", type=float, default=20.0, help="B's run in each phase")
    parser.add_argument("--max-batch-rows", type=int, default=0, help="0: the server default")
    parser.add_argument("--slice-s", type=float, default=0.0,
                        help="fair setup's serve.slice_s (0: the server default)")  # fmt: skip
    parser.add_argument("--setups", default=",".join(SETUPS), help="of " + ", ".join(SETUPS))
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = Path(tempfile.mkdtemp(prefix="veoptim-fairness-bench-"))
    keys = {t: f"tml-bench-{t}-" + os.urandom(16).hex() for t in ("a", "b")}
    (work / "keys.txt").write_text("".join(f"tenant_{t} {k}\n" for t, k in keys.items()))
    load_start = os.getloadavg()[0]
    report: dict[str, Any] = {
        "bench": "service_fairness", "dir": str(work),
        "model": {"hidden_size": args.hidden, "intermediate_size": args.intermediate,
                  "num_hidden_layers": args.layers, "dtype": "bf16"},
        "b_backlog": args.backlog, "b_samples_per_request": args.samples,
        "b_max_tokens": args.max_tokens, "b_seconds": args.seconds,
    }  # fmt: skip
    for schedule in args.setups.split(","):
        report[schedule] = measure(args, schedule, keys, work)
    report["targets"] = {"a_p95": TARGET_P95, "b_throughput_ratio": f">= {TARGET_B}"}
    report["loadavg_1min_start_end"] = [round(load_start, 2), round(os.getloadavg()[0], 2)]
    report["cpus"] = os.cpu_count()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
