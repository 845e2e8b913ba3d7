"""`megarl plan`: check a recipe against a cluster and estimate the memory of every GPU, without a GPU.

    megarl plan RECIPE.yaml --nodes 8 --gpus-per-node 8 [--gpu-mem-gb 80] [--host-mem-gb 2048]
        [--model-config config.json] [--json] [key.path=value ...]

Planning reads the recipe (its files need not exist on this machine) and the model's HF `config.json` (from
`model.path`, or `--model-config` where the checkpoint lives only on the cluster), then:

1. checks the layout on --nodes * --gpus-per-node ranks with the check launch makes (megarl.layout): the world
   divides by tp*pp*cp, heads, query groups, MLP width by tp, layers by pp (and by pp * virtual stages),
   experts by ep and the expert grid tp*ep*pp by the world, the global batch by the data-parallel size and
   micro-batch, and every rollout engine fits inside one node. A failure raises PlanError with launch's text
   (exit code 2). With `placement.mode: split` the trainer's world is the job's less the last
   `placement.rollout_ranks` ranks, which only generate (megarl.loops.split): tp, pp, cp, ep and dp divide it.
2. estimates, per GPU, the bytes each phase of an RL step holds on the device (train, weight push, rollout;
   SFT and DPO only train), and per node the host memory the offloaded trainer state takes, and says
   whether everything fits (exit code 0) or not (exit code 1, with the reasons). A split plan estimates the
   training GPUs and the rollout GPUs apart, and both must fit.

The package: `estimate` (the verdict: `plan`, `Plan`), `memory` (the memory model of each phase and its
assumptions) and `render` (the table and the JSON). Imports no torch.
"""

from megarl.plan.estimate import DEFAULT_SEQ_TOKENS, Plan, PlanError, plan, read_model, sequence_tokens
from megarl.plan.memory import (ADAM_BYTES, DEFAULT_HOST_MEM_GIB, DTYPE_BYTES, ENGINE_START_USED_GIB, GIB,
                                GRAD_BYTES, HOST_RESERVE_GIB, HOST_USABLE_FRACTION, MASTER_BYTES, RESERVE_GIB,
                                USABLE_FRACTION, Cluster, kv_bytes_per_token, sglang_pool_tokens,
                                stage_params)
from megarl.plan.render import render_table, to_json

__all__ = ["ADAM_BYTES", "DEFAULT_HOST_MEM_GIB", "DEFAULT_SEQ_TOKENS", "DTYPE_BYTES", "ENGINE_START_USED_GIB",
           "GIB", "GRAD_BYTES", "HOST_RESERVE_GIB", "HOST_USABLE_FRACTION", "MASTER_BYTES", "RESERVE_GIB",
           "USABLE_FRACTION", "Cluster", "Plan", "PlanError", "plan", "read_model", "render_table",
           "sequence_tokens", "kv_bytes_per_token", "sglang_pool_tokens", "stage_params", "to_json"]
