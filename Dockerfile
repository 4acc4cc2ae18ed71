# attention-server, CPU image.
#
#   docker build -t attention-service:0.1.0 .
#   docker run --rm -p 50051:50051 -p 9464:9464 attention-service:0.1.0
#
# Without a Docker daemon (as the `docker` CTest does):
#   buildah bud --format docker -t attention-service:0.1.0 .
# (--format docker keeps the HEALTHCHECK, which OCI images cannot carry.)
#
# Build stage: Debian bookworm with the README's packages and build
# commands (tests and benchmarks off, so GoogleTest and Google Benchmark are
# not needed).
FROM debian:bookworm AS build
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
       build-essential cmake ninja-build pkg-config \
       libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler \
       libabsl-dev prometheus-cpp-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DATTN_CUDA=OFF \
       -DATTN_BUILD_TESTS=OFF -DATTN_BUILD_BENCH=OFF \
    && cmake --build build --target attention-server attnctl \
    && for binary in attention-server attnctl; do \
         install -D -m 0755 -s \
           "$(find build -type f -name "$binary" -perm -u+x | head -n 1)" \
           "/out/usr/local/bin/$binary" || exit 1; \
       done

# Runtime stage: bookworm-slim with only the shared libraries the two
# binaries load (their dependencies, e.g. libgrpc29, come along).
FROM debian:bookworm-slim
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
       libgrpc++1.51 libprotobuf32 libabsl20220623 \
       libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 attention \
    && useradd --system --uid 10001 --gid attention --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin attention
COPY --from=build /out/ /
# Numeric, so that Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
# gRPC (attention.v1 + grpc.health.v1 + reflection) and Prometheus /metrics.
EXPOSE 50051 9464
HEALTHCHECK --interval=10s --timeout=5s --start-period=15s --retries=3 \
    CMD ["attnctl", "health", "--target=localhost:50051", "--timeout=2s"]
ENTRYPOINT ["attention-server"]
CMD ["--port=50051", "--metrics_port=9464"]
