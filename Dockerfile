# iscore's dashboard (and its CLI), installed from its wheel. CPU image by default; a GPU image with
#   docker build --build-arg BASE=pytorch/pytorch:2.7.0-cuda12.6-cudnn9-runtime --build-arg TORCH=skip .
# Run (published on the host's loopback only; see docs/security.md before exposing it):
#   docker run -p 127.0.0.1:8501:8501 iscore                                # open localhost:8501
#   docker run -p 127.0.0.1:8501:8501 -v "$PWD/runs:/data:ro" iscore /data  # a dump preloaded
#   docker run -p 127.0.0.1:8501:8501 iscore --allowed-host iscore.example.org  # behind a proxy
#   docker run -v "$PWD/runs:/data:ro" --entrypoint iscore iscore validate /data
ARG BASE=python:3.12-slim

# The wheel (the engine, the app with its Streamlit config, the samples), built apart so that
# the image holds what a user's `pip install` gets and no sources.
FROM python:3.12-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY iscore ./iscore
COPY app ./app
COPY data ./data
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

FROM ${BASE}
ARG TORCH=cpu
WORKDIR /app
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1

# GNU OpenMP, which numba's OpenMP threading layer loads (slim images lack it): without it the
# compiled kernels run on numba's own scheduler, a whole analysis about 25% slower.
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/*

# CPU torch first, so installing the project never pulls the CUDA build.
RUN if [ "$TORCH" = "cpu" ]; then \
        pip install --no-cache-dir torch --index-url https://download.pytorch.org/whl/cpu; \
    fi

# Mounted from the first stage, not copied: the wheel file stays out of the image's layers.
RUN --mount=type=bind,from=wheel,source=/dist,target=/dist \
    pip install --no-cache-dir /dist/iscore-*.whl && useradd --create-home --uid 1000 iscore
USER iscore

EXPOSE 8501
# Slim images have no curl. It asks for localhost, one of the Host names allowed by default.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://localhost:8501/_stcore/health', timeout=4).status != 200)"]
# Every interface inside the container, so that a published port reaches it; the Host
# allow-list (loopback names, plus --allowed-host) still refuses other names.
ENTRYPOINT ["iscore", "app", "--server.address=0.0.0.0", "--server.port=8501"]
