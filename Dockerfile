# kvgate container image.
#   docker build -t kvgate:0.1.0 .
#   docker run --stop-timeout 40 -p 8000:8000 -v "$PWD/kvgate.yaml:/etc/kvgate/config.yaml:ro" \
#     -e KVGATE_CONFIG=/etc/kvgate/config.yaml -e KVGATE_ADMIN_TOKEN=... -e KVGATE_SALT_SECRET=... \
#     kvgate:0.1.0
# or, without a file (the secrets still needed: authentication is on):
#   docker run --stop-timeout 40 -p 8000:8000 -e KVGATE_ADMIN_TOKEN=... -e KVGATE_SALT_SECRET=... \
#     kvgate:0.1.0 --upstream http://vllm:8000
# (--no-auth listens on the container's loopback only: add --host 0.0.0.0 to publish it)
# --stop-timeout above server.shutdown_grace_s (30 s): `docker stop` kills after 10 s otherwise,
# cutting the streams kvgate is draining

# ---- build: install kvgate and its dependencies into a self-contained virtualenv --------------
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kvgate
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY routing ./routing
COPY loadtest ./loadtest
# Every dependency ships manylinux wheels for CPython 3.11, so no compiler is needed; pip
# itself is removed afterwards so the runtime image cannot install anything.
RUN /opt/kvgate/bin/pip install . \
 && /opt/kvgate/bin/pip uninstall --yes pip

# ---- runtime: the venv only, as an unprivileged user ------------------------------------------
FROM python:3.11-slim AS runtime
RUN groupadd --system --gid 10001 kvgate \
 && useradd --system --uid 10001 --gid kvgate --no-create-home --shell /usr/sbin/nologin kvgate
COPY --from=build /opt/kvgate /opt/kvgate
ENV PATH=/opt/kvgate/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Numeric so Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
EXPOSE 8000
# slim has no curl: probe with the image's Python. The port follows KVGATE_SERVER__PORT.
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('KVGATE_SERVER__PORT', '8000'), timeout=2)"]
ENTRYPOINT ["kvgate", "serve"]
