"""The config of ``python -m tasks.serve``: a multi-LoRA config plus the ``serve`` section."""

from __future__ import annotations

from dataclasses import dataclass, field

from veoptim.config.schema import opt
from veoptim.errors import ConfigError
from veoptim.slots import MultiLoRAConfig

#: serve.schedule: the orders of queued work across tenants (veoptim.service.engine).
SCHEDULES = ("fair", "fifo")


@dataclass
class ServeSection:
    host: str = opt("127.0.0.1", "Address the HTTP server binds (loopback by default).")
    port: int = opt(8000, "TCP port of the HTTP server (0 = any free port, logged at start).")
    base_model: str = opt(
        "", "Name clients pass as base_model (create_lora_training_client); empty = model.name."
    )
    keys_file: str = opt(
        "", "File of API keys, one 'NAME tml-KEY' per line (# comments); hashed into the db."
    )
    tokenizer_cache: str = opt(
        "auto",
        "Hugging Face cache into which the served tokenizer is installed at start under "
        "serve.base_model, so SDK clients on this machine load it offline "
        "(SamplingClient.get_tokenizer); auto = the huggingface_hub cache, empty = none.",
    )
    session_timeout_s: float = opt(
        120.0, "A session without a heartbeat for this long is finished and its slots freed."
    )
    poll_timeout_s: float = opt(
        20.0, "Longest retrieve_future long-poll before answering try_again (SDK waits 45 s)."
    )
    seq_gap_timeout_s: float = opt(
        60.0, "A request waiting this long for an earlier seq_id of its model fails (user)."
    )
    batch_tenants: bool = opt(
        True, "Run queued forward_backward requests of several models as one slot batch."
    )
    schedule: str = opt(
        "fair",
        "Order of queued work across tenants: fair (tenants take turns, each batch starts "
        "with the tenant served longest ago and others join one request per tenant at a "
        "time) or fifo (arrival order).",
    )
    max_batch_rows: int = opt(
        64,
        "Most rows (datums of forward_backward requests, samples of sampling requests) one "
        "batch holds; a single larger request runs alone.",
    )
    slice_s: float = opt(
        0.2,
        "Seconds of decoding a sampling batch runs before the worker may run one batch of "
        "waiting training requests (forward, forward_backward, optim_step): about the "
        "longest such a request waits for sampling; 0 = the whole generation at once.",
    )
    threads: int = opt(
        0,
        "torch intra-op threads of the server (each rank under torchrun); 0 = auto: "
        "OMP_NUM_THREADS if set, else the usable cores per rank on the host (at least 1).",
    )
    max_request_bytes: int = opt(64_000_000, "Largest request body accepted (bytes).")
    max_datums: int = opt(1024, "Most datums in one forward_backward request.")
    max_futures_per_tenant: int = opt(1024, "Most unfinished requests one tenant may have queued.")
    drain_timeout_s: float = opt(
        60.0, "On SIGTERM: how long queued requests may run before they are failed."
    )
    rank_timeout_s: float = opt(
        600.0,
        "torchrun: how long one trainer call may wait for a rank before the job gives up on it.",
    )


@dataclass
class ServeConfig(MultiLoRAConfig):
    """Root config of ``python -m tasks.serve`` (``veoptim-serve``)."""

    serve: ServeSection = field(default_factory=ServeSection)

    def check_serve_keys(self) -> None:
        s = self.serve
        if not 0 <= s.port < 65536:
            raise ConfigError(f"serve.port must be in [0, 65536), got {s.port}.")
        if not 0 < s.poll_timeout_s < 45:
            raise ConfigError(
                f"serve.poll_timeout_s must be in (0, 45) (the SDK's poll timeout is 45 s), "
                f"got {s.poll_timeout_s}."
            )
        for key in ("session_timeout_s", "seq_gap_timeout_s", "drain_timeout_s", "rank_timeout_s"):
            if getattr(s, key) <= 0:
                raise ConfigError(f"serve.{key} must be > 0, got {getattr(s, key)}.")
        if s.schedule not in SCHEDULES:
            raise ConfigError(
                f"serve.schedule must be one of {', '.join(SCHEDULES)}, got {s.schedule!r}."
            )
        if not s.slice_s >= 0:
            raise ConfigError(f"serve.slice_s must be >= 0 (0 = no slices), got {s.slice_s}.")
        if s.threads < 0:
            raise ConfigError(f"serve.threads must be >= 0 (0 = auto), got {s.threads}.")
        for key in ("max_request_bytes", "max_datums", "max_futures_per_tenant", "max_batch_rows"):
            if getattr(s, key) < 1:
                raise ConfigError(f"serve.{key} must be >= 1, got {getattr(s, key)}.")
        if self.lora.num_slots < 1:
            raise ConfigError(
                f"lora.num_slots must be >= 1 (one slot per training client), got "
                f"{self.lora.num_slots}."
            )
