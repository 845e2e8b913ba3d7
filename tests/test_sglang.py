"""The real SGLang engine (CPU mode here) against the Megatron trainer: weight push, logprob parity, EOS,
the loop; the GPU-only paths (CUDA IPC push, memory release, trainer offload) on a CUDA machine.

These run in the SGLang environment (SGLang pins its own torch; see the README's SGLang test command).
Each check runs in a subprocess, because an exception in SGLang's scheduler kills the whole process tree.
GPU tests are marked `gpu` and skipped without CUDA; tools/gpu_check.sh runs them.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import REPO, _tiny_model_tool, needs_cuda, run_python

pytest.importorskip("sglang", reason="SGLang environment not installed (README: SGLang tests)")

SGLANG_TIMEOUT_S = 600  # engine start-up is 15-70 s on 2 busy cores; a hang fails instead of stalling CI


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ---- the SGLang and Megatron APIs megarl calls -----------------------------------------------------------
# GPU-only calls cannot run here; these checks make a release that renames or drops a method or parameter
# fail on CPU instead of on a GPU run.
def test_sglang_engine_api_takes_the_arguments_megarl_passes():
    """Every SGLang call megarl makes binds the arguments it passes (tools/check_engine.py's `api` check, in
    this process)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_engine", REPO / "tools" / "check_engine.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.api_check()[0] == "PASS"


def test_trainer_offload_round_trip_under_the_torch_of_gpu_runs(qwen2_dir):
    # SGLang's torch is the one GPU runs use: the storage resizes and host copies of megarl.engine.offload
    # must free and restore the same bytes under it (tests/test_handover.py checks more under the CPU build).
    code = f"""
import torch
from megarl.config import OptimConfig
from megarl.engine.megatron import TrainEngine
from megarl.models.arch import read_shape
from megarl.engine.parallel import init_parallel
groups = init_parallel(tp=1, pp=1)
tokens = torch.randint(3, 30, (2, 8), generator=torch.Generator().manual_seed(0))
mask = torch.ones(2, 8)
def loss_fn(logprobs, mb):
    loss = -(logprobs * mb["mask"]).mean()
    return loss, {{"loss": loss.detach()}}
for distributed in (True, False):
    engine = TrainEngine(model_dir={str(qwen2_dir)!r}, shape=read_shape({str(qwen2_dir)!r}), dtype="float32", megatron={{}}, groups=groups,
                         optim=OptimConfig(distributed=distributed))
    engine.train_step(tokens, {{"mask": mask}}, loss_fn, temperature=1.0, micro_batch_size=2)
    want = engine.logprobs(tokens, temperature=1.0, micro_batch_size=2)
    freed = engine.offload_training_state() + engine.offload_params()
    assert all(p.untyped_storage().nbytes() == 0 for p in engine.module.parameters())
    assert freed >= 16 * sum(p.numel() for p in engine.module.parameters()), freed
    engine.onload()
    assert torch.equal(engine.logprobs(tokens, temperature=1.0, micro_batch_size=2), want)
print("ok")
"""
    proc = run_python(["-c", code], timeout_s=180)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-4000:]


PAYLOADS_WORKER = """
import sys
import torch
import torch.distributed as dist
from sglang.srt.utils import MultiprocessingSerializer
from megarl.device import current_device
from megarl.device import host_barrier
from megarl.rollout.sglang_transfer import SGLangPeer, gather_payloads

dist.init_process_group("gloo")
rank = dist.get_rank()
group = dist.new_group([0, 1])
# each rank's copy differs, so the host can tell whose payload it got
buckets = [[("w", torch.full((3, 4), float(rank + 2 * n))), ("b", torch.arange(5, dtype=torch.int64) + 10 * rank)]
           for n in range(2)]
if rank == 0:  # the host's side of SGLangEngine.update_weights, reading each payload as a scheduler would
    for n, bucket in enumerate(buckets):
        gathered, flat, slots = gather_payloads(bucket, group=group)
        assert len(gathered) == 2
        for k, payload in enumerate(gathered):
            theirs = MultiprocessingSerializer.deserialize(payload)
            assert theirs.device == current_device(), theirs.device
            tensors = {name: theirs[start:end].view(dtype).view(shape) for name, shape, dtype, start, end in slots}
            assert torch.equal(tensors["w"], torch.full((3, 4), float(k + 2 * n))), (k, tensors["w"])
            assert torch.equal(tensors["b"], torch.arange(5) + 10 * k), (k, tensors["b"])
    host_barrier(group)
else:
    stats = SGLangPeer(group).push([t for bucket in buckets for t in bucket], bucket_bytes=100)
    assert stats == {"bytes": 2 * (12 * 4 + 5 * 8)}, stats
sys.stdout.write(f"ok {rank}\\n")  # one write: the ranks share a pipe, and print's separate writes interleave
"""


def test_every_rank_of_an_engines_group_serializes_its_own_copy_for_the_tp_rank_on_its_device(tmp_path):
    """The push's payload for SGLang TP rank k is made by the trainer rank on TP rank k's device (its own copy,
    in its own memory), gathered to the host in TP-rank order; on a GPU the receiving scheduler then opens
    memory on its own device instead of on the host's."""
    script = tmp_path / "payloads.py"
    script.write_text(PAYLOADS_WORKER)
    proc = run_python(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
                      timeout_s=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ok 0" in proc.stdout and "ok 1" in proc.stdout


TP_CHECKS_WORKER = """
import json
import sys

import torch
import torch.distributed as dist

from megarl.handoff import WeightMismatch, push_weights
from megarl.models.arch import read_shape
from megarl.models.safetensors_dir import SafetensorsDir
from megarl.rollout.sglang_engine import SGLangEngine
from megarl.rollout.sglang_transfer import SGLangPeer


def main(model_dir, out):
    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), dist.new_group([0, 1])
    checkpoint = SafetensorsDir(model_dir)
    pushes = [[(name, checkpoint.get(name) * (1 + p / 10)) for name in sorted(checkpoint.names())] for p in (1, 2)]
    if rank == 1:  # this rank's copy of one tensor differs in the second push (a trainer rank out of step)
        pushes[1] = [(name, t + 1 if name == "model.norm.weight" else t) for name, t in pushes[1]]
    every = dict(bucket_bytes=1 << 16, verify=lambda index: True)
    if rank == 0:
        engine = SGLangEngine(model_dir, shape=read_shape(model_dir), tp_size=2, group=group)
        result = {"tensors": len(pushes[0]), "verified": push_weights(engine, pushes[0], version=1, **every)["verified"]}
        try:
            push_weights(engine, pushes[1], version=2, **every)
            result["mismatch"] = None
        except WeightMismatch as e:
            result["mismatch"] = str(e)
        engine.shutdown()
        with open(out, "w") as f:
            json.dump(result, f)
    else:
        peer = SGLangPeer(group)
        for push in pushes:
            peer.push(push, bucket_bytes=every["bucket_bytes"])


if __name__ == "__main__":
    main(*sys.argv[1:])
"""


@pytest.mark.timeout(SGLANG_TIMEOUT_S)
def test_a_push_at_rollout_tp_2_is_checked_on_both_tp_ranks_and_names_the_rank_that_differs(qwen2_dir, tmp_path):
    """An SGLang engine of two TP ranks on two trainer ranks (each hands the scheduler on its device its own copy):
    every tensor of a push is checked on both TP ranks (SGLang itself reads none of Qwen2's back), and when rank 1's
    copy of one tensor differs from the host's, the push fails naming the tensor and TP rank 1."""
    script, out = tmp_path / "tp_checks.py", tmp_path / "tp_checks.json"
    script.write_text(TP_CHECKS_WORKER)
    proc = run_python(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
                       str(qwen2_dir), str(out)], timeout_s=SGLANG_TIMEOUT_S - 60)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["verified"] == 2 * result["tensors"]
    assert result["mismatch"] is not None
    assert "SGLang TP rank 1 holds other weights than the trainer pushed: 'model.norm.weight' arrived" in \
        result["mismatch"], result["mismatch"]


def test_the_scheduler_side_check_records_where_each_piece_of_a_pushed_tensor_lands():
    """megarl.rollout.sglang_checks.load_bucket on a model whose loader shards as SGLang's do (narrow to this
    rank's rows and copy, chunk a fused tensor and assign, cast to the parameter's dtype, concatenate two tensors
    into one parameter as DeepSeek's fused q/kv-a projection is): every verified tensor is
    found where it was loaded; a tensor the loader skips, one overwritten by a later tensor, and one that arrived
    with other bytes than the header's fingerprint are each named."""
    from megarl.handoff import fingerprint, flatten
    from megarl.rollout import sglang_checks

    class ShardedModel:
        def __init__(self):
            self.qkv = torch.zeros(4, 3)             # this rank's rows of q and of k, fused
            self.norm = torch.zeros(3, dtype=torch.bfloat16)
            self.head = torch.zeros(2, 3)
            self.fused = torch.zeros(3, 3)           # two tensors concatenated, as a fused q/kv projection is
            self.cached = None

        def load_weights(self, stream):
            for name, w in stream:
                if name in ("a", "b"):                   # the first waits for the second, then both go in at once
                    if self.cached is None:
                        self.cached = w
                    else:
                        self.fused.copy_(torch.cat([self.cached, w]))
                if name == "q":
                    self.qkv[0:2].copy_(w.narrow(0, 2, 2))   # rank 1 of 2: rows 2..3
                elif name == "k":
                    self.qkv[2:4] = w.chunk(2)[1]
                elif name == "norm":
                    self.norm.copy_(w)                       # cast to bf16 on the way
                elif name == "clobber":
                    self.qkv[0].copy_(w)                     # writes over q's rows
                # "skipped": never loaded

    def push(bucket, *, corrupt: str | None = None):
        flat, slots = flatten(bucket)
        expected = {name: fingerprint(t) for name, t in bucket}
        if corrupt is not None:
            name, _, _, start, end = next(slot for slot in slots if slot[0] == corrupt)
            flat[start] ^= 1  # one bit of the buffer, after the trainer's fingerprint
        model = ShardedModel()
        sglang_checks.load_bucket(model, [(sglang_checks.header(slots, expected), flat)])
        checked, failures = sglang_checks._checked, list(sglang_checks._failures)
        sglang_checks._checked, sglang_checks._failures[:] = 0, []
        return model, checked, failures

    q, k, norm, a, b = torch.randn(4, 3), torch.randn(4, 3), torch.randn(3), torch.randn(1, 3), torch.randn(2, 3)
    model, checked, failures = push([("q", q), ("k", k), ("norm", norm), ("a", a), ("b", b)])
    assert (checked, failures) == (5, [])
    assert torch.equal(model.qkv, torch.cat([q[2:], k[2:]])) and torch.equal(model.norm, norm.bfloat16())
    assert torch.equal(model.fused, torch.cat([a, b]))
    _, checked, failures = push([("q", q), ("k", k), ("skipped", torch.randn(2)), ("clobber", torch.randn(3))])
    assert checked == 2 and len(failures) == 2  # k, clobber; q was overwritten, skipped never loaded
    assert "'q': a piece loaded into a parameter is not there after the bucket" in failures[0]
    assert "'skipped' was not loaded into any parameter" in failures[1]
    _, checked, failures = push([("q", q), ("k", k)], corrupt="k")
    assert checked == 1 and failures == ["'k' arrived with other bytes than the trainer pushed"]


# ---- CPU: push, parity, EOS ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen2_eos_dir(tmp_path_factory):
    """The seed-0 tiny Qwen2 with EOS made likely at every position (about 0.2 per token at temperature 1).

    Every token's embedding gets 1.0 in dimension 0, so the final hidden state is positive there (~8
    after the norm); the tied output row of EOS gets 0.43 more than the others in that dimension, which
    adds ~3.4 to the EOS logit and nothing else. Responses then end at EOS after 1-12 tokens.
    """
    from safetensors.torch import load_file, save_file

    out = _tiny_model_tool().make_tiny_model(tmp_path_factory.mktemp("eos") / "qwen2_eos", arch="qwen2", seed=0)
    tensors = load_file(out / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"]
    embed[:, 0] = 1.0
    embed[0, 0] = 1.43
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def push_result(qwen2_dir, qwen2_other_dir, qwen2_eos_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sglang") / "result.json"
    proc = run_python([str(REPO / "tests" / "sglang_worker.py"), "cpu", "--trainer-model", str(qwen2_dir),
                       "--other-model", str(qwen2_other_dir), "--eos-model", str(qwen2_eos_dir),
                       "--out", str(out)], timeout_s=SGLANG_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(SGLANG_TIMEOUT_S)
def test_engine_serves_its_checkpoint_before_a_push(push_result):
    # SGLang and transformers compute the same fp32 function: 1e-4 is the DESIGN bound (measured ~5e-7).
    assert push_result["before_vs_other_hf"] <= 1e-4
    assert push_result["before_vs_trainer"] > 1e-2  # the two models differ, so the next check can fail


@pytest.mark.timeout(SGLANG_TIMEOUT_S)
def test_after_a_push_sglang_logprobs_equal_the_trainers(push_result):
    assert push_result["push"]["buckets"] >= 5  # many small buckets, every tensor delivered
    assert push_result["after_vs_trainer"] <= 1e-4
    assert push_result["weight_version"] == 1
    assert push_result["stamped_versions"] == [1]  # SGLang stamps its responses with the version pushed
    assert push_result["logprob_lens_match"]
    assert set(push_result["finish_reasons"]) <= {"stop", "length"}
    for ids, reason in zip(push_result["response_ids"], push_result["finish_reasons"]):
        assert 1 <= len(ids) <= 8
        assert (reason == "stop") == (ids[-1] == 0)  # a stopped response ends with its EOS token


@pytest.mark.timeout(SGLANG_TIMEOUT_S)
def test_pushing_a_second_models_weights_reproduces_that_model(push_result):
    assert push_result["second_push_vs_other_hf"] <= 1e-4


@pytest.mark.timeout(SGLANG_TIMEOUT_S)
@pytest.mark.parametrize("engine", ["sglang", "native"])
def test_engines_stop_at_eos(push_result, engine):
    summary = push_result[f"eos_{engine}"]
    n = len(summary["lengths"])
    assert summary["eos_inside"] == 0  # nothing is generated after an EOS
    for length, reason, ends_with_eos in zip(summary["lengths"], summary["reasons"], summary["ends_with_eos"]):
        assert (reason == "stop") == ends_with_eos
        assert reason == "stop" or length == summary["max_new_tokens"]
    # With P(EOS) ~0.2 per token, a response reaches 12 tokens with probability ~0.07: most stop early
    # (measured 42 of 48 with the native engine); half is a bound no EOS-ignoring engine can meet.
    stopped_early = sum(r == "stop" and length < summary["max_new_tokens"]
                        for r, length in zip(summary["reasons"], summary["lengths"]))
    assert stopped_early >= n // 2, summary


@pytest.mark.timeout(SGLANG_TIMEOUT_S)
def test_sglang_checks_what_a_push_loaded_and_names_a_skipped_tensor(llama_dir, push_result, tmp_path):
    """SGLang 0.5.23 reads tensors back only for a few model classes (its Llama, not Qwen2); megarl's loader checks
    every verified tensor in the scheduler for any class: Llama's and Qwen2's pushes are checked whole, and a push
    handing the engine a tensor's old value is caught naming it."""
    out = tmp_path / "readback.json"
    proc = run_python([str(REPO / "tests" / "sglang_worker.py"), "readback", "--trainer-model", str(llama_dir),
                       "--out", str(out)], timeout_s=SGLANG_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["verified"] == result["tensors"]  # every pushed tensor found as pushed (one TP rank)
    assert result["mismatch"] is not None
    assert (f"SGLang TP rank 0 holds other weights than the trainer pushed: {result['skipped']!r} arrived with other "
            "bytes than the trainer pushed") in result["mismatch"]
    assert push_result["qwen2_verified"] == push_result["qwen2_tensors"] > 0


@pytest.mark.timeout(SGLANG_TIMEOUT_S)
def test_a_push_with_an_unknown_tensor_name_fails_loudly(push_result):
    assert push_result["bad_push_error"] is not None
    assert "model.layers.0.no_such.weight" in push_result["bad_push_error"]


@pytest.mark.timeout(SGLANG_TIMEOUT_S)
def test_adapters_pushed_alone_give_sglang_the_trainers_adapted_policy(qwen2_dir, tmp_path):
    """rollout.lora_sync: adapter. SGLang starts from the base model and takes only the LoRA policy's adapters
    (SGLang's LoRA serving; on CPU through megarl's SGLang plugin): its logprobs are the trainer's adapted
    policy's at fp32 parity (1e-4, the DESIGN bound; measured 5e-7), and far from the base model's, which shows
    the adapters are applied. A second push of other adapters replaces the first. The native engine, which
    merges what it is pushed, gives the same policy (measured 1.4e-6)."""
    out = tmp_path / "result.json"
    proc = run_python([str(REPO / "tests" / "sglang_worker.py"), "lora", "--trainer-model", str(qwen2_dir),
                       "--out", str(out)], timeout_s=SGLANG_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    for version in (1, 2):
        for engine in ("sglang", "native"):
            assert r[f"v{version}_{engine}_vs_trainer"] <= 1e-4, r
            assert r[f"v{version}_{engine}_vs_base"] > 0.1, r
            assert r[f"v{version}_{engine}_versions"] == [version], r
        assert r[f"v{version}_adapter_bytes"] < r["model_bytes"] / 5, r


# ---- CPU: MoE routes --------------------------------------------------------------------------------
def encode_routes(ids) -> str:
    """Routes as SGLang's meta_info carries them: base64 of int32 [rows, layers, top_k]."""
    import base64

    return base64.b64encode(torch.tensor(ids, dtype=torch.int32).numpy().tobytes()).decode()


def test_decoded_routes_are_cut_to_the_tokens_fed_in_and_anything_else_is_refused():
    from megarl.rollout.sglang_transfer import decode_routes

    rows = torch.arange(5 * 2 * 2).remainder(4).view(5, 2, 2)  # 5 rows, 2 layers, top-2 of 4 experts
    routes = decode_routes(encode_routes(rows), tokens=4, layers=2, top_k=2, experts=4)
    assert routes.dtype == torch.uint8 and routes.device.type == "cpu"
    assert torch.equal(routes.long(), rows[:4])  # a row past the last token fed in is dropped
    assert torch.equal(decode_routes(encode_routes(rows), tokens=5, layers=2, top_k=2, experts=4).long(), rows)
    with pytest.raises(RuntimeError, match="routes for 5 tokens; the prompt and response fed in 6"):
        decode_routes(encode_routes(rows), tokens=6, layers=2, top_k=2, experts=4)
    with pytest.raises(RuntimeError, match="not whole rows of 3 layers"):
        decode_routes(encode_routes(rows), tokens=4, layers=3, top_k=2, experts=4)
    with pytest.raises(RuntimeError, match="outside the model's 3 experts"):
        decode_routes(encode_routes(rows), tokens=4, layers=2, top_k=2, experts=3)
    with pytest.raises(RuntimeError, match="outside"):
        decode_routes(encode_routes(-rows - 1), tokens=4, layers=2, top_k=2, experts=4)
    with pytest.raises(RuntimeError, match="no routed_experts"):
        decode_routes(None, tokens=4, layers=2, top_k=2, experts=4)


@pytest.mark.timeout(SGLANG_TIMEOUT_S)
def test_capture_routes_is_refused_for_a_dense_model(qwen2_dir):
    # Refused before SGLang starts: a scheduler dying at start-up would take the caller with it.
    code = f"""
from megarl.rollout.sglang_engine import SGLangEngine
from megarl.models.arch import read_shape
try:
    SGLangEngine({str(qwen2_dir)!r}, shape=read_shape({str(qwen2_dir)!r}), capture_routes=True)
except ValueError as e:
    print("dense:", e)
"""
    proc = run_python(["-c", code], timeout_s=SGLANG_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "dense: capture_routes needs a mixture-of-experts model" in proc.stdout, proc.stdout


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def routes_result(request, arch_dir, tmp_path_factory):
    # Qwen2-MoE is left out: SGLang's CPU mode cannot serve it at all (its shared-expert gate is a Triton
    # kernel unless AMX is present: sglang/srt/models/qwen2_moe.py, use_fused_gate).
    out = tmp_path_factory.mktemp("routes") / "result.json"
    proc = run_python([str(REPO / "tests" / "sglang_routes_worker.py"), "--model", str(arch_dir(request.param)),
                       "--out", str(out)], timeout_s=SGLANG_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(SGLANG_TIMEOUT_S)
def test_sglang_routes_are_the_experts_transformers_routes_each_token_to(routes_result):
    r = routes_result
    # [len(prompt) + len(response) - 1, moe_layers, top_k] per sequence, uint8 for 4 experts, on the host.
    for got, contract in r["shapes"]:
        assert got == contract, r["shapes"]
    assert set(r["dtypes"]) == {"torch.uint8"} and r["devices"] == ["cpu"]
    # The second round's prompts came mostly from the prefix cache: their routes were recorded when the first
    # round computed those tokens, and must match all the same.
    assert r["cached_tokens"] > 0
    # Exact agreement of the expert set of every (token, layer): with these random weights no router comes
    # near a tie (smallest gap between the k-th and (k+1)-th router logit, measured: 3.6e-4 for qwen3_moe,
    # 5.0e-4 for mixtral), three orders of magnitude above the fp32 differences between SGLang's and
    # transformers' kernels, so a single differing set is a wrong row or layer, not rounding.
    assert r["min_topk_margin"] > 1e-5, r["min_topk_margin"]
    assert r["rows"] >= 200 and r["differing"] == 0, (r["differing"], r["rows"], r["differing_margins"])


def two_rank_sglang_run(model_dir, data_dir, run_dir, *overrides: str) -> list[dict]:
    """The metrics of a short quickstart GRPO run on two gloo ranks with SGLang rollouts; an entropy bonus moves
    the weights every step."""
    proc = run_python(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "megarl", "train",
                       str(REPO / "recipes" / "quickstart.yaml"), f"run_dir={run_dir}", f"model.path={model_dir}",
                       f"data.train_path={data_dir / 'train.jsonl'}", "data.eval_path=null",
                       "data.prompts_per_step=4", "rollout.n_samples=4", "rollout.max_new_tokens=4",
                       "rollout.engine=sglang", "warmup.sft_steps=0", "algo.entropy_coef=0.1", "optim.lr=1.0e-3",
                       "train.micro_batch_size=8", "checkpoint.save_final=false", "log.progress=false", *overrides],
                      timeout_s=SGLANG_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return read_metrics(run_dir)


@pytest.mark.timeout(SGLANG_TIMEOUT_S)
def test_both_pipeline_stages_run_an_sglang_engine_that_gets_every_update(qwen2_dir, arithmetic_dir, tmp_path):
    # pp = 2 on two gloo ranks: an SGLang engine on each rank (rollout.tp = 1), each generating half the
    # samples; an entropy bonus moves the weights every step, so a push a stale engine missed would show.
    lines = two_rank_sglang_run(qwen2_dir, arithmetic_dir, tmp_path / "run", "parallel.pp=2", "train.steps=2")
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert m["rollout/engines"] == 2, m
        assert m["rollout/logprob_diff_max"] <= 1e-4, m
        assert m["grad_norm"] > 0, m


@pytest.mark.timeout(SGLANG_TIMEOUT_S)
def test_split_placement_with_an_sglang_rollout_rank(qwen2_dir, arithmetic_dir, tmp_path):
    # One training rank and one SGLang rollout rank outside Megatron's world (placement split, max_staleness 0):
    # every step's weights reach SGLang through the gloo broadcast, so its logprobs equal the trainer's on every
    # step while an entropy bonus moves the weights (a missed or garbled push would show).
    lines = two_rank_sglang_run(qwen2_dir, arithmetic_dir, tmp_path / "run", "placement.mode=split",
                                "placement.rollout_ranks=1", "algo.max_staleness=0", "train.steps=3")
    assert [m["step"] for m in lines] == [1, 2, 3]
    for m in lines:
        assert m["rollout/engines"] == 1 and m["async/staleness_max"] == 0, m
        assert m["rollout/logprob_diff_max"] <= 1e-4, m
        assert m["grad_norm"] > 0 and m["handoff/bytes"] > 0, m


@pytest.mark.timeout(SGLANG_TIMEOUT_S)
def test_the_engine_check_passes_on_the_installed_sglang(tmp_path):
    """tools/check_engine.py, what a user runs after upgrading SGLang, on its own tiny Qwen2: every check passes
    but those this machine cannot run (release and resume, routes: GPU only); the push's check covers every tensor
    in SGLang's scheduler (SGLang itself reads none of its Qwen2 class back). Its timeout check stops the engine's processes (SIGSTOP): generate fails within 5 s
    of no progress naming its phase; then abandon kills them and a new engine in the same process takes a push
    and generates."""
    out = tmp_path / "report.json"
    proc = run_python([str(REPO / "tools" / "check_engine.py"), "--json", str(out)], timeout_s=SGLANG_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["check"]: r for r in json.loads(out.read_text())}
    assert [*rows] == ["api", "push", "version", "verify", "parity", "flush", "memory", "routes", "timeout",
                       "restart"]
    assert {name for name, r in rows.items() if r["status"] == "SKIP"} == {"memory", "routes"}, rows
    assert rows["verify"]["verified"] == rows["push"]["tensors"], rows
    assert rows["parity"]["max_diff"] <= 1e-4 and rows["push"]["buckets"] >= 2, rows
    assert "generate failed after" in rows["timeout"]["detail"] and rows["timeout"]["elapsed_s"] >= 5.0, rows


@pytest.mark.timeout(SGLANG_TIMEOUT_S)
@pytest.mark.parametrize("arch", ["glm4_moe", "gemma3"])
def test_the_engine_check_passes_for_the_new_architectures(arch, arch_dir, tmp_path):
    """SGLang's CPU mode serves GLM-4.5 (sigmoid routing with the expert bias, shared experts, a dense first
    layer, partial RoPE) and Gemma 3 (sliding windows, softcapping): a push of other weights loads, and the
    engine's logprobs equal transformers' on them (1e-4, fp32), its routes cover every token fed in (GLM). (Its
    DeepSeek-V3 differs from transformers before any push, and its gpt-oss needs a GPU attention backend.)"""
    out = tmp_path / "report.json"
    proc = run_python([str(REPO / "tools" / "check_engine.py"), "--model", str(arch_dir(arch)), "--json", str(out)],
                      timeout_s=SGLANG_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["check"]: r for r in json.loads(out.read_text())}
    assert rows["parity"]["max_diff"] <= 1e-4 and rows["push"]["status"] == "PASS", rows
    assert rows["routes"]["status"] == ("PASS" if arch == "glm4_moe" else "SKIP"), rows


# ---- GPU (tools/gpu_check.sh) --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu_result(tmp_path_factory):
    # Weights drawn with std 0.2 (not 0.02) give logits of order 1, so the two models' logprobs differ by
    # far more than bf16 rounding and the parity check below can tell them apart.
    root = tmp_path_factory.mktemp("gpu")
    tool = _tiny_model_tool()
    trainer = tool.make_tiny_model(root / "trainer", arch="qwen2", seed=0, init_std=0.2)
    other = tool.make_tiny_model(root / "other", arch="qwen2", seed=1, init_std=0.2)
    out = root / "result.json"
    proc = run_python([str(REPO / "tests" / "sglang_worker.py"), "gpu", "--trainer-model", str(trainer),
                       "--other-model", str(other), "--out", str(out)], timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(300)
@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_ipc_push_makes_sglang_logprobs_equal_the_trainers(gpu_result):
    r = gpu_result
    assert r["push"]["buckets"] >= 2 and r["push"]["bytes"] > 0
    # bf16 keeps 8 significant bits: a logit of magnitude 4-8 sits on a grid of 1/32. Measured on CPU with
    # these models (logits of std 1.6), bf16 against fp32 of the same model: mean |dlogprob| 0.034, max 0.19
    # over 312 tokens. SGLang and Megatron each carry such an error, rounded at different points (fused
    # attention and GEMMs vs Megatron's), so up to about twice that. The two models differ by ~2.5 per
    # token, so "pushed" and "not pushed" stay apart by more than an order of magnitude on the mean.
    assert r["before_mean"] >= 1.0, r
    assert r["after_mean"] <= 0.1 and r["after_max"] <= 0.6, r
    # Peak extra device memory of the push: one flattened bucket (a tensor larger than the bucket travels
    # alone); with TP=1 the trainer's tensors are views of its parameters. 1 MiB covers allocator rounding.
    bound = max(r["bucket_bytes"], r["largest_tensor_bytes"]) + (1 << 20)
    assert r["push_peak_extra_bytes"] <= bound, r


@pytest.mark.timeout(300)
@pytest.mark.gpu
@needs_cuda
def test_gpu_release_frees_sglang_memory_and_generation_works_after_resume(gpu_result):
    r = gpu_result
    # The engine took mem_fraction 0.2 of the device (weights, KV cache, CUDA graphs); releasing must give
    # most of it back (the CUDA context and NCCL buffers stay). After resume it takes its share again and
    # generates.
    assert r["engine_bytes"] > 1 << 30, r
    assert r["released_bytes"] >= 0.8 * r["engine_bytes"], r
    assert r["free_after_resume"] <= r["free_serving"] + 0.2 * r["engine_bytes"], r
    assert r["generated_after_resume"] > 0
    assert r["stamped_versions"] == [1]  # SGLang stamps its responses with the version of the push


# ---- CPU: SGLang's pool is sized at start, before the trainer's models ----------------------------------------
# The KV pool this test asks for: large beside SGLang's own allocations between its two memory readings (about
# 70 MB measured: buffers other than the weights), which the plan does not model and which would be 20% of a
# 384 MiB pool; 2 GiB fits a 24 GiB CI machine beside the trainer.
POOL_TARGET_BYTES = 2 * 2**30
TRAINER_HOG_BYTES = 2**30  # memory a real trainer would take after the engine started

# Builds a PPO run through megarl.loops.rl_run.build_run (rollout engine, then actor, reference and critic) with
# the engine factory wrapped: it reads the free host memory the way SGLang's CPU mode does just before the engine
# starts, starts it without megarl's CPU pool cap at a mem_fraction that asks for POOL_TARGET_BYTES and with
# SGLang's log at info (its scheduler prints its memory readings on the worker's stderr), and records when each
# model is built and this process's resident memory. After the build, a trainer-sized hog is allocated and the
# scheduler asked again.
POOL_WORKER = """
import json, os, sys
from pathlib import Path
import psutil, torch
sys.path.insert(0, "tests")
from conftest import HOST_LOCKS_ENV, host_to_itself
os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
from megarl.device import load_cuda_driver_stand_in
load_cuda_driver_stand_in()
from sglang.srt.utils.common import get_available_gpu_memory
from transformers import AutoTokenizer
from megarl.config import load_config
from megarl.data.prompts import load_prompts
from megarl.engine import roles
from megarl.loops import colocated, rl_run
from megarl.loops.launch import launch
from megarl.models.arch import read_shape
from megarl.plan import DTYPE_BYTES, stage_params
from megarl.rollout import sglang_engine
from megarl.rollout.sglang_engine import SGLangEngine

recipe, out, target, hog_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
cfg = load_config(recipe)
shape = read_shape(cfg.model.path)
params = stage_params(shape, tp=1, pp=1, ep=1, stage=0, padded_vocab=shape.vocab_size).total
weights = params * DTYPE_BYTES[cfg.model.dtype]
result = {"built": [], "weight_bytes": weights}
engines = []

def free_bytes():  # SGLang's own reading in CPU mode: available host memory (cgroup-bounded) per NUMA node
    return get_available_gpu_memory("cpu", 0) * 2**30

def rss():
    return psutil.Process().memory_info().rss

def info_log(*args, **kwargs):
    return engine_args(*args, **kwargs) | {"log_level": "info"}

engine_args, sglang_engine.engine_args = sglang_engine.engine_args, info_log

def start_engine(rollout_cfg, model_dir, *, shape, dtype, seed, capture_routes, group, lora, nodes, init_addr):
    assert not capture_routes and group is None and lora is None and nodes == 1  # a dense model; rollout.tp = 1; no LoRA
    result["built"].append("rollout")
    # the host to this process while it reads the free memory and SGLang sizes its pool (tests/conftest.py)
    locks = os.environ.get(HOST_LOCKS_ENV)
    with host_to_itself(Path(locks) if locks else None, alone=True):
        free = free_bytes()
        fraction = (target + weights) / free
        engine = SGLangEngine(model_dir, shape=shape, dtype=dtype, seed=seed, mem_fraction=fraction,
                              cpu_pool_tokens=None)
    info = engine.engine.get_server_info()
    result.update(free_before_start=free, mem_fraction=fraction, rss_after_start=rss(),
                  pool_tokens=info["max_total_num_tokens"], memory_usage=info["internal_states"][0]["memory_usage"])
    engines.append(engine)
    return engine

def build_engine(role, groups, **build):
    result["built"].append(role.name)
    return make_engine(role, groups, **build)

make_engine = roles.make_engine
# every train engine of the run's cast is built through megarl.engine.roles.build_engine
colocated.make_rollout_engine, roles.make_engine = start_engine, build_engine
job, groups = launch(cfg)
rows = load_prompts(cfg.data.train_path)
run = rl_run.build_run(job, groups, rollouts=colocated.ColocatedRollouts(job, groups),
                       tokenizer=AutoTokenizer.from_pretrained(cfg.model.path), train_rows=rows, eval_rows=[])
hog = torch.ones(hog_bytes // 4)  # written, so the pages are really taken
state = engines[0].engine.get_server_info()["internal_states"][0]["memory_usage"]
result.update(pool_tokens_after_trainer=state["token_capacity"], rss_after_trainer=rss())
engines[0].shutdown()
open(out, "w").write(json.dumps(result))
"""

# SGLang's scheduler (0.5.23, model_runner.load_model) around its weights: the host memory free (GiB, two
# decimals) just after its first reading, which sets the pool's headroom, and just before its second, of which the
# pool is the rest
LOAD_BEGIN = re.compile(r"Load weight begin\. avail mem=([0-9.]+) GB")
LOAD_END = re.compile(r"Load weight end\..*avail mem=([0-9.]+) GB")


@pytest.mark.alone
@pytest.mark.timeout(SGLANG_TIMEOUT_S)
def test_sglang_cpu_pool_is_sized_before_the_trainer_and_agrees_with_the_plan(qwen2_dir, arithmetic_dir, tmp_path,
                                                                              host_locks_env):
    """megarl's build order starts the rollout engine before actor, reference and critic, so SGLang sizes its KV
    pool from the host memory free before the trainer takes any; the pool does not change when the trainer's
    models and a trainer-sized allocation come after, and it is the plan's formula (megarl.plan.sglang_pool_tokens)
    of the memory free when SGLang reads it."""
    from megarl.models.arch import read_shape
    from megarl.plan import kv_bytes_per_token, sglang_pool_tokens

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"""
run_dir: {tmp_path / 'run'}
model: {{path: {qwen2_dir}}}
data: {{train_path: {arithmetic_dir / 'train.jsonl'}, prompts_per_step: 4}}
rollout: {{engine: sglang, n_samples: 4, max_new_tokens: 4}}
algo: {{name: ppo, kl_coef: 0.01}}
train: {{steps: 1, micro_batch_size: 8}}
""")
    out = tmp_path / "pool.json"
    proc = run_python(["-c", POOL_WORKER, str(recipe), str(out), str(POOL_TARGET_BYTES), str(TRAINER_HOG_BYTES)],
                      timeout_s=SGLANG_TIMEOUT_S, env=host_locks_env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    print(json.dumps(r, indent=1))
    assert r["built"] == ["rollout", "actor", "reference", "critic"]
    # fixed at start: the trainer's models and a GiB more of trainer memory do not shrink it
    assert r["rss_after_trainer"] - r["rss_after_start"] >= TRAINER_HOG_BYTES  # the trainer did take memory after
    assert r["pool_tokens_after_trainer"] == r["pool_tokens"]

    shape = read_shape(qwen2_dir)
    per_token = kv_bytes_per_token(shape, dtype="float32")
    planned = sglang_pool_tokens(shape, free_bytes=r["free_before_start"], mem_fraction=r["mem_fraction"],
                                 weight_bytes=r["weight_bytes"], dtype="float32")
    assert planned * per_token == pytest.approx(POOL_TARGET_BYTES, rel=1e-3)
    # SGLang's CPU mode gives the pool mem_fraction of the host memory free at its first reading, taken once its
    # scheduler runs (less than before start by the engine's processes: torch, the model runner, the CPU
    # counterpart of the CUDA context the plan subtracts on a GPU), less what it loads before its second: the
    # plan's formula, with the memory free at SGLang's first reading and what its log shows it loaded. On a quiet
    # machine that is the weights and about 70 MB of SGLang's buffers (the pool measured 0.99-1.00 of the plan
    # of the weights alone). Memory another process takes or returns between SGLang's readings moves the pool
    # byte for byte, which no plan can know: another test's engine ending there made the pool 1.64 of the plan,
    # so the test is `alone` (conftest): the other test process waits while SGLang starts. Within 10%, as the
    # issue asks: what is left is what moved in the second or so between the log's readings and SGLang's own.
    gib = 2**30
    begins, ends = LOAD_BEGIN.findall(proc.stderr), LOAD_END.findall(proc.stderr)
    assert len(begins) == len(ends) == 1, proc.stderr[-4000:]
    at_start, after_load = float(begins[0]) * gib, float(ends[0]) * gib
    beyond_weights = at_start - after_load - r["weight_bytes"]
    at_reading = sglang_pool_tokens(shape, free_bytes=at_start, mem_fraction=r["mem_fraction"],
                                    weight_bytes=r["weight_bytes"], dtype="float32") - beyond_weights / per_token
    print(f"SGLang CPU pool / plan of the memory free before start: {r['pool_tokens'] / planned:.3f}; / plan of "
          f"SGLang's readings: {r['pool_tokens'] / at_reading:.3f} (loaded beyond the weights "
          f"{beyond_weights / gib:+.2f} GiB; engine's processes {(r['free_before_start'] - at_start) / gib:.2f} GiB)")
    assert abs(r["pool_tokens"] - at_reading) <= 0.1 * at_reading, (r["pool_tokens"], at_reading)
