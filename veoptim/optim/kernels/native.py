"""The CPU mixed-dtype AdamW kernel (``adamw.c``): one pass, bitwise the eager engine.

With BF16 gradients or moments, the eager engine (``eager.py``) runs torch's
one-dtype fused kernel on FP32 scratch and pays a widening or narrowing pass per
narrow operand: 1.4-2.3x torch's FP32 AdamW on CPU. ``adamw.c`` widens, updates and
narrows in registers, with torch's FP32 arithmetic operation for operation, so its
results are bitwise those of the eager engine (and so of torch's AdamW on FP32).

It is compiled on first use with the system C compiler (``cc``, about 5-10 s) into a
per-user cache keyed by the source, the compiler, the flags and the CPU, and loaded
with ``ctypes``. Before its first use in a process it is run against the eager engine
on every dtype combination; a compiler that is missing or fails, or any bitwise
difference, leaves the eager engine in charge (one INFO or WARNING line). One call
updates a whole batch, shared over torch's OpenMP threads (``torch.set_num_threads``
applies; ``ctypes`` releases the GIL meanwhile).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from veoptim.optim.kernels.eager import Hyper, Scratch, UpdateBatch, adamw_update_

LOG = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("adamw.c")
#: -ffp-contract=off: the source spells out every fused multiply-add torch's kernel
#: uses, and the compiler must add none; -fno-math-errno lets sqrtf vectorise.
#: -fopenmp: the work is shared over torch's OpenMP threads (see adamw.c).
CFLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fopenmp",
    "-shared",
    "-fPIC",
)
#: Below this many elements a step runs in the calling thread only.
PARALLEL_MIN_NUMEL = 1 << 16
_OUT_KINDS = {None: 0, torch.bfloat16: 1, torch.float32: 2}
_NARROW = (torch.float32, torch.bfloat16)
_WIDE = (torch.float32,)


class _Hyper(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_float)
        for name in (
            "decay",
            "lerp_weight",
            "beta2",
            "sq_weight",
            "bc2_sqrt",
            "eps",
            "neg_step_size",
            "grad_sign",
        )
    ]


def _hyper(hp: Hyper, step: float) -> _Hyper:
    """The kernel's FP32 constants, rounded from FP64 exactly where torch's kernel rounds them."""
    step_size = hp.lr / (1 - hp.beta1**step)
    return _Hyper(
        1 - hp.lr * hp.weight_decay,
        1 - hp.beta1,
        hp.beta2,
        1 - hp.beta2,
        math.sqrt(1 - hp.beta2**step),
        hp.eps,
        -step_size,
        -1.0 if hp.maximize else 1.0,
    )


def cache_dir() -> Path:
    """Where built kernels are kept: private to the user (a per-user temporary directory
    where there is no home directory)."""
    try:
        return Path.home() / ".cache" / "veoptim" / "kernels"
    except RuntimeError:
        return Path(tempfile.gettempdir()) / f"veoptim-kernels-{os.getuid()}"


def _cpu_key() -> str:
    """What the build depends on besides the source: -march=native code is CPU-specific."""
    lines: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name = line.split(":")[0].strip()
            if name in ("flags", "Features", "model name"):
                lines.setdefault(name, line)
    except OSError:
        pass
    return platform.machine() + platform.processor() + "".join(sorted(lines.values()))


def build(
    compiler: str | None = None, directory: Path | None = None, flags: tuple[str, ...] = CFLAGS
) -> Path:
    """The shared library for this machine: built once (under a lock, into a temporary
    file renamed into place, so a reader never sees half a library), then reused. Raises
    OSError or CalledProcessError when no compiler works."""
    cc = compiler or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise FileNotFoundError("no C compiler (cc or gcc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), cc, version, *flags, _cpu_key()]).encode()
    ).hexdigest()[:16]
    directory = directory or cache_dir()
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = directory.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise PermissionError(f"{directory} is not a directory only this user can write to")
    target = directory / f"adamw-{key}.so"
    if target.exists():
        return target
    with open(directory / ".build.lock", "w") as lock:  # ranks starting together build once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        fd, tmp = tempfile.mkstemp(prefix=".adamw-", suffix=".so", dir=directory)
        os.close(fd)
        try:
            subprocess.run(
                [cc, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True, check=True
            )
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


class _Tensor(ctypes.Structure):
    _fields_ = [
        ("numel", ctypes.c_int64),
        ("master", ctypes.c_void_p),
        ("grad", ctypes.c_void_p),
        ("exp_avg", ctypes.c_void_p),
        ("exp_avg_sq", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("grad_bf16", ctypes.c_int32),
        ("moments_bf16", ctypes.c_int32),
        ("out_kind", ctypes.c_int32),
        ("hyper", ctypes.POINTER(_Hyper)),
    ]


class NativeKernel:
    """The loaded library: one call updates a whole batch on torch's OpenMP threads."""

    one_pass = True

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        self._fn = lib.veoptim_adamw
        self._fn.argtypes = [ctypes.POINTER(_Tensor), ctypes.c_int64, ctypes.c_int64]
        self._fn.restype = None

    @staticmethod
    def supports(batch: UpdateBatch, on_cpu: bool = True) -> bool:
        """FP32 masters; FP32/BF16 gradients and moments (both moments of one dtype, as the
        optimizers keep them); no, FP32 or BF16 parameter copy;
        all contiguous, and on the CPU unless ``on_cpu`` is False (an offloaded batch,
        whose device gradients are staged to the host chunk by chunk)."""
        for tensors, dtypes in (
            (batch.masters, _WIDE),
            (batch.grads, _NARROW),
            (batch.exp_avgs, _NARROW),
            (batch.exp_avg_sqs, _NARROW),
            ([o for o in batch.outs if o is not None], _NARROW),
        ):
            for t in tensors:
                if t.dtype not in dtypes or not t.is_contiguous() or (on_cpu and not t.is_cpu):
                    return False
        pairs = zip(batch.exp_avgs, batch.exp_avg_sqs, strict=True)
        return all(m.dtype == v.dtype for m, v in pairs)

    def update_(self, batch: UpdateBatch, hp: Hyper) -> None:
        """One AdamW step of every tensor of ``batch`` (steps already incremented)."""
        count = len(batch.masters)
        if not count:
            return
        hypers: dict[float, _Hyper] = {}
        tensors = (_Tensor * count)()
        for t, master, grad, m, v, out, step_t in zip(
            tensors,
            batch.masters,
            batch.grads,
            batch.exp_avgs,
            batch.exp_avg_sqs,
            batch.outs,
            batch.steps,
            strict=True,
        ):
            step = float(step_t.item())
            if step not in hypers:
                hypers[step] = _hyper(hp, step)
            t.numel = master.numel()
            t.master, t.grad = master.data_ptr(), grad.data_ptr()
            t.exp_avg, t.exp_avg_sq = m.data_ptr(), v.data_ptr()
            t.grad_bf16 = grad.dtype == torch.bfloat16
            t.moments_bf16 = m.dtype == torch.bfloat16
            t.out = out.data_ptr() if out is not None else None
            t.out_kind = _OUT_KINDS[out.dtype if out is not None else None]
            t.hyper = ctypes.pointer(hypers[step])
        self._fn(tensors, count, PARALLEL_MIN_NUMEL)


def converts(batch: UpdateBatch) -> bool:
    """Whether a batch has anything to widen or narrow (else torch's one fused call is it)."""
    return any(o is not None for o in batch.outs) or any(
        t.dtype != torch.float32 for t in (*batch.grads, *batch.exp_avgs, *batch.exp_avg_sqs)
    )


def native_for(
    kernel: str, batch: UpdateBatch, sr: bool, offloaded: bool = False
) -> NativeKernel | None:
    """The native kernel where it should run ``batch``: ``kernel="auto"``, round to nearest
    (stochastic rounding's noise lives in the eager engine), something to convert, tensors
    it supports, and a kernel that built and passed its check on this machine."""
    if sr or kernel != "auto" or not (offloaded or converts(batch)):
        return None
    if not NativeKernel.supports(batch, on_cpu=not offloaded):
        return None
    return native_kernel()


_LOCK = threading.Lock()
_KERNEL: list[NativeKernel | None] = []


def native_kernel() -> NativeKernel | None:
    """The checked kernel of this process, or None where it cannot be built or differs
    from the eager engine (decided once per process)."""
    with _LOCK:
        if not _KERNEL:
            _KERNEL.append(_load_checked())
        return _KERNEL[0]


def _load_checked() -> NativeKernel | None:
    try:
        kernel = NativeKernel(build())
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        LOG.info(
            "The CPU mixed-dtype AdamW kernel could not be built (%s); the exact optimizers "
            "use the eager engine (same results, slower with BF16 operands).",
            str(detail).strip().splitlines()[-1] if str(detail).strip() else type(exc).__name__,
        )
        return None
    found = differences(kernel)
    if found:
        LOG.warning(
            "The CPU mixed-dtype AdamW kernel is not bitwise the eager engine on this machine "
            "(%s); the exact optimizers use the eager engine.",
            found,
        )
        return None
    return kernel


def _check_batch(
    seed: int, grad_dtype: torch.dtype, moment_dtypes: tuple, out_dtype
) -> UpdateBatch:
    """A random batch: values over seven decades, every tail length, steps 1 to 1000."""
    gen = torch.Generator().manual_seed(seed)
    sizes = (4096 + 37, 64 * 3, *(16 * k + k for k in range(16)))  # every tail length
    scale = [10.0**e for e in (-6, -2, 1)]

    def rand(n: int, k: int, positive: bool = False) -> torch.Tensor:
        x = torch.randn(n, generator=gen) * scale[k % 3]
        return x.abs() if positive else x

    masters = [rand(n, k) for k, n in enumerate(sizes)]
    return UpdateBatch(
        masters=masters,
        grads=[rand(n, k + 1).to(grad_dtype) for k, n in enumerate(sizes)],
        exp_avgs=[rand(n, k).to(moment_dtypes[0]) for k, n in enumerate(sizes)],
        exp_avg_sqs=[rand(n, k, True).to(moment_dtypes[1]) for k, n in enumerate(sizes)],
        steps=[torch.tensor(float(7**k % 1000 + 1)) for k in range(len(sizes))],
        outs=[None if out_dtype is None else m.to(out_dtype) for m in masters],
        sr_keys=[0] * len(sizes),
        sr_offsets=[0] * len(sizes),
    )


def _clone(batch: UpdateBatch) -> UpdateBatch:
    def copy(ts: list) -> list:
        return [None if t is None else t.clone() for t in ts]

    return UpdateBatch(
        copy(batch.masters), copy(batch.grads), copy(batch.exp_avgs), copy(batch.exp_avg_sqs),
        copy(batch.steps), copy(batch.outs), batch.sr_keys, batch.sr_offsets,
    )  # fmt: skip


def differences(kernel: NativeKernel) -> str:
    """Run ``kernel`` and the eager engine on the same random state for every dtype
    combination and both lerp forms; '' when every result is bitwise equal."""
    bf16, f32 = torch.bfloat16, torch.float32
    seed = 0
    for grad_dtype in (f32, bf16):
        for moments in ((f32, f32), (bf16, bf16)):
            for out_dtype in (None, bf16, f32):
                for beta1, maximize, wd in ((0.9, False, 0.01), (0.3, True, 0.0)):
                    seed += 1
                    hp = Hyper(1e-3, beta1, 0.999, 1e-8, wd, maximize)
                    eager = _check_batch(seed, grad_dtype, moments, out_dtype)
                    native = _clone(eager)
                    adamw_update_(eager, hp, Scratch(), 1 << 20, False)
                    kernel.update_(native, hp)
                    for name in ("masters", "exp_avgs", "exp_avg_sqs", "outs"):
                        for a, b in zip(getattr(eager, name), getattr(native, name), strict=True):
                            if a is not None and not torch.equal(a.view(-1), b.view(-1)):
                                return (
                                    f"{name} differ with grad {grad_dtype}, moments {moments}, "
                                    f"parameter {out_dtype}, beta1 {beta1}"
                                )
    return ""
