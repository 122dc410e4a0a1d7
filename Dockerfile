# tandem serving image: CUDA runtime, PyTorch, flashinfer and tandem[gpu] (which brings Ray Serve).
# The KubeRay chart in helm/tandem runs it as both the Ray head and the GPU workers.
#
#   docker build -t REGISTRY/tandem:0.1.0 .
#
# See docs/kuberay.md. Build arguments:
#   BASE_IMAGE  a CUDA image; use a -devel variant if flashinfer must JIT-compile kernels it has no
#               prebuilt cubins for (that needs nvcc).
#   TORCH_SPEC  the torch requirement; TORCH_INDEX_URL picks a wheel index for a specific CUDA build.
ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

ARG TORCH_SPEC="torch>=2.11,<2.15"
ARG TORCH_INDEX_URL=""

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH}

# wget: KubeRay's default liveness and readiness probes call it inside the Ray containers.
# build-essential, python3-dev: Triton and flashinfer build small host-side stubs at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev build-essential wget ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# KubeRay starts Ray through `bash -l`; a login shell must find the venv too.
RUN python3 -m venv "${VIRTUAL_ENV}" \
    && echo "export PATH=${VIRTUAL_ENV}/bin:\$PATH" > /etc/profile.d/tandem-venv.sh \
    && pip install --upgrade pip

# Heavy, rarely changing layers first, so code changes rebuild only the last one.
RUN if [ -n "${TORCH_INDEX_URL}" ]; then \
        pip install "${TORCH_SPEC}" --index-url "${TORCH_INDEX_URL}"; \
    else \
        pip install "${TORCH_SPEC}"; \
    fi
RUN pip install "flashinfer-python>=0.6"

COPY . /tmp/tandem-src
RUN pip install "/tmp/tandem-src[gpu]" && rm -rf /tmp/tandem-src

WORKDIR /home/ray
EXPOSE 8000 8265 6379 10001 8080

# Outside Kubernetes: `docker run --gpus all -p 8000:8000 IMAGE tandem serve --model M --device cuda`
# (with no arguments it serves the demo model, a smoke test).
# KubeRay replaces this command with `ray start`.
CMD ["tandem", "serve"]
