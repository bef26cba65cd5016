"""The pure parts of `python -m bench multihost-steps`: gradient bytes, the link's allreduce time, the ideal
step, the efficiency, and the MPIJob it hands to `nightshift run-mpijob` (parsed as run-mpijob parses it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.bench_multihost import (
    STEP_MODEL_KWARGS,
    TCP_PAYLOAD_SHARE,
    gradient_bytes,
    ideal_step_seconds,
    manifest,
    model_parameters,
    ring_allreduce_seconds,
    scaling_efficiency,
)
from nightshift.mpijob_local.manifest import parse_job

GBIT = 1_000_000_000


def test_the_benchmarks_model_has_megabytes_of_gradients_and_fp16_compression_halves_them() -> None:
    channels, hidden = STEP_MODEL_KWARGS["channels"], STEP_MODEL_KWARGS["hidden"]
    by_hand = ((1 * channels * 9 + channels) + (channels * 2 * channels * 9 + 2 * channels)
               + (2 * channels * 4 * 4 * hidden + hidden) + (hidden * 10 + 10))
    parameters = model_parameters(STEP_MODEL_KWARGS)
    assert parameters == by_hand
    assert gradient_bytes(parameters, "none") == 4 * parameters > 4_000_000  # communication must matter
    assert gradient_bytes(parameters, "fp16") == 2 * parameters


def test_an_unknown_compression_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'int8'"):
        gradient_bytes(100, "int8")


def test_the_ring_sends_2_n_minus_1_over_n_of_the_bytes_at_the_tcp_payload_rate() -> None:
    payload = GBIT / 8 * TCP_PAYLOAD_SHARE
    assert 0.95 < TCP_PAYLOAD_SHARE < 0.96
    assert ring_allreduce_seconds(8e6, 1, GBIT) == 0.0  # one host reduces nothing
    assert ring_allreduce_seconds(8e6, 2, GBIT) == pytest.approx(8e6 / payload)
    assert ring_allreduce_seconds(8e6, 4, GBIT) == pytest.approx(1.5 * 8e6 / payload)
    assert ring_allreduce_seconds(8e6, 4, 10 * GBIT) == pytest.approx(ring_allreduce_seconds(8e6, 4, GBIT) / 10)


@pytest.mark.parametrize(("nbytes", "hosts", "rate"), [(1.0, 0, GBIT), (1.0, 2, 0), (-1.0, 2, GBIT)])
def test_the_link_time_refuses_nonsense(nbytes: float, hosts: int, rate: int) -> None:
    with pytest.raises(ValueError, match="hosts >= 1"):
        ring_allreduce_seconds(nbytes, hosts, rate)


def test_the_ideal_step_splits_the_compute_over_the_ranks_or_the_cores_and_adds_the_link() -> None:
    assert ideal_step_seconds(0.2, 1, 0.0) == pytest.approx(0.2)
    assert ideal_step_seconds(0.2, 4, 0.1) == pytest.approx(0.05 + 0.1)
    assert ideal_step_seconds(0.2, 4, 0.1, cores=2) == pytest.approx(0.1 + 0.1)  # 4 ranks on 2 cores
    assert ideal_step_seconds(0.2, 2, 0.1, cores=16) == pytest.approx(0.1 + 0.1)
    with pytest.raises(ValueError, match="cores >= 1"):
        ideal_step_seconds(0.2, 2, 0.1, cores=0)
    with pytest.raises(ValueError, match="positive step"):
        ideal_step_seconds(0.0, 2, 0.1)


def test_scaling_efficiency_is_the_speed_up_over_the_number_of_hosts() -> None:
    assert scaling_efficiency(0.2, 1, 0.2) == pytest.approx(1.0)
    assert scaling_efficiency(0.2, 2, 0.1) == pytest.approx(1.0)
    assert scaling_efficiency(0.2, 4, 0.1) == pytest.approx(0.5)
    assert scaling_efficiency(0.2, 4, 0.4) == pytest.approx(0.125)  # slower than one host
    with pytest.raises(ValueError, match="positive step"):
        scaling_efficiency(0.2, 2, 0.0)


def test_the_job_runs_the_program_under_horovodrun_on_every_worker_host_with_the_shared_volume() -> None:
    workdir = Path("/tmp/bench-x")
    job = manifest("steps-4-fp16-0", 4, workdir, ["python", "-m", "nightshift.train", "--epochs", "2"])
    local = parse_job(job, claims={"bench": str(workdir)}, gpus_available=0)
    assert len(local.workers) == 4
    assert local.slots_per_worker == 1
    assert local.launcher.argv == ("horovodrun", "--gloo", "--network-interfaces", "eth0", "-np", "4",
                                   "--hostfile", "/etc/mpi/hostfile", "python", "-m", "nightshift.train",
                                   "--epochs", "2")
    for pod in local.pods:  # the data and every rank's output on the claim, at the same path everywhere
        assert [m.source for m in pod.mounts if m.target == str(workdir)] == [str(workdir)]
