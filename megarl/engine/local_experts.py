"""The local layer spec's expert linear_fc2 for experts with biases (gpt-oss).

Megatron's MLP adds an expert's fc2 bias, scaled by the token's routing probability, in place on fc2's output
(`output += output_bias * per_token_scale`, megatron.core.transformer.mlp). Without tensor or expert
parallelism, RowParallelLinear's reduce over its one-rank group hands its input back as is, which autograd
marks as a view of a custom Function's output and refuses to change in place while training. This linear
returns its own tensor there; under TP or EP the layer skips that reduce (the MoE dispatcher communicates) and
its output is already its own.

Imported only by megarl.engine.model.build_gpt, with Megatron.
"""

from __future__ import annotations

from megatron.core.tensor_parallel import RowParallelLinear


class ExpertBiasRowParallelLinear(RowParallelLinear):
    """RowParallelLinear whose output may be changed in place by the expert MLP that calls it."""

    def forward(self, input_, **kwargs):
        output, bias = super().forward(input_, **kwargs)
        return (output if self.explicit_expert_comm else output.clone()), bias
