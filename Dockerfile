# tandem serving image: CUDA runtime, PyTorch, flashinfer and tandem[gpu] (which brings Ray Serve).
# The KubeRay chart in helm/tandem runs it as both the Ray head and the GPU workers.
#
#   docker build -t REGISTRY/tandem:0.1.0 .
#
# See docs/kuberay.md. Build arguments:
#   BASE_IMAGE          a CUDA image; use a -devel variant if flashinfer must JIT-compile kernels it has
#                       no prebuilt cubins for (that needs nvcc).
#   RAY_VERSION         must equal the chart's rayVersion (helm/tandem/values.yaml; a unit test checks).
#   TORCH_VERSION, FLASHINFER_VERSION   exact versions (those the GPU benchmarks ran: torch 2.11.0,
#                       flashinfer 0.7.4); TORCH_INDEX_URL picks a wheel index for a
#                       specific CUDA build.
# It runs as the unprivileged user `ray` (uid 1000), as the chart's securityContext expects.
ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

ARG RAY_VERSION=2.60.0
ARG TORCH_VERSION=2.11.0
ARG FLASHINFER_VERSION=0.7.4
ARG TORCH_INDEX_URL=""

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# wget: KubeRay's default probes and this image's HEALTHCHECK call it.
# build-essential, python3-dev: Triton and flashinfer build small host-side stubs at run time.
# The distribution's packages follow the base image's release (its security updates included), so
# they are not pinned one by one.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev build-essential wget ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# The unprivileged user; Ubuntu 24.04 images ship `ubuntu` as uid 1000, which gives the id up first.
RUN if id -u ubuntu >/dev/null 2>&1; then userdel -r ubuntu; fi \
    && useradd --create-home --uid 1000 --user-group --shell /bin/bash ray

# KubeRay starts Ray through `bash -l`; a login shell must find the venv too.
RUN python3 -m venv "${VIRTUAL_ENV}" \
    && echo "export PATH=${VIRTUAL_ENV}/bin:\$PATH" > /etc/profile.d/tandem-venv.sh

# Heavy, rarely changing layers first, so code changes rebuild only the last one.
RUN if [ -n "${TORCH_INDEX_URL}" ]; then \
        pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"; \
    else \
        pip install "torch==${TORCH_VERSION}"; \
    fi
RUN pip install "flashinfer-python==${FLASHINFER_VERSION}" "ray[serve]==${RAY_VERSION}"

COPY . /tmp/tandem-src
# The constraint keeps the pins above: installing tandem must not move Ray, torch or flashinfer.
RUN printf 'ray==%s\ntorch==%s\nflashinfer-python==%s\n' "${RAY_VERSION}" "${TORCH_VERSION}" \
        "${FLASHINFER_VERSION}" > /tmp/pins.txt \
    && pip install --constraint /tmp/pins.txt "/tmp/tandem-src[gpu]" \
    && rm -rf /tmp/tandem-src /tmp/pins.txt

# Inside a container the server must listen on every interface, or a published port cannot reach it;
# `tandem serve` reads this when no --host is given (KubeRay's pods use the chart's http_options).
ENV TANDEM_HOST=0.0.0.0

USER 1000:1000
WORKDIR /home/ray
EXPOSE 8000 8265 6379 10001 8080

# Outside Kubernetes (KubeRay ignores it and probes the pods itself).
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["wget", "-q", "-O", "/dev/null", "http://127.0.0.1:8000/health"]

# Outside Kubernetes: `docker run --gpus all -p 8000:8000 -e TANDEM_API_KEY=... IMAGE tandem serve
# --model M --device cuda` (with no arguments it serves the demo model, a smoke test).
# KubeRay replaces this command with `ray start`.
CMD ["tandem", "serve"]
