"""Code paths only a GPU run takes, tested on CPU where their inputs can be stood in for: Transformer Engine's
grouped MoE weights as TE tags them, and megatron-core's MoE router on a CUDA machine without Transformer
Engine.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from conftest import run_python

pytestmark = pytest.mark.timeout(180)

SPAWN_TIMEOUT_S = 120


# ---- Transformer Engine's grouped expert linears ----------------------------------------------------------------
class _TEGroupedLinear(torch.nn.Module):
    """The parameters of one TE GroupedLinear as megatron-core builds its expert layers with tp > 1 or ep > 1
    (TEGroupedLinear's `explicit_expert_comm`): weight0..weight{n-1}, each [out, in] of this rank, tagged by TE
    without a parallel mode, so `partition_dim` 0 whether the layer is column or row parallel."""

    def __init__(self, experts: int, out_features: int, in_features: int):
        super().__init__()
        for e in range(experts):
            weight = torch.nn.Parameter(torch.zeros(out_features, in_features))
            weight.tensor_model_parallel, weight.partition_dim, weight.partition_stride = True, 0, 1
            self.register_parameter(f"weight{e}", weight)


def _te_grouped_experts(shape, *, tp: int) -> torch.nn.Module:
    """A model holding only the routed experts of every layer, named as megatron-core's TE spec names them
    (`decoder.layers.{i}.mlp.experts.linear_fc{1,2}.weight{e}`, TEGroupedMLP): fc1 (gate and up, column
    parallel) [2 * moe_ffn / tp, hidden], fc2 (row parallel) [hidden, moe_ffn / tp]."""
    layers = torch.nn.ModuleList()
    for _ in range(shape.layers):
        layer = torch.nn.Module()
        layer.mlp = torch.nn.Module()
        layer.mlp.experts = torch.nn.Module()
        layer.mlp.experts.linear_fc1 = _TEGroupedLinear(shape.experts, 2 * shape.moe_ffn // tp, shape.hidden)
        layer.mlp.experts.linear_fc2 = _TEGroupedLinear(shape.experts, shape.hidden, shape.moe_ffn // tp)
        layers.append(layer)
    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.layers = layers
    return model


def test_grouped_expert_fc2_splits_on_its_input_dim_whatever_te_tags():
    from megarl.engine.model import tp_split

    fc1, fc2 = torch.nn.Parameter(torch.zeros(4, 8)), torch.nn.Parameter(torch.zeros(8, 2))
    for p in (fc1, fc2):  # what TE tags with tp > 1 or ep > 1
        p.tensor_model_parallel, p.partition_dim = True, 0
    assert tp_split("decoder.layers.3.mlp.experts.linear_fc1.weight7", fc1) == 0
    assert tp_split("decoder.layers.3.mlp.experts.linear_fc2.weight7", fc2) == 1
    # every other layer's own tag is right: Megatron's row-parallel linears say 1, replicated weights nothing
    row = torch.nn.Parameter(torch.zeros(8, 2))
    row.tensor_model_parallel, row.partition_dim = True, 1
    assert tp_split("decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight", row) == 1
    assert tp_split("decoder.layers.0.mlp.shared_experts.linear_fc2.weight", row) == 1
    assert tp_split("decoder.layers.0.mlp.router.weight", torch.nn.Parameter(torch.zeros(4, 8))) is None


def _te_experts_worker(rank: int, world: int, model_dir: str, out_dir: str) -> None:
    from datetime import timedelta

    from megarl.engine import hf_weights
    from megarl.engine.model import StageModel
    from megarl.engine.parallel import ParallelGroups
    from megarl.models.arch import read_shape
    from megarl.models.names import NameTable, name_rules

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world)
    own = [dist.new_group([r]) for r in range(world)][rank]  # every one-rank axis
    groups = ParallelGroups(tp=dist.group.WORLD, pp=own, dp=own, mp=dist.group.WORLD, ep=own,
                            etp=dist.group.WORLD, cp=own, tp_rank=rank, tp_size=world, pp_rank=0, pp_size=1,
                            dp_rank=0, dp_size=1, ep_rank=0, ep_size=1, etp_rank=rank, etp_size=world, cp_rank=0,
                            cp_size=1, pp_last_global_rank=world - 1,
                            mp_src_global_rank=0, timeout=timedelta(seconds=60))
    shape = read_shape(model_dir)
    stage = StageModel(shape=shape, config=None, groups=groups, chunks=[_te_grouped_experts(shape, tp=world)],
                       layer_offsets=[0], names=NameTable(name_rules(shape, te_spec=True)), value_head=False)
    hf_weights.load_hf(stage, model_dir)
    shards = {name: param.detach().clone() for name, param in stage.named_parameters()}
    exported = dict(hf_weights.hf_tensors(stage))
    torch.save((shards, exported), f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_te_grouped_experts_load_and_export_with_tensor_parallelism(arch_dir, tmp_path):
    """With TP = 2 the expert fc2 of Transformer Engine's grouped MLP is loaded split along its input dim
    (rank r holds down_proj[:, r * moe_ffn / 2 : (r + 1) * moe_ffn / 2], the slice its half of the
    activation multiplies), although TE tags it partition_dim 0, and the export gives the checkpoint back
    bit for bit."""
    model_dir = arch_dir("qwen3_moe")
    world = 2
    ctx = mp.start_processes(_te_experts_worker, args=(world, str(model_dir), str(tmp_path)), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the TP = 2 expert ranks did not finish within {SPAWN_TIMEOUT_S} s")
    checkpoint = load_file(str(Path(model_dir) / "model.safetensors"))
    experts = {k: v for k, v in checkpoint.items() if ".mlp.experts." in k}
    for rank in range(world):
        shards, exported = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        down = checkpoint["model.layers.1.mlp.experts.3.down_proj.weight"]  # [hidden, moe_ffn]
        width = down.shape[1] // world
        assert torch.equal(shards["decoder.layers.1.mlp.experts.linear_fc2.weight3"],
                           down[:, rank * width:(rank + 1) * width])
        assert exported.keys() == experts.keys()
        for name, tensor in experts.items():
            assert torch.equal(exported[name], tensor), name


# ---- megatron-core's MoE router without Transformer Engine --------------------------------------------------------
_ROUTER_ON_THE_CUDA_PATH = """
import torch
import torch.distributed as dist

from megarl.device import load_cuda_driver_stand_in

load_cuda_driver_stand_in()  # a real driver where there is one; megatron's imports may load CUDA kernels
from megatron.core import tensor_parallel
from megatron.core.transformer.moe import moe_utils

from megarl.engine import cpu_compat, parallel

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
parallel.on_gpu = lambda: True  # the path a CUDA machine takes: cpu_compat is never installed
tensor_parallel.model_parallel_cuda_manual_seed = lambda seed: None  # it seeds CUDA generators
parallel.init_parallel(tp=1, pp=1)
assert not cpu_compat.is_installed()
tokens, weight = torch.randn(2, 3, 8), torch.randn(4, 8, requires_grad=True)
logits = moe_utils.router_gating_linear(tokens, weight, None, torch.float32)  # [2, 3, 4]
torch.testing.assert_close(logits, tokens @ weight.t())
logits.sum().backward()
torch.testing.assert_close(weight.grad, tokens.reshape(-1, 8).sum(0).expand(4, 8))
print("routed")
"""


def test_moe_router_runs_without_transformer_engine_on_the_cuda_path():
    """megatron-core's router gating reads `te_general_gemm`, a name bound only when Transformer Engine imports;
    init_parallel binds it to None on every device, not only where the CPU compatibility layer is installed, so
    a GPU machine without TE routes with torch's matmul (forward and backward) instead of a NameError."""
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed: the router uses its GEMM")
    result = run_python(["-c", _ROUTER_ON_THE_CUDA_PATH], timeout_s=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "routed" in result.stdout


# ---- Megatron settings the engine cannot honour ------------------------------------------------------------------
@pytest.mark.parametrize("key,value,why", [
    ("enable_cuda_graph", True, "new addresses"),
    ("external_cuda_graph", True, "new addresses"),
    ("cuda_graph_impl", "transformer_engine", "new addresses"),
    ("cuda_graph_scope", "attn", "new addresses"),
    ("cuda_graph_warmup_steps", 5, "new addresses"),
    ("fp8_param", True, "quantized tensors"),
    ("fp4_param", True, "quantized tensors"),
])
def test_cuda_graph_and_quantized_param_settings_are_refused_naming_the_key(key, value, why):
    """CUDA graphs replay captured addresses that the offload moves; fp8/fp4 parameters are tensors the HF load,
    the weight push and the export do not handle. Both are refused before anything is built, naming the key."""
    from megarl.job import check_megatron_fields

    with pytest.raises(ValueError, match=rf"model\.megatron\.{key} = .* is not supported: .*{why}"):
        check_megatron_fields({key: value})


def test_cuda_graph_and_quantized_param_settings_at_megatrons_defaults_pass():
    from megarl.job import check_megatron_fields

    check_megatron_fields({"enable_cuda_graph": False, "cuda_graph_impl": "none", "fp8_param": False,
                           "external_cuda_graph": False})

