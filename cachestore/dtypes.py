"""Store dtypes <-> numpy storage dtypes <-> torch dtypes.

numpy has no bfloat16, so bfloat16 is stored as its raw 16 bits (uint16) and viewed back with torch.
Everything on disk is little-endian.
"""
import numpy as np
import torch

# store dtype name -> (torch dtype, numpy dtype of the bytes on disk)
STORE_DTYPES = {
    "float16": (torch.float16, np.dtype("<f2")),
    "bfloat16": (torch.bfloat16, np.dtype("<u2")),
    "float32": (torch.float32, np.dtype("<f4")),
}


def check_dtype(name: str) -> str:
    if name not in STORE_DTYPES:
        raise ValueError(f"unsupported store dtype {name!r}; use one of {', '.join(STORE_DTYPES)}")
    return name


def itemsize(name: str) -> int:
    return STORE_DTYPES[name][1].itemsize


def to_stored(x, name: str) -> np.ndarray:
    """Cast a tensor or array to the store dtype; return a C-contiguous numpy array of its on-disk bits."""
    torch_dtype, np_dtype = STORE_DTYPES[name]
    if isinstance(x, torch.Tensor):
        t = x.detach().to(device="cpu", dtype=torch_dtype).contiguous()
        if name == "bfloat16":
            return t.view(torch.int16).numpy().view(np_dtype)  # same memory, bits unchanged
        return t.numpy()
    a = np.asarray(x)
    if a.dtype.kind not in "fiu":
        raise TypeError(f"KV must be a float tensor or array, got dtype {a.dtype}")
    if name == "bfloat16":  # round to bf16 with torch (numpy cannot)
        return to_stored(torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)), name)
    return np.ascontiguousarray(a, dtype=np_dtype)


def empty_tensor(shape, name: str) -> torch.Tensor:
    return torch.empty(shape, dtype=STORE_DTYPES[name][0])


def byte_view(t: torch.Tensor) -> np.ndarray:
    """Writable flat uint8 numpy view of a contiguous CPU tensor's memory (any dtype, bf16 included)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("out= must be a contiguous CPU tensor")
    return t.reshape(-1).view(torch.uint8).numpy()


def extra_to_numpy(x) -> np.ndarray:
    """Extras keep their own dtype; a bf16 tensor becomes float32 (numpy cannot hold bf16)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            x = x.float()
        x = x.numpy()
    a = np.asarray(x)
    if a.dtype.kind not in "biuf":
        raise TypeError(f"extras must be bool/int/float arrays, got dtype {a.dtype}")
    a = np.asarray(a, dtype=a.dtype.newbyteorder("<") if a.dtype.itemsize > 1 else a.dtype)
    return a if a.flags.c_contiguous else a.copy()  # (ascontiguousarray would turn 0-d into 1-d)
