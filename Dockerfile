# megarl images (commands also in docs/cluster.md, "Docker").
#   GPU (default target):  docker build -t megarl:gpu .
#                          docker run --gpus all --ipc=host -v $PWD/runs:/workspace/megarl/runs megarl:gpu \
#                              launch/torchrun.sh recipes/quickstart.yaml
#   CPU (runs the tests):  docker build --target cpu -t megarl:cpu .
#                          docker run megarl:cpu
#
# The GPU stack is pinned here and only here. SGLang's own CUDA image brings CUDA, cuDNN, torch and SGLang
# (0.5.23 pins torch 2.14.1, the release the CPU tests run). Transformer Engine's kernels come in its prebuilt
# core wheel; its PyTorch extension (C++ only) and apex (C++ and CUDA, for TORCH_CUDA_ARCH_LIST: Hopper,
# sm_90; add architectures for other GPUs) are compiled against that torch. Transformer Engine stays inside
# megatron-core 0.16.1's declared range (>=2.9, <2.12); tools/check_install.py checks these pins against the
# packages' metadata. Nothing is installed that these pins do not name, except megarl's own requirements.
ARG SGLANG_VERSION=0.5.23
ARG SGLANG_IMAGE=lmsysorg/sglang:v${SGLANG_VERSION}
ARG TORCH_VERSION=2.14.1
ARG TE_VERSION=2.11.0
ARG ONNX_VERSION=1.23.2
ARG ONNX_IR_VERSION=1.1.0
ARG ONNXSCRIPT_VERSION=0.7.2
ARG WHEEL_VERSION=0.48.0
ARG APEX_COMMIT=10417aceddd7d5d05d7cbf7b0fc2daad1105f8b4
ARG MCORE_VERSION=0.16.1
ARG TORCH_CUDA_ARCH_LIST=9.0
ARG MAX_JOBS=8

# ---- CPU: the README's test commands, verbatim, on a bare Python 3.11 ----
FROM python:3.11-slim AS cpu
ENV PIP_NO_CACHE_DIR=1
# The code sandbox (docs/rewards.md, "Code sandbox"): bubblewrap and libseccomp at the base distribution's own
# versions (a pin would name a release another base image does not carry).
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap libseccomp2 && rm -rf /var/lib/apt/lists/*
WORKDIR /workspace/megarl
COPY . .
RUN pip install -e '.[test]' -c constraints.txt
CMD ["pytest", "-q", "-n", "2", "--dist", "loadfile", "tests"]

# ---- GPU: SGLang's CUDA image (CUDA, torch, sglang) + Transformer Engine + apex + megatron-core + megarl ----
FROM ${SGLANG_IMAGE} AS gpu
ARG SGLANG_VERSION
ARG TORCH_VERSION
ARG TE_VERSION
ARG ONNX_VERSION
ARG ONNX_IR_VERSION
ARG ONNXSCRIPT_VERSION
ARG WHEEL_VERSION
ARG APEX_COMMIT
ARG MCORE_VERSION
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
# The code sandbox (docs/rewards.md, "Code sandbox"): bubblewrap and libseccomp at the base distribution's own
# versions (a pin would name a release another base image does not carry).
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap libseccomp2 && rm -rf /var/lib/apt/lists/*
# A base image with another torch or SGLang would make every pin below a different, untested stack.
RUN python -c "import torch, sglang; v = (torch.__version__.split('+')[0], sglang.__version__); \
assert v == ('${TORCH_VERSION}', '${SGLANG_VERSION}'), f'base image has torch, sglang = {v}'"
# apex compiles its CUDA extensions only with an nvcc of torch's own CUDA major.minor (its setup.py raises
# otherwise, after minutes of Transformer Engine's build): the base image must carry that toolkit.
RUN nvcc_cuda=$(nvcc --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p') \
 && torch_cuda=$(python -c "import torch; print(torch.version.cuda)") \
 && if [ "${nvcc_cuda}" != "${torch_cuda}" ]; then \
      echo "base image: nvcc is CUDA ${nvcc_cuda:-missing}, torch was built with CUDA ${torch_cuda}; apex needs" \
           "both the same: use an SGLANG_IMAGE whose CUDA toolkit is its torch's" >&2; \
      exit 1; \
    fi
# Transformer Engine's PyTorch setup.py imports wheel.bdist_wheel, which its pyproject.toml does not declare,
# so the build below (without isolation) takes it from the image.
RUN pip install --no-deps "wheel==${WHEEL_VERSION}"
# Transformer Engine: three distributions of one version, without dependencies. The metapackage; the core
# library, a prebuilt wheel (its CUDA kernels) for torch's CUDA major version (transformer_engine_cu12 or
# _cu13); the PyTorch extension, a source distribution compiled against this torch, with
# NVTE_PYTORCH_FORCE_BUILD so its setup.py does not fetch a prebuilt one from GitHub instead. Of the Python
# packages it imports, einops, pydantic and packaging are SGLang's own (checked first); onnx and onnxscript
# (imported by transformer_engine.pytorch for its ONNX export) are pinned here, at versions whose own
# requirements SGLang's environment already meets (tools/check_install.py resolves them together).
# The extension includes <cudnn.h> and its build adds only the CUDA toolkit's include folder: the header
# comes from a default include path (SGLang's cudnn-devel base has it in /usr/include), else from the
# nvidia-cudnn wheel torch depends on; without either the build stops here, naming what is missing.
RUN python -c "import einops, pydantic, packaging" \
    || { echo "base image: lacks einops, pydantic or packaging, which Transformer Engine imports" >&2; exit 1; } \
 && cuda_major=$(python -c "import torch; print(torch.version.cuda.split('.')[0])") \
 && if ! echo "#include <cudnn.h>" | g++ -E -x c++ - -o /dev/null 2>/dev/null; then \
      cudnn_include=$(python -c "import glob, os, site; hits = [h for d in site.getsitepackages() \
for h in glob.glob(os.path.join(d, 'nvidia', '*', 'include', 'cudnn.h'))]; print(os.path.dirname(hits[0]) if hits else '')"); \
      if [ -z "${cudnn_include}" ]; then \
        echo "base image: no cudnn.h, neither on the compiler's include path nor in an nvidia-cudnn wheel;" \
             "Transformer Engine's extension needs cuDNN's headers (use a cudnn-devel SGLANG_IMAGE)" >&2; \
        exit 1; \
      fi; \
      export CPATH="${cudnn_include}${CPATH:+:${CPATH}}"; \
    fi \
 && NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS="${MAX_JOBS}" pip install --no-deps --no-build-isolation \
    "transformer_engine==${TE_VERSION}" "transformer_engine_cu${cuda_major}==${TE_VERSION}" \
    "transformer_engine_torch==${TE_VERSION}" \
    "onnx==${ONNX_VERSION}" "onnx_ir==${ONNX_IR_VERSION}" "onnxscript==${ONNXSCRIPT_VERSION}"
# NVIDIA apex from a pinned commit (PyPI's `apex` is another project), with its C++ and CUDA extensions
# (that commit takes them as build options).
RUN TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" NVCC_APPEND_FLAGS="--threads 4" \
    pip install --no-deps --no-build-isolation \
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
