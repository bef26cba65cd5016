"""Test helper: a training output directory in the trainer's layout, trained for a few steps with plain torch.

Layout (what `python -m nightshift.train --out DIR` writes): `model.pt` (state_dict), `model.json`,
`metrics.jsonl` (per-epoch lines with "event": "epoch"), `metrics.json` (final).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from nightshift.datasets import load_split
from nightshift.models import build_model


def write_trained_output(out: Path, data_dir: Path, *, epochs: int = 3, steps_per_epoch: int | None = None,
                         seed: int = 0, hidden: int = 64, lr: float = 0.003) -> Path:
    """Train `digits_cnn` for `epochs` (optionally only `steps_per_epoch` batches) and write the layout."""
    torch.manual_seed(seed)
    train = load_split("digits", data_dir, "train")
    val = load_split("digits", data_dir, "validation")
    kwargs = {"channels": 8, "hidden": hidden, "input_shape": list(train.input_shape),
              "num_classes": train.num_classes}
    model = build_model("digits_cnn", **kwargs)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loss_fn = torch.nn.CrossEntropyLoss()
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for epoch in range(1, epochs + 1):
        model.train()
        perm = torch.randperm(len(train))
        total, batches = 0.0, 0
        for start in range(0, len(train), 64):
            if steps_per_epoch is not None and batches >= steps_per_epoch:
                break
            idx = perm[start:start + 64]
            opt.zero_grad()
            loss = loss_fn(model(train.features[idx]), train.labels[idx])
            loss.backward()
            opt.step()
            total += float(loss)
            batches += 1
        model.eval()
        with torch.no_grad():
            logits = model(val.features)
            val_loss = float(loss_fn(logits, val.labels))
            val_acc = float((logits.argmax(1) == val.labels).float().mean())
        lines.append({"event": "epoch", "epoch": epoch, "step": epoch * batches, "train_loss": total / max(batches, 1),
                      "val_loss": val_loss, "val_accuracy": val_acc})
    torch.save(model.state_dict(), out / "model.pt")
    (out / "model.json").write_text(json.dumps({
        "model": "digits_cnn", "model_kwargs": kwargs, "dataset": "digits",
        "input_shape": list(train.input_shape), "num_classes": train.num_classes,
        "params": {"epochs": epochs, "lr": lr, "batch_size": 64, "seed": seed},
        # What the trainer records (TrainConfig.train_key): here a digest of this function's arguments.
        "train_key": hashlib.sha256(json.dumps([str(data_dir), epochs, steps_per_epoch, seed, hidden, lr])
                                    .encode()).hexdigest()[:16],
    }))
    (out / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (out / "metrics.json").write_text(json.dumps({"val_loss": lines[-1]["val_loss"],
                                                  "val_accuracy": lines[-1]["val_accuracy"],
                                                  "epochs": epochs}))
    return out
