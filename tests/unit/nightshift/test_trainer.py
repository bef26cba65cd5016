from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from nightshift.errors import DeviceMismatch, DeviceUnavailable, UsageError
from nightshift.train.checkpoint import FORMAT, CheckpointStore
from nightshift.train.config import TrainConfig
from nightshift.train.device import CudaView, autocast, choose_device, compression, grad_scaler, select_device
from nightshift.train.trainer import rng_state, set_rng_state


def draw() -> tuple[float, float, float, float]:
    return (float(torch.rand(1)), float(np.random.rand()), random.random(), float(np.random.randn()))


def test_rng_states_survive_a_weights_only_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(1)
    np.random.seed(1)
    random.seed(1)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    saved = rng_state()
    expected = draw()

    store = CheckpointStore(tmp_path)
    store.write({"format": FORMAT, "step": 1, "epoch": 0, "resume_key": {}, "model": {}, "optimizer": {},
                 "scheduler": {}, "rng": [saved]})
    draw()  # move every generator on
    _, loaded = store.latest_valid()  # type: ignore[misc]
    set_rng_state(loaded["rng"][0])
    assert draw() == expected



def test_a_cuda_rng_state_is_only_restored_on_a_gpu() -> None:
    state = rng_state(torch.device("cpu"))
    assert "cuda" not in state
    state["cuda"] = torch.zeros(16, dtype=torch.uint8)  # as a GPU rank's checkpoint holds it
    with pytest.raises(ValueError, match="restore it on a CUDA device"):
        set_rng_state(state, torch.device("cpu"))

def test_resume_key_covers_what_changes_the_result() -> None:
    base = TrainConfig(data=Path("d"), out=Path("o"), checkpoint_dir=Path("c"))
    other_paths = TrainConfig(data=Path("elsewhere"), out=Path("o2"), checkpoint_dir=Path("c"), log_every=3)
    assert base.resume_key(2, "cpu") == other_paths.resume_key(2, "cpu")  # paths and logging don't matter
    assert base.resume_key(2, "cpu") != base.resume_key(4, "cpu")
    changes = {"batch_size": 64, "lr": 0.1, "seed": 1, "model": "mlp", "epochs": 9, "precision": "bf16",
               "compression": "fp16", "task": "binary", "dataset_options": {"label": "y"}}
    for field, value in changes.items():
        changed = TrainConfig(data=Path("d"), out=Path("o"), checkpoint_dir=Path("c"), **{field: value})
        assert changed.resume_key(2, "cpu") != base.resume_key(2, "cpu"), field


def test_resume_key_holds_the_resolved_device_not_auto() -> None:
    auto = TrainConfig(data=Path("d"), out=Path("o"), checkpoint_dir=Path("c"))
    explicit = TrainConfig(data=Path("d"), out=Path("o"), checkpoint_dir=Path("c"), device="cpu")
    assert auto.resume_key(1, "cpu") == explicit.resume_key(1, "cpu")  # auto that chose the CPU is the CPU
    assert auto.resume_key(1, "cpu")["device"] == "cpu"
    assert auto.resume_key(1, "cpu") != auto.resume_key(1, "cuda")  # a CPU checkpoint never resumes on a GPU
    with pytest.raises(ValueError, match="resolved device"):
        auto.resume_key(1, "auto")


def test_thread_count_is_restored_when_automatic_and_must_match_when_explicit() -> None:
    automatic = TrainConfig(data=Path("d"), out=Path("o"), checkpoint_dir=Path("c"))
    explicit = TrainConfig(data=Path("d"), out=Path("o"), checkpoint_dir=Path("c"), threads=2)
    assert "threads" not in automatic.resume_key(1, "cpu")
    assert automatic.threads_conflict([4, 4]) is None  # the trainer restores 4
    assert explicit.threads_conflict([2, 2]) is None
    assert explicit.threads_conflict([4, 4]) == "threads: 4 there, 2 here"
    assert explicit.threads_conflict([2, 1]) == "threads: [2, 1] there, 2 here"
    assert explicit.threads_conflict([]) is None  # a checkpoint that did not record it


@pytest.mark.parametrize(("field", "value"), [("device", "tpu"), ("precision", "fp8"), ("compression", "int8")])
def test_config_refuses_unknown_device_precision_and_compression(field: str, value: str) -> None:
    with pytest.raises(UsageError, match=f"--{field} must be one of .*, got '{value}'"):
        TrainConfig(data=Path("d"), out=Path("o"), checkpoint_dir=Path("c"), **{field: value})


# --- device selection ---------------------------------------------------------------------------------


def view(available: bool = False, count: int = 0, visible: str | None = None, horovod_cuda: bool = True) -> CudaView:
    return CudaView(available=available, device_count=count, visible_devices=visible, horovod_cuda=horovod_cuda)


@pytest.mark.parametrize(("requested", "cuda", "local_rank", "expected"), [
    ("cpu", view(True, 2), 1, "cpu"),
    ("auto", view(False, 0), 0, "cpu"),
    ("auto", view(True, 2), 1, "cuda:1"),
    ("auto", view(True, 2, horovod_cuda=False), 0, "cpu"),  # a CPU-only Horovod cannot reduce CUDA tensors
    ("cuda", view(True, 4), 3, "cuda:3"),
])
def test_choose_device(requested: str, cuda: CudaView, local_rank: int, expected: str) -> None:
    assert choose_device(requested, rank=5, local_rank=local_rank, cuda=cuda, host="h") == expected


def test_cuda_without_a_gpu_names_host_rank_and_what_it_saw() -> None:
    with pytest.raises(DeviceUnavailable) as caught:
        choose_device("cuda", rank=3, local_rank=1, cuda=view(False, 0, visible=""), host="node-7")
    message = str(caught.value)
    for fragment in ("rank 3 (local rank 1) on host node-7", "--device cuda", "torch.cuda.is_available() is False",
                     "torch.cuda.device_count() is 0", "CUDA_VISIBLE_DEVICES is ''", "--device cpu"):
        assert fragment in message


def test_cuda_with_fewer_gpus_than_local_ranks_is_refused() -> None:
    with pytest.raises(DeviceUnavailable, match=r"needs GPU 2 .* sees 2: .*CUDA_VISIBLE_DEVICES is '0,1'"):
        choose_device("cuda", rank=2, local_rank=2, cuda=view(True, 2, visible="0,1"), host="h")
    with pytest.raises(DeviceUnavailable, match="needs GPU 1"):  # auto that found GPUs holds the same rule
        choose_device("auto", rank=1, local_rank=1, cuda=view(True, 1), host="h")


def test_cuda_with_a_cpu_only_horovod_is_refused() -> None:
    with pytest.raises(DeviceUnavailable, match=r"hvd.cuda_built\(\) is False"):
        choose_device("cuda", rank=0, local_rank=0, cuda=view(True, 1, horovod_cuda=False), host="h")


class FakeHorovod:
    """Rank 0 of a 2-rank job whose other rank answers `peer` in the device collective."""

    def __init__(self, peer: dict[str, str]) -> None:
        self.peer = peer

    def rank(self) -> int:
        return 0

    def local_rank(self) -> int:
        return 0

    def cuda_built(self) -> bool:
        return True

    def allgather_object(self, obj: dict[str, str], name: str) -> list[dict[str, str]]:
        assert name == "nightshift.device"
        return [obj, self.peer]


def test_every_rank_fails_with_the_message_of_the_rank_that_has_no_gpu() -> None:
    peer_error = "rank 1 (local rank 0) on host gpu-less was asked for --device cuda but has no usable GPU"
    hvd = FakeHorovod({"error": peer_error, "host": "gpu-less"})
    with pytest.raises(DeviceUnavailable, match="on host gpu-less"):
        select_device("cpu", hvd, probe=lambda built: view(horovod_cuda=built))


def test_auto_that_resolves_differently_across_hosts_is_refused() -> None:
    hvd = FakeHorovod({"device": "cuda:0", "host": "gpu-host"})
    with pytest.raises(DeviceMismatch, match=r"rank 0 on .*: cpu, rank 1 on gpu-host: cuda:0.*--device cpu"):
        select_device("auto", hvd, probe=lambda built: view(horovod_cuda=built))


def test_agreeing_ranks_get_their_device() -> None:
    hvd = FakeHorovod({"device": "cpu", "host": "other"})
    assert select_device("auto", hvd, probe=lambda built: view(horovod_cuda=built)) == torch.device("cpu")


# --- precision and compression ------------------------------------------------------------------------


def test_autocast_runs_matmuls_in_the_chosen_precision_on_cpu() -> None:
    a, b = torch.rand(4, 4), torch.rand(4, 4)
    cpu = torch.device("cpu")
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        with autocast(cpu, precision):
            assert (a @ b).dtype == dtype, precision


def test_only_fp16_scales_the_loss() -> None:
    cpu = torch.device("cpu")
    assert grad_scaler(cpu, "fp16").is_enabled()
    assert not grad_scaler(cpu, "bf16").is_enabled() and not grad_scaler(cpu, "fp32").is_enabled()


def test_compression_maps_to_horovods_compressors() -> None:
    import horovod.torch as hvd

    assert compression("fp16", hvd) is hvd.Compression.fp16
    assert compression("none", hvd) is hvd.Compression.none
    with pytest.raises(ValueError, match="compression must be one of"):
        compression("int8", hvd)
