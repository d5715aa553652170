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
CMD ["serve", "--http-addr", "0.0.0.0:8080", "--data-dir", "/data", "--nats-url", "nats://nats:4222"]
