# megarl images (commands also in the README, "Docker").
#   GPU (default target):  docker build -t megarl:gpu .
#                          docker run --gpus all --ipc=host -v $PWD/runs:/workspace/megarl/runs megarl:gpu \
#                              launch/torchrun.sh recipes/quickstart.yaml
#   CPU (runs the tests):  docker build --target cpu -t megarl:cpu .
#                          docker run megarl:cpu
#
# The GPU stack is pinned here and only here. SGLang's own CUDA image brings CUDA, torch and SGLang (0.5.23
# pins torch 2.14.1, the release the CPU tests run); Transformer Engine and apex are compiled against that
# torch for Hopper (sm_90; add architectures to CUDA_ARCHS / TORCH_CUDA_ARCH_LIST for other GPUs).
# Transformer Engine stays inside megatron-core 0.16.1's declared range (>=2.9, <2.12);
# tools/check_install.py checks these pins against the packages' metadata.
ARG SGLANG_VERSION=0.5.23
ARG SGLANG_IMAGE=lmsysorg/sglang:v${SGLANG_VERSION}
ARG TORCH_VERSION=2.14.1
ARG TE_VERSION=2.11.0
ARG APEX_COMMIT=10417aceddd7d5d05d7cbf7b0fc2daad1105f8b4
ARG MCORE_VERSION=0.16.1
ARG CUDA_ARCHS=90
ARG TORCH_CUDA_ARCH_LIST=9.0
ARG MAX_JOBS=8

# ---- CPU: the README's test commands, verbatim, on a bare Python 3.11 ----
FROM python:3.11-slim AS cpu
ENV PIP_NO_CACHE_DIR=1
# The code sandbox (README "Code sandbox"): bubblewrap and libseccomp at the base distribution's own
# versions (a pin would name a release another base image does not carry).
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap libseccomp2 && rm -rf /var/lib/apt/lists/*
WORKDIR /workspace/megarl
COPY . .
RUN pip install -e '.[test]' -c constraints.txt
CMD ["pytest", "-q", "tests"]

# ---- GPU: SGLang's CUDA image (CUDA, torch, sglang) + Transformer Engine + apex + megatron-core + megarl ----
FROM ${SGLANG_IMAGE} AS gpu
ARG SGLANG_VERSION
ARG TORCH_VERSION
ARG TE_VERSION
ARG APEX_COMMIT
ARG MCORE_VERSION
ARG CUDA_ARCHS
ARG TORCH_CUDA_ARCH_LIST
ARG MAX_JOBS
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Megatron needs one hardware queue per device to overlap communication; SGLang disables NCCL's cuMem
# allocator and the trainer's communicators must match it.
ENV PIP_CONSTRAINT="" \
    PIP_NO_CACHE_DIR=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1 \
    NCCL_CUMEM_ENABLE=0
WORKDIR /workspace/megarl
# The code sandbox (README "Code sandbox"): bubblewrap and libseccomp at the base distribution's own
# versions (a pin would name a release another base image does not carry).
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap libseccomp2 && rm -rf /var/lib/apt/lists/*
# A base image with another torch or SGLang would make every pin below a different, untested stack.
RUN python -c "import torch, sglang; v = (torch.__version__.split('+')[0], sglang.__version__); \
assert v == ('${TORCH_VERSION}', '${SGLANG_VERSION}'), f'base image has torch, sglang = {v}'"
# Transformer Engine: its core library is a wheel for the image's CUDA major version (core_cu12 or core_cu13,
# read from torch); its PyTorch extension compiles against this torch, for CUDA_ARCHS only.
RUN cuda_major=$(python -c "import torch; print(torch.version.cuda.split('.')[0])") \
 && NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS="${CUDA_ARCHS}" MAX_JOBS="${MAX_JOBS}" \
    pip install --no-build-isolation "transformer_engine[pytorch,core_cu${cuda_major}]==${TE_VERSION}"
# NVIDIA apex from a pinned commit (PyPI's `apex` is another project), with its C++ and CUDA extensions
# (that commit takes them as build options).
RUN TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" NVCC_APPEND_FLAGS="--threads 4" \
    pip install --no-build-isolation \
    --config-settings "--build-option=--cpp_ext --cuda_ext --parallel ${MAX_JOBS}" \
    "git+https://github.com/NVIDIA/apex.git@${APEX_COMMIT}"
# megatron-core without its dependencies: the base image's torch and numpy stay as they are. Each compiled
# package has its own layer, so a failed build starts again from the last one that succeeded.
# hadolint ignore=DL3059
RUN pip install --no-deps "megatron-core==${MCORE_VERSION}"
COPY . .
# torch is named with the image's version, so pip fails rather than replace the base image's torch; the
# base's transformers and SGLang satisfy megarl's ranges and stay.
RUN pip install -e '.[ray,parquet]' "torch==${TORCH_VERSION}" \
 && python tools/check_gpu_imports.py
CMD ["bash"]
