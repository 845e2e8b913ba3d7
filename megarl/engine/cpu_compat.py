"""Run real megatron-core on a machine without CUDA (gloo process groups, CPU tensors).

megatron-core assumes CUDA in a few dozen places: `torch.cuda.current_device()` as an allocation device,
the CUDA RNG in tensor_parallel/random.py, literal `device="cuda"` scalars in the schedules, optimizer and
grad clipping, `.type() == 'torch.cuda.FloatTensor'` asserts, and CUDA streams in DDP. `install()`
redirects exactly those to the CPU. Everything it changes is process-global, so it refuses to run when a
CUDA device is usable: on a GPU machine megatron runs untouched.

Also here: `te_general_gemm`, which megatron-core's MoE router reads although it is bound only with
Transformer Engine: `patch_moe_router_without_te` fixes that on every device (a GPU machine may lack TE),
`patch_mla_without_te` the same kind of mistake in multi-latent attention, and
`patch_optimizer_config_without_te` another in the optimizer's config (optim.cpu_offload).
And, on the CPU path only: numpy split sizes passed to `all_to_all_single`, gloo's `all_gather`, which
refuses tensors of different lengths per rank that the MoE dispatcher gathers under tensor parallelism (NCCL
takes them), and megatron-core's optimizer that steps part of the state on the host.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types

import torch


_CPU = torch.device("cpu")
_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor",
                    "torch.HalfTensor": "torch.cuda.HalfTensor",
                    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}
# Modules that create tensors with a literal device="cuda" (or in pinned host memory, which needs a CUDA
# allocator); they get a torch whose factories make plain CPU tensors.
_LITERAL_CUDA_MODULES = (
    "megatron.core.models.common.embeddings.rope_utils",  # the rotary table's context-parallel slice
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.tensor_parallel.data",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.rerun_state_machine",
    "megatron.core.utils",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
)
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like", "empty_like")


# TransformerConfig fields of a run without CUDA: fused kernels are CUDA code (their unfused twins compute the
# same function), and weights are created on the CPU.
TRANSFORMER_CONFIG = dict(bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                          persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
                          use_cpu_initialization=True)


def is_installed() -> bool:
    return install.cache_info().currsize > 0


@functools.cache  # once per process: the patches are the libraries' own functions, replaced
def install() -> None:
    """Redirect megatron-core's CUDA-only calls to the CPU. Idempotent; an error on a CUDA machine."""
    if torch.cuda.is_available():
        raise RuntimeError("megarl.engine.cpu_compat must not be installed on a machine with a usable CUDA device")
    _patch_torch_cuda()
    _patch_megatron_rng()
    for name in _LITERAL_CUDA_MODULES:
        importlib.import_module(name).torch = _CpuTorch()
    _patch_cuda_type_asserts()
    _patch_moe_without_te()
    _patch_adam_step_restore()
    _patch_hybrid_device_optimizer()


class _Stream:
    """Stands in for torch.cuda.Stream/Event: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: None

    def query(self):
        return True

    def record_event(self, *args, **kwargs):
        # The alltoall MoE dispatcher records an event on its copy stream and later waits on it.
        return _Stream()


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: _CPU
    cuda.synchronize = lambda *args, **kwargs: None
    cuda.empty_cache = lambda: None
    cuda.Stream = _Stream
    cuda.Event = _Stream
    cuda.current_stream = lambda *args, **kwargs: _Stream()
    cuda.default_stream = lambda *args, **kwargs: _Stream()
    cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    cuda.nvtx = types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None,
                                      range=lambda *a, **k: contextlib.nullcontext())
    # Megatron seeds "the CUDA generator" for its model-parallel RNG streams; on CPU that is the CPU
    # generator, so tensor-parallel ranks still get the distinct streams Megatron intends.
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    # torch.manual_seed itself calls cuda.manual_seed_all: seed the CPU generator directly.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self


def _patch_megatron_rng() -> None:
    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)


class _CpuTorch(types.ModuleType):
    """`torch`, except that the tensor factories treat device="cuda" as the CPU."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name in _FACTORIES:
            return functools.partial(_on_cpu, value)
        return value


def _on_cpu(factory, *args, **kwargs):
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "cuda":
        kwargs["device"] = _CPU
    kwargs.pop("pin_memory", None)
    return factory(*args, **kwargs)


@contextlib.contextmanager
def _cuda_type_names():
    """Within the block, `tensor.type()` names CPU float tensors as their CUDA twins."""
    original = torch.Tensor.type

    def cuda_named_type(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        return _CUDA_TYPE_NAMES.get(name, name) if not args and not kwargs else name

    torch.Tensor.type = cuda_named_type
    try:
        yield
    finally:
        torch.Tensor.type = original


def _with_cuda_type_names(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _cuda_type_names():
            return fn(*args, **kwargs)
    return wrapper


def _patch_cuda_type_asserts() -> None:
    # The optimizers sort parameters by `.type()` name and clip_grads asserts it; only those calls see
    # CUDA type names, nothing else in the process does.
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    clip_grads.clip_grad_by_total_norm_fp32 = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    optimizer.clip_grad_by_total_norm_fp32 = clip_grads.clip_grad_by_total_norm_fp32
    dist_opt = distrib_optimizer.DistributedOptimizer
    dist_opt._build_model_and_main_param_groups = classmethod(
        _with_cuda_type_names(dist_opt._build_model_and_main_param_groups.__func__))
    fp16_opt = optimizer.Float16OptimizerWithFloat16Params
    fp16_opt.__init__ = _with_cuda_type_names(fp16_opt.__init__)


def patch_moe_router_without_te() -> None:
    """Without Transformer Engine, on any device: megatron-core's router gating (moe_utils.router_gating_linear)
    calls `te_general_gemm` unless it is None, but moe_utils binds the name only when TE imports, so every MoE
    forward would raise NameError. Bound to None, the router takes its torch matmul. Idempotent."""
    from megatron.core.transformer.moe import moe_utils

    if not getattr(moe_utils, "HAVE_TE", True) or not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def patch_mla_without_te() -> None:
    """Without Transformer Engine, on any device: megatron-core's multi-latent attention imports TE's layer
    classes from its extensions module, which then hands back mock stand-ins instead of failing, so MLA believes
    TE is present (HAVE_TE) and `isinstance(layer, TELinear)` raises TypeError on a mock. Told the truth, it
    builds and runs its local layers. Idempotent."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        from megatron.core.transformer import multi_latent_attention

        multi_latent_attention.HAVE_TE = False


def patch_optimizer_config_without_te() -> None:
    """Without Transformer Engine, on any device: megatron-core's OptimizerConfig asks TE's version whenever
    `use_precision_aware_optimizer` is set, also for its HybridDeviceOptimizer (optim.cpu_offload), which needs no
    TE; without TE that version is None and the comparison raises TypeError. Told the truth (no TE, so not TE
    2.1), it turns off `store_param_remainders`, a TE FusedAdam feature megarl never asks for with the offloading
    optimizer. Idempotent."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        from megatron.core.optimizer import optimizer_config

        optimizer_config.is_te_min_version = lambda version, check_equality=True: False


def _patch_hybrid_device_optimizer() -> None:
    from megatron.core import optimizer
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    class HostSteppedOnCpu(HybridDeviceOptimizer):
        """megatron-core's HybridDeviceOptimizer (optim.cpu_offload) on a machine whose device is the CPU.

        It steps the first `offload_fraction` of its parameters (by element count, in group order) on a host
        copy with a host optimizer, copying the gradients over before and the updated values back after, and
        the rest on the device. It tells the two apart by `param.is_cuda` and pins its host copies: on the CPU
        no parameter is on CUDA, so none would get a host copy, every one would land in the host optimizer
        without a device twin, and the first step would fail looking that twin up (KeyError); pinning needs
        CUDA too. Here the parameters it is given are the device's and the offloaded ones get a plain host
        copy: the same copies, hooks and steps as on a GPU."""

        def __init__(self, params, **kwargs):
            super().__init__(params, **{**kwargs, "pin_cpu_grads": False, "pin_cpu_params": False})

        def _get_sub_optimizer_param_groups(self, offload_fraction: float):
            """The split, every parameter given taken as a device one: (host groups, device groups, parameter
            -> host copy, host copy -> parameter, 16-bit parameter -> fp32 copy)."""
            params = [param for group in self.param_groups for param in group["params"]]
            threshold = offload_fraction * sum(param.numel() for param in params)
            offloaded = 0
            host_groups, device_groups, to_host, to_device, to_fp32 = [], [], {}, {}, {}
            for group in self.param_groups:
                host, device = {**group, "params": []}, {**group, "params": []}
                for param in group["params"]:
                    inner, side = param, device
                    if offloaded < threshold:
                        inner, side = param.detach().clone(), host
                        offloaded += param.numel()
                    if self.param_update_in_fp32 and inner.dtype != torch.float32:
                        inner = to_fp32[param] = inner.detach().float()
                    if side is host:
                        to_host[param], to_device[inner] = inner, param
                    side["params"].append(inner)
                host_groups += [host] if host["params"] else []
                device_groups += [device] if device["params"] else []
            return host_groups, device_groups, to_host, to_device, to_fp32

    # the class megatron-core's optimizer factory builds, and the one the distributed optimizer builds again
    # over its shards and tests with isinstance
    optimizer.HybridDeviceOptimizer = distrib_optimizer.HybridDeviceOptimizer = HostSteppedOnCpu


def _patch_moe_without_te() -> None:
    patch_moe_router_without_te()
    original = torch.distributed.all_to_all_single

    @functools.wraps(original)
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        to_list = lambda sizes: None if sizes is None else [int(s) for s in sizes]  # noqa: E731
        return original(output, input, to_list(output_split_sizes), to_list(input_split_sizes), *args, **kwargs)

    torch.distributed.all_to_all_single = all_to_all_single
    torch.distributed.all_gather = _all_gather_uneven(torch.distributed.all_gather)


def _all_gather_uneven(original):
    """`all_gather` that also takes tensors of different lengths (dim 0) per rank, which gloo refuses.

    With tensor and sequence parallelism, the alltoall MoE dispatcher gathers each TP rank's routed tokens
    over the (expert) tensor-parallel group, as many as its router sent: uneven. Each rank's length is known
    from its output slot, so the rows are padded to the longest, gathered, and cut back."""

    @functools.wraps(original)
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        rows = [t.shape[0] if t.dim() else None for t in tensor_list]
        if len(set(rows)) == 1 or None in rows:
            return original(tensor_list, tensor, group=group, async_op=async_op)
        if async_op:
            raise NotImplementedError("asynchronous all_gather of tensors of different lengths on the CPU")
        longest = max(rows)
        padded = torch.cat([tensor, tensor.new_zeros(longest - tensor.shape[0], *tensor.shape[1:])])
        gathered = [torch.empty_like(padded) for _ in tensor_list]
        original(gathered, padded.contiguous(), group=group)
        for out, full, n in zip(tensor_list, gathered, rows):
            out.copy_(full[:n])
        return None

    return all_gather


def _patch_adam_step_restore() -> None:
    # Without apex or Transformer Engine the distributed optimizer wraps torch Adam, whose state has a
    # `step` next to the moments. Restoring a checkpoint, Megatron puts `step` back into that state and then
    # copies every state key from the loaded shards, which hold only the parameter and the moments: a
    # KeyError. Copy the keys the shards have; `step` is already set, but as ONE tensor shared by every
    # parameter, which torch Adam increments in place once per parameter: give each its own copy. The
    # offloading optimizer (optim.cpu_offload, the precision-aware path) takes the shards by key, as Megatron
    # gives them, and has the same shared `step`.
    from megatron.core.optimizer import distrib_optimizer

    dist_opt = distrib_optimizer.DistributedOptimizer
    original = dist_opt._set_main_param_and_optimizer_states

    @functools.wraps(original)
    def set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state[main_param]
        if "step" not in state or "step" in tensors:
            return original(self, model_param, tensors)
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            original(self, model_param, tensors)
        else:
            main_param.detach().copy_(tensors["param"])
            for key, value in state.items():
                if key != "step":
                    value.copy_(tensors[key])
        state["step"] = state["step"].clone()

    dist_opt._set_main_param_and_optimizer_states = set_states
