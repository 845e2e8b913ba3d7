"""`megarl train ARGS` with the memory choreography of an earlier megarl put back, to show that the CPU run
catches what a GPU run of that order would do (tests/test_choreography.py):

    python tests/order_worker.py export-beside-engines ARGS   # the final export onloads the whole training state
                                                              # after the engines took their memory back
    python tests/order_worker.py adapters-over-released ARGS  # rollout.lora_sync: adapter with an engine that
                                                              # releases its base weights
    python tests/order_worker.py log-pushes ARGS              # today's order; each weight push appends a line to
                                                              # the file PUSH_LOG: its version and its step
"""

import json
import os
import sys

from megarl.cli import main
from megarl.engine.megatron import TrainEngine
from megarl.loops import colocated
from megarl.loops.colocated import ColocatedRollouts
from megarl.timeline import TIMELINE


def export_beside_engines() -> None:
    resident = ColocatedRollouts.resident
    onload = TrainEngine.onload
    # the last checkpoint hands the devices back to the engines, and the export onloads everything
    ColocatedRollouts.resident = lambda self, run, **kwargs: resident(self, run, **(kwargs | {"final": False}))
    TrainEngine.onload = lambda self, params_only=False: onload(self)


def adapters_over_released() -> None:
    make = colocated.make_rollout_engine

    def releasing(*args, **kwargs):
        engine = make(*args, **kwargs)
        engine.keeps_weights = False
        return engine
    colocated.make_rollout_engine = releasing


def log_pushes() -> None:
    push = ColocatedRollouts.push

    def logged(self, run, **kwargs):
        with open(os.environ["PUSH_LOG"], "a") as f:  # the step whose timeline is open: None between steps
            f.write(json.dumps({"version": run.weight_version, "step": TIMELINE._step}) + "\n")
        return push(self, run, **kwargs)
    ColocatedRollouts.push = logged


if __name__ == "__main__":
    {"export-beside-engines": export_beside_engines, "adapters-over-released": adapters_over_released,
     "log-pushes": log_pushes}[sys.argv[1]]()
    sys.argv = [sys.argv[0], "train", *sys.argv[2:]]
    main()
