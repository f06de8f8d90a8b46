"""torch tensors <-> MPI buffers.

CPU tensors travel as NumPy views of their storage (no copy).  MPI has no bfloat16 and only
some libraries know a 16-bit float, so both 16-bit float types travel as 16-bit words and are
reduced by psrt itself (torch kernels) or, for the MPI library's own collectives, by a
user-defined MPI op (MPI 4.1 sec. 6.9.5) that runs the same torch kernel.  Sums therefore stay
in the tensor's own dtype on the wire, as NCCL does; nothing is upcast silently.

CUDA tensors go straight to MPI when the library is CUDA-aware (detected at run time,
`PSRT_CUDA_AWARE=0|1` overrides), after the producing stream is synchronised; otherwise they
are staged through pinned host buffers.
"""
from __future__ import annotations

import functools
import os
import subprocess

import numpy as np
import torch

from psrt import env
from psrt.errors import PsrtError

# dtype -> the MPI datatype the MPI library reduces it as (None: MPI has no such type, so
# psrt moves it as raw words; see `mpi_op`).
_DTYPES = {
    torch.float32: "FLOAT", torch.float64: "DOUBLE", torch.float16: None, torch.bfloat16: None,
    torch.int32: "INT32_T", torch.int64: "INT64_T", torch.uint8: "UINT8_T", torch.int8: "INT8_T",
    torch.bool: None,
}
_RAW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.bool: torch.uint8}
SUPPORTED_DTYPES = tuple(_DTYPES)


def check_dtype(t: torch.Tensor) -> None:
    if t.dtype not in _DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in _DTYPES)
        raise PsrtError(f"dtype {t.dtype} is not supported by psrt's transport (supported: {names})")


def np_view(t: torch.Tensor) -> np.ndarray:
    """A NumPy array sharing `t`'s memory: t must be a contiguous CPU tensor."""
    check_dtype(t)
    raw = _RAW.get(t.dtype)
    return (t.detach().view(raw) if raw else t.detach()).numpy()


def msg(t: torch.Tensor):
    """An mpi4py message spec for a contiguous tensor (CPU view or CUDA tensor)."""
    if t.is_cuda:
        sync_cuda(t)
        # handed over by DLPack, which refuses a tensor that requires grad
        return [t.detach(), t.numel() * t.element_size(), _mpi().BYTE]
    return np_view(t)


def sync_cuda(t: torch.Tensor) -> None:
    """MPI does not see CUDA streams: the kernels that wrote t must finish before the library
    touches its memory.  Called wherever a CUDA buffer is handed to MPI."""
    torch.cuda.current_stream(t.device).synchronize()


def _mpi():
    from mpi4py import MPI
    return MPI


def mpi_datatype(dtype: torch.dtype):
    """The MPI datatype for reductions in the MPI library, or None for the 16-bit floats."""
    name = _DTYPES[dtype]
    return getattr(_mpi(), name) if name else None


# ---------------------------------------------------------------- local reductions
# The bitwise ops of MPI (MPI 4.1 sec. 6.9.2: MPI_BAND, MPI_BOR, MPI_BXOR), for integer and
# bool tensors; torch.distributed's ReduceOp.BAND/BOR/BXOR map onto them.
BITWISE = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}
OPS = ("sum", "avg", "max", "min", "prod") + tuple(BITWISE)


def check_op(op: str, dtype: torch.dtype) -> None:
    if op not in OPS:
        raise PsrtError(f"unknown reduction op {op!r}; choose one of {', '.join(OPS)}")
    if op == "avg" and not dtype.is_floating_point:
        raise PsrtError(f"op 'avg' needs a floating-point tensor, got {dtype}: use 'sum' and divide")
    if op in BITWISE and (dtype.is_floating_point or dtype.is_complex):
        raise PsrtError(f"op {op!r} needs an integer or bool tensor, got {dtype}")


def reduce_(acc: torch.Tensor, other: torch.Tensor, op: str) -> torch.Tensor:
    """acc <- acc (op) other, in acc's dtype, in place.  'avg' reduces as 'sum'."""
    return reduce_into(acc, acc, other, op)


def reduce_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, op: str) -> torch.Tensor:
    """out <- a (op) b: the out-of-place form of `reduce_` (out may alias a)."""
    if op in ("sum", "avg"):
        return torch.logical_or(a, b, out=out) if out.dtype == torch.bool else torch.add(a, b, out=out)
    if op == "max":
        return torch.maximum(a, b, out=out)
    if op == "min":
        return torch.minimum(a, b, out=out)
    if op in BITWISE:
        return BITWISE[op](a, b, out=out)
    return torch.logical_and(a, b, out=out) if out.dtype == torch.bool else torch.mul(a, b, out=out)


@functools.lru_cache(maxsize=None)
def mpi_op(op: str, dtype: torch.dtype):
    """(MPI op, MPI datatype) for the MPI library's own reductions.

    Types MPI knows use its built-in ops.  float16/bfloat16 use a commutative user-defined op
    over 16-bit words whose body is `reduce_` on torch views of the two buffers.
    """
    MPI = _mpi()
    builtin = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD,
               "band": MPI.BAND, "bor": MPI.BOR, "bxor": MPI.BXOR}
    datatype = mpi_datatype(dtype)
    if datatype is not None and dtype != torch.bool:
        return builtin[op], datatype

    def body(inbuf, inoutbuf, _datatype, _dtype=dtype, _op=op):
        if len(memoryview(inbuf)) == 0:
            return
        src = torch.frombuffer(inbuf, dtype=_dtype)
        dst = torch.frombuffer(inoutbuf, dtype=_dtype)
        reduce_(dst, src, _op)

    word = MPI.INT16_T if dtype != torch.bool else MPI.UINT8_T
    return MPI.Op.Create(body, commute=True), word


# ---------------------------------------------------------------- CUDA
def cuda_aware() -> bool:
    """Whether CUDA buffers can be handed to MPI directly.

    PSRT_CUDA_AWARE=1/0 decides if set; otherwise ask the library (`cuda_support`).
    """
    forced = env.cuda_aware()
    return cuda_support()[0] if forced is None else forced


@functools.lru_cache(maxsize=1)
def cuda_support() -> tuple[bool, str]:
    """(whether the MPI library takes CUDA buffers, how that was learnt), asked once.

    MPIX_Query_cuda_support is the run-time answer of Open MPI (mpi-ext.h), MPICH and Intel
    MPI (with I_MPI_OFFLOAD=1): 1 only when the library was built for CUDA *and* can use it
    now.  mpi4py 4.1 wraps it only in some builds, so it is called through ctypes on the
    libmpi this process loaded.  An MPI without it: Open MPI's build flag (ompi_info).
    """
    MPI = _mpi()
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        try:
            return bool(query()), f"MPI.Query_cuda_support() = {int(query())}"
        except Exception:  # noqa: BLE001 - an MPI without the extension raises NotImplemented
            pass
    # Intel MPI crashes when asked before MPI_Init; Open MPI would answer its build flag alone
    answer = _mpix_query_cuda_support() if MPI.Is_initialized() else None
    if answer is not None:
        return bool(answer), f"MPIX_Query_cuda_support() = {answer}"
    try:
        out = subprocess.run(["ompi_info", "--parsable", "--all"], capture_output=True,
                             text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False, "the MPI library has no MPIX_Query_cuda_support and no ompi_info"
    built = "mpi_built_with_cuda_support:value:true" in out
    return built, f"ompi_info: mpi_built_with_cuda_support:{str(built).lower()}"


def forced_but_unsupported() -> str | None:
    """Why PSRT_CUDA_AWARE=1 would hand device pointers to an MPI library that says it cannot
    take them (a crash in the library, not an error), or None where it would not."""
    aware, how = cuda_support()
    return f"PSRT_CUDA_AWARE=1 but the MPI library is not CUDA-aware ({how})" if env.cuda_aware() and not aware else None


def loaded_libmpi() -> list[str]:
    """The MPI libraries mapped into this process (mpi4py loads one with RTLD_LOCAL, so its
    symbols are not in the global namespace): paths from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split()[-1] for line in maps if "/libmpi" in line]
    except OSError:
        return []
    return [p for p in dict.fromkeys(paths) if ".so" in os.path.basename(p)]


def _mpix_query_cuda_support() -> int | None:
    """MPIX_Query_cuda_support() of the loaded libmpi, or None where it has no such symbol."""
    import ctypes
    _mpi()      # load the library first
    for path in loaded_libmpi():
        try:
            fn = ctypes.CDLL(path).MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        fn.restype, fn.argtypes = ctypes.c_int, []
        return int(fn())
    return None


class CudaDevice:
    """The caller's CUDA device, carried into a psrt thread that hands buffers to MPI.

    A CUDA-aware MPI works on device buffers in whichever thread calls it, and a new thread
    has no current CUDA context: Intel MPI's cuIpcOpenMemHandle of a peer's buffer, reached
    from psrt's progress thread, failed there (CUDA error 201, invalid context).  `note()`, in
    the thread that issues a call, records its device once CUDA is in use; `adopt()`, in the
    psrt thread before it calls MPI, makes that device (its primary context) current."""

    def __init__(self):
        self.index: int | None = None
        self._current: int | None = None

    def note(self) -> None:
        if torch.cuda.is_initialized():
            self.index = torch.cuda.current_device()

    def adopt(self) -> None:
        if self.index is not None and self.index != self._current:
            torch.cuda.set_device(self.index)
            self._current = self.index


class Staging:
    """Where CUDA tensors meet MPI: whether they go direct (`direct_cuda`), the pinned host
    buffers they are staged through otherwise (cached by dtype and size, reused), and
    `from_mpi`, which writes a result back into the user's tensor when they differ."""

    def __init__(self, cuda_aware_mpi: bool | None = None):
        self._cuda_aware = cuda_aware_mpi
        self._pinned: dict[tuple, torch.Tensor] = {}

    @property
    def direct_cuda(self) -> bool:
        if self._cuda_aware is None:
            self._cuda_aware = cuda_aware()
        return self._cuda_aware

    def host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        key = (like.dtype, like.numel())
        buf = self._pinned.get(key)
        if buf is None:
            buf = torch.empty(like.numel(), dtype=like.dtype, pin_memory=torch.cuda.is_available())
            self._pinned[key] = buf
        return buf

    @staticmethod
    def from_mpi(flat: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        """Write `flat` into `into` unless they already share memory; return `into`."""
        if flat.data_ptr() != into.data_ptr() or not into.is_contiguous():
            into.copy_(flat.view(into.shape))
        return into
