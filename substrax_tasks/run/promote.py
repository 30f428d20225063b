"""Promote verified staged outputs into their final paths, one rename each.

A half-written output never stands at its final path: each output is moved
into place by a single rename (the previous version moved aside first, then
dropped). When the staging folder is on another file system, the output is
first copied next to its final path and renamed from there.

A promotion is journaled in the run's folder before its first rename, and
the journal goes once the last is done. A kill in between leaves outputs
half old, half new, and folders moved aside or copied half: `recover`
(the step's next launch, under its lock, before anything reads them)
finishes the promotion from the staged files, which stay until the last
rename (a copy from another file system leaves them for teardown).

Outputs carry no privileges: whatever a command, a host, a bucket or a
cache entry set, a promoted file or folder has no setuid, setgid or sticky
bit and is not world-writable (`safe_mode`). The transports already copy
with that rule (rsync's `--chmod`, the bucket's and the cache's modes), but
the promotion applies it again (`make_safe`, `safe_manifest`): every path
into the project goes through it, and it never trusts an earlier step.

`verify_staged` and `promote_verified` are the one way staged outputs
reach their final paths, for the chain (outputs_phases.py) and for
`substrax-compute fetch` alike: a promotion takes only `Verified` outputs.
Staged outputs are verified once, as they are fetched, and not again at
their promotion: see `verify_staged` for why nothing can change them in
between.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from substrax_tasks._remote import manifest as remote_manifest
from substrax_tasks.atomic import write_json_atomic
from substrax_tasks.backends.base import Fetched
from substrax_tasks.errors import OutputsRefused, SubstraxError
from substrax_tasks.uptodate import manifests as manifest_cache

JOURNAL = "promotion.json"
# What no output keeps: a setuid file made by a host's user (or a root
# command in a sandbox) would run as the client's user, root on CI; a
# world-writable one could be changed by anyone here.
UNSAFE_BITS = stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX | stat.S_IWOTH
# The same rule in rsync's words, for copies made by rsync (a test holds
# the two to the same result for every mode).
RSYNC_SAFE_CHMOD = "--chmod=ugo-st,o-w"
_O_PATH = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


def safe_mode(mode: int) -> int:
    """`mode` (permission bits) without the bits an output never keeps."""
    return mode & 0o7777 & ~UNSAFE_BITS


def safe_manifest(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """`manifest` with each file's and folder's mode made safe (its digest
    taken again if one changed), so that outputs made safe verify against
    it and the verified manifest recorded says what stands here."""
    entries = manifest.get("entries") or []
    if not any(
        e.get("type") in ("file", "dir") and isinstance(e.get("mode"), int) and e["mode"] & UNSAFE_BITS
        for e in entries
    ):
        return dict(manifest)
    digest = remote_manifest.entries_digest
    if manifest.get("digest") != digest(entries):
        return dict(manifest)  # damaged: left as it is for verification to refuse, never mended here
    kept = ("file", "dir")
    made_safe = (
        {**e, "mode": safe_mode(e["mode"])} if e.get("type") in kept and isinstance(e.get("mode"), int) else e
        for e in entries
    )
    # packed entries stay packed (a fetched manifest of many files)
    safe = remote_manifest.PackedEntries(made_safe) if isinstance(entries, remote_manifest.PackedEntries) \
        else list(made_safe)  # fmt: skip
    return {**manifest, "entries": safe, "digest": digest(safe)}


def make_safe(root: Path, outputs: Sequence[str]) -> None:
    """Clear the unsafe bits of every file and folder of `outputs` under
    `root`. Nothing is reached through a symlink (a folder above an output,
    or inside one, that is a link is left alone: verification refuses such
    a tree), and each entry is changed through a descriptor of the very
    entry checked, so nothing swapped in meanwhile is changed instead."""
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return  # nothing staged: verification names the missing outputs
    try:
        for out in outputs:
            *folders, name = out.rstrip("/").split("/")
            parent = _open_folders(root_fd, folders)
            if parent is not None:
                try:
                    _make_entry_safe(parent, name)
                finally:
                    os.close(parent)
    finally:
        os.close(root_fd)


def _open_folders(root_fd: int, folders: list[str]) -> int | None:
    """A descriptor of the folder `root_fd/folders...`, None if one is
    missing or is not a folder (a symlink included)."""
    fd = os.dup(root_fd)
    for folder in folders:
        try:
            inner = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        except OSError:  # missing, a link or not a folder: verification names it
            inner = None
        os.close(fd)
        if inner is None:
            return None
        fd = inner
    return fd


def _make_entry_safe(dir_fd: int, name: str) -> None:
    try:
        fd = os.open(name, _O_PATH, dir_fd=dir_fd)
    except FileNotFoundError:
        return  # verification names a missing output
    try:
        st = os.fstat(fd)
        if stat.S_ISLNK(st.st_mode):
            return  # a link's own mode means nothing on Linux
        if st.st_mode & UNSAFE_BITS and (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            # chmod has no descriptor form for an O_PATH descriptor but its
            # /proc link (glibc's fchmodat(AT_SYMLINK_NOFOLLOW) does the same)
            os.chmod(f"/proc/self/fd/{fd}", safe_mode(st.st_mode))  # noqa: PTH101
        if stat.S_ISDIR(st.st_mode):
            listing = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
            try:
                for entry in os.listdir(listing):  # noqa: PTH208 - a descriptor, not a path
                    _make_entry_safe(listing, entry)
            finally:
                os.close(listing)
    finally:
        os.close(fd)


class NotProduced(SubstraxError):
    """The run's manifest names declared outputs its command did not make."""


@dataclass(frozen=True)
class Verified(Fetched):
    """Staged outputs that match their run's manifest, their modes made
    safe (`manifest` says so too): the only thing a promotion moves. Made
    by `verify_staged`."""


def verify_staged(fetched: Fetched, outputs: Sequence[str], cache: Path, source: str) -> Verified:
    """The one verification of staged outputs: made safe, then compared
    with the manifest of `source` (a run, or a cache entry), named in each
    message. Raises NotProduced, OutputsRefused (the copy differs: nothing
    is promoted, the run stays for a fetch again), or a SubstraxError when
    the unsafe bits cannot be cleared.

    Nothing checks them again before their promotion, because nothing but
    this client writes them in between. The staging folder is the
    backend's fetch's, in the run's private folder (a copy refused here is
    removed, so a fetch again never updates one), and its transport
    has finished writing it (rsync has exited, the bucket's copies are
    joined). Only one client stages a run at a time: `doit` holds the step's
    lock from launch to the chain's end, and `substrax-compute fetch` takes
    it too (a fetch while doit drives the step is refused). The local
    backend stages hard links to the sandbox's own outputs: the command
    could write those, but a run is final only once every process of it
    has been killed (remote/worker.py). tests/integration/chain/test_fetch_once.py holds
    these to account."""
    missing = list(fetched.manifest.get("missing") or [])
    if missing:
        raise NotProduced(f"the run did not produce declared output(s) {', '.join(missing)}{_near(fetched)}")
    try:
        if not fetched.modes_safe:  # else one walk fewer: a mode left unsafe is refused below
            make_safe(fetched.root, outputs)
    except OSError as exc:
        raise SubstraxError(
            f"could not clear the setuid and world-writable bits of the outputs of {source} ({exc}); "
            "nothing was promoted"
        ) from exc
    manifest = safe_manifest(fetched.manifest)
    problems = manifest_cache.verify_outputs(fetched.root, outputs, manifest, cache)
    if problems:
        if fetched.updated_in_place:  # the next fetch copies afresh, never on top of a copy refused
            shutil.rmtree(fetched.root, ignore_errors=True)
        raise OutputsRefused(
            f"the fetched outputs of {source} do not match its manifest; nothing was promoted:\n  "
            + "\n  ".join(problems)
        )
    return Verified(fetched.root, manifest, fetched.saw_whole_project)


def _near(fetched: Fetched) -> str:
    """What the run wrote instead of its missing outputs, where a name is
    close (the manifest's "near"), said after them."""
    near = fetched.manifest.get("near")
    if not isinstance(near, dict):
        return ""
    said = [
        f"{', '.join(str(n) for n in names)} instead of {out}"
        for out, names in near.items()
        if isinstance(names, list) and names
    ]
    return f" (it wrote {'; '.join(said)}: a typo in the command or in outputs=?)" if said else ""


def promote_verified(
    verified: Verified, dest: Path, outputs: Sequence[str], journal: Path, cache: Path
) -> None:
    """Move verified outputs to `dest` (journaled in `journal`); outputs
    verified where they stand (written in place) stay. Moved by renames,
    they are the very files verified; copied (another file system), the
    copies are checked where they now stand. Raises OSError from the moves,
    SubstraxError if a copy does not match."""
    if verified.root.resolve() == dest.resolve():
        # Written in place (no sandbox): the project is anyone's to write,
        # now as after; a check again here would close no window, and every
        # later up-to-date check sees a change.
        return
    digest = str(verified.manifest["digest"])
    copied = not _same_file_system(verified.root, dest)
    if copied and manifest_cache.outputs_match(dest, outputs, digest, cache):
        # A copy (another file system) that stands in place already: its
        # promotion was finished by `recover` after a full disk or a kill.
        # Copying it again would need room for two copies the disk may lack.
        return
    if promote(verified.root, dest, list(outputs), journal):
        manifest_cache.renamed_into_place(dest, outputs, cache)
    elif not manifest_cache.outputs_match(dest, outputs, digest, cache):
        raise SubstraxError("outputs changed while they were promoted")


def replaced_extras(verified: Verified, dest: Path, outputs: Sequence[str]) -> list[str]:
    """What the promotion of `verified` into `dest` removes that is not
    among its outputs: the paths in a folder output there that the staged
    tree lacks (a folder output is replaced whole), the topmost of each
    (a folder with its "/"). A stat per path, no list of the manifest held.
    Nothing for outputs written in place, which replace nothing."""
    if verified.root.resolve() == dest.resolve():
        return []
    extras: list[str] = []
    for out in outputs:
        top = dest / out.rstrip("/")
        if not out.endswith("/") or top.is_symlink() or not top.is_dir():
            continue
        for folder, dirs, files in os.walk(top):
            rel = os.path.relpath(folder, dest)
            staged = verified.root / rel
            for name in files:
                if not os.path.lexists(staged / name):
                    extras.append(f"{rel}/{name}")
            for name in list(dirs):
                if not os.path.lexists(staged / name):
                    extras.append(f"{rel}/{name}/")
                    dirs.remove(name)  # named whole, not each file in it
    return sorted(extras)


def said_extras(extras: Sequence[str], source: str, shown: int = 5) -> str:
    """The line that names what a promotion removed (`replaced_extras`)."""
    more = f" and {len(extras) - shown} more" if len(extras) > shown else ""
    return (f"removed {', '.join(extras[:shown])}{more}: not among the outputs of {source} "
            "(a folder output is replaced whole)")  # fmt: skip


def _same_file_system(staging: Path, dest: Path) -> bool:
    try:
        return staging.stat().st_dev == dest.stat().st_dev
    except OSError:
        return True  # nothing to compare: the promotion finds out


def remove_path(path: Path) -> None:
    """Remove a file, symlink or folder tree (a symlink is never followed)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _next_to(final: Path, tag: str) -> Path:
    # secrets, not uuid: uuid imports platform, 3 ms of every no-op doit.
    return final.with_name(f".{final.name}.substrax-{tag}-{secrets.token_hex(4)}")


def promote_one(staged: Path, final: Path) -> bool:
    """Move `staged` to `final`; True if by renames alone (the very files
    staged now stand there), False if it had to be copied."""
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        staged.replace(final) if not final.is_dir() or final.is_symlink() else _swap_dir(staged, final)
        return True
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        # Another file system: copy beside the final path, then rename.
        beside = _next_to(final, "in")
        try:
            if staged.is_dir() and not staged.is_symlink():
                try:
                    shutil.copytree(staged, beside, symlinks=True, copy_function=_copy_or_stop)
                except _CopyStopped as stopped:
                    raise stopped.error from None
            else:
                shutil.copy2(staged, beside, follow_symlinks=False)
            promote_one(beside, final)
        except OSError as copy_failed:
            # shutil names the source: name the file system that is full
            if copy_failed.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OSError(copy_failed.errno, copy_failed.strerror, str(beside)) from copy_failed
            raise
        finally:  # a copy made half (a full disk) takes no room there
            if beside.exists() or beside.is_symlink():
                remove_path(beside)
        # `staged` stays (teardown removes it): a tree removed half, after a
        # kill, would be promoted again by `recover` over the whole copy.
        return False


class _CopyStopped(Exception):
    """Not an OSError, so that copytree lets it through: it gathers the
    OSErrors of every file into one shutil.Error with their errno lost (a
    full disk would not be told as one) and goes on copying after the
    first."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def _copy_or_stop(source: str, target: str) -> object:
    try:
        return shutil.copy2(source, target)
    except OSError as exc:
        raise _CopyStopped(exc) from exc


def _swap_dir(staged: Path, final: Path) -> None:
    """A folder cannot be renamed over a non-empty folder: move the old one
    aside first (the path is briefly absent, never half-written)."""
    aside = _next_to(final, "old")
    final.rename(aside)
    try:
        staged.rename(final)
    except OSError:
        aside.rename(final)  # put the old one back
        raise
    remove_path(aside)


def promote(staging_root: Path, project: Path, outputs: list[str], journal: Path) -> bool:
    """Move each output from `staging_root/<out>` to `project/<out>`. True
    if every one was moved by renames alone, so the project holds the very
    files that were staged (and verified there)."""
    write_json_atomic(journal, {"staging_root": str(staging_root), "project": str(project),
                                "outputs": outputs})
    renamed = True
    for out in outputs:
        rel = out.rstrip("/")
        renamed = promote_one(staging_root / rel, project / rel) and renamed
    journal.unlink()
    return renamed


def recover(journal: Path) -> bool:
    """Finish the promotion `journal` records, if a kill interrupted it:
    each output still staged is promoted, and what the kill left beside the
    outputs (an old version moved aside, a copy made half) is removed.
    True if there was one to finish."""
    try:
        data = json.loads(journal.read_text())
        staging_root, project, outputs = Path(data["staging_root"]), Path(data["project"]), data["outputs"]
    except FileNotFoundError:
        return False
    for out in outputs:
        rel = str(out).rstrip("/")
        staged, final = staging_root / rel, project / rel
        if staged.exists() or staged.is_symlink():
            promote_one(staged, final)
        beside = f".{final.name}.substrax-"  # moved aside ("old") or copied half ("in")
        for left in final.parent.iterdir() if final.parent.is_dir() else []:
            if left.name.startswith(beside):
                remove_path(left)
    journal.unlink()
    return True
