"""The device check's probes, each in its own process so that check.py can bound it (tools/device_check/check.py
runs them; each writes its figures to the JSON file --json names and exits 1 when what it proves does not hold):

    torchrun --standalone --nproc_per_node=N probes.py world --json PATH
    probes.py memory_saver --json PATH --bytes N [--mode preload|torch] [--wheels DIR]
    probes.py pinned --json PATH --bytes N --work DIR
    probes.py export --json PATH DIR

world: megarl's `init_parallel` world and every Megatron group it makes carry gloo for host tensors and NCCL for
  device tensors (on the CPU: gloo for both); a sum of host tensors, a sum of device tensors, the object
  collectives and a barrier work on each; a group of NCCL alone refuses a host tensor, with the message the CPU
  emulation of tests/gpu_world_worker.py gives.
memory_saver: what SGLang's release and resume (torch_memory_saver's pause and resume of its "weights" region)
  do to the weights: the pause gives the device memory back; after the resume, a region without a CPU backup
  holds whatever the new pages hold (the trainer wrote its own data there in between), one with a backup holds
  its weights again. On the CPU, a stand-in with the same calls (storages freed and allocated again, megarl's
  CPU release) runs the same probe, and the carried wheel's API is read without loading its CUDA library.
pinned: the page-locked host memory behind one park of the trainer's state, in torch's caching host allocator
  (which rounds every block up to a power of two) and in megarl's offload buffer (cudaHostRegister of a plain
  buffer: the bytes asked for); the time to pin and the copy rates both ways; then megarl's TrainerMemory on the
  engine offload test's model: the device bytes it gave back, the host bytes its buffers hold (`host_bytes`)
  and what torch's allocator pinned for them (none: the buffers are registered, not allocated by torch).
export: transformers loads an HF export and computes finite logits with it.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def write(path: str, figures: dict) -> int:
    """The figures to `path`; the exit status: 1 when they name problems."""
    Path(path).write_text(json.dumps(figures, indent=2, default=str))
    return 1 if figures.get("problems") else 0


# ---- world -------------------------------------------------------------------------------------------------
def megatron_groups(groups) -> dict[str, object]:
    """Every group a training step may use: megarl's (ParallelGroups) and Megatron's own, by name; a getter
    that this megatron-core lacks or that leaves this rank out is skipped."""
    from megatron.core import parallel_state as ps

    named = {"world": lambda: torch.distributed.group.WORLD, "tp": lambda: groups.tp, "pp": lambda: groups.pp,
             "dp": lambda: groups.dp, "mp": lambda: groups.mp, "ep": lambda: groups.ep, "cp": lambda: groups.cp,
             "dp_cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
             "tp_dp": lambda: ps.get_tensor_and_data_parallel_group(),
             "expert_tp": lambda: ps.get_expert_tensor_parallel_group(),
             "expert_dp": lambda: ps.get_expert_data_parallel_group(),
             "embedding": lambda: ps.get_embedding_group()}
    found = {}
    for name, get in named.items():
        with contextlib.suppress(AttributeError, AssertionError, RuntimeError, TypeError):
            group = get()
            if group is not None and torch.distributed.get_rank() in torch.distributed.get_process_group_ranks(group):
                found[name] = group
    return found


def probe_group(group, *, cuda: bool) -> dict:
    """The backends `group` routes host and device tensors to, and whether each kind of collective gives the
    right result on it. Every rank of the world calls this for every group, in the same order."""
    import torch.distributed as dist

    from megarl.device import host_barrier

    ranks = dist.get_process_group_ranks(group)
    rank = dist.get_rank()
    want = float(sum(r + 1 for r in ranks))
    r = {"ranks": ranks, "problems": []}
    for device in ("cpu", "cuda") if cuda else ("cpu",):
        with contextlib.suppress(RuntimeError):
            r[f"{device}_backend"] = type(group._get_backend(torch.device(device))).__name__
    host = torch.tensor([rank + 1.0], dtype=torch.float64)
    dist.all_reduce(host, group=group)
    r["host_sum"] = host.item()
    if cuda:
        device_sum = torch.tensor([rank + 1.0], device="cuda")
        dist.all_reduce(device_sum, group=group)
        torch.cuda.synchronize()
        r["device_sum"] = device_sum.item()
    gathered = [None] * len(ranks)
    dist.all_gather_object(gathered, {"rank": rank}, group=group)
    sent = [{"from": min(ranks)} if rank == min(ranks) else None]
    dist.broadcast_object_list(sent, src=min(ranks), group=group)
    dist.barrier(group=group)
    host_barrier(group)  # megarl's own wait: a host tensor, so gloo on every world
    with contextlib.suppress(Exception):
        r["object_device"] = str(dist.distributed_c10d._get_object_coll_device(group))
    if r["host_sum"] != want or r.get("device_sum", want) != want:
        r["problems"].append(f"sums {r['host_sum']} (host), {r.get('device_sum')} (device), expected {want}")
    if [g["rank"] for g in gathered] != ranks or sent != [{"from": min(ranks)}]:
        r["problems"].append(f"object collectives gave {gathered} and {sent}")
    expected = {"cpu_backend": "ProcessGroupGloo"} | ({"cuda_backend": "ProcessGroupNCCL"} if cuda else {})
    for key, name in expected.items():
        if r.get(key) != name:
            r["problems"].append(f"{key} {r.get(key)}, expected {name}")
    return r


def refusal(backend: str) -> str | None:
    """What a group of `backend` alone says to a host tensor: None when it sums it."""
    import torch.distributed as dist

    group = dist.new_group(list(range(dist.get_world_size())), backend=backend)
    try:
        dist.all_reduce(torch.ones(1), group=group)
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return None


def world(args) -> int:
    import torch.distributed as dist

    from megarl.device import on_gpu
    from megarl.engine.parallel import init_parallel, world_backend

    cuda = on_gpu()
    start = time.monotonic()
    groups = init_parallel(tp=1, pp=1, seed=0)
    figures = {"world_size": dist.get_world_size(), "backend": dist.get_backend_config(),
               "init_s": round(time.monotonic() - start, 2), "problems": []}
    want = {"gloo": "cpu:gloo,cuda:gloo"}.get(world_backend(cuda), world_backend(cuda))  # torch's spelling
    if figures["backend"] != want:
        figures["problems"].append(f"world backend {figures['backend']}, megarl starts {want}")
    if cuda:
        nccl = torch.cuda.nccl.version()
        figures["nccl_version"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    figures["groups"] = {}
    for name, group in megatron_groups(groups).items():
        r = figures["groups"][name] = probe_group(group, cuda=cuda)
        figures["problems"] += [f"{name}: {p}" for p in r.pop("problems")]
    # NCCL alone refuses host tensors; the CPU tests emulate it with gloo limited to CUDA devices
    # (tests/gpu_world_worker.py), which must refuse them in the same words.
    figures["refusal_emulated"] = refusal("cuda:gloo")
    if cuda:
        figures["refusal_nccl"] = refusal("nccl")
        if figures["refusal_nccl"] is None or figures["refusal_nccl"] != figures["refusal_emulated"]:
            figures["problems"].append(f"NCCL said {figures['refusal_nccl']!r} to a host tensor, the CPU emulation "
                                       f"{figures['refusal_emulated']!r}")
    elif figures["refusal_emulated"] is None:
        figures["problems"].append("gloo limited to CUDA devices summed a host tensor")
    figures["seconds"] = round(time.monotonic() - start, 2)
    status = 0
    if dist.get_rank() == 0:
        status = write(args.json, figures)
    dist.barrier()
    dist.destroy_process_group()
    return status


# ---- memory_saver --------------------------------------------------------------------------------------
class StorageSaver:
    """torch_memory_saver's region, pause and resume for CPU tensors (the dry run): a tensor made inside a
    region is paused by freeing its storage (after copying it aside when the region keeps a CPU backup) and
    resumed into newly allocated memory, whose contents are whatever the allocator hands out; megarl's CPU
    release does the same to a rollout engine's weights."""

    def __init__(self):
        self._made: dict[str, list[tuple[torch.Tensor, bool]]] = {}
        self._backups: dict[int, torch.Tensor] = {}

    @contextlib.contextmanager
    def region(self, tag: str = "default", enable_cpu_backup: bool = False):
        saver = self

        class Made(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func is torch.empty:
                    saver._made.setdefault(tag, []).append((out, enable_cpu_backup))
                return out

        with Made():
            yield

    def pause(self, tag: str) -> None:
        for tensor, backup in self._made[tag]:
            storage = tensor.untyped_storage()
            if backup:
                self._backups[id(tensor)] = tensor.view(torch.uint8).clone()
            storage.resize_(0)

    def resume(self, tag: str) -> None:
        for tensor, backup in self._made[tag]:
            nbytes = tensor.numel() * tensor.element_size()
            tensor.untyped_storage().resize_(nbytes)
            if backup:
                tensor.view(torch.uint8).copy_(self._backups.pop(id(tensor)))


def wheel_api(wheels: Path) -> dict:
    """The signatures probe_memory_saver relies on, read from the carried wheel's Python (zipimport loads
    its modules, not its CUDA libraries)."""
    found = sorted(wheels.glob("torch_memory_saver-*.whl"))
    if not found:
        return {"checked": False, "why": f"no torch_memory_saver wheel in {wheels}"}
    sys.path.insert(0, str(found[-1]))  # a wheel is a zip: its pure-Python modules import from it
    try:
        import torch_memory_saver
        from torch_memory_saver.entrypoint import TorchMemorySaver
    finally:
        sys.path.pop(0)
    params = {name: list(inspect.signature(getattr(TorchMemorySaver, name)).parameters)
              for name in ("region", "pause", "resume")}
    problems = [f"{name} takes {p}" for name, p in params.items()
                if "tag" not in p or (name == "region" and "enable_cpu_backup" not in p)]
    if not isinstance(getattr(TorchMemorySaver, "hook_mode", None), property):
        problems.append("no hook_mode setter")
    if not hasattr(torch_memory_saver, "torch_memory_saver"):
        problems.append("no torch_memory_saver singleton")
    return {"checked": True, "wheel": found[-1].name, "params": params, "problems": problems}


def probe_memory_saver(saver, *, nbytes: int, device: str, held_bytes) -> dict:
    """One "weights" region without and one with a CPU backup, each filled with random words, paused, its
    memory taken and written by someone else (the trainer, between SGLang's release and resume), freed,
    resumed and read back. `held_bytes()`: the device memory held now, None where it cannot be read."""
    scribble = int.from_bytes(b"\x5a" * 8, "little", signed=True)  # every byte 0x5A, as one int64 word
    out = {}
    for backup in (False, True):
        tag = "weights_backup" if backup else "weights"
        with saver.region(tag=tag, enable_cpu_backup=backup):
            weights = torch.empty(nbytes // 8, dtype=torch.int64, device=device)
        weights.random_(generator=torch.Generator(device).manual_seed(1))
        sync(device)
        held = [held_bytes()]
        t0 = time.perf_counter()
        saver.pause(tag)
        sync(device)
        pause_s = time.perf_counter() - t0
        held.append(held_bytes())
        other = torch.full((nbytes,), 0x5A, dtype=torch.uint8, device=device)  # the trainer's own data
        sync(device)
        del other
        if device == "cuda":
            torch.cuda.empty_cache()
        t0 = time.perf_counter()
        saver.resume(tag)
        sync(device)
        resume_s = time.perf_counter() - t0
        held.append(held_bytes())
        want = torch.empty_like(weights).random_(generator=torch.Generator(device).manual_seed(1))
        r = {"cpu_backup": backup, "bytes": nbytes, "pause_s": round(pause_s, 4), "resume_s": round(resume_s, 4),
             **{f"{name}_fraction": (weights == value).sum().item() / weights.numel()
                for name, value in (("kept", want), ("zero", 0), ("scribble", scribble))}}
        if None not in held:
            r["freed_on_pause_bytes"], r["back_on_resume_bytes"] = held[0] - held[1], held[2] - held[1]
        out[tag] = r
        del weights, want
    return out


def memory_saver_problems(r: dict) -> list[str]:
    """What SGLang's release and resume rely on and the probe did not see: the pause gives back (almost) all
    of a region's bytes and the resume takes them again; a region with a CPU backup comes back word for word.
    What comes back without a backup is the finding, not a failure."""
    problems = []
    for tag, m in r.items():
        if "freed_on_pause_bytes" in m:
            if m["freed_on_pause_bytes"] < 0.9 * m["bytes"]:
                problems.append(f"{tag}: the pause freed {m['freed_on_pause_bytes']} of {m['bytes']} bytes")
            if m["back_on_resume_bytes"] < 0.9 * m["bytes"]:
                problems.append(f"{tag}: the resume took {m['back_on_resume_bytes']} of {m['bytes']} bytes")
        if m["cpu_backup"] and m["kept_fraction"] != 1.0:
            problems.append(f"{tag}: {m['kept_fraction']:.2%} of the words kept with a CPU backup")
    return problems


def preload_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with torch_memory_saver's preload library first in LD_PRELOAD (what SGLang's `configure_subprocess`
    does for its scheduler) and the directory of the libcudart this torch loaded on LD_LIBRARY_PATH: the
    library needs it before the interpreter starts, and a pip-installed CUDA runtime is on no default path."""
    from torch_memory_saver.utils import get_binary_path_from_package

    lib = str(get_binary_path_from_package("torch_memory_saver_hook_mode_preload"))
    torch.cuda.is_available()  # loads libcudart
    maps = Path("/proc/self/maps").read_text().splitlines()
    cudart = {Path(line.split()[-1]).parent for line in maps if "libcudart.so" in line.split()[-1]}
    paths = [str(p) for p in sorted(cudart)] + [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]
    preload = [lib] + [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    return env | {"LD_PRELOAD": ":".join(preload), "LD_LIBRARY_PATH": ":".join(paths)}


def memory_saver(args) -> int:
    cuda = torch.cuda.is_available()
    figures: dict = {"device": "cuda" if cuda else "cpu", "problems": []}
    if args.wheels:
        figures["wheel_api"] = api = wheel_api(Path(args.wheels))
        figures["problems"] += api.get("problems", [])
    if cuda:
        from importlib.metadata import version

        import torch_memory_saver as tms

        if args.mode == "preload" and "torch_memory_saver" not in os.environ.get("LD_PRELOAD", ""):
            os.execve(sys.executable, [sys.executable, *sys.argv], preload_env(dict(os.environ)))
        saver = tms.torch_memory_saver
        saver.hook_mode = args.mode
        figures |= {"saver": f"torch_memory_saver {version('torch_memory_saver')}", "hook_mode": args.mode}

        def held_bytes() -> int:
            free, total = torch.cuda.mem_get_info()
            return total - free
    else:
        saver, held_bytes = StorageSaver(), lambda: None
        figures["saver"] = "CPU stand-in (storage freed, then allocated again)"
    figures["regions"] = r = probe_memory_saver(saver, nbytes=args.bytes, device=figures["device"],
                                                held_bytes=held_bytes)
    figures["problems"] += memory_saver_problems(r)
    status = write(args.json, figures)
    if cuda:
        # Gone at once: what torch_memory_saver's pools do as the interpreter tears down is not what this
        # probes (SGLang's processes are ended, not torn down), and a crash there would hide the figures.
        sys.stdout.flush()
        os._exit(status)
    return status


# ---- pinned --------------------------------------------------------------------------------------------
def host_stats() -> dict[str, int]:
    """torch's caching host allocator: the bytes of the pinned blocks it holds, and its time in cudaHostAlloc
    (microseconds); {} where torch does not say."""
    stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    # the name of the rounded bytes held has changed between torch releases
    held = next((stats[k] for k in ("allocated_bytes.current", "reserved_bytes.current", "segment_bytes.current")
                 if k in stats), None)
    return {} if held is None else {"held_bytes": held, "alloc_us": stats.get("host_alloc_time.total", 0)}


def mem_available_bytes() -> int:
    """The host's MemAvailable: page-locked memory leaves it, whether or not the process's RSS counts it."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def copy_rates(host: torch.Tensor, device: torch.Tensor, reps: int = 2) -> dict[str, float]:
    """GB/s of device -> host and host -> device copies of the whole buffer (the best of `reps`)."""
    rates = {}
    for name, dst, src in (("d2h_gb_s", host, device), ("h2d_gb_s", device, host)):
        best = float("inf")
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        rates[name] = round(host.numel() / best / 1e9, 2)
    return rates


def park(nbytes: int) -> dict:
    """One park of `nbytes` from the device: into torch's pinned allocator (`pin_memory=True`) and into megarl's
    offload buffer (`megarl.engine.offload._host_buffer`: cudaHostRegister of a plain buffer); the bytes each
    page-locks, its time and the copy rates. Without CUDA nothing is page-locked, which the figures say."""
    out = {"requested_bytes": nbytes}
    if not torch.cuda.is_available():
        return out | {"no_cuda": "nothing is page-locked on the CPU: the offload's host buffers are plain memory"}
    device = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    before, avail = host_stats(), mem_available_bytes()
    t0 = time.perf_counter()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    alloc_s = time.perf_counter() - t0
    after = host_stats()
    torch_pinned = {"alloc_s": round(alloc_s, 3), "host_left_bytes": avail - mem_available_bytes()}
    if after:
        torch_pinned |= {"pinned_bytes": after["held_bytes"] - before["held_bytes"],
                         "cuda_host_alloc_s": round((after["alloc_us"] - before["alloc_us"]) / 1e6, 3)}
    out["torch_pin_memory"] = torch_pinned | copy_rates(host, device)
    del host
    if hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()  # the cached block back to the driver before the next measurement
    from megarl.engine.offload import _host_buffer

    avail = mem_available_bytes()
    t0 = time.perf_counter()
    try:
        buffer = _host_buffer(nbytes)  # unregistered when it is freed
    except RuntimeError as e:  # the CUDA error cudaHostRegister returned
        out["cuda_host_register"] = {"error": str(e)}
        return out
    register_s = time.perf_counter() - t0
    plain = torch.empty(0, dtype=torch.uint8).set_(buffer)
    out["cuda_host_register"] = {"register_s": round(register_s, 3), "host_left_bytes": avail - mem_available_bytes(),
                                 "is_pinned": plain.is_pinned()} | copy_rates(plain, device)
    return out


def trainer_offload(work: Path) -> dict:
    """The engine offload test's model (tests/test_engine.py: tiny Qwen2, bf16 on a GPU, trained one step),
    offloaded whole: the device bytes TrainerMemory gave back, the host bytes its buffers hold, and the bytes
    torch's allocator pinned for them."""
    sys.path.insert(0, str(REPO / "tools"))
    from make_tiny_model import make_tiny_model

    from megarl.config import OptimConfig
    from megarl.engine.megatron import TrainEngine
    from megarl.models.arch import read_shape
    from megarl.engine.parallel import init_parallel

    cuda = torch.cuda.is_available()
    model_dir = make_tiny_model(work / "offload_qwen2", arch="qwen2", seed=0)
    groups = init_parallel(tp=1, pp=1, seed=0)
    optim = OptimConfig(lr=1e-3, weight_decay=0.0, grad_clip=1.0, distributed=True)
    # Megatron's compiled fusions off: they change no buffer, and their compile would eat the stage's budget.
    fusions = ("bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion", "gradient_accumulation_fusion")
    engine = TrainEngine(model_dir=str(model_dir), shape=read_shape(str(model_dir)), dtype="bfloat16" if cuda else "float32",
                         megatron=dict.fromkeys(fusions, False), groups=groups, optim=optim)
    tokens = torch.randint(3, 98, (4, 16), generator=torch.Generator().manual_seed(1234))
    mask = torch.zeros(tokens.shape)
    mask[:, 5:] = 1.0

    def loss_fn(logprobs, mb):
        loss = -(logprobs * mb["response_mask"]).sum() / mask.sum()
        return loss, {"loss": loss.detach()}

    engine.train_step(tokens, {"response_mask": mask}, loss_fn, temperature=1.0, micro_batch_size=2)
    before = host_stats() if cuda else {}
    freed = engine.offload_training_state() + engine.offload_params()
    memory = engine.memory
    out = {"model": "tiny qwen2 (tools/make_tiny_model.py defaults), " + ("bf16" if cuda else "fp32"),
           "freed_bytes": freed, "offloaded_bytes": memory.offloaded_bytes,
           "host_bytes": memory.host_bytes, "host_buffers": len(memory._hosts)}
    if before:
        out["pinned_bytes"] = host_stats()["held_bytes"] - before["held_bytes"]
    engine.onload()
    return out


def pinned(args) -> int:
    figures = {"park": park(args.bytes), "problems": []}
    figures["trainer"] = t = trainer_offload(Path(args.work))
    if t["offloaded_bytes"] <= 0 or t["freed_bytes"] != t["offloaded_bytes"]:
        figures["problems"].append(f"TrainerMemory freed {t['freed_bytes']} bytes, says {t['offloaded_bytes']}")
    for how in ("torch_pin_memory", "cuda_host_register"):
        r = figures["park"].get(how, {})
        if r.get("error"):
            figures["problems"].append(f"{how}: cudaError {r['error']}")
    return write(args.json, figures)


# ---- export ----------------------------------------------------------------------------------------------
def export(args) -> int:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.dir).eval()
    tokens = torch.randint(3, 98, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(tokens).logits
    figures = {"dtype": str(model.dtype), "params": sum(p.numel() for p in model.parameters()),
               "logits_finite": bool(torch.isfinite(logits).all()), "problems": []}
    if not figures["logits_finite"]:
        figures["problems"].append("non-finite logits")
    return write(args.json, figures)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="probe", required=True)
    p = sub.add_parser("world")
    p.add_argument("--json", required=True)
    p = sub.add_parser("memory_saver")
    p.add_argument("--json", required=True)
    p.add_argument("--bytes", type=int, required=True, help="bytes of each region")
    p.add_argument("--mode", choices=("preload", "torch"), default="preload",
                   help="torch_memory_saver's hook: preload (SGLang's, LD_PRELOAD) or torch (a pluggable allocator)")
    p.add_argument("--wheels", help="a folder whose torch_memory_saver wheel's API is read")
    p = sub.add_parser("pinned")
    p.add_argument("--json", required=True)
    p.add_argument("--bytes", type=int, required=True, help="bytes of the one park")
    p.add_argument("--work", required=True, help="a scratch folder for the model")
    p = sub.add_parser("export")
    p.add_argument("--json", required=True)
    p.add_argument("dir")
    args = parser.parse_args(argv)
    return {"world": world, "memory_saver": memory_saver, "pinned": pinned, "export": export}[args.probe](args)


if __name__ == "__main__":
    sys.exit(main())
