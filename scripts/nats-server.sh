# Sourced by scripts/serve and scripts/test: makes sure a nats-server binary exists, installing
# Debian's package `nats-server` when it is missing (a fresh machine must work).
ensure_nats_server() {
  if command -v nats-server >/dev/null 2>&1; then
    NATS_SERVER_BIN=$(command -v nats-server)
  elif [ -x /usr/sbin/nats-server ]; then
    NATS_SERVER_BIN=/usr/sbin/nats-server
  else
    echo "nats-server not found: installing the Debian package nats-server" >&2
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq nats-server >&2
    NATS_SERVER_BIN=$(command -v nats-server || echo /usr/sbin/nats-server)
  fi
  export NATS_SERVER_BIN
}
