# syntax=docker/dockerfile:1.7
# kvroute-agent image. Build from the repository root:
#   docker build -f deploy/docker/agent.Dockerfile -t ghcr.io/kvroute/kvroute-agent:0.1.0 .
# Stage 1 compiles with the Rust toolchain the workspace requires (rust-version 1.95; g++ and make
# for the vendored libzmq, protoc comes vendored). Stage 2 is distroless/cc: glibc, libgcc,
# libstdc++ (libzmq is C++), CA certificates, no shell, user 65532 ("nonroot").
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p kvroute-agent --bin kvroute-agent \
 && install -D -m 0755 target/release/kvroute-agent /out/kvroute-agent

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/kvroute-agent /usr/local/bin/kvroute-agent
USER 65532:65532
# NVML (libnvidia-ml.so.1) is not in the image: the NVIDIA container runtime mounts the host driver's
# copy (runtimeClassName: nvidia, NVIDIA_DRIVER_CAPABILITIES=utility); the agent loads it at run time.
ENV NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=utility
# 9091 /metrics /healthz
EXPOSE 9091
ENTRYPOINT ["/usr/local/bin/kvroute-agent"]
CMD ["--config", "/etc/kvroute/agent.yaml"]
