"""Where each rank trains (`--device`), in which precision (`--precision`), and the settings that keep
a run reproducible there.

Every rank resolves its own device, then all ranks compare verdicts in one collective, so a rank that
cannot train where it was asked makes every rank fail at once with the same message, naming the host,
the rank and what that rank saw, instead of leaving the others waiting in their first allreduce.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nightshift.errors import DeviceMismatch, DeviceUnavailable
from nightshift.train.config import COMPRESSIONS, DEVICES, PRECISIONS

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# cuBLAS reuses workspaces across streams unless told their size; with this setting its matmuls are
# deterministic (https://docs.nvidia.com/cuda/cublas/#results-reproducibility). It must be in the
# environment before the first cuBLAS handle exists, so it is set before the model reaches the GPU.
CUBLAS_WORKSPACE_CONFIG = ":4096:8"


@dataclass(frozen=True)
class CudaView:
    """What one process sees of CUDA: what a person needs to know when a GPU is missing."""

    available: bool
    device_count: int
    visible_devices: str | None
    horovod_cuda: bool

    @classmethod
    def probe(cls, horovod_cuda: bool) -> CudaView:
        available = torch.cuda.is_available()
        return cls(available=available, device_count=torch.cuda.device_count() if available else 0,
                   visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"), horovod_cuda=horovod_cuda)

    def describe(self) -> str:
        visible = "unset" if self.visible_devices is None else repr(self.visible_devices)
        return (f"torch.cuda.is_available() is {self.available}, torch.cuda.device_count() is "
                f"{self.device_count}, CUDA_VISIBLE_DEVICES is {visible}")


def choose_device(requested: str, *, rank: int, local_rank: int, cuda: CudaView, host: str | None = None) -> str:
    """This rank's device, "cuda:N" or "cpu"; DeviceUnavailable when `requested` cannot be met here.

    `auto` means CUDA when torch sees a GPU and Horovod was built with CUDA (a CPU-only Horovod cannot
    reduce CUDA tensors), else the CPU. Each rank takes the GPU numbered by its local rank.
    """
    if requested not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {requested!r}")
    if requested == "cpu" or (requested == "auto" and not (cuda.available and cuda.horovod_cuda)):
        return "cpu"
    where = f"rank {rank} (local rank {local_rank}) on host {host or socket.gethostname()}"
    flag = f"--device {requested}"
    if not cuda.available or cuda.device_count == 0:
        raise DeviceUnavailable(f"{where} was asked for {flag} but has no usable GPU: {cuda.describe()}; "
                                f"run it where a GPU is visible or pass --device cpu")
    if local_rank >= cuda.device_count:
        raise DeviceUnavailable(f"{where} was asked for {flag} and needs GPU {local_rank} (one per local rank) "
                                f"but sees {cuda.device_count}: {cuda.describe()}; start at most "
                                f"{cuda.device_count} processes on this host")
    if not cuda.horovod_cuda:
        raise DeviceUnavailable(f"{where} was asked for {flag} but Horovod here was built without CUDA "
                                f"(hvd.cuda_built() is False; {cuda.describe()}); use the CUDA trainer image "
                                f"(Horovod built with HOROVOD_GPU_OPERATIONS=NCCL) or pass --device cpu")
    return f"cuda:{local_rank}"


def select_device(requested: str, hvd: Any, probe: Callable[[bool], CudaView] = CudaView.probe) -> torch.device:
    """Resolve `requested` on every rank, check that all ranks agree, pin this rank's GPU.

    Collective: every rank must call it. Raises DeviceUnavailable (naming every rank that failed) or
    DeviceMismatch (`auto` resolved to CUDA on some hosts and to the CPU on others) on every rank.
    """
    rank, local_rank, host = hvd.rank(), hvd.local_rank(), socket.gethostname()
    try:
        verdict = {"device": choose_device(requested, rank=rank, local_rank=local_rank, host=host,
                                           cuda=probe(bool(hvd.cuda_built()))), "host": host}
    except DeviceUnavailable as err:
        verdict = {"error": str(err), "host": host}
    verdicts: list[dict[str, str]] = hvd.allgather_object(verdict, name="nightshift.device")
    errors = [v["error"] for v in verdicts if "error" in v]
    if errors:
        raise DeviceUnavailable("; ".join(errors))
    kinds = {torch.device(v["device"]).type for v in verdicts}
    if len(kinds) > 1:
        placed = ", ".join(f"rank {r} on {v['host']}: {v['device']}" for r, v in enumerate(verdicts))
        raise DeviceMismatch(f"--device {requested} resolved to different devices across ranks ({placed}); "
                             f"every rank must train on the same kind of device: pass --device cuda or "
                             f"--device cpu")
    device = torch.device(verdicts[rank]["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def configure_determinism(device: torch.device) -> None:
    """Deterministic kernels everywhere; on CUDA also deterministic cuBLAS, no cuDNN autotuning, no TF32.

    `warn_only=True`: an operation of a user's model that has no deterministic implementation still
    runs, and torch warns naming it; the bit-for-bit guarantee then no longer holds for that model.
    """
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        # --precision fp32 means fp32: TF32 matmuls and convolutions would round inputs to 10 bits.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def autocast(device: torch.device, precision: str) -> torch.autocast:
    """The autocast context of `precision` on `device` (disabled for fp32).

    fp16 is allowed on the CPU too: CPU autocast supports float16 in the torch this project pins, and
    `torch.amp.GradScaler("cpu")` exists, so CI exercises the fp16 + GradScaler + Horovod path without a
    GPU. It is slower than fp32 there; use bf16 for mixed precision on CPUs.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    dtype = _AUTOCAST_DTYPES.get(precision, torch.bfloat16)
    return torch.autocast(device_type=device.type, dtype=dtype, enabled=precision != "fp32")


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """Loss scaling for fp16 (whose gradients underflow without it); a disabled scaler otherwise."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


def compression(name: str, hvd: Any) -> Any:
    """Horovod's gradient compression for `--compression`: fp16 halves the bytes each allreduce sends."""
    if name not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {name!r}")
    return hvd.Compression.fp16 if name == "fp16" else hvd.Compression.none
