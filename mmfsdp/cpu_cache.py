"""A caching CPU allocator for torch, built on first use: FSDP's freed buffers are reused.

On the CPU, each all-gather output, unsharded gradient and reduce-scatter
input that FSDP frees goes back to glibc. Mapped on its own (the ``'release'``
setting), a block leaves the resident set when freed, and the next block of
that size costs the kernel a fresh, zeroed page per 4 KiB (or 2 MiB); left on
glibc's heap, freed blocks stay resident and fragment, and the resident set
creeps above DDP's. This allocator keeps each freed block mapped and hands it
to the next request of its size, most recently freed first. It maps new
memory only while the live plus the cached bytes stay within the most bytes
live at once in this window or the one before; past that it unmaps the least
recently freed blocks, resizing the last of them in place (``mremap``) to the
request. So its resident set peaks where ``'release'``'s does, and a loop that
repeats its sizes step after step is served from warm pages. The runner ends
a window after every training iteration (:func:`mark`), so a one-off peak
(building the model, a checkpoint) is not kept cached through training.

torch has no Python API for a CPU allocator, so the C++ source
(``mmfsdp/csrc/caching_cpu_allocator.cpp``, one file, c10 headers only) is
compiled with the system's C++ compiler (``$CXX``, else ``c++``) into
``$XDG_CACHE_HOME/mmfsdp`` (else ``~/.cache/mmfsdp``) the first time a process
asks for it (about a second; once per torch install), and installed with
``c10::SetCPUAllocator``. Tensors below ``min_bytes`` keep torch's allocator.
Where it cannot be built, :func:`install` says why and changes nothing.

Used through ``env_cfg.cpu_allocator`` (:mod:`mmfsdp.allocator`), whose
default ``'cache'`` installs it for tensors of 64 KiB and more::

    env_cfg = dict(cpu_allocator='cache')
"""
import ctypes
import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, List, Optional, Tuple

import torch
from mmengine.hooks import Hook

__all__ = ['CacheStats', 'CacheWindowHook', 'InstallResult', 'install', 'installed',
           'installed_min_bytes', 'mark', 'release', 'stats']

SOURCE = Path(__file__).parent / 'csrc' / 'caching_cpu_allocator.cpp'
#: The build takes about a second; a compiler still running after this is stopped.
COMPILE_TIMEOUT_S = 120


@dataclass(frozen=True)
class CacheStats:
    """The allocator's counters since it was installed.

    Attributes:
        live_bytes: Handed out and not yet freed.
        cached_bytes: Freed and still mapped, for the next request of their size.
        high_water: The most bytes live at once since the allocator was installed.
        bound: Live + cached stays within this: the most bytes live at once in
            this window or the one before (:func:`mark` ends a window).
        hits: Requests served by a cached block of their size.
        resized: Requests served by resizing the least recently freed block.
        mapped: Requests that mapped new memory.
        unmapped: Cached blocks unmapped to stay within ``high_water``.
        fresh_bytes: Bytes newly mapped (by ``mmap`` or by growing a block).

    """

    live_bytes: int
    cached_bytes: int
    high_water: int
    bound: int
    hits: int
    resized: int
    mapped: int
    unmapped: int
    fresh_bytes: int


@dataclass(frozen=True)
class InstallResult:
    """Whether the allocator is in force, and if not, why."""

    installed: bool
    reason: str = ''


_lib: Optional[ctypes.CDLL] = None
_settings: Optional[Tuple[int, bool]] = None  # (min_bytes, huge_pages) of the installed one
_install_lock = threading.Lock()


def _cache_dir() -> Path:
    root = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
    return Path(root) / 'mmfsdp'


def _compile_command(target: str) -> List[str]:
    """The command that builds the library into ``target`` (its compiler ``''`` if none)."""
    compiler = os.environ.get('CXX') or shutil.which('c++') or shutil.which('g++') or ''
    torch_dir = Path(torch.__file__).parent
    abi = int(torch.compiled_with_cxx11_abi())
    return [compiler, '-O2', '-std=c++17', '-shared', '-fPIC', f'-D_GLIBCXX_USE_CXX11_ABI={abi}',
            f'-I{torch_dir / "include"}', str(SOURCE), f'-L{torch_dir / "lib"}', '-lc10',
            f'-Wl,-rpath,{torch_dir / "lib"}', '-o', target]


def _library_path() -> Path:
    """Where the build lives: one per source, torch install and build command."""
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()
                         + ' '.join(_compile_command('')).encode()).hexdigest()[:16]
    return _cache_dir() / f'caching_cpu_allocator-{key}.so'


def _compile(target: Path) -> None:
    """Build the shared library into ``target`` (atomically: ranks may build at once)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix='.so', dir=target.parent)
    os.close(fd)
    cmd = _compile_command(tmp)
    try:
        if not cmd[0]:
            raise OSError('no C++ compiler found (set CXX, or install g++)')
        # A session of its own, so that a timeout stops the compiler's children too
        # (cc1plus, ld), not only the driver: none may write into the cache later.
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) as build:
            try:
                _, stderr = build.communicate(timeout=COMPILE_TIMEOUT_S)
            except subprocess.TimeoutExpired as err:
                os.killpg(build.pid, signal.SIGKILL)
                build.communicate()
                raise OSError(f'{cmd[0]} ran past {COMPILE_TIMEOUT_S} s') from err
        if build.returncode != 0:
            raise OSError(f'{" ".join(cmd)} failed:\n{stderr[-2000:]}')
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> ctypes.CDLL:
    """The built library, built first if need be.

    A file that cannot be loaded (truncated, or linked against a c10 that has
    since been replaced) is built again, once.
    """
    path = _library_path()
    if not path.exists():
        _compile(path)
    try:
        return ctypes.CDLL(str(path))
    except OSError:
        path.unlink(missing_ok=True)
        _compile(path)
        return ctypes.CDLL(str(path))


def install(min_bytes: int, huge_pages: bool) -> InstallResult:
    """Route every later CPU allocation of ``min_bytes`` or more through the cache.

    Once per process: torch's CPU allocator is set once, and tensors it served
    may live as long as the process. A second call with the same settings
    reports it installed; with other settings it reports why not (the first
    stays in force). Tensors allocated before keep torch's allocator, so call
    it before the model is built.
    """
    global _lib, _settings
    if min_bytes < 1:
        raise ValueError(f'min_bytes must be at least 1, got {min_bytes}')
    with _install_lock:
        if _lib is not None:
            if _settings == (min_bytes, bool(huge_pages)):
                return InstallResult(True)
            return InstallResult(False, f'installed already in this process, for tensors of '
                                        f'{_settings[0]} bytes and more (huge pages: '
                                        f'{_settings[1]}); it stays in force: a process sets '
                                        "torch's CPU allocator once")
        try:
            lib = _load()
        except OSError as err:
            return InstallResult(False, f'could not be built: {err}')
        lib.mmfsdp_cpu_cache_install.argtypes = [ctypes.c_size_t, ctypes.c_int]
        lib.mmfsdp_cpu_cache_install.restype = ctypes.c_int
        lib.mmfsdp_cpu_cache_stats.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
        lib.mmfsdp_cpu_cache_stats.restype = ctypes.c_int
        lib.mmfsdp_cpu_cache_release.restype = ctypes.c_size_t
        lib.mmfsdp_cpu_cache_mark.restype = ctypes.c_size_t
        if lib.mmfsdp_cpu_cache_install(min_bytes, int(huge_pages)) != 0:
            return InstallResult(False, 'another copy of the library installed one already')
        _lib, _settings = lib, (min_bytes, bool(huge_pages))
    return InstallResult(True)


def installed() -> bool:
    """Whether this process allocates through the cache."""
    return _lib is not None


def installed_min_bytes() -> Optional[int]:
    """The smallest allocation the installed cache serves (``None`` if none is installed)."""
    return None if _settings is None else _settings[0]


def stats() -> Optional[CacheStats]:
    """The allocator's counters, ``None`` if it is not installed."""
    if _lib is None:
        return None
    out = (ctypes.c_uint64 * len(fields(CacheStats)))()
    _lib.mmfsdp_cpu_cache_stats(out)
    return CacheStats(*out)


def mark() -> int:
    """End a window: unmap the cached blocks beyond the most bytes live in it; bytes returned.

    Called after every training iteration (:class:`CacheWindowHook`), so that
    what a one-off peak (building the model, loading or saving a checkpoint)
    left cached is given back one iteration later instead of staying resident.
    """
    return 0 if _lib is None else int(_lib.mmfsdp_cpu_cache_mark())


def release() -> int:
    """Unmap every cached (free) block and start a window; the bytes returned to the system."""
    return 0 if _lib is None else int(_lib.mmfsdp_cpu_cache_release())


class CacheWindowHook(Hook):
    """Ends the cache's window (:func:`mark`) after every training iteration.

    Registered by :class:`mmfsdp.FSDPRunner` whenever the caching allocator is
    installed in the process, at the lowest priority: after the checkpoint hook, so that a save's
    peak falls in its iteration's window.
    """

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                         outputs: Any = None) -> None:
        """Mark the end of the iteration's window."""
        mark()
