# One image for every MFS process (gateway, scheduler, worker); compose.yaml picks the command.
FROM python:3.11-slim
# g++: the AVX2 int8 kernel (kernels/cpu_gemv.cpp) and torch.compile's C++ backend build with it.
RUN apt-get update && apt-get install -y --no-install-recommends make g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY requirements.lock pyproject.toml Makefile README.md ./
COPY core core
COPY family family
COPY mfs mfs
COPY gateway gateway
COPY scheduler scheduler
COPY worker worker
COPY kvstore kvstore
COPY kernels kernels
COPY engine engine
COPY service service
COPY training training
COPY evaluation evaluation
COPY benches benches
RUN make setup PY=python3
ENV PATH=/app/.venv/bin:$PATH MFS_LOG_JSON=1 HF_HUB_OFFLINE=1
# Dequantize the default family's GGUF once at build time (cached under /root/.cache/mfs).
RUN python -c "from worker.family import load_family; load_family('default')"
# Build the AVX2 int8 kernel once into the same cache (portable: -mavx2, not -march=native).
RUN python -c "from kernels import cpu_gemv; cpu_gemv.build()"
EXPOSE 8000
CMD ["mfs", "up", "--model", "default", "--host", "0.0.0.0"]
