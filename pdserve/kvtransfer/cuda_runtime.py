"""The CUDA runtime calls of ``kv_transport: cuda_ipc``, through ctypes: pointer facts, IPC handles
and the device-to-device copy of a descriptor table.

Copy methods (``CudaRuntime(copy_method=...)``, default ``DEFAULT_COPY_METHOD``), for
``BATCHED_COPY_MIN`` descriptors or more; fewer, larger runs always go as one
``cudaMemcpyAsync`` each (the copy engine, ~7-10 us of host time per call on the H200):
- ``triton`` / ``triton:<variant>``: one Triton kernel over the table
  (``pdserve.kernels.triton_copy``, its ``DEFAULT_VARIANT`` or the named one). Without triton,
  with a kernel it cannot compile, or with an address or length not 16-byte aligned, one
  memcpy each.
- ``memcpy_batch``: one ``cudaMemcpyBatchAsync`` (CUDA runtime 12.8 or newer; the call lost its
  ``failIdx`` argument in 13.0, both forms are bound); where the runtime lacks or refuses it,
  one memcpy each.
- ``memcpy``: one ``cudaMemcpyAsync`` per descriptor.
A method that cannot run here is logged once with the reason (``unavailable``) and not tried
again; a failed copy (a CUDA error) raises OSError, which ``write`` reports as a failed transfer.
Every copy is waited for: when ``copy`` returns the bytes landed. bench/gpu_ipc.py times them.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any, Protocol

import numpy as np

from pdserve.errors import ConfigError
from pdserve.kvtransfer.regions import Descriptors, descriptor_table

logger = logging.getLogger(__name__)
_IPC_HANDLE_BYTES = 64
BATCHED_COPY_MIN = 4
COPY_METHODS = ("triton", "memcpy_batch", "memcpy")  # and "triton:<variant>"
DEFAULT_COPY_METHOD = "triton"


def copy_table(copies: Descriptors) -> np.ndarray:
    """Descriptors as an int64 array [n, 3] (src, dst, bytes); an int64 array passes through."""
    return descriptor_table(copies)


def check_copy_method(method: str) -> str:
    """``method`` if it names a copy method (a Triton variant is checked where triton imports);
    ConfigError naming the supported ones otherwise."""
    kind, _, variant = method.partition(":")
    if kind not in COPY_METHODS or (variant and kind != "triton"):
        raise ConfigError(f"copy method {method!r}: expected one of {COPY_METHODS} or 'triton:<variant>'")
    if variant:
        try:
            from pdserve.kernels.triton_copy import VARIANTS
        except ImportError:
            return method  # no triton here: the copy falls back, ``unavailable`` says why
        if variant not in VARIANTS:
            raise ConfigError(f"copy method {method!r}: Triton variants are {sorted(VARIANTS)}")
    return method


class CudaApi(Protocol):
    """The CUDA calls the backend needs; ``CudaRuntime`` is the real one."""

    def current_device(self) -> int: ...

    def allocation_of(self, addr: int) -> tuple[int, int]:
        """(base, size) of the device allocation holding ``addr``; raises ValueError for host memory."""
        ...

    def ipc_handle(self, base: int) -> bytes: ...

    def open_handle(self, handle: bytes, device: int) -> int: ...

    def close_handle(self, addr: int, device: int) -> None: ...

    def copy(self, copies: np.ndarray, device: int) -> None:
        """Device-to-device copies of the rows (src, dst, bytes) of an int64 array [n, 3], none
        overlapping another; returns once all landed."""
        ...


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * _IPC_HANDLE_BYTES)]


class _MemcpyAttributes(ctypes.Structure):
    """cudaMemcpyAttributes: srcAccessOrder, srcLocHint and dstLocHint (cudaMemLocation: type,
    id), flags; 24 bytes in 12.8 and 13.x."""

    _fields_ = [(f, ctypes.c_int) for f in ("order", "src_type", "src_id", "dst_type", "dst_id")] + [
        ("flags", ctypes.c_uint)
    ]


def _load_cudart() -> ctypes.CDLL:
    """The libcudart torch already loaded (same version as the caching allocator's), else any."""
    import torch  # the engine's process already has it; initialising CUDA maps libcudart

    torch.cuda.init()
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    for path in sorted(paths) + ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise OSError("kv_transport cuda_ipc: no libcudart found (torch with CUDA is required)")


class CudaRuntime:
    """ctypes over libcudart (runtime API: the primary context torch uses, on any thread)."""

    _MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: unified addressing picks D2D or peer
    _IPC_LAZY_PEER = 1  # cudaIpcMemLazyEnablePeerAccess
    _CU_POINTER_MEMORY_TYPE = 2  # CU_POINTER_ATTRIBUTE_MEMORY_TYPE -> unsigned int
    _CU_POINTER_DEVICE_ORDINAL = 9  # CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL -> int
    _CU_MEMORYTYPE_DEVICE = 2

    def __init__(self, copy_method: str = DEFAULT_COPY_METHOD, *, lib: Any = None) -> None:
        """``lib``: a stand-in for libcudart with the calls ``copy`` makes (unit tests of the
        dispatch); None loads the real one and the driver."""
        self._copy_method = check_copy_method(copy_method)
        self.unavailable: dict[str, str] = {}  # method -> why it cannot run here
        self._streams: dict[int, ctypes.c_void_p] = {}
        self._torch_streams: dict[int, Any] = {}  # device -> torch.cuda.Stream of the kernel
        self._copy_locks: dict[int, threading.Lock] = {}  # device -> one copy at a time
        self._lock = threading.Lock()
        self._batch_attrs = _MemcpyAttributes(order=1)  # cudaMemcpySrcAccessOrderStream
        self._batch_attr_idx = (ctypes.c_size_t * 1)(0)
        self._batch_fail_idx = False
        self._triton: tuple[Any, Any, Any] | None = None  # (torch, CompilationError, triton_copy)
        self._rt: Any = lib
        if lib is None:
            self._rt = _load_cudart()
            self._bind()

    def _bind(self) -> None:
        self._cu = ctypes.CDLL("libcuda.so.1")
        rt, vp, sz = self._rt, ctypes.c_void_p, ctypes.c_size_t
        rt.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(vp), _IpcHandle, ctypes.c_uint]
        rt.cudaMemcpyAsync.argtypes = [vp, vp, sz, ctypes.c_int, vp]
        rt.cudaStreamSynchronize.argtypes = [vp]
        rt.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), vp]
        rt.cudaIpcCloseMemHandle.argtypes = [vp]
        rt.cudaStreamCreateWithFlags.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
        rt.cudaSetDevice.argtypes = [ctypes.c_int]
        rt.cudaGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
        rt.cudaGetErrorString.argtypes = [ctypes.c_int]
        rt.cudaGetErrorString.restype = ctypes.c_char_p
        # Driver calls for pointer facts: one scalar each, no struct whose size changes between
        # CUDA releases (cudaPointerAttributes grew in 13.0; a short struct corrupts memory).
        self._cu.cuPointerGetAttribute.argtypes = [vp, ctypes.c_int, ctypes.c_uint64]
        self._cu.cuMemGetAddressRange_v2.argtypes = [
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(sz),
            ctypes.c_uint64,
        ]
        self._batch_fail_idx = self._bind_memcpy_batch()

    @property
    def copy_method(self) -> str:
        """How ``BATCHED_COPY_MIN`` descriptors or more are copied (module docstring)."""
        return self._copy_method

    @copy_method.setter
    def copy_method(self, method: str) -> None:
        self._copy_method = check_copy_method(method)

    def _bind_memcpy_batch(self) -> bool:
        """Bind cudaMemcpyBatchAsync; True when its 12.x form (with ``failIdx``) is the one here."""
        version = ctypes.c_int()
        self._rt.cudaRuntimeGetVersion(ctypes.byref(version))
        v = version.value
        fn = getattr(self._rt, "cudaMemcpyBatchAsync", None)
        if fn is None or v < 12080:
            self.unavailable["memcpy_batch"] = f"libcudart {v} has no cudaMemcpyBatchAsync (CUDA >= 12.8)"
            logger.info("cuda_ipc: %s", self.unavailable["memcpy_batch"])
            return False
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        head = [vp, vp, vp, sz, ctypes.POINTER(_MemcpyAttributes), vp, sz]
        fn.argtypes = [*head, vp] if v >= 13000 else [*head, ctypes.POINTER(sz), vp]
        return v < 13000

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            self._rt.cudaGetLastError()  # clear it: torch's next launch check would report it as its own
            msg = self._rt.cudaGetErrorString(code).decode()
            raise OSError(f"{what} failed: CUDA error {code} ({msg})")

    def _use(self, device: int) -> None:
        self._check(self._rt.cudaSetDevice(device), f"cudaSetDevice({device})")

    def current_device(self) -> int:
        dev = ctypes.c_int()
        self._check(self._rt.cudaGetDevice(ctypes.byref(dev)), "cudaGetDevice")
        return dev.value

    def allocation_of(self, addr: int) -> tuple[int, int]:
        self._use(self.current_device())  # a current context for the driver calls below
        mem_type, ordinal = ctypes.c_uint(), ctypes.c_int()
        code = self._cu.cuPointerGetAttribute(ctypes.byref(mem_type), self._CU_POINTER_MEMORY_TYPE, addr)
        if code != 0 or mem_type.value != self._CU_MEMORYTYPE_DEVICE:
            raise ValueError(
                f"address {addr:#x} is not device memory (CUresult {code}, type {mem_type.value})"
            )
        code = self._cu.cuPointerGetAttribute(ctypes.byref(ordinal), self._CU_POINTER_DEVICE_ORDINAL, addr)
        if code != 0:
            raise OSError(f"cuPointerGetAttribute(DEVICE_ORDINAL, {addr:#x}) failed: CUresult {code}")
        self._use(ordinal.value)
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        code = self._cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), addr)
        if code != 0:
            raise OSError(f"cuMemGetAddressRange({addr:#x}) failed: CUresult {code}")
        return base.value, size.value

    def ipc_handle(self, base: int) -> bytes:
        h = _IpcHandle()
        self._check(
            self._rt.cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(base)), "cudaIpcGetMemHandle"
        )
        # string_at, not h.reserved: a c_char array field reads as a C string and stops at a NUL
        return ctypes.string_at(ctypes.addressof(h), _IPC_HANDLE_BYTES)

    def open_handle(self, handle: bytes, device: int) -> int:
        if len(handle) != _IPC_HANDLE_BYTES:
            raise ValueError(f"CUDA IPC handle of {len(handle)} bytes, expected {_IPC_HANDLE_BYTES}")
        self._use(device)
        h = _IpcHandle()
        ctypes.memmove(ctypes.addressof(h), handle, _IPC_HANDLE_BYTES)
        ptr = ctypes.c_void_p()
        self._check(
            self._rt.cudaIpcOpenMemHandle(ctypes.byref(ptr), h, self._IPC_LAZY_PEER), "cudaIpcOpenMemHandle"
        )
        assert ptr.value is not None
        return ptr.value

    def close_handle(self, addr: int, device: int) -> None:
        self._use(device)
        self._check(self._rt.cudaIpcCloseMemHandle(ctypes.c_void_p(addr)), "cudaIpcCloseMemHandle")

    def _stream(self, device: int) -> ctypes.c_void_p:
        with self._lock:
            s = self._streams.get(device)
            if s is None:
                s = ctypes.c_void_p()
                self._check(self._rt.cudaStreamCreateWithFlags(ctypes.byref(s), 1), "cudaStreamCreate")
                self._streams[device] = s
                self._copy_locks[device] = threading.Lock()
            return s

    def _unavailable(self, method: str, why: str) -> None:
        self.unavailable[method] = why
        logger.warning("cuda_ipc: no %s copy, the next method runs: %s", method, why)

    def copy(self, copies: np.ndarray, device: int) -> None:
        self._use(device)
        kind, _, variant = self._copy_method.partition(":")
        if len(copies) >= BATCHED_COPY_MIN:
            if kind == "triton" and self._triton_copy(copies, device, variant or None):
                return
            if kind == "memcpy_batch" and "memcpy_batch" not in self.unavailable:
                try:
                    self._on_stream(device, self.memcpy_batch_async, copies)
                    return
                except OSError as e:  # refused (nothing or part enqueued): the copies are redone
                    self._unavailable("memcpy_batch", str(e))
        self._on_stream(device, self.memcpy_async, copies)

    def _on_stream(self, device: int, enqueue: Any, copies: np.ndarray) -> None:
        stream = self._stream(device)
        with self._copy_locks[device]:
            enqueue(copies, stream)
            self._check(self._rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")

    def memcpy_async(self, copies: np.ndarray, stream: Any) -> None:
        """Enqueue one cudaMemcpyAsync per row on ``stream`` (a cudaStream_t)."""
        memcpy = self._rt.cudaMemcpyAsync
        for src, dst, n in copies.tolist():
            self._check(memcpy(dst, src, n, self._MEMCPY_DEFAULT, stream), "cudaMemcpyAsync")

    def memcpy_batch_async(self, copies: np.ndarray, stream: Any) -> None:
        """Enqueue all rows as one cudaMemcpyBatchAsync on ``stream`` (not the legacy default
        stream); OSError where this runtime lacks it (``unavailable`` says why)."""
        if "memcpy_batch" in self.unavailable:
            raise OSError(self.unavailable["memcpy_batch"])
        dsts, srcs, sizes = (np.ascontiguousarray(copies[:, i]) for i in (1, 0, 2))
        args: list[Any] = [dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, len(copies)]
        args += [ctypes.byref(self._batch_attrs), self._batch_attr_idx, 1]
        if self._batch_fail_idx:
            args.append(ctypes.byref(ctypes.c_size_t()))
        self._check(self._rt.cudaMemcpyBatchAsync(*args, stream), "cudaMemcpyBatchAsync")

    def _triton_copy(self, copies: np.ndarray, device: int, variant: str | None) -> bool:
        """All copies as one Triton kernel (``pdserve.kernels.triton_copy``) on a private torch
        stream, waited for; False (nothing moved) when the kernel cannot take them: no triton or
        a kernel it cannot compile (logged once, not tried again), or an address / length not
        16-byte aligned."""
        if "triton" in self.unavailable:
            return False
        if self._triton is None:  # imported once: an import statement per copy costs ~3 us
            try:
                import torch
                from triton.compiler.errors import CompilationError

                from pdserve.kernels import triton_copy
            except ImportError as e:
                self._unavailable("triton", f"{type(e).__name__}: {e}")
                return False
            self._triton = (torch, CompilationError, triton_copy)
        torch, CompilationError, triton_copy = self._triton
        stream = self._torch_streams.get(device)
        if stream is None:
            self._stream(device)  # the device's copy lock
            with self._lock:
                stream = self._torch_streams.setdefault(
                    device, torch.cuda.Stream(torch.device("cuda", device))
                )
        # one copy at a time per device: the kernel's stream and its table buffers are shared
        with self._copy_locks[device]:
            try:
                triton_copy.batched_copy(copies, stream.device, stream, variant)
                stream.synchronize()
            except triton_copy.UnalignedCopyError:  # nothing enqueued: one memcpy each instead
                return False
            except CompilationError as e:  # nothing enqueued: this Triton cannot build the kernel
                self._unavailable("triton", f"{type(e).__name__}: {e}")
                return False
            except (RuntimeError, ValueError) as e:  # CUDA's or Triton's launch error: as a failed memcpy
                raise OSError(f"batched copy of {len(copies)} descriptors failed: {e}") from e
        return True
