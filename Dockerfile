# syntax=docker/dockerfile:1
#
# Two targets:
#   runtime (default)  the mmserve server image; one image for every role (api / engine / worker /
#                      model-init in docker-compose.yml, or `mmserve serve` for all three at once).
#   bench              a small image with locust + Pillow for bench/locustfile.py (compose profile "load").
#
#   docker build -t mmserve .                       # runtime
#   docker run --rm -p 8000:8000 -v mmserve-models:/models mmserve
#                                                   # builds the tiny model on first start, then serves

# --- bench: load generator only, no torch -------------------------------------------------------
FROM python:3.11-slim AS bench

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Same packages as the `bench` extra plus Pillow (a core dependency the locustfile uses for images);
# installing the extra itself would pull torch and the whole server.
RUN pip install locust pillow \
    && useradd --create-home --uid 1000 locust

COPY bench /bench
WORKDIR /bench
USER locust
EXPOSE 8089
CMD ["locust", "-f", "/bench/locustfile.py"]

# --- runtime: the server --------------------------------------------------------------------------
FROM python:3.11-slim AS runtime

# No hub access at run time (DESIGN §6): models come from a local folder.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    MMSERVE_MODEL=/models/tiny-llava \
    MMSERVE_HOST=0.0.0.0 \
    MMSERVE_PORT=8000

# torch first, from the CPU wheel index: pyproject pins torch==2.13.0 and a plain `pip install .`
# would fetch the multi-GB CUDA build from PyPI. The +cpu wheel satisfies that pin, so the project
# install below keeps it. For a GPU image, swap the index for the matching CUDA one
# (e.g. https://download.pytorch.org/whl/cu128); the worker picks cuda when it sees a device.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

# The Mooncake store client (a dependency, for --ec-connector mooncake) links libibverbs.so.1 even
# over TCP.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/mmserve
# Dependencies in their own layer, read from pyproject.toml, so a code-only change reuses it. xgrammar
# lists triton for its CUDA kernels only: beside a CPU torch it is removed (1 GB, and transformers would
# import it into every process).
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt \
    && (python -c "import sys, torch; sys.exit(torch.version.cuda is not None)" && pip uninstall -y triton || true)
COPY app ./app
COPY engine ./engine
COPY workers ./workers
COPY wire ./wire
RUN pip install --no-deps . \
    && rm -rf build *.egg-info

# Non-root. /models is created here, owned by that user, so a fresh named volume mounted on it
# inherits the ownership and model-init can write the tiny checkpoint into it.
RUN useradd --create-home --uid 1000 mmserve \
    && mkdir -p /models \
    && chown mmserve:mmserve /models
USER mmserve
WORKDIR /home/mmserve

EXPOSE 8000
# All three roles in one container; compose overrides the command with one role per service.
CMD ["sh", "-c", "{ test -f \"$MMSERVE_MODEL/config.json\" || mmserve build-tiny-model --family llava --out \"$MMSERVE_MODEL\"; } && exec mmserve serve"]
