# One image for every BigFleet daemon: `bigfleet <subcommand>` (shard, coordinator, operator,
# pod-controller, fake-provider, ...). Build: docker build -t bigfleet:dev .
ARG PYTHON_VERSION=3.11

# Build the project and all of its dependencies as wheels, so the runtime stage needs neither a
# compiler nor network access to an index.
FROM python:${PYTHON_VERSION}-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:${PYTHON_VERSION}-slim-bookworm
# tini reaps zombies and forwards SIGTERM, so daemons shut down cleanly as PID 1's child.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini=0.19.0-1 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 65532 bigfleet \
    && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin bigfleet
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links=/wheels /wheels/bigfleet-*.whl \
    && rm -rf /wheels
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 65532:65532
WORKDIR /tmp
# shard gRPC/metrics/raft, coordinator gRPC/raft/metrics, operator metrics, pod-controller metrics
EXPOSE 7780 7781 8780 7790 7791 8790 8770 8080
ENTRYPOINT ["tini", "--", "bigfleet"]
CMD ["--help"]
