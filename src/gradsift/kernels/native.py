"""Build and load the compiled selection kernels (``select.c``) with the machine's C compiler.

The source is plain C with POSIX threads and no Python or torch headers, so it
compiles with any ``cc`` (about 5 s of one core at ``-O3``); the shared library
is cached under ``$GRADSIFT_CACHE`` (default ``$XDG_CACHE_HOME/gradsift`` or
``~/.cache/gradsift``), keyed by the source, the compiler, its flags and the
CPU, and written atomically. Several processes starting at once (the DDP ranks
of one machine) build it once: the first takes a lock on the cache, the others
wait for it and load what it built. ctypes calls release the GIL.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("select.c")
HEADER = Path(__file__).with_name("spec.h")  # the spec rows' fields (kernels/many.py reads them too)
ABI = 40


class KernelUnavailable(RuntimeError):
    """The compiled kernels cannot be built or loaded here; the message says why."""


def cache_dir() -> Path:
    env = os.environ.get("GRADSIFT_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gradsift"


def compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise KernelUnavailable("no C compiler found (cc, gcc or clang on PATH, or $CC)")
    return cc


def _cpu_signature() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compile(cc: str, flags: list[str], out: Path) -> str | None:
    """Compile to ``out``; None on success, else the compiler's first error line."""
    cmd = [cc, *flags, "-fPIC", "-shared", "-pthread", "-o", str(out), str(SOURCE), "-lm"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    if r.returncode != 0:
        lines = (r.stderr or r.stdout).strip().splitlines()
        return lines[0] if lines else f"exit {r.returncode}"
    return None


def build() -> Path:
    """The path of the compiled library, building it if it is not cached yet."""
    cc = compiler()
    source = SOURCE.read_bytes() + HEADER.read_bytes()
    attempts = [["-O3", "-march=native", "-ffp-contract=off"], ["-O3", "-ffp-contract=off"]]  # (no FMA: torch rounds a*b+c twice)
    d = cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KernelUnavailable(f"cannot create the kernel cache {d}: {e.strerror}") from None
    errors = []
    key = source + cc.encode() + _cpu_signature().encode() + platform.machine().encode()
    targets = [d / f"select-{hashlib.sha256(key + ' '.join(flags).encode()).hexdigest()[:16]}.so" for flags in attempts]
    built = [t for t in targets if t.exists()]
    if built:
        return built[0]
    with _build_lock(d):
        for flags, target in zip(attempts, targets):
            if target.exists():  # (another process built it while this one waited for the lock)
                return target
            err = _compile_to(cc, flags, d, target)
            if err is None:
                return target
            errors.append(err)
    raise KernelUnavailable(f"{cc} could not compile {SOURCE.name}: {errors[-1]}")


@contextlib.contextmanager
def _build_lock(d: Path):
    """Held while building: one process of several starting at once compiles (no lock where flock is missing)."""
    try:
        import fcntl
    except ImportError:  # (not POSIX: each process builds its own copy, written atomically)
        yield
        return
    with open(d / ".build.lock", "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _compile_to(cc: str, flags: list[str], d: Path, target: Path) -> str | None:
    """Compile into a temporary file of ``d``, then move it to ``target``; None on success, else the error."""
    fd, tmp = tempfile.mkstemp(prefix=".select-", suffix=".so", dir=d)
    os.close(fd)
    err = _compile(cc, flags, Path(tmp))
    if err is None:
        os.replace(tmp, target)
    else:
        os.unlink(tmp)
    return err


def load() -> ctypes.CDLL:
    """Build if needed, load, and declare the functions."""
    return open_library(build())


def build_with(flags: list[str], out: Path) -> ctypes.CDLL:
    """The kernels compiled with other ``flags`` into ``out`` (not cached), loaded and declared: the instruction
    sets a machine lacks tried against its own (``-mno-avx512f``, ``-mno-avx2``: the same numbers on every path)."""
    err = _compile(compiler(), [*flags, "-ffp-contract=off"], out)
    if err is not None:
        raise KernelUnavailable(f"{compiler()} could not compile {SOURCE.name} with {' '.join(flags)}: {err}")
    return open_library(out)


def open_library(path: Path) -> ctypes.CDLL:
    """The library at ``path``, loaded, its version checked and its functions declared."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelUnavailable(f"cannot load {path}: {e}") from None
    if lib.gs_abi_version() != ABI:
        raise KernelUnavailable(f"{path} is of another version")
    lib.gs_hist16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    lib.gs_hist16.restype = ctypes.c_int
    lib.gs_compact16.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int32, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.gs_compact16.restype = ctypes.c_int
    lib.gs_topk_many.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_int, ctypes.c_int]
    lib.gs_topk_many.restype = ctypes.c_int
    lib.gs_count_above.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32, ctypes.c_int]
    lib.gs_count_above.restype = ctypes.c_int64
    lib.gs_take_above.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32, ctypes.c_int,
                                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.gs_take_above.restype = ctypes.c_int64
    lib.gs_gaussk_many.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.gs_gaussk_many.restype = None
    lib.gs_redsync_many.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.gs_redsync_many.restype = None
    lib.gs_take_above_many.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.gs_take_above_many.restype = None
    lib.gs_keep_largest_many.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.gs_keep_largest_many.restype = ctypes.c_int
    lib.gs_cast_bf16_many.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.gs_cast_bf16_many.restype = ctypes.c_int64
    lib.gs_bernoulli.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_uint64, ctypes.c_void_p,
                                 ctypes.c_int64]
    lib.gs_bernoulli.restype = ctypes.c_int64
    lib.gs_draw_k.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p]
    lib.gs_draw_k.restype = ctypes.c_int64
    lib.gs_sampled.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_void_p]
    lib.gs_sampled.restype = ctypes.c_float
    lib.gs_sample_many.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_void_p]
    lib.gs_sample_many.restype = None
    lib.gs_subtract_at.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.gs_subtract_at.restype = None
    lib.gs_add_segments.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.gs_add_segments.restype = ctypes.c_int64
    lib.gs_div_at.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p]
    lib.gs_div_at.restype = None
    lib.gs_gather_many.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    lib.gs_gather_many.restype = ctypes.c_int64
    lib.gs_add_at_many.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.gs_add_at_many.restype = ctypes.c_int64
    lib.gs_pack_segments.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.gs_pack_segments.restype = ctypes.c_int
    lib.gs_unpack_segments.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                       ctypes.c_void_p]
    lib.gs_unpack_segments.restype = None
    lib.gs_add_gathered.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                    ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                    ctypes.c_void_p, ctypes.c_float]
    lib.gs_add_gathered.restype = ctypes.c_int64
    lib.gs_adam_many.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.gs_adam_many.restype = None
    lib.gs_figures_many.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    lib.gs_figures_many.restype = None
    lib.gs_momentum_whole.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p,
                                      ctypes.c_void_p]
    lib.gs_momentum_whole.restype = None
    return lib
