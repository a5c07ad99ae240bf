"""Which device and compute dtype a command runs on, checked before any work starts."""
from __future__ import annotations

from pathlib import Path

import torch

from kvf.errors import KvfError, warn

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_device(device: str, workers_only: bool = False) -> None:
    """cpu, or cuda / cuda:N on a torch that can see a GPU; anything else is a one-line error.
    workers_only (--ray): the device is the Ray workers', which check it themselves; here only its spelling."""
    if device == "cpu":
        return
    if device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit()):
        if workers_only:
            return
        if not torch.cuda.is_available():
            raise KvfError(f"--device {device}: this torch sees no CUDA GPU (it is a CPU build, or no GPU is visible); "
                           "install a CUDA build of torch (see README) or use --device cpu")
        if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
            raise KvfError(f"--device {device}: only {torch.cuda.device_count()} GPU(s) visible")
        return
    raise KvfError(f"--device {device}: kvf runs on cpu or cuda (cuda:N)")


def driver_device(device: str, ray: str | None) -> str:
    """Where this process's own work runs (the dense index's embeddings): --device, except that with --ray
    --device names the workers' device, and a driver without a GPU (a cluster's CPU head node) uses its CPU."""
    if ray is not None and device.startswith("cuda") and not torch.cuda.is_available():
        return "cpu"
    return device


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16", as flags, records and manifests spell it."""
    return str(dtype).removeprefix("torch.")


def compute_dtype(device: str, name: str | None, flag: str = "--dtype") -> torch.dtype:
    """--dtype (build-cache's --compute-dtype), default float32 on the CPU (bf16 matmul is far slower
    there) and bfloat16 on CUDA."""
    if name is None:
        return torch.float32 if device == "cpu" else torch.bfloat16
    if name not in COMPUTE_DTYPES:
        raise KvfError(f"{flag} {name}{dtype_meant(name)}: use one of {', '.join(COMPUTE_DTYPES)}")
    return COMPUTE_DTYPES[name]


# how other tools write kvf's dtype names
DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "float": "float32", "fp16": "float16", "f16": "float16",
                 "half": "float16", "bf16": "bfloat16", "bfloat": "bfloat16"}


def dtype_meant(name: str) -> str:
    """' (kvf writes bfloat16)' for bf16 and the like; '' for a name with no alias."""
    meant = DTYPE_ALIASES.get(name.lower().replace("torch.", ""))
    return f" (kvf writes {meant})" if meant else ""


def native_half_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies bfloat16 / float16 natively (AVX512-BF16, AMX, AVX512-FP16)."""
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.ops.mkldnn._is_mkldnn_fp16_supported()


def warn_if_slow(device: str, dtype: torch.dtype, flag: str = "--dtype") -> None:
    """A half-precision dtype on a CPU without native support runs every matmul tens of times slower than
    float32 (64x for one SmolLM2 projection on this repository's AVX2 machine): said once, up front."""
    if device == "cpu" and dtype != torch.float32 and not native_half_matmul(dtype):
        name = dtype_name(dtype)
        warn(f"{flag} {name} on this CPU ({torch.backends.cpu.get_cpu_capability()}, no native {name} matmul): the model "
             f"will run tens of times slower than in float32; leave {flag} out for float32")


def free_bytes(device: str) -> int | None:
    """What a new allocation can take on `device`: the GPU's free memory, or the kernel's MemAvailable
    (None where neither can be read)."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    kib = next((line.split()[1] for line in meminfo.splitlines() if line.startswith("MemAvailable:")), None)
    return int(kib) * 1024 if kib else None


def allocatable_bytes(device: str) -> int | None:
    """What this process can still allocate on `device`: free_bytes, plus on a GPU the blocks PyTorch's
    caching allocator holds unused (freed tensors it keeps for reuse, which the driver counts as taken)."""
    free = free_bytes(device)
    if free is not None and device.startswith("cuda"):
        free += torch.cuda.memory_reserved(torch.device(device)) - torch.cuda.memory_allocated(torch.device(device))
    return free


def check_model_fits(config, dtype: torch.dtype, device: str, flag: str) -> None:
    """A model whose weights alone exceed the free memory is refused in one line, before any is allocated:
    the kernel's OOM killer would end the process midway without a word (`kvf bench --random-weights
    llama3-8b` on a 24 GB CPU machine: 32 GB of float32 weights)."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):   # shapes only: no memory
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    need, free = params * dtype.itemsize, free_bytes(device)
    if free is not None and need > free:
        raise KvfError(f"{flag}: its {params / 1e6:,.0f}M parameters take {need / 2**30:.2f} GiB in "
                       f"{dtype_name(dtype)}, more than the {free / 2**30:.2f} GiB free on {device}; "
                       "use a smaller model or a device with more memory, or free some")

