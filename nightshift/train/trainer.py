"""The data-parallel trainer: one instance per Horovod process.

Only rank 0 reads or writes checkpoints, logs and writes outputs. A resumed run is bit-for-bit the
uninterrupted one: the model, optimizer, scheduler, loss scaler, every rank's RNG states (CPU and
CUDA) and torch thread count, and the position in the epoch's sample order all come back, and the
sample order is a pure function of seed and epoch. docs/concepts/training.md says what that covers on GPUs.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data.distributed import DistributedSampler

from nightshift.datasets import Split
from nightshift.errors import CheckpointMismatch, NightshiftError, UsageError
from nightshift.fsutil import atomic_write_json
from nightshift.models import MODELS
from nightshift.tasks import REGRESSION
from nightshift.train.artifacts import METRICS_LOG, METRICS_SUMMARY, save_trained_model
from nightshift.train.checkpoint import FORMAT, AsyncCheckpointWriter, CheckpointStore
from nightshift.train.config import TrainConfig
from nightshift.train.device import autocast, compression, configure_determinism, grad_scaler, select_device

log = logging.getLogger("nightshift.train")

EVAL_BATCH = 1024

# Called on rank 0 after each epoch's validation with (epoch, 1-based; that epoch's metrics); True asks
# the trainer to stop there (e.g. a search pruning the trial). Its answer reaches every rank.
EpochHook = Callable[[int, dict[str, float]], bool]


class EpochHookFailed(NightshiftError):
    """The per-epoch hook raised on rank 0; every rank stops with its message."""


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This process's RNG states in a form `torch.load(weights_only=True)` accepts; with a CUDA
    `device`, also that GPU's generator (a CPU byte tensor, like the others)."""
    _, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": [version, list(internal), gauss],
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        if device is None or device.type != "cuda":
            raise ValueError("this RNG state holds a CUDA generator: restore it on a CUDA device")
        torch.cuda.set_rng_state(state["cuda"], device)
    np_state = state["numpy"]
    np.random.set_state(("MT19937", np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    """Trains `config.model` on `config.dataset` with Horovod, resuming from checkpoints."""

    def __init__(self, config: TrainConfig, train: Split, validation: Split, hvd: Any,
                 on_epoch: EpochHook | None = None) -> None:
        self.config = config
        # Given on every rank or on none: asking it is a collective (rank 0 answers, all ranks hear).
        self.on_epoch = on_epoch
        self.stopped_at_epoch: int | None = None
        self.hvd = hvd
        self.rank = hvd.rank()
        self.size = hvd.size()
        self.is_chief = self.rank == 0
        self.model_kwargs = {"input_shape": tuple(train.input_shape), "num_classes": train.num_classes,
                             **config.model_kwargs}
        # What the served model needs to read the raw table as training did (tabular: columns, scaling, classes).
        self.preprocessing = train.preprocessing
        # val_rmse is reported in the target's units: the regression loss is on the standardised target.
        self.target_std = float((train.preprocessing or {}).get("target_std", 1.0))

        self.device = self._select_device(config.device, hvd)
        configure_determinism(self.device)
        torch.set_num_threads(config.threads_per_process(hvd.local_size()))
        seed_everything(config.seed)  # seeds every GPU's generator too
        # Built on the CPU, then moved: the initial weights are the same on either device.
        self.model = self._build_model().to(self.device)
        # The whole split goes to the device once, rather than pinned host memory and a non_blocking
        # copy per batch: a Split is already held in memory whole (the dataset loaders' contract), the
        # demo's train split is 0.3 MB, and a batch is then a gather on the GPU with no host work or
        # transfer per step. Pinning would not even overlap here: `features[index]` on a pinned tensor
        # returns unpinned memory. A dataset that does not fit in GPU memory needs a streaming loader.
        self.train_split = _on_device(train, self.device)
        self.validation_split = _on_device(validation, self.device)
        optimizer = torch.optim.SGD(self.model.parameters(), lr=config.lr * self.size, momentum=config.momentum)
        # Wrap before loading any state: DistributedOptimizer rebuilds the optimizer from its
        # parameter groups, dropping state loaded into the inner one.
        self.optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=self.model.named_parameters(),
                                                  compression=compression(config.compression, hvd))
        self.scaler = grad_scaler(self.device, config.precision)
        self.sampler: DistributedSampler[int] = DistributedSampler(
            range(len(train)), num_replicas=self.size, rank=self.rank, shuffle=True, seed=config.seed,  # type: ignore[arg-type]
        )
        self.steps_per_epoch = math.ceil(len(self.sampler) / config.batch_size)
        self.total_steps = self.steps_per_epoch * config.epochs
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=self.total_steps)
        self.store = CheckpointStore(config.checkpoint_dir, keep=config.keep_checkpoints)
        self.writer = AsyncCheckpointWriter(self.store)
        self.metrics_path = config.out / METRICS_LOG
        self.step = 0
        self.epoch_loss = [0.0, 0]  # sum and count of rank 0's batch losses in the current epoch
        self.resumed_from: int | None = None
        self.checkpoint_seconds = 0.0  # time the training loop spent blocked on checkpointing

    def _select_device(self, requested: str, hvd: Any) -> torch.device:
        """Collective: a rank that cannot use the device it was asked for fails every rank, here."""
        return select_device(requested, hvd)

    def _build_model(self) -> nn.Module:
        factory = MODELS.get(self.config.model)
        try:
            return factory(**self.model_kwargs)
        except TypeError as err:
            raise UsageError(f"model {self.config.model!r} cannot be built with {self.model_kwargs}: {err}") from err

    # -- checkpoints -------------------------------------------------------------------------

    def _checkpoint_state(self) -> dict[str, Any]:
        ranks = self.hvd.allgather_object({"rng": rng_state(self.device), "threads": torch.get_num_threads()},
                                          name="nightshift.rng")
        return {
            "format": FORMAT,
            "step": self.step,
            "epoch": self.step // self.steps_per_epoch,
            "resume_key": self.config.resume_key(self.size, self.device.type),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),  # {} unless --precision fp16
            "rng": [entry["rng"] for entry in ranks],
            "threads": [entry["threads"] for entry in ranks],  # torch threads of each rank
            "sampler": {"seed": self.config.seed, "epoch": self.step // self.steps_per_epoch},
            "epoch_loss": list(self.epoch_loss),
        }

    def save_checkpoint(self) -> None:
        started = time.perf_counter()
        state = self._checkpoint_state()  # collective (gathers RNG states): every rank calls it
        if self.is_chief:
            self.writer.submit(state)
        self.checkpoint_seconds += time.perf_counter() - started

    def _find_checkpoint(self) -> dict[str, Any]:
        """Rank 0's verdict on the checkpoint directory, to be broadcast to every rank.

        The newest valid checkpoint whose resume key matches is resumed. A checkpoint written for other
        training (other data bytes, code, parameters, world size, device or an explicit thread count: a DAG
        run cleared after its data or best.json changed, or a stale writer) is never resumed: such
        checkpoints are set aside, saying so, and a run with no matching one trains from step 0."""
        self.store.remove_temporaries()
        expected = self.config.resume_key(self.size, self.device.type)
        mismatched: list[tuple[Path, list[str]]] = []
        chosen: dict[str, Any] = {}
        for checkpoint, state in self.store.valid_newest_first():
            saved = state["resume_key"] if isinstance(state.get("resume_key"), dict) else {}
            diff = sorted(k for k in set(expected) | set(saved) if saved.get(k) != expected.get(k))
            details = [f"{k}: {_short(saved.get(k))} there, {_short(expected.get(k))} here" for k in diff]
            threads = self.config.threads_conflict(list(state.get("threads", [])))
            if threads:
                details.append(threads)
            if details:
                mismatched.append((checkpoint.path, details))
            else:
                chosen = {"state": state, "path": str(checkpoint.path)}
                break
        if mismatched:
            try:
                aside = self.store.set_aside([path for path, _ in mismatched])
            except OSError as err:
                return {"error": f"cannot set aside the checkpoints in {self.config.checkpoint_dir} that were "
                                 f"written for other training ({err}); free the disk or use a new --checkpoint-dir"}
            path, details = mismatched[0]
            log.warning("not resuming: %s was written for other training (%s); moved %d such checkpoint(s) to %s%s",
                        path, ", ".join(details), len(mismatched), aside,
                        "" if chosen else " and training from step 0")
            chosen["set_aside"] = str(aside)
        return chosen

    def resume(self) -> None:
        # broadcast_object names its collective after the object's type unless told: rank 0's dict
        # and the others' None would then never meet. Rank 0 loads the checkpoint onto the CPU (not
        # its GPU) because the state travels to every rank pickled, and a pickled CUDA tensor would
        # unpickle onto rank 0's GPU everywhere; each rank's load_state_dict then copies the model and
        # optimizer state onto its own device, and the RNG states must be CPU tensors anyway.
        verdict = self._checkpoint_verdict("nightshift.resume")
        if "state" in verdict:
            state = verdict["state"]
            self._load_weights(state, verdict["path"], scheduler=True)
            set_rng_state(state["rng"][self.rank], self.device)
            self._restore_threads(state.get("threads"))
            self.step = int(state["step"])
            self.epoch_loss = [float(state["epoch_loss"][0]), int(state["epoch_loss"][1])]
            self.resumed_from = self.step
            if self.is_chief:
                log.info("resumed from checkpoint %s at step %d/%d (epoch %d)", verdict["path"], self.step,
                         self.total_steps, self.step // self.steps_per_epoch + 1)
        elif self.is_chief and "set_aside" not in verdict:
            log.info("no checkpoint in %s: starting from step 0", self.config.checkpoint_dir)
        self.hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.is_chief:
            self._truncate_metrics()

    def _checkpoint_verdict(self, name: str) -> dict[str, Any]:
        """Rank 0's `_find_checkpoint` on every rank (a collective named `name`); raise its error everywhere."""
        verdict: dict[str, Any] = self.hvd.broadcast_object(self._find_checkpoint() if self.is_chief else None,
                                                            root_rank=0, name=name)
        if "error" in verdict:
            raise CheckpointMismatch(verdict["error"])
        return verdict

    def _load_weights(self, state: dict[str, Any], path: str, *, scheduler: bool) -> None:
        """The model, optimizer (and scheduler) and loss scaler of checkpoint `state` read from `path`."""
        try:
            self.model.load_state_dict(state["model"], strict=True)
            self.optimizer.load_state_dict(state["optimizer"])
            if scheduler:
                self.scheduler.load_state_dict(state["scheduler"])
            if self.scaler.is_enabled():
                self.scaler.load_state_dict(state.get("scaler", {}))
        except (RuntimeError, ValueError, KeyError) as err:
            raise CheckpointMismatch(f"{path} does not fit model {self.config.model!r}: {err}") from err

    def _restore_threads(self, saved: list[int] | None) -> None:
        """Run with the torch thread count this rank had when the checkpoint was written (the CPU
        kernels' reduction order depends on it); an explicit --threads that differs was refused."""
        if not saved:
            return
        threads = int(saved[self.rank])
        if threads != torch.get_num_threads():
            if self.is_chief:
                log.info("using %d torch threads per process as the checkpoint was written with (not %d), "
                         "so that the resumed run stays bit-for-bit", threads, torch.get_num_threads())
            torch.set_num_threads(threads)

    def _truncate_metrics(self) -> None:
        """Forget metric lines written after the checkpoint we resumed from: they will be redone."""
        self.config.out.mkdir(parents=True, exist_ok=True)
        if self.resumed_from is None:
            self.metrics_path.write_text("")
        else:
            self._forget_metrics_after(self.resumed_from)
        if self.resumed_from is not None:
            self._record({"event": "resume", "step": self.resumed_from})

    def _forget_metrics_after(self, step: int) -> None:
        """Drop the metric lines written after `step` (and lines torn by a kill): they will be redone."""
        if not self.metrics_path.exists():
            return
        kept: list[str] = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except json.JSONDecodeError:
                continue  # a line torn by the kill
        self.metrics_path.write_text("".join(line + "\n" for line in kept))

    def _record(self, entry: dict[str, Any]) -> None:
        with self.metrics_path.open("a") as handle:
            handle.write(json.dumps(entry, sort_keys=True) + "\n")

    # -- training ------------------------------------------------------------------------------

    def loss(self, output: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Cross-entropy over the classes of a classification task; mean squared error on the standardised
        target of a regression task (the model has one output)."""
        if self.config.task == REGRESSION:
            return F.mse_loss(output.reshape(-1).float(), target, reduction=reduction)
        return F.cross_entropy(output, target, reduction=reduction)

    def evaluate(self, split: Split) -> dict[str, float]:
        """`val_loss` (the training loss) and the task's validation metric: `val_accuracy` for classification,
        `val_rmse` (in the target's own units) for regression."""
        loss_sum, correct = self.evaluation_sums(split, 0, len(split))
        return self.validation_metrics(loss_sum, correct, len(split))

    def evaluation_sums(self, split: Split, start: int, stop: int) -> tuple[float, int]:
        """The summed loss and the correct predictions over rows [start, stop) of `split`."""
        # In fp32 whatever --precision is: these are the metrics of the saved fp32 weights, as the
        # evaluate step will see them.
        self.model.eval()
        loss_sum, correct = 0.0, 0
        with torch.no_grad():
            for first in range(start, stop, EVAL_BATCH):
                last = min(first + EVAL_BATCH, stop)
                x, y = split.features[first:last], split.labels[first:last]
                output = self.model(x)
                loss_sum += float(self.loss(output, y, reduction="sum"))
                if self.config.task != REGRESSION:
                    correct += int((output.argmax(dim=1) == y).sum())
        self.model.train()
        return loss_sum, correct

    def validation_metrics(self, loss_sum: float, correct: int, rows: int) -> dict[str, float]:
        if self.config.task == REGRESSION:
            return {"val_loss": loss_sum / rows, "val_rmse": math.sqrt(loss_sum / rows) * self.target_std}
        return {"val_loss": loss_sum / rows, "val_accuracy": correct / rows}

    def fit(self) -> dict[str, Any]:
        config = self.config
        self.resume()
        started = time.perf_counter()
        window_start, window_steps, window_loss = started, 0, 0.0
        steps_run = 0
        epoch_metrics: dict[str, float] = {}
        self.model.train()
        if self.is_chief:
            where = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
            log.info("training on %s (%s) x %d ranks: precision %s, gradient compression %s, %d torch threads",
                     self.device, where, self.size, config.precision, config.compression, torch.get_num_threads())
            if self.device.type == "cpu" and config.precision == "fp16":
                log.warning("--precision fp16 on the CPU is allowed but slow: CPUs have no fp16 arithmetic units "
                            "and torch's float16 convolution backward there is tens of times slower than fp32; "
                            "use --precision bf16 for mixed precision on CPUs")
        while self.step < self.total_steps:
            epoch = self.step // self.steps_per_epoch
            self.sampler.set_epoch(epoch)
            batches = torch.tensor(list(self.sampler), dtype=torch.long).split(config.batch_size)
            for batch in batches[self.step % self.steps_per_epoch:]:
                index = batch.to(self.device, non_blocking=True)
                x, y = self.train_split.features[index], self.train_split.labels[index]
                self.optimizer.zero_grad()
                with autocast(self.device, config.precision):
                    loss = self.loss(self.model(x), y)
                self._backward_and_step(loss)
                self.scheduler.step()
                self.step += 1
                steps_run += 1
                loss_value = float(loss.detach())
                self.epoch_loss[0] += loss_value
                self.epoch_loss[1] += 1
                window_steps += 1
                window_loss += loss_value
                if self.is_chief and self.step % config.log_every == 0:
                    now = time.perf_counter()
                    rate = window_steps * config.batch_size * self.size / max(now - window_start, 1e-9)
                    steps_per_s = window_steps / max(now - window_start, 1e-9)
                    eta = timedelta(seconds=round((self.total_steps - self.step) / steps_per_s))
                    lr = self.scheduler.get_last_lr()[0]
                    log.info("epoch %d/%d step %d/%d loss %.4f lr %.5f samples/s %.0f eta %s", epoch + 1,
                             config.epochs, self.step, self.total_steps, window_loss / window_steps, lr, rate, eta)
                    self._record({"event": "step", "step": self.step, "epoch": epoch + 1,
                                  "loss": window_loss / window_steps, "lr": lr, "samples_per_sec": rate})
                    window_start, window_steps, window_loss = now, 0, 0.0
                stop = False
                if self.step % self.steps_per_epoch == 0:
                    epoch_metrics = self._end_epoch(epoch)
                    stop = self._hook_says_stop(epoch + 1, epoch_metrics)
                if self.step % config.checkpoint_every == 0 or self.step == self.total_steps or stop:
                    self.save_checkpoint()
                if stop:
                    break
            if self.stopped_at_epoch is not None:
                break
        waited = time.perf_counter()
        self.writer.wait()
        self.checkpoint_seconds += time.perf_counter() - waited
        if not epoch_metrics and self.is_chief:
            epoch_metrics = self.evaluate(self.validation_split)
        return self._finish(epoch_metrics, steps_run, time.perf_counter() - started)

    def _backward_and_step(self, loss: torch.Tensor) -> None:
        if not self.scaler.is_enabled():
            loss.backward()
            self.optimizer.step()
            return
        # Horovod's pattern for a GradScaler (its examples/pytorch ImageNet and MNIST scripts): wait
        # for the allreduce first, so that unscale_ checks the averaged gradients for inf/NaN (every
        # rank then skips or takes the step alike), then step without reducing a second time.
        self.scaler.scale(loss).backward()
        self.optimizer.synchronize()
        self.scaler.unscale_(self.optimizer)
        with self.optimizer.skip_synchronize():
            self.scaler.step(self.optimizer)
        self.scaler.update()

    def summary_extra(self) -> dict[str, Any]:
        """More entries for metrics.json (a subclass's)."""
        return {}

    def _hook_says_stop(self, epoch: int, metrics: dict[str, float]) -> bool:
        """Ask `on_epoch` (rank 0) whether to stop after `epoch`; every rank gets the same answer."""
        if self.on_epoch is None:
            return False
        answer: dict[str, Any] | None = None
        if self.is_chief:
            try:
                answer = {"stop": bool(self.on_epoch(epoch, metrics))}
            except Exception as err:  # the other ranks must hear of it, not wait forever
                answer = {"error": f"the per-epoch hook failed after epoch {epoch}: {type(err).__name__}: {err}"}
        if self.size > 1:
            answer = self.hvd.broadcast_object(answer, root_rank=0, name="nightshift.epoch_hook")
        assert answer is not None
        if "error" in answer:
            raise EpochHookFailed(answer["error"])
        if not answer["stop"] or self.step >= self.total_steps:
            return False
        self.stopped_at_epoch = epoch
        if self.is_chief:
            log.info("stopping after epoch %d/%d (step %d): the per-epoch hook asked to; checkpointing first",
                     epoch, self.config.epochs, self.step)
        return True

    def _end_epoch(self, epoch: int) -> dict[str, float]:
        if not self.is_chief:
            self.epoch_loss = [0.0, 0]
            return {}
        train_loss = self.epoch_loss[0] / max(self.epoch_loss[1], 1)
        metrics = {"train_loss": train_loss, **self.evaluate(self.validation_split)}
        self.epoch_loss = [0.0, 0]
        log.info("epoch %d/%d done: %s", epoch + 1, self.config.epochs,
                 " ".join(f"{name} {value:.4f}" for name, value in metrics.items()))
        self._record({"event": "epoch", "epoch": epoch + 1, "step": self.step, **metrics})
        return metrics

    def _finish(self, epoch_metrics: dict[str, float], steps_run: int, seconds: float) -> dict[str, Any]:
        if not self.is_chief:
            return {}
        summary = {
            **epoch_metrics,
            "epochs": self.config.epochs,
            "steps": self.total_steps,
            "steps_run": steps_run,
            "resumed_from_step": self.resumed_from,
            "world_size": self.size,
            "device": self.device.type,
            "precision": self.config.precision,
            "compression": self.config.compression,
            "seconds": seconds,
            "checkpoint_seconds": self.checkpoint_seconds,
            "data_version": self.config.data_version,
            "code_version": self.config.code_version,
            "train_key": self.config.train_key(self.size, self.device.type),
        }
        if self.stopped_at_epoch is not None:  # stopped early by the per-epoch hook
            summary["stopped_at_epoch"] = self.stopped_at_epoch
        summary.update(self.summary_extra())
        save_trained_model(self.config.out, self.model, model_name=self.config.model,
                           model_kwargs=self.model_kwargs, dataset=self.config.dataset,
                           params=self.config.params(), task=self.config.task, preprocessing=self.preprocessing,
                           train_key=self.config.train_key(self.size, self.device.type))
        atomic_write_json(self.config.out / METRICS_SUMMARY, summary)
        outcome = {k: v for k, v in summary.items() if k not in ("seconds", "checkpoint_seconds")}
        log.info("training done: %s", json.dumps(outcome, sort_keys=True))
        return summary


def _short(value: Any) -> str:
    """A resume-key value for a log line: long digests cut to a readable prefix."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "...'"


def _on_device(split: Split, device: torch.device) -> Split:
    return replace(split, features=split.features.to(device), labels=split.labels.to(device))
