# A stand-in for the official redis image (build.sh): Debian's Redis 7.0, as the official image
# runs it: `redis-server` listening on every address of the container (the compose network)
# with protected mode off (no password: the broker is reachable on that network only), data in
# /data, as the redis user; redis-cli for the healthcheck.
FROM debian:bookworm-slim
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        redis-server \
    && rm -rf /var/lib/apt/lists/* \
    && install -d -o redis -g redis -m 0750 /data
USER redis
WORKDIR /data
EXPOSE 6379
CMD ["redis-server", "--bind", "0.0.0.0", "--protected-mode", "no", "--dir", "/data"]
