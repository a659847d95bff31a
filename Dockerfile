# iscore: CPU image by default; a GPU image with
#   docker build --build-arg BASE=pytorch/pytorch:2.7.0-cuda12.6-cudnn9-runtime --build-arg TORCH=skip .
ARG BASE=python:3.12-slim
FROM ${BASE}

ARG TORCH=cpu
WORKDIR /app

# CPU torch first, so installing the project never pulls the CUDA build.
RUN if [ "$TORCH" = "cpu" ]; then \
        pip install --no-cache-dir torch --index-url https://download.pytorch.org/whl/cpu; \
    fi

COPY pyproject.toml README.md ./
COPY iscore ./iscore
COPY data ./data
RUN pip install --no-cache-dir . && useradd --create-home --uid 1000 iscore
USER iscore

ENTRYPOINT ["iscore"]
CMD ["validate", "data/dense_bf16.parquet"]
