# syntax=docker/dockerfile:1.7
# kvroute-picker image. Build from the repository root:
#   docker build -f deploy/docker/picker.Dockerfile -t ghcr.io/kvroute/kvroute-picker:0.1.0 .
# Stage 1 compiles with the Rust toolchain the workspace requires (rust-version 1.95; g++ and make
# for the vendored libzmq, protoc comes vendored). Stage 2 is distroless/cc: glibc, libgcc,
# libstdc++ (libzmq is C++), CA certificates, no shell, user 65532 ("nonroot").
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p kvroute-picker --bin kvroute-picker \
 && install -D -m 0755 target/release/kvroute-picker /out/kvroute-picker

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/kvroute-picker /usr/local/bin/kvroute-picker
USER 65532:65532
# 9002 ext_proc gRPC + grpc.health.v1, 9003 grpc.health.v1 (GIE probes), 9004 agent ingest gRPC, 9090 /metrics /healthz /explain
EXPOSE 9002 9003 9004 9090
ENTRYPOINT ["/usr/local/bin/kvroute-picker"]
CMD ["--config", "/etc/kvroute/picker.yaml"]
