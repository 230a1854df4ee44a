"""Compiles hetero/cuda's sources on first use, cached by source, compiler and flags.

  cuda_library(arch)  signal.cu -> a shared library (nvcc; the CUDA transport loads it through
                      ctypes). Needs nvcc, not a CUDA build of torch.
  host_library()      host_test.cpp -> a shared library (c++), the protocol on the host (tests).
  compile_check(arch) signal.cu -> an object file for `arch` (the tests: a broken kernel fails CI
                      on any machine with nvcc, GPU or not).
The control word offsets and dtype codes are passed as -D flags from hetero.ipc.control and the
kernel, so the C code never repeats them. Builds land in <planner.cache_dir()>/cuda.
"""
import hashlib
import os
import shutil
import subprocess
import tempfile

from hetero.ipc.control import BF16, F16, F32
from hetero.cpu_attention.planner import cache_dir
from hetero.errors import HeteroError
from hetero.ipc import control as C

SRC = os.path.dirname(os.path.abspath(__file__))
SOURCES = ("protocol.h", "signal.cu", "host_test.cpp")


class BuildError(HeteroError):
    """The CUDA extension (or its host build) could not be compiled or loaded."""


def defines():
    words = {"LINE": C.LINE, "CMD": C.CMD, "LAYER": C.LAYER, "QLEN": C.QLEN, "WINDOW": C.WINDOW,
             "NSPLIT": C.NSPLIT, "PSPLIT": C.PSPLIT, "NGROUPS": C.NGROUPS, "UNITS": C.UNITS,
             "F_SCALE": C.F_SCALE, "F_SOFTCAP": C.F_SOFTCAP,
             "TICKET": C.TICKET, "FIN": C.FIN, "ABORT": C.ABORT, "DONE_LINE": C.DONE_LINE,
             "CMD_BITS": C.CMD_BITS, "TAG_MASK": C.TAG_MASK, "CMD_ATTN": C.CMD_ATTN, "CMD_LORA_GPU": C.CMD_LORA_GPU,
             "F32": F32, "BF16": BF16, "F16": F16}
    return [f"-DHW_{k}={v}" for k, v in words.items()]


def nvcc():
    """The nvcc to use (CUDA_HOME, PATH, /usr/local/cuda), or None."""
    for path in (os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "nvcc"), shutil.which("nvcc"),
                 "/usr/local/cuda/bin/nvcc"):
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def _cache_dir():
    path = os.path.join(cache_dir(), "cuda")
    os.makedirs(path, exist_ok=True)
    return path


def _build(compiler, flags, source, suffix):
    """Compile `source` with `flags` unless a build of the same inputs exists; returns its path."""
    h = hashlib.sha256()
    for name in SOURCES:
        with open(os.path.join(SRC, name), "rb") as f:
            h.update(f.read())
    h.update(" ".join([compiler, *flags, *defines(), source]).encode())
    out = os.path.join(_cache_dir(), f"{os.path.splitext(source)[0]}-{h.hexdigest()[:16]}{suffix}")
    if os.path.exists(out):
        return out
    fd, tmp = tempfile.mkstemp(suffix=suffix, dir=os.path.dirname(out))
    os.close(fd)
    cmd = [compiler, *flags, *defines(), "-I", SRC, os.path.join(SRC, source), "-o", tmp]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise BuildError(f"{' '.join(cmd)} failed:\n{r.stderr[-4000:]}")
        os.replace(tmp, out)           # atomic: a concurrent build of the same inputs is harmless
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _nvcc_or_raise():
    path = nvcc()
    if path is None:
        raise BuildError("nvcc not found (CUDA_HOME, PATH, /usr/local/cuda/bin)")
    return path


def _gencode(archs):
    """Machine code for each compute capability (e.g. 90 = sm_90), and PTX of the newest for later GPUs."""
    return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs] + \
        [f"-gencode=arch=compute_{max(archs)},code=compute_{max(archs)}"]


def cuda_library(arch):
    """signal.cu built for compute capability `arch` (e.g. 90 for sm_90) as a shared library."""
    return _build(_nvcc_or_raise(), ["-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", *_gencode([arch])],
                  "signal.cu", f"-sm{arch}.so")


def compile_check(archs=(80, 90)):
    """signal.cu compiled to an object file for `archs` (no GPU needed)."""
    return _build(_nvcc_or_raise(), ["-O3", "-std=c++17", "-c", "-Xcompiler", "-fPIC", *_gencode(archs)],
                  "signal.cu", f"-sm{'-'.join(map(str, archs))}.o")


def host_library():
    """host_test.cpp (protocol.h on the host) as a shared library, built with the system c++."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise BuildError("no C++ compiler found (CXX, c++, g++)")
    return _build(cxx, ["-O2", "-std=c++17", "-shared", "-fPIC"], "host_test.cpp", ".so")
