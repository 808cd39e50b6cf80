"""CUDA C kernels compiled at run time with NVRTC and launched through the CUDA driver API, with no toolkit.

A leaf (it knows nothing of NVFP4). CUDA builds of torch depend on the ``nvidia-cuda-nvrtc`` wheel, so NVRTC is
present wherever CUDA torch is; the driver library comes with the GPU driver. Both are opened with `ctypes`:

* `compile_cubin` turns a source and one C++ name expression (a template instance) into a cubin for one
  ``sm_XY`` target. It needs no GPU, which is how the CPU tests cross-compile for every target.
* `CudaKernel.get` compiles (or reads the on-disk cache under ``$TRL_QERL_CACHE`` or ``~/.cache/trl_qerl``),
  loads the cubin into the current device's primary context (the one torch uses) and launches on torch's current
  stream, so launches are captured by CUDA graphs like any other kernel.

torch has a private wrapper of the same calls (``torch.cuda._compile_kernel``, no stability promise); this module
talks to the two public C APIs instead.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import json
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from ._files import write_atomically


class NVRTCError(RuntimeError):
    """NVRTC or the CUDA driver was missing or refused a kernel (the caller falls back to another kernel)."""


# -- libraries ------------------------------------------------------------------------------------------------
def _candidate_nvrtc_paths() -> list[str]:
    """Where the NVRTC library may be: the loader's search path first, then the ``nvidia`` wheels' folders."""
    names = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"] if sys.platform != "win32" else []
    found = []
    for base in sys.path:
        for pattern in ("nvidia/cu*/lib/libnvrtc.so*", "nvidia/cuda_nvrtc/lib/libnvrtc.so*"):  # CUDA 13+, 12
            found += sorted(glob.glob(os.path.join(base, pattern)), reverse=True)
    return names + [path for path in found if "builtins" not in path and "alt" not in os.path.basename(path)]


def _preload_builtins(nvrtc_path: str) -> None:
    # NVRTC opens libnvrtc-builtins by its soname; a wheel's folder is not on the loader's path, so load the one
    # beside the library first (a no-op when the system provides both).
    folder = os.path.dirname(nvrtc_path)
    for builtins in sorted(glob.glob(os.path.join(folder, "libnvrtc-builtins.so*"))) if folder else []:
        try:
            ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue


def _load_nvrtc() -> ctypes.CDLL:
    errors = []
    for path in _candidate_nvrtc_paths():
        try:
            lib = ctypes.CDLL(path)
        except OSError as error:
            errors.append(f"{path}: {error}")
            continue
        _preload_builtins(path)
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        return lib
    raise NVRTCError(
        "NVRTC (libnvrtc) was not found; it ships with CUDA builds of torch as the nvidia-cuda-nvrtc wheel "
        "(`pip install nvidia-cuda-nvrtc`). Tried: " + "; ".join(errors[-3:])
    )


_NVRTC: ctypes.CDLL | None = None
_CUDA: ctypes.CDLL | None = None
_LOCK = threading.Lock()


def nvrtc() -> ctypes.CDLL:
    """The NVRTC library (raises `NVRTCError` if it cannot be opened)."""
    global _NVRTC
    if _NVRTC is None:
        _NVRTC = _load_nvrtc()
    return _NVRTC


def nvrtc_version() -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check_nvrtc(nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)))
    return major.value, minor.value


def driver_version() -> int:
    """The CUDA driver's version as ``cuDriverGetVersion`` gives it (1000 x major + 10 x minor: 12030 for 12.3)."""
    version = ctypes.c_int()
    _check_cuda(cuda_driver().cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
    return version.value


def cuda_driver() -> ctypes.CDLL:
    """The CUDA driver library."""
    global _CUDA
    if _CUDA is None:
        try:
            _CUDA = ctypes.CDLL("libcuda.so.1" if sys.platform != "win32" else "nvcuda.dll")
        except OSError as error:
            raise NVRTCError(f"the CUDA driver library could not be opened: {error}") from error
    return _CUDA


def _check_nvrtc(result: int, program=None) -> None:
    if result == 0:
        return
    message = nvrtc().nvrtcGetErrorString(result).decode()
    if program is not None:
        message += "\n" + _program_log(program)
    raise NVRTCError(f"NVRTC: {message}")


def _check_cuda(result: int, what: str) -> None:
    if result == 0:
        return
    text = ctypes.c_char_p()
    cuda_driver().cuGetErrorString(result, ctypes.byref(text))
    raise NVRTCError(f"CUDA driver: {what} failed: {text.value.decode() if text.value else result}")


def _program_log(program) -> str:
    size = ctypes.c_size_t()
    nvrtc().nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc().nvrtcGetProgramLog(program, log)
    return log.value.decode(errors="replace")


# -- compiling ------------------------------------------------------------------------------------------------
def define_flags(defines: str) -> tuple[str, ...]:
    """``-D`` options from comma-separated defines (``"NVFP4_DEPTH=2,NVFP4_L2_PREFETCH=1"``; ``""``: none), the
    form benchmarks take a source's compile-time switches in."""
    return tuple(f"-D{define}" for define in defines.split(",") if define)


def compile_cubin(source: str, name_expression: str, arch: str, options: tuple[str, ...] = (),
                  log: list[str] | None = None) -> tuple[bytes, str]:  # fmt: skip
    """``(cubin, lowered kernel name)`` of ``name_expression`` (e.g. ``"kernel<1, 2>"``) for ``arch``
    (e.g. ``"sm_90"``). Needs NVRTC only, no GPU. ``log`` receives NVRTC's log of a successful build (warnings;
    with ``-Xptxas=-v`` ptxas' resource report where the NVRTC version passes it on)."""
    lib = nvrtc()
    program = ctypes.c_void_p()
    _check_nvrtc(lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"kernel.cu", 0, None, None))
    try:
        expression = name_expression.encode()
        _check_nvrtc(lib.nvrtcAddNameExpression(program, expression))
        flags = [f"--gpu-architecture={arch}", "-std=c++17", *options]
        array = (ctypes.c_char_p * len(flags))(*[flag.encode() for flag in flags])
        _check_nvrtc(lib.nvrtcCompileProgram(program, len(flags), array), program)
        if log is not None:
            log.append(_program_log(program))
        size = ctypes.c_size_t()
        _check_nvrtc(lib.nvrtcGetCUBINSize(program, ctypes.byref(size)))
        cubin = ctypes.create_string_buffer(size.value)
        _check_nvrtc(lib.nvrtcGetCUBIN(program, cubin))
        lowered = ctypes.c_char_p()
        _check_nvrtc(lib.nvrtcGetLoweredName(program, expression, ctypes.byref(lowered)))
        return cubin.raw, lowered.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


def cache_dir() -> Path:
    return Path(os.environ.get("TRL_QERL_CACHE", Path.home() / ".cache" / "trl_qerl")) / "nvrtc"


def cached_cubin(source: str, name_expression: str, arch: str, options: tuple[str, ...] = ()) -> tuple[bytes, str]:
    """`compile_cubin` through an on-disk cache keyed by source, expression, target, options and NVRTC version
    (written atomically: a crashed writer leaves no half file)."""
    key = json.dumps([source, name_expression, arch, list(options), nvrtc_version()])
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    directory = cache_dir()
    cubin_path, name_path = directory / f"{digest}.cubin", directory / f"{digest}.name"
    try:
        return cubin_path.read_bytes(), name_path.read_text()
    except OSError:
        pass
    cubin, lowered = compile_cubin(source, name_expression, arch, options)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        write_atomically(name_path, lowered)
        write_atomically(cubin_path, cubin)
    except OSError:  # a read-only home: compile again next time
        pass
    return cubin, lowered


# -- launching ------------------------------------------------------------------------------------------------
def _arch(device_index: int, arch_specific: bool = False) -> str:
    """``sm_XY`` of the device; ``arch_specific``: the target with the architecture's own instructions (``sm_90a``:
    wgmma), whose cubin runs on that compute capability only."""
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}" + ("a" if arch_specific and major >= 9 else "")


@dataclass
class CudaKernel:
    """One compiled kernel loaded on one device."""

    function: ctypes.c_void_p
    module: ctypes.c_void_p
    name: str
    shared_memory_limit: int = 48 * 1024
    """Dynamic shared memory a launch may ask for: raised with `cuFuncSetAttribute` the first time a launch needs
    more than the default 48 KB."""

    @classmethod
    def get(cls, source: str, name_expression: str, device_index: int, options: tuple[str, ...] = (),
            arch_specific: bool = False) -> CudaKernel:  # fmt: skip
        """The kernel for ``device_index``, compiled and loaded once per (source, expression, device, options);
        ``arch_specific`` builds for the ``sm_XYa`` target (see `_arch`)."""
        key = (hashlib.sha256(source.encode()).hexdigest(), name_expression, device_index, options, arch_specific)
        with _LOCK:
            if key not in _KERNELS:
                arch = _arch(device_index, arch_specific)
                cubin, lowered = cached_cubin(source, name_expression, arch, options)
                _KERNELS[key] = cls._load(cubin, lowered, device_index)
            return _KERNELS[key]

    @classmethod
    def _load(cls, cubin: bytes, lowered: str, device_index: int) -> CudaKernel:
        lib = cuda_driver()
        with torch.cuda.device(device_index):
            torch.cuda.current_stream()  # makes torch's primary context current on this thread
            module, function = ctypes.c_void_p(), ctypes.c_void_p()
            _check_cuda(lib.cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData")
            _check_cuda(
                lib.cuModuleGetFunction(ctypes.byref(function), module, lowered.encode()), "cuModuleGetFunction"
            )
        return cls(function, module, lowered)

    def resident_blocks(self, threads: int, shared_memory: int = 0) -> int:
        """How many CTAs of ``threads`` threads (and ``shared_memory`` bytes of dynamic shared memory) fit one
        multiprocessor at once (``cuOccupancyMaxActiveBlocksPerMultiprocessor``: registers, static shared memory and
        warps counted)."""
        self._allow_shared_memory(shared_memory)  # else CTAs over the default 48 KB count as not fitting at all
        blocks = ctypes.c_int()
        result = cuda_driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(blocks), self.function, ctypes.c_int(threads), ctypes.c_size_t(shared_memory)
        )
        _check_cuda(result, f"the occupancy of {self.name}")
        return blocks.value

    def launch(
        self, grid: tuple[int, int, int], block: tuple[int, int, int], args: list, stream=None,
        programmatic: bool = False, shared_memory: int = 0,
    ) -> None:  # fmt: skip
        """Launch on ``stream`` (default: torch's current stream). ``args`` are ctypes values (or structures) in
        the kernel's parameter order. ``programmatic``: Programmatic Dependent Launch (sm_90+): the kernel may
        start before the previous one on the stream has finished and must wait for it itself
        (``griddepcontrol.wait``) before reading what it wrote. ``shared_memory``: bytes of dynamic shared memory
        (``extern __shared__``)."""
        self._allow_shared_memory(shared_memory)
        stream = torch.cuda.current_stream() if stream is None else stream
        pointers = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
        handle = ctypes.c_void_p(stream.cuda_stream)
        if not programmatic:
            result = cuda_driver().cuLaunchKernel(self.function, *grid, *block, shared_memory, handle, pointers, None)
        else:
            attribute = LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
            attribute.value[0] = 1  # programmaticStreamSerializationAllowed
            config = LaunchConfig(*grid, *block, shared_memory, handle, ctypes.pointer(attribute), 1)
            result = cuda_driver().cuLaunchKernelEx(ctypes.byref(config), self.function, pointers, None)
        _check_cuda(result, f"launching {self.name}")

    def _allow_shared_memory(self, shared_memory: int) -> None:
        """Raise the kernel's dynamic shared memory limit to ``shared_memory`` bytes where that is above it (the
        driver's default is 48 KB)."""
        if shared_memory > self.shared_memory_limit:
            _check_cuda(
                cuda_driver().cuFuncSetAttribute(self.function, MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_memory),
                f"allowing {shared_memory} bytes of shared memory to {self.name}",
            )
            self.shared_memory_limit = shared_memory


MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
"""``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`` in cuda.h."""
MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
"""``CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`` in cuda.h."""


def device_index(device: torch.device) -> int:
    """The CUDA device's index (``cuda`` without one: torch's current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def max_shared_memory_per_block(device_index: int) -> int:
    """The most dynamic shared memory one CTA may ask for on this device (227 KB on Hopper, 163 KB on A100, 99 KB
    on sm_86/89)."""
    value, device = ctypes.c_int(), ctypes.c_int()
    _check_cuda(cuda_driver().cuDeviceGet(ctypes.byref(device), device_index), "cuDeviceGet")
    _check_cuda(
        cuda_driver().cuDeviceGetAttribute(ctypes.byref(value), MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device),
        "cuDeviceGetAttribute",
    )
    return value.value


class TensorMap(ctypes.Structure):
    """``CUtensorMap`` of cuda.h: 128 opaque bytes (a kernel takes it by value as a ``__grid_constant__``)."""

    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


TENSOR_MAP_UINT8, TENSOR_MAP_UINT16 = 0, 1
"""``CU_TENSOR_MAP_DATA_TYPE_UINT8`` / ``_UINT16`` in cuda.h (the copy moves bits; the kernel knows the type)."""
_TENSOR_MAP_ELEMENT_BYTES = {TENSOR_MAP_UINT8: 1, TENSOR_MAP_UINT16: 2}
SWIZZLE = {0: 0, 32: 1, 64: 2, 128: 3}
"""``CU_TENSOR_MAP_SWIZZLE_NONE`` / ``_32B`` / ``_64B`` / ``_128B`` in cuda.h, by swizzle span in bytes."""


def tensor_map_2d(address: int, data_type: int, shape: tuple[int, int], row_stride_bytes: int, box: tuple[int, int],
                  swizzle_bytes: int = 0) -> TensorMap:  # fmt: skip
    """A tiled tensor map of a row-major 2-D tensor (``shape`` = (rows, columns), ``box`` = (rows, columns) per
    copy) for the Tensor Memory Accelerator (sm_90+); boxes past the tensor's edge read zeros. The CUDA driver
    checks the TMA rules (16-byte aligned address and row stride, box rows <= 256, box row bytes a multiple of 16
    and at most the swizzle span) and `NVRTCError` names what it refused."""
    tensor_map = TensorMap()
    dims = (ctypes.c_uint64 * 2)(shape[1], shape[0])  # innermost first
    strides = (ctypes.c_uint64 * 1)(row_stride_bytes)
    box_dims = (ctypes.c_uint32 * 2)(box[1], box[0])
    element_strides = (ctypes.c_uint32 * 2)(1, 1)
    result = cuda_driver().cuTensorMapEncodeTiled(
        ctypes.byref(tensor_map), data_type, 2, ctypes.c_void_p(address), dims, strides, box_dims,
        element_strides, 0, SWIZZLE[swizzle_bytes], 2, 0,  # no interleave, L2 promotion 128 B, zero fill
    )  # fmt: skip
    element_bytes = _TENSOR_MAP_ELEMENT_BYTES[data_type]
    _check_cuda(result, f"encoding a tensor map of {shape} x {element_bytes} B with boxes of {box}")
    return tensor_map


PROGRAMMATIC_STREAM_SERIALIZATION = 6
"""``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` in cuda.h."""


class LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute`` of cuda.h: the attribute id, padding to 8 bytes, a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint64 * 8)]


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` of cuda.h (for ``cuLaunchKernelEx``)."""

    _fields_ = [
        ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint),
    ]  # fmt: skip


_KERNELS: dict[tuple, CudaKernel] = {}


def available() -> bool:
    """Whether NVRTC and the CUDA driver can be opened here."""
    try:
        nvrtc()
        cuda_driver()
    except NVRTCError:
        return False
    return True
