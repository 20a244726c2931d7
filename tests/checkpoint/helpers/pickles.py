"""Malicious DCP ``.metadata`` pickles for the allow-list tests (test_bad_checkpoints.py)."""

from __future__ import annotations

from pathlib import Path


def _call_global(module: str, name: str, *args: str) -> bytes:
    """A raw pickle calling ``module.name(*args)`` (protocol 4, so dotted names resolve)."""
    body = "".join(f"V{arg}\n" for arg in args)
    return f"\x80\x04c{module}\n{name}\n({body}tR.".encode("latin-1")


def _getattr_call(module: str, name: str, attr: str, arg: str) -> bytes:
    """``builtins.getattr(module.name, attr)(arg)``: any callable, reached through getattr."""
    return f"\x80\x04cbuiltins\ngetattr\n(c{module}\n{name}\nV{attr}\ntR(V{arg}\ntR.".encode(
        "latin-1"
    )


def dangerous_payloads(marker: Path) -> dict[tuple[str, str], bytes]:
    """Pickles whose first global is a (module, name) pair outside the allow-list in a
    module inside it. With an allow-list checked by module only, most would create
    ``marker``; the rest would build a non-metadata object (another error message)."""
    touch = f"touch {marker}"
    code = f"open({str(marker)!r}, 'w').close()"
    meta, fs = "torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"
    raw = "veoptim.checkpoint.storage.raw_format"
    return {
        ("builtins", "eval"): _call_global("builtins", "eval", code),
        ("builtins", "exec"): _call_global("builtins", "exec", code),
        ("builtins", "open"): _call_global("builtins", "open", str(marker), "w"),
        ("builtins", "getattr"): _getattr_call(meta, "os", "system", touch),
        ("torch", "save"): _call_global("torch", "save", "x", str(marker)),
        ("torch", "load"): _call_global("torch", "load", str(marker)),
        (meta, "os.system"): _call_global(meta, "os.system", touch),
        (meta, "field"): _call_global(meta, "field"),
        (fs, "os.system"): _call_global(fs, "os.system", touch),
        ("torch.serialization", "os.system"): _call_global(
            "torch.serialization", "os.system", touch
        ),
        ("torch._utils", "os.system"): _call_global("torch._utils", "os.system", touch),
        ("pathlib", "os.system"): _call_global("pathlib", "os.system", touch),
        ("collections", "namedtuple"): _call_global("collections", "namedtuple", "T", "a"),
        (raw, "os.system"): _call_global(raw, "os.system", touch),
        (raw, "check_storage"): _call_global(raw, "check_storage"),
    }
