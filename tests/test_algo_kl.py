"""KL estimators and entropy against hand-computed values; the math package imports nothing heavy."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megarl.algo.kl import entropy_from_logits, kl_estimate


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def test_kl_estimators_hand_computed():
    logprobs = torch.tensor([[-1.0, -2.0, -0.3]])
    ref = torch.tensor([[-1.5, -1.0, -0.3]])
    # d = ref - logp = [-0.5, 1.0, 0]
    close(kl_estimate(logprobs, ref, kind="k1"), [[0.5, -1.0, 0.0]])  # -d
    close(kl_estimate(logprobs, ref, kind="k2"), [[0.125, 0.5, 0.0]])  # d^2 / 2
    # e^d - d - 1: e^-.5 + .5 - 1 = 0.6065307 - .5 = 0.1065307; e - 2 = 0.7182818
    close(kl_estimate(logprobs, ref, kind="k3"), [[0.1065307, 0.7182818, 0.0]])


def test_k3_is_accurate_for_tiny_differences():
    # for d = 1e-4, e^d - d - 1 = d^2/2 + d^3/6 = 5.0001667e-9; a naive exp(d) - d - 1 in fp32 gives ~0 or noise
    out = kl_estimate(torch.tensor([0.0]), torch.tensor([1e-4]), kind="k3")
    assert out.item() == pytest.approx(5.0001667e-9, rel=1e-3)


def test_unknown_kl_kind_names_the_allowed_kinds():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_estimate(torch.zeros(1), torch.zeros(1), kind="k4")


def test_entropy_hand_computed_and_stable():
    # uniform over 2: ln 2; p = [.25, .75] (logits [0, ln 3]): .25 ln 4 + .75 ln(4/3) = 0.5623351
    logits = torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)], [1000.0, 1000.0 + math.log(3.0)]])
    close(entropy_from_logits(logits), [math.log(2.0), 0.5623351, 0.5623351], atol=1e-5)


def test_entropy_with_masked_vocabulary_has_finite_value_and_gradient():
    logits = torch.tensor([[0.0, 0.0, -math.inf]], requires_grad=True)
    h = entropy_from_logits(logits)
    close(h, [math.log(2.0)])
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()
    # dH/dz_j = -p_j (log p_j + H): at the uniform pair this is 0; the masked entry gets 0
    close(logits.grad, [[0.0, 0.0, 0.0]])


def test_math_imports_no_heavy_backend():
    code = (
        "import sys\n"
        "import megarl.algo.advantages, megarl.algo.losses, megarl.algo.kl, megarl.algo.aggregate\n"
        "heavy = ('megatron', 'sglang', 'transformer_engine', 'apex', 'ray')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True, cwd=root, env=env
    )
    assert out.stdout.strip() == "[]", out.stdout
