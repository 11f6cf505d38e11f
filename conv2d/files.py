"""Writing and opening files safely: the one place that knows how this library writes
a file (npz, HDF5, PNG) and which paths it reads.

`atomic_write(path, write)` writes through a temporary file in the target's directory,
synced, then renamed over the target: a failed or interrupted write (an exception, a
SIGINT) leaves any existing file as it was and never a truncated one. The target may be
a symbolic link (the file it names is replaced) but never an existing non-regular file
(a device, FIFO, socket or directory: replacing `/dev/null` with a regular file is not a
save). The new file's mode is what `open(path, "w")` would give it: the existing file's,
else 0o666 less the process umask, which the kernel applies at creation (the umask is
never changed, so saves in several threads cannot race on it).
"""

from __future__ import annotations

import errno
import glob
import os
import secrets
import stat
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable

STALE_SECONDS = 600  # a temporary file of a save untouched this long was left by a killed one


def writable_target(where: str, path: str | os.PathLike) -> Path:
    """The file a save to `path` replaces (through a symbolic link, the file it names),
    after checking that it is absent or a regular file and that its directory exists."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{where}: expected a str or os.PathLike path, got {type(path).__name__}")
    target = Path(path)
    if target.is_symlink():
        target = target.resolve()
    try:
        mode = target.stat().st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
                "a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else
                "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
        raise ValueError(f"{where}: {str(path)!r} is {kind}; a save replaces only a regular file or writes a new one")
    directory = target.parent if str(target.parent) else Path(".")
    if not directory.is_dir():
        raise FileNotFoundError(f"{where}: the directory {str(directory)!r} of {str(path)!r} does not exist")
    return target


def _writer_gone(tmp: Path, name: str) -> bool:
    """Whether the save that made `tmp` (`.<name>.<pid>.<random>.tmp`) was a process of
    this machine that no longer runs. False where the name carries no process id (an
    older save's) or the process (or another that took its id) runs."""
    pid = tmp.name[len(name) + 2:].split(".")[0]
    if not pid.isdigit() or int(pid) <= 0 or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):  # runs under another user; or no such id
        return False
    return False


def _remove_stale_temporaries(directory: Path, name: str) -> None:
    """Remove the temporary files that killed saves of `name` left behind
    (`.<name>.<pid>.*.tmp`): those whose writing process no longer runs, and any
    unchanged for STALE_SECONDS (a writer on another machine, or an id taken again); a
    save in progress elsewhere keeps its own."""
    now = time.time()
    for tmp in directory.glob(f".{glob.escape(name)}.*.tmp"):
        try:
            if _writer_gone(tmp, name) or now - tmp.stat().st_mtime > STALE_SECONDS:
                tmp.unlink()
        except OSError:  # gone meanwhile, or not ours to remove
            pass


def _create_temporary(directory: Path, name: str) -> tuple[int, Path]:
    """A new file `.<name>.<pid>.<random>.tmp` in `directory` (the process id tells a later
    save whether its writer still runs), created with mode 0o666 so that the kernel
    applies the umask (mkstemp's 0o600 would need the umask read back)."""
    for _ in range(100):
        tmp = directory / f".{name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name for {name!r} in {str(directory)!r}")


def atomic_write(where: str, path: str | os.PathLike, write: Callable[[Any], None]) -> Path:
    """Call `write(f)` with a binary file object open on a temporary file, then put that
    file in place of `path` (see the module docstring). Returns the path written."""
    target = writable_target(where, path)
    directory = target.parent if str(target.parent) else Path(".")
    try:
        keep_mode: int | None = stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        keep_mode = None
    _remove_stale_temporaries(directory, target.name)
    fd, tmp = _create_temporary(directory, target.name)
    try:
        with os.fdopen(fd, "w+b") as f:  # readable too: h5py reads back what it writes
            write(f)
            f.flush()
            if keep_mode is not None:
                os.fchmod(f.fileno(), keep_mode)
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return target
    try:
        os.fsync(dir_fd)  # the rename itself, on disk
    finally:
        os.close(dir_fd)
    return target


def open_regular(where: str, path: str | os.PathLike) -> BinaryIO:
    """`path` opened once for reading, after checking that what was opened (through
    symbolic links) is a regular file: a FIFO would block a reader, a device is no file
    of ours, and a check of the name before an open by name could be of another file
    swapped in between. The open does not block (a FIFO opens at once, then is refused).
    FileNotFoundError for a missing file, PermissionError as the system says; a name no
    file can have (a NUL byte, too long, a loop of symbolic links) is a ValueError."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{where}: expected a str or os.PathLike path, got {type(path).__name__}")
    name = os.fspath(path)
    text = name if isinstance(name, str) else os.fsdecode(name)
    shown = repr(text)
    if "\0" in text:
        raise ValueError(f"{where}: {shown} holds a NUL byte, which no file name can")
    try:
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{where}: no such file {shown}") from e
    except PermissionError:
        raise
    except OSError as e:
        reason = {errno.ELOOP: "a loop of symbolic links", errno.ENAMETOOLONG: "a name too long for the file system",
                  errno.ENOTDIR: "a path through something that is not a directory"}.get(e.errno, e.strerror)
        raise ValueError(f"{where}: {shown} cannot be opened: {reason}") from e
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"{where}: {shown} is not a regular file (a directory, FIFO or device is not read)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
