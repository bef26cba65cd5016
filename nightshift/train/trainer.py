"""The data-parallel trainer: one instance per Horovod process.

Only rank 0 reads or writes checkpoints, logs and writes outputs. A resumed run is bit-for-bit the
uninterrupted one: the model, optimizer, scheduler, every rank's RNG states and the position in
the epoch's sample order all come back, and the sample order is a pure function of seed and epoch.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data.distributed import DistributedSampler

from nightshift.datasets import Split
from nightshift.errors import CheckpointMismatch, UsageError
from nightshift.fsutil import atomic_write_json
from nightshift.models import MODELS
from nightshift.train.artifacts import save_trained_model
from nightshift.train.checkpoint import FORMAT, AsyncCheckpointWriter, CheckpointStore
from nightshift.train.config import TrainConfig

log = logging.getLogger("nightshift.train")

EVAL_BATCH = 1024


def rng_state() -> dict[str, Any]:
    """This process's RNG states in a form `torch.load(weights_only=True)` accepts."""
    _, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": [version, list(internal), gauss],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
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

    def __init__(self, config: TrainConfig, train: Split, validation: Split, hvd: Any) -> None:
        self.config = config
        self.train_split = train
        self.validation_split = validation
        self.hvd = hvd
        self.rank = hvd.rank()
        self.size = hvd.size()
        self.is_chief = self.rank == 0
        self.model_kwargs = {"input_shape": tuple(train.input_shape), "num_classes": train.num_classes,
                             **config.model_kwargs}

        torch.set_num_threads(config.threads_per_process(hvd.local_size()))
        torch.use_deterministic_algorithms(True, warn_only=True)
        seed_everything(config.seed)
        self.model = self._build_model()
        optimizer = torch.optim.SGD(self.model.parameters(), lr=config.lr * self.size, momentum=config.momentum)
        # Wrap before loading any state: DistributedOptimizer rebuilds the optimizer from its
        # parameter groups, dropping state loaded into the inner one.
        self.optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=self.model.named_parameters())
        self.sampler: DistributedSampler[int] = DistributedSampler(
            range(len(train)), num_replicas=self.size, rank=self.rank, shuffle=True, seed=config.seed,  # type: ignore[arg-type]
        )
        self.steps_per_epoch = math.ceil(len(self.sampler) / config.batch_size)
        self.total_steps = self.steps_per_epoch * config.epochs
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=self.total_steps)
        self.store = CheckpointStore(config.checkpoint_dir, keep=config.keep_checkpoints)
        self.writer = AsyncCheckpointWriter(self.store)
        self.metrics_path = config.out / "metrics.jsonl"
        self.step = 0
        self.epoch_loss = [0.0, 0]  # sum and count of rank 0's batch losses in the current epoch
        self.resumed_from: int | None = None
        self.checkpoint_seconds = 0.0  # time the training loop spent blocked on checkpointing

    def _build_model(self) -> nn.Module:
        factory = MODELS.get(self.config.model)
        try:
            return factory(**self.model_kwargs)
        except TypeError as err:
            raise UsageError(f"model {self.config.model!r} cannot be built with {self.model_kwargs}: {err}") from err

    # -- checkpoints -------------------------------------------------------------------------

    def _checkpoint_state(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "step": self.step,
            "epoch": self.step // self.steps_per_epoch,
            "resume_key": self.config.resume_key(self.size),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": self.hvd.allgather_object(rng_state(), name="nightshift.rng"),
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
        """Rank 0's verdict on the checkpoint directory, to be broadcast to every rank."""
        self.store.remove_temporaries()
        found = self.store.latest_valid()
        if found is None:
            return {}
        checkpoint, state = found
        expected = self.config.resume_key(self.size)
        if state["resume_key"] != expected:
            diff = sorted(k for k in expected if state["resume_key"].get(k) != expected[k])
            details = ", ".join(f"{k}: {state['resume_key'].get(k)!r} there, {expected[k]!r} here" for k in diff)
            return {"error": f"{checkpoint.path} was written by a different configuration ({details}); "
                             f"resume with the same arguments or use a new --checkpoint-dir"}
        return {"state": state, "path": str(checkpoint.path)}

    def resume(self) -> None:
        # broadcast_object names its collective after the object's type unless told: rank 0's dict
        # and the others' None would then never meet.
        verdict = self.hvd.broadcast_object(self._find_checkpoint() if self.is_chief else None, root_rank=0,
                                            name="nightshift.resume")
        if "error" in verdict:
            raise CheckpointMismatch(verdict["error"])
        if "state" in verdict:
            state = verdict["state"]
            try:
                self.model.load_state_dict(state["model"], strict=True)
                self.optimizer.load_state_dict(state["optimizer"])
                self.scheduler.load_state_dict(state["scheduler"])
            except (RuntimeError, ValueError, KeyError) as err:
                raise CheckpointMismatch(f"{verdict['path']} does not fit model {self.config.model!r}: {err}") from err
            set_rng_state(state["rng"][self.rank])
            self.step = int(state["step"])
            self.epoch_loss = [float(state["epoch_loss"][0]), int(state["epoch_loss"][1])]
            self.resumed_from = self.step
            if self.is_chief:
                log.info("resumed from checkpoint %s at step %d/%d (epoch %d)", verdict["path"], self.step,
                         self.total_steps, self.step // self.steps_per_epoch + 1)
        elif self.is_chief:
            log.info("no checkpoint in %s: starting from step 0", self.config.checkpoint_dir)
        self.hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.is_chief:
            self._truncate_metrics()

    def _truncate_metrics(self) -> None:
        """Forget metric lines written after the checkpoint we resumed from: they will be redone."""
        self.config.out.mkdir(parents=True, exist_ok=True)
        kept: list[str] = []
        if self.resumed_from is not None and self.metrics_path.exists():
            for line in self.metrics_path.read_text().splitlines():
                try:
                    if json.loads(line).get("step", 0) <= self.resumed_from:
                        kept.append(line)
                except json.JSONDecodeError:
                    continue  # a line torn by the kill
        self.metrics_path.write_text("".join(line + "\n" for line in kept))
        if self.resumed_from is not None:
            self._record({"event": "resume", "step": self.resumed_from})

    def _record(self, entry: dict[str, Any]) -> None:
        with self.metrics_path.open("a") as handle:
            handle.write(json.dumps(entry, sort_keys=True) + "\n")

    # -- training ------------------------------------------------------------------------------

    def evaluate(self, split: Split) -> dict[str, float]:
        self.model.eval()
        loss_sum, correct = 0.0, 0
        with torch.no_grad():
            for start in range(0, len(split), EVAL_BATCH):
                x = split.features[start:start + EVAL_BATCH]
                y = split.labels[start:start + EVAL_BATCH]
                logits = self.model(x)
                loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
                correct += int((logits.argmax(dim=1) == y).sum())
        self.model.train()
        return {"val_loss": loss_sum / len(split), "val_accuracy": correct / len(split)}

    def fit(self) -> dict[str, Any]:
        config = self.config
        self.resume()
        started = time.perf_counter()
        window_start, window_steps, window_loss = started, 0, 0.0
        steps_run = 0
        epoch_metrics: dict[str, float] = {}
        self.model.train()
        while self.step < self.total_steps:
            epoch = self.step // self.steps_per_epoch
            self.sampler.set_epoch(epoch)
            batches = torch.tensor(list(self.sampler), dtype=torch.long).split(config.batch_size)
            for batch in batches[self.step % self.steps_per_epoch:]:
                x, y = self.train_split.features[batch], self.train_split.labels[batch]
                self.optimizer.zero_grad()
                loss = F.cross_entropy(self.model(x), y)
                loss.backward()
                self.optimizer.step()
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
                if self.step % self.steps_per_epoch == 0:
                    epoch_metrics = self._end_epoch(epoch)
                if self.step % config.checkpoint_every == 0 or self.step == self.total_steps:
                    self.save_checkpoint()
        waited = time.perf_counter()
        self.writer.wait()
        self.checkpoint_seconds += time.perf_counter() - waited
        if not epoch_metrics and self.is_chief:
            epoch_metrics = self.evaluate(self.validation_split)
        return self._finish(epoch_metrics, steps_run, time.perf_counter() - started)

    def _end_epoch(self, epoch: int) -> dict[str, float]:
        if not self.is_chief:
            self.epoch_loss = [0.0, 0]
            return {}
        train_loss = self.epoch_loss[0] / max(self.epoch_loss[1], 1)
        metrics = {"train_loss": train_loss, **self.evaluate(self.validation_split)}
        self.epoch_loss = [0.0, 0]
        log.info("epoch %d/%d done: train_loss %.4f val_loss %.4f val_accuracy %.4f", epoch + 1,
                 self.config.epochs, metrics["train_loss"], metrics["val_loss"], metrics["val_accuracy"])
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
            "seconds": seconds,
            "checkpoint_seconds": self.checkpoint_seconds,
        }
        save_trained_model(self.config.out, self.model, model_name=self.config.model,
                           model_kwargs=self.model_kwargs, dataset=self.config.dataset,
                           params=self.config.params())
        atomic_write_json(self.config.out / "metrics.json", summary)
        outcome = {k: v for k, v in summary.items() if k not in ("seconds", "checkpoint_seconds")}
        log.info("training done: %s", json.dumps(outcome, sort_keys=True))
        return summary
