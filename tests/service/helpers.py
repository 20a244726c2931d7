"""Servers for the service tests, always on a free 127.0.0.1 port: one in this process
(a thread; its trainer's slot state can be read) or a real ``python -m tasks.serve``
subprocess. Every wait is bounded."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import uvicorn

from tests import forkserver
from tests.conftest import REPO

os.environ.setdefault("TINKER_TELEMETRY", "0")

import tinker  # noqa: E402
from tinker import types  # noqa: E402
from tinker.lib import internal_client_holder  # noqa: E402

HOST = "127.0.0.1"
TENANTS = ("alice", "bob")
BASE_MODEL = "tiny_dense"
#: A small server: 4 slots of rank <= 8, short timeouts.
OVERRIDES = [
    "lora.num_slots=4", "lora.r=8", "data.max_seq_len=64", "checkpoint.fsync=false",
    "serve.poll_timeout_s=5", "serve.drain_timeout_s=10", "serve.seq_gap_timeout_s=10",
    "logging.progress=false", "serve.tokenizer_cache=",
]  # fmt: skip


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def write_keys(path: Path) -> dict[str, str]:
    keys = {name: f"tml-test-{name}-{os.urandom(12).hex()}" for name in TENANTS}
    path.write_text("".join(f"{name} {key}\n" for name, key in keys.items()))
    return keys


def wait_healthy(
    url: str, timeout: float = 90.0, proc: subprocess.Popen | forkserver.ForkedModule | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not become healthy in {timeout} s")


def client_env(api_key: str = "") -> dict[str, str]:
    """The environment of an SDK client process: offline, one thread, no telemetry, Python
    stacks on a fatal signal, the repository importable; ``api_key`` as ``TINKER_API_KEY``."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONFAULTHANDLER": "1",
           "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    if api_key:
        env["TINKER_API_KEY"] = api_key
    return env


def holders_of(client: tinker.ServiceClient) -> list[Any]:
    """The SDK client's connection holders that exist (each has its own heartbeat)."""
    return [h for h in (client._session_holder, client._rest_holder) if h is not None]


def stop_sdk_thread(clients: Sequence[tinker.ServiceClient] = (), timeout: float = 10.0) -> None:
    """Before a client process exits: close its SDK clients locally and stop the SDK's
    event-loop thread, so that no SDK code runs while the interpreter finalizes.

    That loop runs in a daemon thread, which the interpreter ends at exit wherever it is
    (``pthread_exit``, an unwind through whatever native frames are on its stack); a test
    client process that had finished its work once ended with SIGABRT and printed nothing.
    Only for a process about to exit: the loop is the SDK's, shared by every client."""
    singleton = internal_client_holder._internal_client_holder_thread_singleton
    loop = singleton.loop_if_started()
    if loop is None:
        return
    for client in clients:
        for holder in holders_of(client):
            if holder._begin_close():
                asyncio.run_coroutine_threadsafe(holder._async_cleanup(), loop).result(timeout)
    loop.call_soon_threadsafe(loop.stop)
    singleton._thread.join(timeout)


def run_and_exit(main: Callable[[], Any]) -> None:
    """Run a client process's ``main``, stop the SDK's loop, and end the process with
    ``os._exit`` (0, or 1 after printing the traceback): its results are written by then,
    and skipping the interpreter's finalization leaves no SDK daemon thread to be torn
    down mid-call (a finished client once died of SIGABRT at exit, despite
    :func:`stop_sdk_thread`)."""
    code = 1
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            stop_sdk_thread()
        except Exception:
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


@dataclass
class Served:
    url: str
    keys: dict[str, str]
    run_dir: Path
    clients: list[tinker.ServiceClient] = field(default_factory=list)

    def client(self, tenant: str = "alice") -> tinker.ServiceClient:
        client = tinker.ServiceClient(base_url=self.url, api_key=self.keys[tenant])
        self.clients.append(client)
        return client

    def release_clients(self) -> None:
        """Stop the SDK clients' heartbeats and connection pools once their server is gone.

        An SDK client's background loop keeps its heartbeat task, which keeps the client,
        so a client of a stopped server would warn "heartbeat failed" for the rest of the
        suite. ``ServiceClient.close`` would first send the session's finish (retried for
        minutes against a dead server), so the holders are closed directly: local only."""
        for client in self.clients:
            for holder in holders_of(client):
                holder.close()
        self.clients.clear()

    def http(self, tenant: str | None = "alice") -> httpx.Client:
        headers = {"X-API-Key": self.keys[tenant]} if tenant else {}
        return httpx.Client(base_url=f"{self.url}/api/v1", headers=headers, timeout=30)


class InProcessServer(Served):
    """The service and uvicorn in threads of this process."""

    def __init__(self, run_dir: Path, *extra: str) -> None:
        from tasks.compose import load_config
        from veoptim.service.app import create_app
        from veoptim.service.runtime import Service
        from veoptim.service.server import uvicorn_config

        run_dir.mkdir(parents=True, exist_ok=True)
        keys = write_keys(run_dir / "keys.txt")
        port = free_port()
        cfg = load_config("serve", [f"run.dir={run_dir}", f"serve.port={port}",
                                    f"serve.keys_file={run_dir / 'keys.txt'}", *OVERRIDES, *extra])  # fmt: skip
        super().__init__(f"http://{HOST}:{port}", keys, run_dir)
        self.service = Service(cfg)
        self.service.start()
        self.uvicorn = uvicorn.Server(uvicorn_config(create_app(self.service), HOST, port))
        self._thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self._thread.start()
        wait_healthy(self.url, 30)

    @property
    def trainer(self) -> Any:
        return self.service.trainer

    def slot_of(self, model_id: str) -> int:
        return self.service.slots.of_model(model_id)

    def tenant_id(self, name: str) -> int:
        return self.service.db.tenant_id(name)

    def store_ref(self, path: str, tenant: str = "alice") -> str:
        """The slot-store entry behind the tenant's ``tinker://`` path."""
        from veoptim.service import paths

        ref = paths.parse(path)
        return self.service.db.checkpoint(
            self.tenant_id(tenant), ref.run_id, ref.kind, ref.name
        ).store_ref

    def close(self) -> None:
        self.uvicorn.should_exit = True
        self._thread.join(15)
        self.service.stop()
        self.release_clients()


class SubprocessServer(Served):
    """``python -m tasks.serve`` in its own process (forked from the preloaded server of
    ``tests/forkserver.py``); ``keys`` written once per run dir."""

    def __init__(self, run_dir: Path, *extra: str, keys: dict[str, str] | None = None,
                 kill_at: str = "", pause_at: str = "", port: int = 0) -> None:  # fmt: skip
        """``kill_at``: ``PHASE:N``, the server kills itself at the N-th save reaching PHASE;
        ``pause_at``: ``PHASE:N:FILE``, that save waits for FILE (both
        ``tests/service/killing_serve.py``); ``port``: 0 = a free one."""
        run_dir.mkdir(parents=True, exist_ok=True)
        keys = keys or write_keys(run_dir / "keys.txt")
        port = port or free_port()
        super().__init__(f"http://{HOST}:{port}", keys, run_dir)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        module = "tasks.serve"
        if kill_at or pause_at:
            module = "tests.service.killing_serve"
            env.update(VEOPTIM_TEST_KILL_AT=kill_at, VEOPTIM_TEST_PAUSE_AT=pause_at)
        self.log = (run_dir / "server.log").open("ab")
        self.proc = forkserver.ForkedModule(
            module, [f"run.dir={run_dir}", f"serve.port={port}",
                     f"serve.keys_file={run_dir / 'keys.txt'}", *OVERRIDES, *extra],
            cwd=REPO, env=env, stdout=self.log,
        )  # fmt: skip
        try:
            wait_healthy(self.url, 90, self.proc)
        except BaseException:
            self.kill()
            raise

    def wait_killed(self, timeout: float = 60) -> None:
        """Wait for the server to kill itself (``kill_at``); fail if it ends otherwise."""
        code = self.proc.wait(timeout)
        assert code == -signal.SIGKILL, f"the server exited with {code}, not by its SIGKILL"
        self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
        self.log.close()
        self.release_clients()

    def terminate(self, timeout: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout)
        self.log.close()
        self.release_clients()
        return code


def running(pid: int) -> bool:
    """Process ``pid`` exists and has not exited (a zombie waiting for its parent has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class TorchrunServer(Served):
    """``torchrun -m tasks.serve parallel=fsdp`` on 2 gloo ranks: one agent with
    ``--nproc-per-node 2`` (``nodes=1``), or two agents of one rank each, launched like two
    nodes on loopback (``nodes=2``: a dead rank then leaves rank 0's agent running)."""

    def __init__(self, run_dir: Path, *extra: str, nodes: int = 1) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        keys = write_keys(run_dir / "keys.txt")
        port = free_port()
        super().__init__(f"http://{HOST}:{port}", keys, run_dir)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        torchrun = [sys.executable, "-m", "torch.distributed.run"]
        if nodes == 1:
            launches = [[*torchrun, "--nproc-per-node", "2", "--master-addr", HOST,
                         "--master-port", str(free_port())]]  # fmt: skip
        else:
            master = str(free_port())
            launches = [[*torchrun, "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node",
                         "1", "--master-addr", HOST, "--master-port", master]
                        for n in range(2)]  # fmt: skip
        serve = ["-m", "tasks.serve", "parallel=fsdp", f"run.dir={run_dir}",
                 f"serve.port={port}", f"serve.keys_file={run_dir / 'keys.txt'}",
                 "serve.rank_timeout_s=60", *OVERRIDES, *extra]  # fmt: skip
        self.logs = [(run_dir / f"torchrun{n}.log").open("ab") for n in range(len(launches))]
        self.agents = [
            subprocess.Popen(
                [*launch, *serve],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
            for launch, log in zip(launches, self.logs, strict=True)
        ]
        try:
            wait_healthy(self.url, 120, self.agents[0])
        except BaseException:
            self.kill()
            raise

    def rank_pid(self, rank: int) -> int:
        """The process id of worker ``rank`` (from its environment)."""
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if (
                f"serve.port={self.url.rsplit(':', 1)[1]}".encode() in cmdline
                and b"torch.distributed.run" not in cmdline
                and f"RANK={rank}".encode() in environ
            ):
                return int(entry.name)
        raise LookupError(f"no worker of rank {rank} is running")

    def terminate(self, timeout: float = 60, agents_s: float = 60) -> list[int | None]:
        """SIGTERM to rank 0, which drains and stops the other ranks; the agents' exit codes
        (None: still running, killed). A SIGTERM to an agent reaches its ranks too, but
        torchrun then exits 1; an agent whose peer node failed waits in torchrun's exit
        barrier (minutes), so this waits for rank 0 itself first, then ``agents_s`` at
        most for the agents."""
        try:
            rank0 = self.rank_pid(0)
            os.kill(rank0, signal.SIGTERM)
        except LookupError:
            rank0 = None
        deadline = time.monotonic() + timeout
        while rank0 is not None and running(rank0):
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"rank 0 did not stop within {timeout} s of its SIGTERM")
            time.sleep(0.2)
        codes: list[int | None] = []
        deadline = time.monotonic() + agents_s
        for agent in self.agents:
            try:
                codes.append(agent.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        self.kill()
        return codes

    def kill(self) -> None:
        for agent in self.agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait(30)
        for log in self.logs:
            log.close()
        self.release_clients()


def datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    """Train on predicting tokens[1:] from tokens[:-1] (weights per target, default 1)."""
    n = len(tokens) - 1
    w = np.ones(n, dtype=np.float32) if weights is None else np.asarray(weights, np.float32)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], dtype=np.int64), "weights": w},
    )


def examples(tokenizer: Any, count: int, start: int = 0) -> list[types.Datum]:
    texts = [f"User: Uppercase word{i}\nAssistant: WORD{i}" for i in range(start, start + count)]
    return [datum(tokenizer.encode(t)) for t in texts]


def losses_of(result: types.ForwardBackwardOutput) -> float:
    return result.metrics["loss:sum"]


def train_step(tc: Any, data: list[types.Datum], **adam: float) -> float:
    """One forward_backward + optim_step through the SDK; the loss sum."""
    fb = tc.forward_backward(data, "cross_entropy")
    step = tc.optim_step(types.AdamParams(**{"learning_rate": 3e-3, **adam}))
    result = fb.result()
    step.result()
    return losses_of(result)


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two slot states differ: tensors bit for bit (dtype, shape), the rest exactly."""
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = (
            a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where} keys"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in differences(x, y, f"{where}[{i}]")
        ]
    return [] if a == b else [where]
