"""The local layer spec's expert linear_fc2 for experts with biases (gpt-oss).

Megatron's MLP adds an expert's fc2 bias, scaled by the token's routing probability, in place on fc2's output
(`output += output_bias * per_token_scale`, megatron.core.transformer.mlp). Without tensor or expert
parallelism, RowParallelLinear's reduce over its one-rank group hands its input back as is, which autograd
marks as a view of a custom Function's output and refuses to change in place while training. This linear
returns its own tensor there; under TP or EP the layer skips that reduce (the MoE dispatcher communicates) and
its output is already its own.

Its bias is not a sequence-parallel weight: Megatron tags a RowParallelLinear's bias `sequence_parallel`, and its
finalize_model_grads then sums the tagged gradients over the tensor-parallel ranks, which is right for a layer whose
input is this rank's slice of the sequence, but an expert's input comes whole from the dispatcher, and with expert
tensor-parallel size 1 under TP > 1 the other TP ranks hold other experts: their biases' gradients would be added
into this one's.

Imported only by megarl.engine.model.build_gpt, with Megatron.
"""

from __future__ import annotations

from megatron.core.tensor_parallel import RowParallelLinear


class ExpertBiasRowParallelLinear(RowParallelLinear):
    """RowParallelLinear whose output may be changed in place by the expert MLP that calls it, and whose bias's
    gradient is its own tokens' (not summed over the tensor-parallel ranks)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.bias is not None:
            self.bias.sequence_parallel = False

    def forward(self, input_, **kwargs):
        output, bias = super().forward(input_, **kwargs)
        return (output if self.explicit_expert_comm else output.clone()), bias
