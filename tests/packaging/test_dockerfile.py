"""The Dockerfile, read (no Docker engine needed): it builds the wheel from what the wheel is
built from and installs it, CPU torch first, into an image that has the OpenMP numba loads and
runs as a user, with the official Streamlit pattern's healthcheck and exec-form entrypoint. The
wheel it builds is the one tests/packaging/test_wheel.py installs and serves."""

from __future__ import annotations

import json
import re

from tests.packaging.conftest import ROOT, SOURCES


def _stages() -> tuple[dict[str, str], list[list[tuple[str, str]]]]:
    """The global ARG defaults, and each stage's instructions as (INSTRUCTION, arguments), with
    continuation lines joined and comments left out."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    args: dict[str, str] = {}
    stages: list[list[tuple[str, str]]] = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        instruction, _, rest = line.strip().partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            stages.append([])
        elif not stages and instruction == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default
            continue
        stages[-1].append((instruction, rest.strip()))
    return args, stages


ARGS, STAGES = _stages()


def _all(stage: list[tuple[str, str]], instruction: str) -> list[str]:
    return [rest for name, rest in stage if name == instruction]


def test_the_first_stage_builds_the_wheel_from_its_sources() -> None:
    builder = STAGES[0]
    assert _all(builder, "FROM") == ["python:3.12-slim AS wheel"]
    copied = [source for rest in _all(builder, "COPY") for source in rest.split()[:-1]]
    assert sorted(copied) == sorted(SOURCES)  # sources added to the build are copied too
    (build,) = _all(builder, "RUN")
    assert build.startswith("pip wheel") and "--no-deps" in build and "--wheel-dir /dist" in build


def test_the_image_installs_the_wheel_after_cpu_torch() -> None:
    assert ARGS["BASE"] == "python:3.12-slim"  # the GPU image: --build-arg BASE=... TORCH=skip
    image = STAGES[-1]
    assert _all(image, "FROM") == ["${BASE}"]
    assert "TORCH=cpu" in _all(image, "ARG")
    assert _all(image, "WORKDIR") == ["/app"]
    assert not _all(image, "COPY") and not _all(image, "ADD")  # no sources, only the wheel
    runs = _all(image, "RUN")
    torch = next(i for i, run in enumerate(runs) if "download.pytorch.org/whl/cpu" in run)
    wheel = next(i for i, run in enumerate(runs) if "pip install" in run and ".whl" in run)
    assert torch < wheel
    assert runs[wheel].startswith("--mount=type=bind,from=wheel,source=/dist,target=/dist ")
    assert "pip install --no-cache-dir /dist/iscore-*.whl" in runs[wheel]
    assert not any("-e ." in run for run in runs)


def test_the_image_has_the_openmp_that_numba_loads() -> None:
    """numba's OpenMP layer links the system's libgomp; without it the kernels run on numba's
    slower `workqueue` layer."""
    (apt,) = [run for run in _all(STAGES[-1], "RUN") if "apt-get" in run]
    assert "apt-get install -y --no-install-recommends libgomp1" in apt
    assert apt.startswith("apt-get update") and apt.endswith("rm -rf /var/lib/apt/lists/*")


def test_the_image_runs_as_a_user_behind_a_healthcheck() -> None:
    image = STAGES[-1]
    names = [name for name, _ in image]
    assert _all(image, "USER") == ["iscore"]
    assert names.index("USER") > max(i for i, name in enumerate(names) if name == "RUN")
    assert _all(image, "EXPOSE") == ["8501"]
    (health,) = _all(image, "HEALTHCHECK")
    assert "http://localhost:8501/_stcore/health" in health
    json.loads(health.partition("CMD ")[2])  # exec form
    (entrypoint,) = _all(image, "ENTRYPOINT")
    assert json.loads(entrypoint) == [
        "iscore", "app", "--server.address=0.0.0.0", "--server.port=8501",
    ]  # fmt: skip
