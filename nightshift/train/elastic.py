"""Horovod elastic training: lose a host and keep training, add one and train faster, with no restart.

Run under an elastic `horovodrun` (`--min-np/--max-np --host-discovery-script`, Gloo), the trainer keeps its
state (model, optimizer, loss scaler, the position in the epoch's sample order, epoch and step, the running
epoch loss) in a `hvd.elastic.TorchState`, committed in memory (`Commits`, below), besides the on-disk
checkpoints of the fixed-size trainer. When a host is lost, the ranks left catch Horovod's error, roll back to
the last commit and go on at the new world size; when a host is added, the state is broadcast to it at the
next commit and training goes on with more ranks. Every rank logs each reset.

Commits. A commit copies the model and optimizer state in memory and asks every rank whether hosts changed (a
broadcast): a cost every elastic run pays, failure or not, and the work a lost host rolls back is the training
since the last one. So commits are counted in time, not steps: about every `commit_seconds` of training (10 s by
default), and every `commit_every` steps as well when that is set. All ranks must commit at the same step, so at
each commit rank 0 turns the seconds into steps at the pace of the steps since the previous commit (the interval at
most doubles from one commit to the next, and starts at one step) and sends that to every rank with the commit
(`next_commit_interval`). Every rank also commits at each epoch's end, after the shared evaluation and the
per-epoch hook: time that no step pace foresees, which a lost host would otherwise redo on top of the steps (that
commit measures the steps' pace up to the end of the epoch's last step, leaving the epoch's end out). A lost host
therefore rolls back at most about `commit_seconds` of training at the pace measured before (a step that slows down
stretches it in proportion until the next commit measures again), plus the part of an epoch's end it interrupted,
and a host that is added waits up to as long to be taken in.

Samples. An epoch's order is a pure function of the seed and the epoch (a permutation of the training split,
as `DistributedSampler` draws it). A step takes the next `batch_size * world_size` samples of that order (fewer
at the end of the epoch) and gives each rank a contiguous share, as equal as can be (`step_shares`), so
whatever the world size does between steps, every sample of an epoch is trained on exactly once per epoch:
after a rollback the samples since the commit are trained again, from the committed position. Each rank's
loss is its shares' summed loss scaled by `world_size / samples in the step`, so Horovod's averaging
allreduce yields the mean gradient over the step's samples exactly, however unevenly they were shared (and a
rank with no sample in the last step of an epoch contributes zero).

Learning rate. The linear scaling rule, as the fixed-size trainer and Horovod's examples, counted in samples
(`step_lr`): a step of `n` samples takes `lr x n / batch_size` times the cosine schedule at the fraction of the
run's samples done (`lr_factor`). A full step of three ranks (3 x batch_size samples) takes three times the base
rate, of two ranks twice; the epoch's short last step takes its share, so per sample the rate is the same in every
step at every world size (scaling by the world size alone gave that last step 3.6x, 1.6x and 10.7x the nominal
rate per sample at sizes 1, 2 and 3 for 1,257 samples of batch 32). The schedule is counted in samples, not
steps, because the steps per epoch change with the world size.

Randomness. At every (re-)entry each rank seeds Python, NumPy and torch from (seed, committed step, rank):
a function of the state, so there is no RNG state to carry, and ranks never share a stream.

On-disk checkpoints (rank 0, every `checkpoint_every` steps) hold the same state; their resume key says
"elastic" for the world size, so a retry of an elastic job resumes from them at any size, and neither kind of
run ever resumes the other's checkpoints. An elastic run is not bit-for-bit reproducible across failures: the
world size changes which samples meet in a step.
"""

from __future__ import annotations

import logging
import math
import os
import random
import sys
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from nightshift.errors import CheckpointMismatch, JoinFailed, UsageError
from nightshift.train.checkpoint import FORMAT
from nightshift.train.device import CudaView, autocast, choose_device
from nightshift.train.trainer import Trainer, rng_state

log = logging.getLogger("nightshift.train")
_clock = time.monotonic  # the commits' clock (tests replace it)


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The sample order of `epoch`: `DistributedSampler`'s shuffle (a permutation seeded by seed + epoch)."""
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(n, generator=generator)


def step_shares(remaining: int, batch_size: int, world_size: int) -> list[int]:
    """How many of the epoch's next samples each rank trains on in one step: `batch_size` each, or, when fewer
    than `batch_size * world_size` are left, the rest split as evenly as can be (lower ranks take one more)."""
    if world_size < 1 or batch_size < 1 or remaining < 0:
        raise ValueError(f"no shares for remaining={remaining}, batch_size={batch_size}, world_size={world_size}")
    total = min(remaining, batch_size * world_size)
    base, extra = divmod(total, world_size)
    return [base + (1 if rank < extra else 0) for rank in range(world_size)]


def rank_indices(order: torch.Tensor, processed: int, shares: list[int], rank: int) -> torch.Tensor:
    """This rank's samples of the step that starts at position `processed` of the epoch's `order`."""
    start = processed + sum(shares[:rank])
    return order[start:start + shares[rank]]


def lr_factor(samples_done: int, total_samples: int) -> float:
    """The cosine schedule (to zero at the end of the run) at the fraction of the run's samples done."""
    return 0.5 * (1.0 + math.cos(math.pi * min(samples_done, total_samples) / total_samples))


def step_lr(lr: float, in_step: int, batch_size: int, samples_done: int, total_samples: int) -> float:
    """The learning rate of a step of `in_step` samples: `lr` per `batch_size` samples (the linear scaling rule
    counted in samples, so the same per sample in a full step at any world size and in a short last one), times
    the cosine schedule."""
    return lr * in_step / batch_size * lr_factor(samples_done, total_samples)


def next_commit_interval(seconds: float, steps: int, elapsed: float, previous: int, most: int | None = None) -> int:
    """Steps from this commit to the next: as many as fit in `seconds` at the pace of the `steps` trained in the
    `elapsed` seconds since the previous commit, at most twice the `previous` interval (a pace measured over a few
    fast steps must not stretch the next interval far past `seconds`), at least 1, at most `most` when given."""
    fit = seconds * steps / elapsed if steps > 0 and elapsed > 0 else previous  # a float: may be inf, never raises
    interval = max(1, int(min(fit, 2 * max(previous, 1))))
    return min(interval, most) if most else interval


def require_elastic_launcher() -> None:
    """--elastic needs the elastic driver of horovodrun, which is what sets HOROVOD_ELASTIC=1 in the ranks."""
    if os.environ.get("HOROVOD_ELASTIC") != "1":
        raise UsageError("--elastic needs an elastic horovodrun: run it as `horovodrun --gloo -np N --min-np MIN "
                         "--max-np MAX --host-discovery-script SCRIPT ...` (or leave out --elastic)")


def set_collective_timeout(seconds: int, join_seconds: int) -> None:
    """Gloo's two timeouts, read at every `hvd.init()` (resets included); a value already in the environment (set
    on the launcher) wins.

    HOROVOD_GLOO_TIMEOUT_SECONDS (`collective_timeout`): how long a rank waits on a peer that stopped answering in a
    collective (the ranks left by a lost host idle that long before they reset). Upstream Horovod also waits that
    long in `hvd.init()`'s rendezvous for every process of the job, and then terminates the process: the ranks
    already training, waiting for the process Horovod starts on a host that is added or comes back, all died when
    that process was slower to start than the collective timeout (a loaded node, a cold page cache), failing the
    job. Nightshift's Horovod (nightshift/horovod_build/horovod-0.28.1-elastic-join.patch) separates the two:

    HOROVOD_GLOO_RENDEZVOUS_TIMEOUT_SECONDS (`join_timeout`): how long the rendezvous waits; when it runs out (a
    joiner late, or gone), `hvd.init()` fails instead of terminating, and `join` tries again, which puts this rank
    in the elastic driver's next round (see `join`). A rank that is merely slow in Python (evaluating, loading a
    checkpoint) does not count against either: Horovod's background thread goes on answering."""
    os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", str(seconds))
    os.environ.setdefault("HOROVOD_GLOO_RENDEZVOUS_TIMEOUT_SECONDS", str(join_seconds))


JOIN_ATTEMPTS = 3  # a process joining for the first time
RESET_JOIN_ATTEMPTS = 10  # a rank already training: failed rounds in a row before it gives up


def join(hvd: Any, attempts: int | None = JOIN_ATTEMPTS) -> None:
    """`hvd.init()`, again after a failed rendezvous: at most `attempts` times in all (None: until it joins).

    A rendezvous fails when a process of the round does not come within the join timeout (a host that joins late
    or never) or a peer it found has gone. Trying again asks the elastic driver for this rank's place in the next
    round (Horovod's reset protocol: every rank of the round reports ready, or its process exits, and the driver
    drops the hosts whose process failed): the ranks left go on without a joiner that never came, and a late
    joiner, failing its own first rendezvous, joins the next round. A joiner that never comes costs the ranks a
    pause of about a join timeout. A joiner late by L costs L plus its own failed rendezvous: at most a join
    timeout where it finds nobody, up to five (Gloo's wait for a peer to connect) where it finds the addresses the
    ranks that gave up left in the round's store. The ranks already training try up to RESET_JOIN_ATTEMPTS rounds
    in a row (a run of late joiners must not end the job from its healthy hosts, nor a round that can never form
    hold it for hours); a process joining for the first time gives up after JOIN_ATTEMPTS, and its host is
    blacklisted. A process that is alive but never reaches `hvd.init()` holds the round until it does or dies:
    Horovod waits for every process of a round."""
    attempt = 0
    while True:
        attempt += 1
        try:
            hvd.init()
            return
        except ValueError as err:  # Horovod's "initialization failed" (its log names the rendezvous error)
            if attempts is not None and attempt >= attempts:
                raise JoinFailed(f"Horovod's rendezvous failed {attempts} times in a row (the reason is in the log "
                                 f"above): a process of the job did not come within the join timeout "
                                 f"(HOROVOD_GLOO_RENDEZVOUS_TIMEOUT_SECONDS="
                                 f"{os.environ.get('HOROVOD_GLOO_RENDEZVOUS_TIMEOUT_SECONDS', 'unset')}); raise "
                                 f"--join-timeout if processes take longer to start") from err
            log.warning("Horovod's rendezvous failed (attempt %d%s: a process of the job did not come in time, "
                        "or a peer has gone): joining the elastic driver's next round", attempt,
                        f" of {attempts}" if attempts is not None else "")
            hvd.shutdown()


def horovod_has_join_patch() -> bool:
    """Whether the installed Horovod is built with nightshift/horovod_build/horovod-0.28.1-elastic-join.patch (its
    torch extension knows HOROVOD_GLOO_RENDEZVOUS_TIMEOUT_SECONDS): without it a joiner slower than the collective
    timeout terminates every rank, failing the job. `nightshift doctor` checks it too."""
    from pathlib import Path

    import horovod.torch

    from nightshift.doctor import join_patch_built, torch_extensions

    return join_patch_built(torch_extensions(Path(horovod.torch.__file__).parent.parent))


def _seed_rank(seed: int, step: int, rank: int) -> None:
    value = (seed * 1_000_003 + step * 7_919 + rank) % (2**32)
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)


class ElasticTrainer(Trainer):
    """The data-parallel trainer in Horovod's elastic mode (module docstring). `fit()` as `Trainer.fit()`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.n_train = len(self.train_split)
        self.total_samples = self.n_train * self.config.epochs
        self.resets = 0
        self.entries = 0  # entries into the elastic function (1 + the resets this process went through)
        self.sizes: list[int] = [self.size]  # the world sizes this process trained at, in order
        self._order_epoch = -1
        self._order = torch.empty(0, dtype=torch.long)
        self.commit_at = 0  # the step of the next commit (every rank the same: rank 0's plan, see _commit)
        self.commit_interval = 1
        self.commits = 0  # commits this process made, and the seconds they took
        self.commit_time = 0.0
        self._pace = (_clock(), 0)  # (clock, step) of the last commit or entry: the pace of the steps since

    def _select_device(self, requested: str, hvd: Any) -> torch.device:
        """This rank's own choice, with no collective: a process that joins a running elastic job must not
        call one outside Horovod's elastic function, where the others wait in the state's sync."""
        import socket

        device = torch.device(choose_device(requested, rank=hvd.rank(), local_rank=hvd.local_rank(),
                                            host=socket.gethostname(), cuda=CudaView.probe(bool(hvd.cuda_built()))))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return device

    # -- state -------------------------------------------------------------------------------

    def _new_state(self) -> Any:
        import horovod.torch as hvd_torch

        state = hvd_torch.elastic.TorchState(
            model=self.model, optimizer=self.optimizer, epoch=0, processed=0, samples_done=0, step=0,
            epoch_loss=(0.0, 0), scaler=self.scaler.state_dict(), disk_checked=False, commit_at=0, commit_interval=1)
        state.register_reset_callbacks([lambda: self._on_reset(state)])
        return state

    def _on_reset(self, state: Any) -> None:
        """After Horovod re-formed the job (a host lost or added): who we are now; logged on every rank."""
        before = (self.rank, self.size)
        self.rank, self.size = self.hvd.rank(), self.hvd.size()
        self.is_chief = self.rank == 0
        self.resets += 1
        self.sizes.append(self.size)
        torch.set_num_threads(self.config.threads_per_process(self.hvd.local_size()))
        log.info("elastic reset %d: now rank %d of %d (was rank %d of %d); going on from the last commit: "
                 "epoch %d, sample %d/%d of the epoch, step %d", self.resets, self.rank, self.size, before[0],
                 before[1], state.epoch + 1, state.processed, self.n_train, state.step)

    def _enter(self, state: Any) -> None:
        """On every (re-)entry, after Horovod synced or rolled back the state: take up its position."""
        if self.entries == 0 and state.disk_checked:
            log.info("joined the running elastic job as rank %d of %d at step %d (epoch %d, sample %d/%d)",
                     self.rank, self.size, state.step, state.epoch + 1, state.processed, self.n_train)
        self.entries += 1
        self.step = int(state.step)
        self.commit_at, self.commit_interval = int(state.commit_at), int(state.commit_interval)
        self._pace = (_clock(), self.step)
        self.epoch_loss = [float(state.epoch_loss[0]), int(state.epoch_loss[1])]
        if self.scaler.is_enabled() and state.scaler:
            self.scaler.load_state_dict(state.scaler)
        _seed_rank(self.config.seed, self.step, self.rank)
        if self.is_chief and state.disk_checked:
            self._forget_metrics_after(self.step)

    def _commit(self, state: Any, epoch: int, processed: int, samples_done: int,
                steps_ended: float | None = None) -> None:
        started = _clock()
        interval = self._next_commit_interval(started if steps_ended is None else steps_ended)
        state.epoch, state.processed, state.samples_done, state.step = epoch, processed, samples_done, self.step
        state.epoch_loss = (self.epoch_loss[0], self.epoch_loss[1])
        state.scaler = self.scaler.state_dict()
        # Saved with the state: a rollback, and a process that joins, take up the same plan.
        self.commit_at, self.commit_interval = self.step + interval, interval
        state.commit_at, state.commit_interval = self.commit_at, interval
        try:
            state.commit()  # may raise HostsUpdatedInterrupt: Horovod then re-forms the job and calls _train again
        finally:
            now = _clock()
            self.commits += 1
            self.commit_time += now - started
            self._pace = (now, self.step)

    def _next_commit_interval(self, steps_ended: float) -> int:
        """Rank 0's `next_commit_interval` from its pace since the last commit, on every rank (a broadcast: ranks must
        commit at the same step, and their clocks differ). `steps_ended`: when the last step ended; at an epoch's end
        that is before the evaluation and the per-epoch hook, which say nothing of the steps' pace (keeping the
        interval planned before there instead left a slowdown of the steps since the last commit unmeasured for a
        whole stale interval after the epoch's end)."""
        plan = None
        if self.is_chief:
            plan = next_commit_interval(self.config.commit_seconds, self.step - self._pace[1],
                                        steps_ended - self._pace[0], self.commit_interval, self.config.commit_every)
        return int(self.hvd.broadcast_object(plan, root_rank=0, name="nightshift.elastic.commit_plan"))

    # -- checkpoints on disk -----------------------------------------------------------------

    def _disk_state(self, epoch: int, processed: int, samples_done: int) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "step": self.step,
            "epoch": epoch,
            "resume_key": self.config.resume_key(self.size, self.device.type),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": {},
            "scaler": self.scaler.state_dict(),
            "rng": [rng_state(self.device)],
            "threads": [torch.get_num_threads()],
            "elastic": {"epoch": epoch, "processed": processed, "samples_done": samples_done,
                        "world_size": self.size},
            "epoch_loss": list(self.epoch_loss),
        }

    def _resume_from_disk(self, state: Any) -> None:
        """Once per job, inside the elastic function (a collective): rank 0's newest matching checkpoint."""
        verdict = self._checkpoint_verdict("nightshift.elastic.resume")
        if "state" in verdict:
            saved = verdict["state"]
            where = saved.get("elastic")
            if not isinstance(where, dict):
                raise CheckpointMismatch(f"{verdict['path']} was written by an elastic run but holds no elastic "
                                         f"position; move it away or use a new --checkpoint-dir")
            self._load_weights(saved, verdict["path"], scheduler=False)
            self.step = int(saved["step"])
            # Each rank its own stream, derived as at every entry (the checkpoint's is rank 0's alone).
            _seed_rank(self.config.seed, self.step, self.rank)
            self.epoch_loss = [float(saved["epoch_loss"][0]), int(saved["epoch_loss"][1])]
            self.resumed_from = self.step
            state.epoch_loss = (self.epoch_loss[0], self.epoch_loss[1])
            state.epoch, state.processed = int(where["epoch"]), int(where["processed"])
            state.samples_done, state.step = int(where["samples_done"]), self.step
            if self.is_chief:
                log.info("resumed from checkpoint %s at step %d (epoch %d, sample %d/%d of the epoch)",
                         verdict["path"], self.step, state.epoch + 1, state.processed, self.n_train)
        elif self.is_chief and "set_aside" not in verdict:
            log.info("no checkpoint in %s: starting from step 0", self.config.checkpoint_dir)
        if self.is_chief:
            self._truncate_metrics()
        state.disk_checked = True

    # -- training ----------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        state = self._new_state()
        started = time.perf_counter()
        self.steps_run = 0
        if self.is_chief:
            every = f" or {self.config.commit_every} steps" if self.config.commit_every else ""
            log.info("elastic training on %s x %d ranks (for now): precision %s, commit every %gs of training%s, "
                     "checkpoint every %d steps", self.device, self.size, self.config.precision,
                     self.config.commit_seconds, every, self.config.checkpoint_every)
        from horovod.common.elastic import run_fn

        # hvd.elastic.run with a reset that survives a failed rendezvous (`join`): Horovod's own is
        # shutdown(); init(), which gives up at the first.
        epoch_metrics = run_fn(self._train, self._reset)(state)
        waited = time.perf_counter()
        self.writer.wait()
        self.checkpoint_seconds += time.perf_counter() - waited
        self.total_steps = self.step
        if not epoch_metrics and self.is_chief:
            epoch_metrics = self.evaluate(self.validation_split)
        return self._finish(epoch_metrics, self.steps_run, time.perf_counter() - started)

    def _reset(self) -> None:
        self.hvd.shutdown()
        join(self.hvd, attempts=RESET_JOIN_ATTEMPTS)

    def summary_extra(self) -> dict[str, Any]:
        return {"elastic": {"resets": self.resets, "world_sizes": self.sizes,
                            "commit_seconds": self.config.commit_seconds, "commit_every": self.config.commit_every,
                            "commits": self.commits, "commit_time_s": round(self.commit_time, 3)}}

    def _order_of(self, epoch: int) -> torch.Tensor:
        if epoch != self._order_epoch:
            self._order = epoch_order(self.n_train, self.config.seed, epoch).to(self.device)
            self._order_epoch = epoch
        return self._order

    def _train(self, state: Any) -> dict[str, float]:
        config = self.config
        self._enter(state)
        if not state.disk_checked:
            self._resume_from_disk(state)
            self._commit(state, int(state.epoch), int(state.processed), int(state.samples_done))
        epoch, processed, samples_done = int(state.epoch), int(state.processed), int(state.samples_done)
        epoch_metrics: dict[str, float] = {}
        window_start, window_steps, window_loss, window_samples = time.perf_counter(), 0, 0.0, 0
        self.model.train()
        while samples_done < self.total_samples:
            order = self._order_of(epoch)
            shares = step_shares(self.n_train - processed, config.batch_size, self.size)
            in_step = sum(shares)
            index = rank_indices(order, processed, shares, self.rank)
            # A rank with no sample in the epoch's last step still takes part in the allreduce: it runs one
            # sample with weight 0 (a model may not accept an empty batch), so it adds zero to the gradient.
            weight = self.size / in_step if len(index) else 0.0
            if not len(index):
                index = order[:1]
            x, y = self.train_split.features[index], self.train_split.labels[index]
            lr = step_lr(config.lr, in_step, config.batch_size, samples_done, self.total_samples)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.zero_grad()
            with autocast(self.device, config.precision):
                summed = self.loss(self.model(x), y, reduction="sum")
            self._backward_and_step(summed * weight)
            self.step += 1
            self.steps_run += 1
            processed += in_step
            samples_done += in_step
            if shares[self.rank]:
                loss_value = float(summed.detach()) / shares[self.rank]
                self.epoch_loss[0] += loss_value
                self.epoch_loss[1] += 1
                window_loss += loss_value
            window_steps += 1
            window_samples += in_step
            if self.is_chief and self.step % config.log_every == 0:
                now = time.perf_counter()
                rate = window_samples / max(now - window_start, 1e-9)
                eta = timedelta(seconds=round((self.total_samples - samples_done) / max(rate, 1e-9)))
                log.info("epoch %d/%d step %d sample %d/%d loss %.4f lr %.5f ranks %d samples/s %.0f eta %s",
                         epoch + 1, config.epochs, self.step, processed, self.n_train,
                         window_loss / max(window_steps, 1), lr, self.size, rate, eta)
                self._record({"event": "step", "step": self.step, "epoch": epoch + 1, "loss": window_loss /
                              max(window_steps, 1), "lr": lr, "samples_per_sec": rate, "world_size": self.size})
                window_start, window_steps, window_loss, window_samples = now, 0, 0.0, 0
            stop = False
            epoch_done = processed >= self.n_train
            steps_ended: float | None = None
            if epoch_done:
                steps_ended = _clock()  # the steps' pace, for the epoch-end commit, leaves the epoch's end out
                epoch_metrics = self._end_epoch(epoch)
                stop = self._hook_says_stop(epoch + 1, epoch_metrics)
                epoch, processed = epoch + 1, 0
            finished = samples_done >= self.total_samples or stop
            if self.step % config.checkpoint_every == 0 or finished:
                self._save_elastic_checkpoint(epoch, processed, samples_done)
            if stop:
                break
            # Every rank knows an epoch's end at the same step: a commit there, after the shared evaluation and
            # the per-epoch hook, keeps that time (no step pace foresees it) out of what a lost host makes redo.
            if not finished and (epoch_done or self.step >= self.commit_at):
                self._commit(state, epoch, processed, samples_done, steps_ended=steps_ended)
        return epoch_metrics

    def _end_epoch(self, epoch: int) -> dict[str, float]:
        """Validation shared by every rank (a collective): no rank waits in a collective for longer than its own
        part of the work, which keeps the collective timeout short (`collective_timeout`)."""
        metrics = self.evaluate_shared(self.validation_split)
        if not self.is_chief:
            self.epoch_loss = [0.0, 0]
            return {}
        metrics = {"train_loss": self.epoch_loss[0] / max(self.epoch_loss[1], 1), **metrics}
        self.epoch_loss = [0.0, 0]
        log.info("epoch %d/%d done: %s", epoch + 1, self.config.epochs,
                 " ".join(f"{name} {value:.4f}" for name, value in metrics.items()))
        self._record({"event": "epoch", "epoch": epoch + 1, "step": self.step, "world_size": self.size, **metrics})
        return metrics

    def evaluate_shared(self, split: Any) -> dict[str, float]:
        """`evaluate` over the split cut in `size` contiguous parts, one per rank, summed by an allreduce."""
        bounds = [len(split) * r // self.size for r in range(self.size + 1)]
        loss_sum, correct = self.evaluation_sums(split, bounds[self.rank], bounds[self.rank + 1])
        totals = self.hvd.allreduce(torch.tensor([loss_sum, float(correct)], dtype=torch.float64),
                                    op=self.hvd.Sum, name="nightshift.elastic.evaluate")
        return self.validation_metrics(float(totals[0]), round(float(totals[1])), len(split))

    def _hook_says_stop(self, epoch: int, metrics: dict[str, float]) -> bool:
        # The parent never stops after the last epoch (step == total_steps); steps are not known ahead here.
        self.total_steps = self.step if epoch >= self.config.epochs else sys.maxsize
        return super()._hook_says_stop(epoch, metrics)

    def _save_elastic_checkpoint(self, epoch: int, processed: int, samples_done: int) -> None:
        if not self.is_chief:
            return
        started = time.perf_counter()
        self.writer.submit(self._disk_state(epoch, processed, samples_done))
        self.checkpoint_seconds += time.perf_counter() - started
