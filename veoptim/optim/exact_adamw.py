"""FP32-master AdamW: the base of ``full_fp32_adamw``, ``master_fp32_adamw`` and ``cpu_offload_adamw``.

State per parameter: ``master_weight`` (FP32), ``exp_avg`` and
``exp_avg_sq`` (the group's moment dtype), ``step`` (FP32 scalar tensor). After
each update the model parameter is written from its master (round-to-nearest,
or stochastic rounding for BF16 parameters when enabled). For a resident FP32
parameter the parameter itself is the master: ``master_weight`` is the
parameter tensor (no second copy), and loading it writes the parameter.

State is created lazily at a parameter's first real gradient, from the
parameter's current value. The "dummy step" of
``torch.distributed.checkpoint.state_dict`` (empty state, every gradient zero,
every lr 0), recognised only inside :func:`~veoptim.optim.base.dcp_state_init`,
creates placeholder state with ``step == 0``; a placeholder is re-derived from
the parameter at the first real step, so weights loaded after it was made are
honoured. Edits of a parameter between steps are followed, never reverted
(``param_edits.py``). ``step`` is kept out of ``torch.compile`` graphs: the fused
kernel mutates its inputs in a way functionalization rejects.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
from torch.optim import Optimizer

from veoptim.errors import ConfigError
from veoptim.optim import kernels
from veoptim.optim.base import ValidatedOptimizerMixin
from veoptim.optim.checks import (
    ExpectedState,
    check_bool,
    check_hyper,
    check_int,
    check_moment_dtype,
    check_positive_finite,
    check_positive_int,
)
from veoptim.optim.dtensor_util import global_flat_offset, local, wrap_like
from veoptim.optim.kernels import DEFAULT_FUSED_CHUNK, Hyper, Scratch, UpdateBatch
from veoptim.optim.offload import StagingBuffer, offload_update_
from veoptim.optim.param_edits import EditFollowingMixin, Mark, log_rederived, mark_of
from veoptim.optim.rounding import noise_key
from veoptim.optim.state_keys import (
    CPU_OFFLOAD,
    EXP_AVG,
    EXP_AVG_SQ,
    MASTER_DTYPE,
    MASTER_WEIGHT,
    STEP,
    STEP_DTYPE,
    SUPPORTED_PARAM_DTYPES,
)

_HOST = torch.device("cpu")


class ExactAdamW(EditFollowingMixin, ValidatedOptimizerMixin, Optimizer):
    """AdamW with FP32 masters; groups with ``cpu_offload=True`` keep their state in host memory."""

    allows_offload: ClassVar[bool] = False

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        maximize: bool = False,
        amsgrad: bool = False,
        resident_moment_dtype: torch.dtype = torch.float32,
        offload_moment_dtype: torch.dtype = torch.float32,
        stochastic_rounding: bool = False,
        sr_seed: int = 0,
        chunk_size: int = 1 << 20,
        fused_chunk_size: int = DEFAULT_FUSED_CHUNK,
        kernel: str = "auto",
        param_names: Mapping[int, str] | None = None,
    ) -> None:
        check_bool("amsgrad", amsgrad)
        if amsgrad:
            raise ConfigError(
                f"{type(self).__name__} does not implement amsgrad (its state would need a fourth "
                "moment tensor outside the checkpoint format); use amsgrad=False."
            )
        defaults = dict(
            lr=lr,
            betas=tuple(betas) if isinstance(betas, (tuple, list)) else betas,
            eps=eps,
            weight_decay=weight_decay,
            maximize=maximize,
            **{CPU_OFFLOAD: False},
        )
        check_hyper(defaults)
        check_moment_dtype("resident_moment_dtype", resident_moment_dtype)
        check_moment_dtype("offload_moment_dtype", offload_moment_dtype)
        check_bool("stochastic_rounding", stochastic_rounding)
        check_int("sr_seed", sr_seed)
        check_positive_int("chunk_size", chunk_size)
        check_positive_int("fused_chunk_size", fused_chunk_size)
        self.resident_moment_dtype = resident_moment_dtype
        self.offload_moment_dtype = offload_moment_dtype
        self.stochastic_rounding = stochastic_rounding
        self.sr_seed = sr_seed
        self.chunk_size = chunk_size
        self.fused_chunk_size = fused_chunk_size
        #: "auto": a compiled mixed-dtype kernel on cuda/npu, the native one on CPU where it
        #: builds (kernels/native.py), else the eager engine ("eager", "compiled" force one).
        self.kernel = kernels.check_kernel(kernel)
        self.param_names: dict[int, str] = dict(param_names or {})
        self._init_runtime()
        super().__init__(params, defaults)

    def _init_runtime(self) -> None:
        """Buffers and bookkeeping that are rebuilt, not copied, by deepcopy and pickle."""
        self._scratch = Scratch()
        self._host_scratch = Scratch()
        self._staging: dict[torch.device, StagingBuffer] = {}
        self._unverified: set[torch.Tensor] = set()
        self._ordinals: dict[int, int] = {}
        #: Per parameter: its (_version, data_ptr) after this optimizer last wrote it.
        self._marks: dict[torch.Tensor, Mark] = {}

    # ------------------------------------------------------------------ deepcopy / pickle
    _SETTINGS: ClassVar[tuple[str, ...]] = (
        "resident_moment_dtype",
        "offload_moment_dtype",
        "stochastic_rounding",
        "sr_seed",
        "chunk_size",
        "fused_chunk_size",
        "kernel",
    )

    def _settings(self) -> dict[str, Any]:
        return {**super()._settings(), **{k: getattr(self, k) for k in self._SETTINGS}}

    def _restore_settings(self, settings: Mapping[str, Any]) -> None:
        super()._restore_settings(settings)
        for k in self._SETTINGS:
            # pickles from before the kernel option have none: the default
            setattr(self, k, settings.get(k, "auto") if k == "kernel" else settings[k])
        self._init_runtime()
        # No marks: the first step compares each parameter with its master once, which also
        # re-aliases resident FP32 masters (a deepcopy clones a Parameter apart from its state).
        for p in self._all_params():
            self._ordinals.setdefault(id(p), len(self._ordinals))

    # ------------------------------------------------------------------ groups and policy
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Validate the whole group first: a rejected group leaves the optimizer unchanged."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else params
        if not isinstance(params, set):  # torch rejects sets with its own message
            params = list(params)
            self._check_group({**self.defaults, **param_group}, params)
            param_group = {**param_group, "params": params}
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            self._ordinals.setdefault(id(p), len(self._ordinals))

    def _check_group(self, group: Mapping[str, Any], params: list[Any]) -> None:
        check_hyper(group)
        offload = group[CPU_OFFLOAD]
        check_bool(CPU_OFFLOAD, offload)
        if offload and not self.allows_offload:
            raise ConfigError(
                f"{type(self).__name__} keeps all state on the device; cpu_offload groups need "
                "cpu_offload_adamw."
            )
        for p in params:
            if not isinstance(p, torch.Tensor):
                continue  # torch's add_param_group names the offending value
            pl = local(p)
            if pl.dtype not in SUPPORTED_PARAM_DTYPES or not pl.is_contiguous():
                raise ConfigError(
                    f"{type(self).__name__} needs contiguous parameters of dtype "
                    f"{[str(d) for d in SUPPORTED_PARAM_DTYPES]}; {self._name(p)} is "
                    f"{pl.dtype}, contiguous={pl.is_contiguous()}."
                )
            if offload and pl.is_meta:
                raise ConfigError(
                    f"{self._name(p)} is on the meta device; an offloaded group copies its "
                    "parameters into host state, so materialise them before building the optimizer."
                )

    @staticmethod
    def is_offloaded(group: Mapping[str, Any]) -> bool:
        return bool(group.get(CPU_OFFLOAD, False))

    def moment_dtype(self, group: Mapping[str, Any]) -> torch.dtype:
        return self.offload_moment_dtype if self.is_offloaded(group) else self.resident_moment_dtype

    def state_device(self, param: torch.Tensor, group: Mapping[str, Any]) -> torch.device:
        return _HOST if self.is_offloaded(group) else local(param).device

    def master_is_param(self, param: torch.Tensor, group: Mapping[str, Any]) -> bool:
        """A resident FP32 parameter is its own master (no second copy)."""
        return local(param).dtype == MASTER_DTYPE and not self.is_offloaded(group)

    def expected_state(self, param: torch.Tensor) -> ExpectedState:
        """State keys with the local shape and dtype this optimizer keeps for ``param``."""
        group = self._group_of(param)
        shape = local(param).shape
        moment = self.moment_dtype(group)
        return {
            MASTER_WEIGHT: (shape, MASTER_DTYPE),
            EXP_AVG: (shape, moment),
            EXP_AVG_SQ: (shape, moment),
            STEP: (torch.Size([]), STEP_DTYPE),
        }

    # ------------------------------------------------------------------ state creation
    @torch.no_grad()
    def _fresh_state(self, p: torch.Tensor, group: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        pl, device, moment = local(p), self.state_device(p, group), self.moment_dtype(group)
        if self.master_is_param(p, group):
            master = p.detach()
        else:
            master_local = torch.empty(pl.shape, dtype=MASTER_DTYPE, device=device)
            master_local.copy_(pl)
            master = wrap_like(p, master_local)
        return {
            MASTER_WEIGHT: master,
            EXP_AVG: wrap_like(p, torch.zeros(pl.shape, dtype=moment, device=device)),
            EXP_AVG_SQ: wrap_like(p, torch.zeros(pl.shape, dtype=moment, device=device)),
            STEP: torch.zeros((), dtype=STEP_DTYPE, device=device),
        }

    def _real_state(
        self, p: torch.Tensor, group: Mapping[str, Any], edited: list[str]
    ) -> dict[str, torch.Tensor]:
        state = self.state[p]
        if p in self._unverified:
            self._unverified.discard(p)
            if state and float(state[STEP]) == 0.0:
                state = {}  # placeholder: re-derive from the parameter as it is now
        if not state:
            state = self._fresh_state(p, group)
            self.state[p] = state
        elif self._marks.get(p) != mark_of(p):
            self._follow_edit(p, group, state, edited)
        return state

    # ------------------------------------------------------------------ step
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure: Any = None, *, grad_divisor: float = 1.0) -> Any:
        """One update of every parameter with a gradient; ``grad_divisor`` divides every
        gradient in FP32 first (fp16 loss scaling: the scale over the clip coefficient), so
        a loss-scaled FP16 gradient is unscaled only once it is wide."""
        check_positive_finite("grad_divisor", grad_divisor)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._is_dcp_dummy_step():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self.state[p] = self._fresh_state(p, group)
                        self._unverified.add(p)
            return loss
        edited: list[str] = []
        for group in self.param_groups:
            self._step_group(group, edited, float(grad_divisor))
        log_rederived(type(self).__name__, edited)
        return loss

    def _step_group(self, group: dict[str, Any], edited: list[str], divisor: float) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        offloaded = self.is_offloaded(group)
        batch = UpdateBatch([], [], [], [], [], [], [], [])
        for p in params:
            grad = local(p.grad)
            if grad.is_sparse:
                raise ValueError(f"{type(self).__name__} does not support sparse gradients.")
            state = self._real_state(p, group, edited)
            batch.masters.append(local(state[MASTER_WEIGHT]).view(-1))
            batch.grads.append(grad.reshape(-1))
            batch.exp_avgs.append(local(state[EXP_AVG]).view(-1))
            batch.exp_avg_sqs.append(local(state[EXP_AVG_SQ]).view(-1))
            batch.steps.append(state[STEP])
            batch.outs.append(None if self.master_is_param(p, group) else local(p).view(-1))
        torch._foreach_add_(batch.steps, 1.0)
        if self.stochastic_rounding:
            steps = torch.stack([s.to(_HOST) for s in batch.steps]).tolist()
            for p, s in zip(params, steps, strict=True):
                batch.sr_keys.append(noise_key(self.sr_seed, int(s), self._ordinals[id(p)]))
                batch.sr_offsets.append(global_flat_offset(p))
        beta1, beta2 = group["betas"]
        hp = Hyper(
            float(group["lr"]), beta1, beta2, group["eps"], group["weight_decay"], group["maximize"],
            grad_divisor=divisor,
        )  # fmt: skip
        sr = self.stochastic_rounding
        if offloaded:
            device = local(params[0]).device
            staging = self._staging.get(device)
            if staging is None:
                staging = self._staging[device] = StagingBuffer(self.chunk_size, device)
            host = kernels.select_host(self.kernel, batch, stochastic_rounding=sr,
                                       scratch=self._host_scratch, chunk=self.fused_chunk_size,
                                       scaled=hp.scaled)  # fmt: skip
            offload_update_(batch, hp, staging, host)
        else:
            kernel = kernels.select(self.kernel, batch, stochastic_rounding=sr,
                                    scratch=self._scratch, chunk=self.fused_chunk_size,
                                    scaled=hp.scaled)  # fmt: skip
            kernel.update_(batch, hp)
        for p in params:
            self._marks[p] = mark_of(p)

    # ------------------------------------------------------------------ state dict
    def state_dict(self) -> dict[str, Any]:
        """Torch's format; the ``cpu_offload`` placement flag is left out of the param groups."""
        sd = super().state_dict()
        for group in sd["param_groups"]:
            group.pop(CPU_OFFLOAD, None)
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Validate every group and state tensor, then install the tensors as they are.

        Raises CheckpointError (nothing changed) on any mismatch of group sizes,
        keys, dtypes or shapes. Tensors already on the state's device are installed
        without a copy (no parameter-dtype copies, unlike ``Optimizer.load_state_dict``).
        """
        state_dict = dict(state_dict)
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        owners = self._validated_owners(state_dict)
        saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
        # Everything is valid: place tensors (device moves only), then commit.
        new_state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        param_writes: list[tuple[torch.Tensor, torch.Tensor]] = []
        for key, entry in saved_state.items():
            p, group, _ = owners[key]
            device = self.state_device(p, group)
            placed = {k: wrap_like(p, local(v).to(device)) for k, v in entry.items() if k != STEP}
            placed[STEP] = entry[STEP].to(device)
            if self.master_is_param(p, group):
                src = local(placed[MASTER_WEIGHT])
                if src.data_ptr() != local(p).data_ptr():
                    param_writes.append((local(p), src))
                placed[MASTER_WEIGHT] = p.detach()
            new_state[p] = placed
        with torch.no_grad():
            for dst, src in param_writes:
                dst.copy_(src)
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            for k, v in saved.items():
                if k not in ("params", CPU_OFFLOAD):
                    group[k] = v
        self.state = new_state
        self._unverified = set()  # loaded step-0 state was validated against the parameter
        self._marks = {p: mark_of(p) for p in new_state}
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)


class FullFP32AdamW(ExactAdamW):
    """FP32 master, FP32 moments, all on the device."""

    def __init__(self, params: Iterable[Any], **kwargs: Any) -> None:
        kwargs.setdefault("resident_moment_dtype", torch.float32)
        super().__init__(params, **kwargs)


class MasterFP32AdamW(ExactAdamW):
    """FP32 master, BF16 moments (explicit), all on the device."""

    def __init__(self, params: Iterable[Any], **kwargs: Any) -> None:
        kwargs.setdefault("resident_moment_dtype", torch.bfloat16)
        super().__init__(params, **kwargs)


class CPUOffloadAdamW(ExactAdamW):
    """FP32 master; groups with ``cpu_offload=True`` keep master and moments in host memory."""

    allows_offload = True
