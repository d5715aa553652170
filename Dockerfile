# kvrouted: build in the Rust image, run on a slim Debian.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY crates crates
COPY src src
COPY benches benches
RUN cargo build --release --bin kvrouted

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends curl ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/kvrouted /usr/local/bin/kvrouted
VOLUME /data
EXPOSE 8080
ENTRYPOINT ["kvrouted"]
# The container's own address must be non-loopback for a published port to reach it. Without an
# API token file that needs --insecure-public: publish the port on the host's loopback only
# (`-p 127.0.0.1:8080:8080`), or pass --api-token-file (and --tls-cert/--tls-key) instead.
CMD ["serve", "--http-addr", "0.0.0.0:8080", "--insecure-public", "--data-dir", "/data", "--nats-url", "nats://nats:4222"]
