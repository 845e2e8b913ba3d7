# megarl images (commands also in the README, "Docker").
#   GPU (default target):  docker build -t megarl:gpu .
#                          docker run --gpus all --ipc=host -v $PWD/runs:/workspace/megarl/runs megarl:gpu \
#                              launch/torchrun.sh recipes/quickstart.yaml
#   CPU (runs the tests):  docker build --target cpu -t megarl:cpu .
#                          docker run megarl:cpu
#
# The GPU stack is pinned here and only here. SGLang's own CUDA image brings CUDA, torch and SGLang (0.5.23
# pins torch 2.14.1, the release the CPU tests run); Transformer Engine and apex are compiled against that
# torch; megatron-core goes in without its dependencies, whose extras would pull a CUDA 13 build of TE.
ARG SGLANG_VERSION=0.5.23
ARG SGLANG_IMAGE=lmsysorg/sglang:v${SGLANG_VERSION}
ARG TORCH_VERSION=2.14.1
ARG TE_VERSION=2.16.1
ARG APEX_COMMIT=10417aceddd7d5d05d7cbf7b0fc2daad1105f8b4
ARG MCORE_VERSION=0.16.1

# ---- CPU: the README's test commands, verbatim, on a bare Python 3.11 ----
FROM python:3.11-slim AS cpu
ENV PIP_NO_CACHE_DIR=1
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
# Megatron needs one hardware queue per device to overlap communication; SGLang disables NCCL's cuMem
# allocator and the trainer's communicators must match it.
ENV PIP_CONSTRAINT="" \
    CUDA_DEVICE_MAX_CONNECTIONS=1 \
    NCCL_CUMEM_ENABLE=0
WORKDIR /workspace/megarl
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap libseccomp2 && rm -rf /var/lib/apt/lists/*
# A base image with another torch or SGLang would make every pin below a different, untested stack.
RUN python -c "import torch, sglang; v = (torch.__version__.split('+')[0], sglang.__version__); \
assert v == ('${TORCH_VERSION}', '${SGLANG_VERSION}'), f'base image has torch, sglang = {v}'"
RUN pip install --no-cache-dir --no-build-isolation "transformer_engine[pytorch]==${TE_VERSION}" \
 && NVCC_APPEND_FLAGS="--threads 4" APEX_CPP_EXT=1 APEX_CUDA_EXT=1 \
    pip install --no-cache-dir --no-build-isolation "git+https://github.com/NVIDIA/apex.git@${APEX_COMMIT}" \
 && pip install --no-cache-dir --no-deps "megatron-core==${MCORE_VERSION}"
COPY . .
# The base image's torch, transformers and SGLang stay: install megarl without letting pip replace them.
RUN pip install --no-cache-dir --no-deps -e . \
 && pip install --no-cache-dir "safetensors>=0.4" "pyyaml>=6" "psutil>=5.9" "tqdm>=4.66" \
    "math-verify>=0.9,<1" "ray>=2.40" "pyarrow>=15" "pyseccomp>=0.1.2"
CMD ["bash"]
