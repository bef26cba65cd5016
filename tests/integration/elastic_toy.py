"""A Horovod elastic toy for run-mpijob's elastic tests: `python elastic_toy.py FULL_STEPS FULL_SIZE PAUSE_S`.

Each step all-reduces a one, prints `step S size N sum M` (N: hvd.size(); M must equal N) and commits the
state (an `ObjectState`: on a lost host the ranks left roll back to the last commit; on a host added the
state is broadcast to the newcomer). The job ends after FULL_STEPS steps done at FULL_SIZE ranks, so a host
lost before the end must come back for it to finish: the sizes it prints go FULL_SIZE, fewer, FULL_SIZE.
"""

from __future__ import annotations

import sys
import time

import horovod.torch as hvd
import torch
from horovod.common.elastic import ObjectState


def main(full_steps: int, full_size: int, pause_s: float) -> None:
    hvd.init()
    state = ObjectState(hvd.broadcast_object, hvd.rank, step=0, full_steps=0)

    @hvd.elastic.run
    def train(state: ObjectState) -> None:
        while state.full_steps < full_steps:
            total = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="ones")
            print(f"step {state.step} size {hvd.size()} sum {int(total.item())}", flush=True)
            state.step += 1
            if hvd.size() == full_size:
                state.full_steps += 1
            state.commit()
            time.sleep(pause_s)

    train(state)
    if hvd.rank() == 0:
        print(f"elastic toy done: {state.step} steps, {state.full_steps} at size {full_size}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
