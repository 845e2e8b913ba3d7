"""`megarl train ARGS` with the memory choreography of an earlier megarl put back, to show that the CPU run
catches what a GPU run of that order would do (tests/test_choreography.py):

    python tests/order_worker.py export-beside-engines ARGS   # the final export onloads the whole training state
                                                              # after the engines took their memory back
    python tests/order_worker.py adapters-over-released ARGS  # rollout.lora_sync: adapter with an engine that
                                                              # releases its base weights
"""

import sys

from megarl.cli import main
from megarl.engine.megatron import TrainEngine
from megarl.loops import colocated
from megarl.loops.colocated import ColocatedRollouts


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


if __name__ == "__main__":
    {"export-beside-engines": export_beside_engines, "adapters-over-released": adapters_over_released}[sys.argv[1]]()
    sys.argv = [sys.argv[0], "train", *sys.argv[2:]]
    main()
