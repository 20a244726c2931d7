"""Single-process publication: versions behind relative links, manifests, readers, retention."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import pytest

from tests.checkpoint.helpers.payload import check_payload, write_payload
from veoptim.checkpoint import layout
from veoptim.checkpoint import versions as readers
from veoptim.checkpoint.faults import PHASE_RETENTION
from veoptim.checkpoint.layout import CHECKSUM_MAX_BYTES, read_link, read_manifest
from veoptim.checkpoint.publish import Publisher
from veoptim.checkpoint.versions import (
    is_within,
    latest_complete,
    resolve,
    resolve_agreed,
    resolve_path,
    resolve_reference,
    resolve_version,
    verify,
)
from veoptim.errors import CheckpointError


def save(pub: Publisher, name: str, step: int, shard_bytes: int = 64, **kw) -> Path:
    with pub.write(name, step=step, **kw) as version:
        write_payload(version, step, shard_bytes)
    return resolve(pub.root, name)


def versions(root: Path) -> list[str]:
    return sorted(os.listdir(root / layout.VERSIONS_DIR))


def test_name_is_a_relative_symlink_to_a_version_inside_the_root(tmp_path: Path) -> None:
    path = save(Publisher(tmp_path), "step_00000001", 1)
    link = tmp_path / "step_00000001"
    assert link.is_symlink()
    target = os.readlink(link)
    assert not os.path.isabs(target) and target.startswith(layout.VERSIONS_DIR + "/")
    assert path == (tmp_path / target).resolve()
    assert check_payload(path) == 1


def test_root_can_be_moved_because_links_are_relative(tmp_path: Path) -> None:
    save(Publisher(tmp_path / "a"), "ckpt", 5)
    (tmp_path / "a").rename(tmp_path / "b")
    assert check_payload(resolve(tmp_path / "b", "ckpt")) == 5


def test_manifest_lists_every_file_with_size_and_checksums_small_files(tmp_path: Path) -> None:
    path = save(Publisher(tmp_path), "ckpt", 3, kind="checkpoint")
    manifest = read_manifest(path)
    on_disk = {
        p.relative_to(path).as_posix(): p.stat().st_size
        for p in path.rglob("*")
        if p.is_file() and p.name != layout.MANIFEST_FILE
    }
    assert {rel: e.size for rel, e in manifest.files.items()} == on_disk
    assert all(e.sha256 and len(e.sha256) == 64 for e in manifest.files.values())
    assert (manifest.name, manifest.kind, manifest.step, manifest.world_size) == (
        "ckpt",
        "checkpoint",
        3,
        1,
    )


def test_large_files_get_size_only(tmp_path: Path) -> None:
    pub = Publisher(tmp_path, fsync=False)
    with pub.write("big") as version:
        with open(version / "big.bin", "wb") as f:
            f.truncate(CHECKSUM_MAX_BYTES + 1)  # sparse: no real I/O
    entry = read_manifest(resolve(tmp_path, "big")).files["big.bin"]
    assert entry.size == CHECKSUM_MAX_BYTES + 1 and entry.sha256 is None


def test_checksums_of_files_noted_as_written_come_from_their_bytes(tmp_path: Path) -> None:
    pending = Publisher(tmp_path, fsync=False).begin("noted")
    for name in ("a.json", "b.json"):
        (pending.path / name).write_bytes(b'{"a": 1}')
    pending.note_written({pending.path / "a.json": b'{"a": 1}', pending.path / "b.json": b"other"})
    path = pending.commit().path
    manifest = read_manifest(path)
    assert manifest.files["a.json"].sha256 == hashlib.sha256(b'{"a": 1}').hexdigest()
    # negative control: the noted bytes, not the file read back, give the checksum, and a
    # note that does not match the file makes the version fail verification
    assert manifest.files["b.json"].sha256 == hashlib.sha256(b"other").hexdigest()
    with pytest.raises(CheckpointError, match="b.json does not match its sha256"):
        verify(path, manifest)


def test_republishing_a_name_moves_it_and_keeps_the_old_version_for_readers(
    tmp_path: Path,
) -> None:
    pub = Publisher(tmp_path)
    old = save(pub, "latest", 1)
    new = save(pub, "latest", 2)
    assert old != new and check_payload(new) == 2
    assert check_payload(old) == 1  # a reader that resolved before still reads step 1


def test_superseded_version_is_collected_by_the_following_save(tmp_path: Path) -> None:
    pub = Publisher(tmp_path)
    first = save(pub, "latest", 1)
    save(pub, "latest", 2)
    save(pub, "latest", 3)
    assert not first.exists()
    assert len(versions(tmp_path)) == 2  # current + the one superseded by this save


def test_exception_inside_write_keeps_previous_version_and_removes_new_one(
    tmp_path: Path,
) -> None:
    pub = Publisher(tmp_path)
    old = save(pub, "ckpt", 1)
    with pytest.raises(CheckpointError, match="write into .*failed on rank 0") as info:
        with pub.write("ckpt", step=2) as version:
            write_payload(version, 2, 64)
            raise FileNotFoundError(2, "No such file or directory", "/missing/tokenizer.json")
    assert "/missing/tokenizer.json" in str(info.value)
    assert isinstance(info.value.__cause__, FileNotFoundError)
    assert resolve(tmp_path, "ckpt") == old and check_payload(old) == 1
    assert versions(tmp_path) == [old.name]


def test_keyboard_interrupt_inside_write_propagates_and_keeps_previous_version(
    tmp_path: Path,
) -> None:
    pub = Publisher(tmp_path)
    old = save(pub, "ckpt", 1)
    with pytest.raises(KeyboardInterrupt):
        with pub.write("ckpt", step=2) as version:
            write_payload(version, 2, 64)
            raise KeyboardInterrupt
    assert resolve(tmp_path, "ckpt") == old and versions(tmp_path) == [old.name]


def test_fault_while_publishing_keeps_previous_version(tmp_path: Path) -> None:
    def fail(phase: str) -> None:
        if phase == "after_replace":
            raise OSError(5, "Input/output error", str(tmp_path))

    old = save(Publisher(tmp_path), "ckpt", 1)
    with pytest.raises(CheckpointError, match="publish of .*Input/output error"):
        save(Publisher(tmp_path, fault_hook=fail), "ckpt", 2)
    assert resolve(tmp_path, "ckpt") == old  # rolled back after the replace
    assert versions(tmp_path) == [old.name]
    assert not [e for e in os.listdir(tmp_path) if layout.is_temp_link_name(e)]


def test_fault_on_first_publish_leaves_no_name(tmp_path: Path) -> None:
    def fail(phase: str) -> None:
        if phase == "after_replace":
            raise OSError(5, "Input/output error")

    with pytest.raises(CheckpointError):
        save(Publisher(tmp_path, fault_hook=fail), "ckpt", 1)
    assert not os.path.lexists(tmp_path / "ckpt") and versions(tmp_path) == []


def test_bad_names_are_rejected_before_anything_is_written(tmp_path: Path) -> None:
    pub = Publisher(tmp_path / "root")
    for bad in ("../escape", "/etc/passwd", "a/b", ".versions", ".."):
        with pytest.raises(CheckpointError, match="not allowed"):
            pub.begin(bad)
    assert not (tmp_path / "root").exists() and sorted(os.listdir(tmp_path)) == []


def test_legacy_directory_is_readable(tmp_path: Path) -> None:
    legacy = tmp_path / "old_run"
    legacy.mkdir()
    write_payload(legacy, 7, 64)
    assert check_payload(resolve(tmp_path, "old_run")) == 7


def test_legacy_directory_is_never_overwritten(tmp_path: Path) -> None:
    legacy = tmp_path / "old_run"
    legacy.mkdir()
    write_payload(legacy, 7, 64)
    before = {p: p.read_bytes() for p in legacy.rglob("*") if p.is_file()}
    with pytest.raises(CheckpointError, match="plain directory.*save under a new name"):
        save(Publisher(tmp_path), "old_run", 8)
    assert {p: p.read_bytes() for p in legacy.rglob("*") if p.is_file()} == before
    assert versions(tmp_path) == []


def test_keep_last_prunes_oldest_names_and_their_versions(tmp_path: Path) -> None:
    pub = Publisher(tmp_path, keep_last=2)
    paths = [save(pub, layout.step_name(s), s) for s in range(1, 5)]
    names = sorted(e for e in os.listdir(tmp_path) if not e.startswith("."))
    assert names == [layout.step_name(3), layout.step_name(4)]
    assert [p.exists() for p in paths] == [False, False, True, True]


def link_by_hand(root: Path, name: str, existing: str) -> None:
    """A second name pointing to ``existing``'s version, as ``ln -s`` would make it."""
    os.symlink(layout.link_target(read_link(root, existing)), root / name)


def test_retention_never_removes_a_version_another_name_points_to(tmp_path: Path) -> None:
    pub = Publisher(tmp_path, keep_last=1)
    first = save(pub, layout.step_name(1), 1)
    link_by_hand(tmp_path, "best", layout.step_name(1))
    save(pub, layout.step_name(2), 2)
    save(pub, layout.step_name(3), 3)
    assert not os.path.lexists(tmp_path / layout.step_name(1))  # the name was pruned
    assert resolve(tmp_path, "best") == first and check_payload(first) == 1


def test_keep_last_ignores_unprunable_names_and_other_kinds(tmp_path: Path) -> None:
    pub = Publisher(tmp_path, keep_last=1)
    save(pub, "keep_me", 0, prunable=False)
    save(pub, "hf_export", 0, kind="hf_export")
    save(pub, layout.step_name(1), 1)
    save(pub, layout.step_name(2), 2)
    names = sorted(e for e in os.listdir(tmp_path) if not e.startswith("."))
    assert names == ["hf_export", "keep_me", layout.step_name(2)]


def test_retention_failure_is_logged_and_the_save_still_succeeds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def fail(phase: str) -> None:
        if phase == PHASE_RETENTION:
            raise PermissionError(13, "Permission denied", str(tmp_path))

    pub = Publisher(tmp_path, keep_last=1, fault_hook=fail)
    save(pub, layout.step_name(1), 1)
    with caplog.at_level(logging.WARNING):
        path = save(pub, layout.step_name(2), 2)
    assert check_payload(path) == 2
    assert any("retention" in r.message and "ignored" in r.message for r in caplog.records)


def test_next_save_cleans_debris_of_crashed_saves(tmp_path: Path) -> None:
    pub = Publisher(tmp_path)
    path = save(pub, "ckpt", 1)
    debris_version = tmp_path / layout.VERSIONS_DIR / layout.new_version_id("ckpt")
    debris_version.mkdir()
    (debris_version / "half.bin").write_bytes(b"x")
    debris_link = layout.temp_link_path(tmp_path, "ckpt", "dead")
    debris_link.symlink_to(layout.link_target(debris_version.name))
    unknown = tmp_path / layout.VERSIONS_DIR / "not-ours"
    unknown.mkdir()
    save(pub, "other", 2)
    assert not debris_version.exists() and not os.path.lexists(debris_link)
    assert unknown.exists()  # cleanup only touches what the layout defines
    assert resolve(tmp_path, "ckpt") == path


def test_fsync_off_publishes_the_same_layout(tmp_path: Path) -> None:
    path = save(Publisher(tmp_path, fsync=False), "ckpt", 4)
    assert check_payload(path) == 4 and read_manifest(path).step == 4


# ---------------------------------------------------------------- readers


def test_resolve_rejects_symlinks_escaping_the_root(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    save(Publisher(root), "ckpt", 1)
    outside.mkdir()
    write_payload(outside, 9, 8)
    (root / "abs").symlink_to(outside)
    (root / "dotdot").symlink_to("../outside")
    (root / "chain").symlink_to("ckpt")
    for name in ("abs", "dotdot", "chain"):
        with pytest.raises(CheckpointError, match="escaping the root|inside its root"):
            resolve(root, name)


def test_resolve_rejects_a_versions_dir_that_points_outside(tmp_path: Path) -> None:
    good, evil = tmp_path / "good", tmp_path / "evil"
    save(Publisher(good), "ckpt", 1)
    evil.mkdir()
    os.symlink(good / layout.VERSIONS_DIR, evil / layout.VERSIONS_DIR)
    os.symlink(os.readlink(good / "ckpt"), evil / "ckpt")
    with pytest.raises(CheckpointError, match="outside"):
        resolve(evil, "ckpt")


def test_is_within_follows_symlinks(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir(), outside.mkdir()
    (root / "inner").mkdir()
    (root / "sneaky").symlink_to(outside)
    assert is_within(root / "inner", root)
    assert not is_within(root / "sneaky", root)


def test_resolve_rejects_bad_names(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not allowed"):
        resolve(tmp_path, "../x")


def test_missing_name_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="No checkpoint named 'nope'"):
        resolve(tmp_path, "nope")


@pytest.mark.parametrize("damage", ["no_manifest", "truncated", "extra", "missing", "flipped"])
def test_resolve_rejects_versions_that_do_not_match_their_manifest(
    tmp_path: Path, damage: str
) -> None:
    path = save(Publisher(tmp_path), "ckpt", 1)
    shard = path / "shards" / "shard_0.bin"
    if damage == "no_manifest":
        (path / layout.MANIFEST_FILE).unlink()
    elif damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:-1])
    elif damage == "extra":
        (path / "stray.bin").write_bytes(b"?")
    elif damage == "missing":
        shard.unlink()
    else:
        data = bytearray(shard.read_bytes())
        data[-1] ^= 1
        shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="incomplete|does not match|bytes"):
        resolve(tmp_path, "ckpt")


def test_manifest_with_unknown_format_version_fails_closed(tmp_path: Path) -> None:
    path = save(Publisher(tmp_path), "ckpt", 1)
    raw = json.loads((path / layout.MANIFEST_FILE).read_text())
    raw["format_version"] = 99
    (path / layout.MANIFEST_FILE).write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="format version 99"):
        resolve(tmp_path, "ckpt")


def test_manifest_of_an_earlier_release_with_metadata_still_reads(tmp_path: Path) -> None:
    path = save(Publisher(tmp_path), "ckpt", 1)
    raw = json.loads((path / layout.MANIFEST_FILE).read_text())
    assert "metadata" not in raw
    raw["metadata"] = {}
    (path / layout.MANIFEST_FILE).write_text(json.dumps(raw))
    assert resolve(tmp_path, "ckpt") == path and read_manifest(path).step == 1


def test_manifest_listing_a_path_outside_the_version_is_rejected(tmp_path: Path) -> None:
    path = save(Publisher(tmp_path), "ckpt", 1)
    raw = json.loads((path / layout.MANIFEST_FILE).read_text())
    raw["files"]["../../../etc/passwd"] = {"size": 1}
    (path / layout.MANIFEST_FILE).write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="unsafe file path"):
        resolve(tmp_path, "ckpt")


def test_pinned_version_resolves_directly_after_the_name_moved(tmp_path: Path) -> None:
    pub = Publisher(tmp_path)
    first = save(pub, "latest", 1)
    save(pub, "latest", 2)  # the version it moved away from stays until the next save
    assert resolve_version(tmp_path, first.name) == first
    assert resolve_path(first) == first
    assert resolve_reference(tmp_path, f"{layout.VERSIONS_DIR}/{first.name}") == first


def test_resolve_reference_accepts_names_and_paths(tmp_path: Path) -> None:
    path = save(Publisher(tmp_path), "ckpt", 1)
    assert resolve_reference(tmp_path, "ckpt") == path
    assert resolve_reference(tmp_path / "elsewhere", str(tmp_path / "ckpt")) == path


def test_latest_complete_picks_the_highest_step_of_the_kind(tmp_path: Path) -> None:
    pub = Publisher(tmp_path)
    assert latest_complete(tmp_path) is None and latest_complete(tmp_path / "missing") is None
    save(pub, layout.step_name(20), 20)
    save(pub, layout.step_name(10), 10)  # published later, older step
    save(pub, "hf_final", 99, kind="hf_export")
    assert latest_complete(tmp_path) == layout.step_name(20)
    assert latest_complete(tmp_path, kind="hf_export") == "hf_final"


def test_latest_complete_skips_incomplete_versions(tmp_path: Path) -> None:
    pub = Publisher(tmp_path)
    save(pub, layout.step_name(1), 1)
    newest = save(pub, layout.step_name(2), 2)
    (newest / "shards" / "shard_1.bin").write_bytes(b"torn")
    assert latest_complete(tmp_path) == layout.step_name(1)


def test_auto_resolves_once_and_checks_one_manifest(tmp_path: Path, monkeypatch) -> None:
    """``auto`` checks the newest version complete once (one manifest read and verified),
    not once to find it and again to resolve it; a plain name also checks once."""
    pub = Publisher(tmp_path, fsync=False)
    save(pub, layout.step_name(1), 1)
    newest = save(pub, layout.step_name(2), 2)
    checked: list[Path] = []
    real_verify = readers.verify

    def counting(version: Path, *args, **kwargs) -> None:
        checked.append(Path(version))
        real_verify(version, *args, **kwargs)

    monkeypatch.setattr(readers, "verify", counting)
    assert resolve_agreed(tmp_path, "auto").path == newest
    assert checked == [newest]
    checked.clear()
    assert resolve_agreed(tmp_path, layout.step_name(2)).path == newest
    assert checked == [newest]
    assert resolve_agreed(tmp_path / "empty", "auto") is None


def test_latest_complete_prefers_the_original_name_over_a_second_link(tmp_path: Path) -> None:
    pub = Publisher(tmp_path)
    save(pub, layout.step_name(1), 1)
    link_by_hand(tmp_path, "a_best", layout.step_name(1))
    assert latest_complete(tmp_path) == layout.step_name(1)


@pytest.mark.parametrize("change", ["grown", "shrunk"])
def test_a_size_only_file_that_changed_size_after_publication_is_refused(
    tmp_path: Path, change: str
) -> None:
    """A file too large for a checksum has only its size in the manifest: bytes appended
    to it (or cut from it) after publication make the version incomplete for every reader,
    with or without checksum verification, and ``auto`` falls back to the previous step."""
    pub = Publisher(tmp_path, fsync=False)
    save(pub, layout.step_name(1), 1)
    size = CHECKSUM_MAX_BYTES + 1
    with pub.write(layout.step_name(2), step=2) as version:
        write_payload(version, 2, 64)
        with open(version / "shards" / "big.bin", "wb") as f:
            f.truncate(size)  # sparse: no real I/O
    path = resolve(tmp_path, layout.step_name(2))
    entry = read_manifest(path).files["shards/big.bin"]
    assert (entry.size, entry.sha256) == (size, None)
    assert latest_complete(tmp_path) == layout.step_name(2)
    big = path / "shards" / "big.bin"
    if change == "grown":
        with open(big, "ab") as f:
            f.write(b"\0")
    else:
        os.truncate(big, size - 1)
    found = size + 1 if change == "grown" else size - 1
    expected = f"Checkpoint file {big} has {found} bytes, its manifest says {size}."
    for verify_checksums in (True, False):
        with pytest.raises(CheckpointError) as info:
            resolve(tmp_path, layout.step_name(2), verify_checksums=verify_checksums)
        assert str(info.value) == expected
    assert latest_complete(tmp_path) == layout.step_name(1)
