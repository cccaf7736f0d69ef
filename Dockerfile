# One image for every loraplex service; docker-compose.yml picks the service by its command.
# torch 2.11 / triton 3.6 are the GPU image's versions (pyproject declares the supported ranges).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app

RUN pip install "torch==2.11.0" "triton==3.6.0"
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
RUN pip install . && mkdir -p /data /model /import /run/loraplex

# The gateway's port; the other services talk over ZeroMQ on the compose network.
EXPOSE 8000
CMD ["loraplex", "--help"]
