# The staging-sink services of docker-compose.yml (assembler, demo worker, trainer, metrics exporter, capture
# proxy and its simulated engine).
# Pinned base image; .dockerignore keeps .git, .env, deploy/users.acl, caches and tests out of the context.
FROM python:3.11.9-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY sink ./sink
COPY worker ./worker
COPY tools ./tools
RUN pip install ".[metrics,proxy,parquet]" ./tools \
    && useradd --system --uid 10001 --no-create-home staging
USER staging
CMD ["staging-sink", "--help"]
