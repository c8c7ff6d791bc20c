"""Files that stay off the page cache, and how much of a file the page cache holds.

Spill files in the page cache take RAM a planner counts as free, so writes use ``O_DIRECT``
(refused: buffered, ``fdatasync``, ``POSIX_FADV_DONTNEED``). Resident pages are counted from the
kernel (``mincore``). A tmpfs file *is* page cache: :func:`in_ram` says so."""

from __future__ import annotations

import ctypes
import errno
import os

from .host_memory import page_size

RAM_FILESYSTEMS = ("tmpfs", "ramfs")
"""Filesystems whose files live in RAM: writing one off the page cache is impossible."""

_PROT_READ, _MAP_SHARED = 1, 1
_libc = None


def _c():
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long)
        libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
        _libc = libc
    return _libc


def filesystem_type(path: str | os.PathLike) -> str:
    """The type of the filesystem ``path`` is on (``ext4``, ``tmpfs``, ...), from the mount
    table: the longest mount point above it ("" where the table cannot be read)."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, fields[2]
    except OSError:
        return ""
    return kind


def in_ram(path: str | os.PathLike) -> bool:
    return filesystem_type(path) in RAM_FILESYSTEMS


def io_block_bytes(path: str | os.PathLike) -> int:
    """What ``O_DIRECT`` lengths and offsets are rounded to in the directory ``path``: the
    filesystem's block (at least a page, which is what the buffers are aligned to)."""
    try:
        block = os.statvfs(path).f_bsize
    except OSError:
        block = 0
    return max(block, page_size())


def round_up(nbytes: int, block: int) -> int:
    return -(-nbytes // block) * block


def _check_aligned(buf: memoryview, length: int, block: int) -> None:
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert address % page_size() == 0, "O_DIRECT buffers start on a page"
    assert length % block == 0 and len(buf) >= length, "O_DIRECT lengths are whole blocks"


def write_file(path: str | os.PathLike, buf: memoryview, nbytes: int, block: int,
               direct: bool = True) -> bool:
    """Write the first ``nbytes`` of page-aligned ``buf`` to a new file off the page cache (the file
    holds the length rounded up to ``block``). Returns whether ``O_DIRECT`` was used."""
    length = round_up(nbytes, block)
    if direct:
        _check_aligned(buf, length, block)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
        else:
            try:
                _pwrite_all(fd, buf[:length])
                return True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
            finally:
                os.close(fd)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _pwrite_all(fd, buf[:length])
        os.fdatasync(fd)  # written back, so that the pages are clean and can be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return False


def read_file(path: str | os.PathLike, buf: memoryview, nbytes: int, block: int,
              direct: bool = True) -> None:
    """Read a file :func:`write_file` wrote (``nbytes`` of data) back into ``buf``; its rounded
    length is read (the tail past ``nbytes`` is the writer's). ``direct``: how it was written."""
    length = round_up(nbytes, block)
    if direct:
        _check_aligned(buf, length, block)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        done = 0
        while done < length:
            n = os.preadv(fd, [buf[done:length]], done)
            if n == 0:
                raise OSError(errno.EIO, f"{path} ended after {done} of {length} bytes")
            done += n
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, data: memoryview) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], done)


def page_cache_bytes(path: str | os.PathLike) -> int:
    """Bytes of the file at ``path`` the page cache holds now, as the kernel reports them
    (``mincore`` over a mapping of the file, which maps without reading anything in)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    page = page_size()
    pages = -(-size // page)
    libc = _c()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            resident = sum(b & 1 for b in bytes(vec))
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return min(resident * page, size)
