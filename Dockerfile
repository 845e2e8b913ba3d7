# megarl images.
#   GPU (default target):  docker build -t megarl:gpu .
#                          docker run --gpus all --ipc=host -v $PWD/runs:/workspace/megarl/runs megarl:gpu \
#                              launch/torchrun.sh recipes/quickstart.yaml
#   CPU (runs the tests):  docker build --target cpu -t megarl:cpu .
#                          docker run megarl:cpu
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23

# ---- CPU: the same commands as the README on a bare Python 3.11 ----
FROM python:3.11-slim AS cpu
WORKDIR /workspace/megarl
COPY . .
RUN pip install --no-cache-dir -e '.[test]'
CMD ["pytest", "-q", "tests"]

# ---- GPU: SGLang's CUDA image (torch, sglang) + megatron-core + Transformer Engine + apex ----
FROM ${SGLANG_IMAGE} AS gpu
ENV PIP_CONSTRAINT="" \
    CUDA_DEVICE_MAX_CONNECTIONS=1 \
    NCCL_CUMEM_ENABLE=0
WORKDIR /workspace/megarl
RUN pip install --no-cache-dir --no-build-isolation "transformer_engine[pytorch]==2.16.1" \
 && NVCC_APPEND_FLAGS="--threads 4" APEX_CPP_EXT=1 APEX_CUDA_EXT=1 \
    pip install --no-cache-dir --no-build-isolation "git+https://github.com/NVIDIA/apex.git@10417aceddd7d5d05d7cbf7b0fc2daad1105f8b4"
COPY . .
# The base image's torch stays: install megarl without letting pip replace it.
RUN pip install --no-cache-dir --no-deps -e . \
 && pip install --no-cache-dir "megatron-core==0.16.1" "safetensors>=0.4" "pyyaml>=6" "psutil>=5.9" "tqdm>=4.66" \
    "math-verify>=0.9,<1" "ray>=2.40" "pyarrow>=15"
CMD ["bash"]
