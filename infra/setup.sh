#!/usr/bin/env bash
# Sets up everything on a fresh machine, idempotently: Python venv and pinned dependencies,
# the Kafka jars from Maven Central, Debian's redis-server and chromium. Java 17 and Maven must exist.
# A second run only checks, so `make demo` and `make test` can call it every time.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }
die() { printf 'setup: %s\n' "$*" >&2; exit 1; }

command -v java >/dev/null || die "Java 17+ is required (apt-get install -y openjdk-17-jre-headless)"
java_major=$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -n1)
[ "${java_major:-0}" -ge 17 ] || die "Java 17+ is required, found ${java_major:-an unknown version} ($(command -v java))"
command -v mvn >/dev/null || die "Maven is required to fetch the Kafka jars (apt-get install -y maven)"

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null; then sudo "$@"
  else die "root is needed to install Debian packages; install them yourself (apt-get install -y redis-server chromium)"
  fi
}

if ! command -v redis-server >/dev/null; then
  say "installing redis-server from Debian"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  # Debian's package starts a system Redis on 6379; the project runs its own there. Stop exactly
  # that service (by its unit or pid file), never every redis-server on the machine.
  as_root systemctl disable --now redis-server >/dev/null 2>&1 \
    || as_root service redis-server stop >/dev/null 2>&1 || true
  if [ -s /run/redis/redis-server.pid ]; then
    as_root kill "$(cat /run/redis/redis-server.pid)" 2>/dev/null || true
  fi
fi

# the live view's browser test drives Debian's chromium through Playwright (no browser is downloaded)
if ! command -v chromium >/dev/null; then
  say "installing chromium from Debian"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi

PYTHON="${PYTHON:-python3}"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || die "Python 3.11+ is required ($PYTHON is $("$PYTHON" -V 2>&1)); set PYTHON=/path/to/python3.11"
if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  "$PYTHON" -m venv .venv || { rm -rf .venv; die "could not create a venv (on Debian: apt-get install -y python3-venv)"; }
fi
# Every dependency, transitive ones too, comes from requirements.lock (pip-compile
# --generate-hashes from pyproject.toml), checked against its hashes; the project itself is
# then installed without resolving anything more.
stamp=".venv/.installed-$(cat pyproject.toml requirements.lock | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  say "installing Python dependencies (requirements.lock, with hashes)"
  .venv/bin/python -m pip install -q --require-hashes -r requirements.lock
  .venv/bin/python -m pip install -q --no-deps -e .
  .venv/bin/python -m pip check >/dev/null \
    || die "requirements.lock misses what pyproject.toml asks for: regenerate it (tests/unit/test_lock.py says how)"
  rm -f .venv/.installed-*; touch "$stamp"
fi

# Resolved into a temporary directory and moved into place whole, so an interrupted download
# never leaves a half-filled directory that later looks complete.
KAFKA_LIBS="${KAFKA_LIBS:-$HOME/.cache/dronepipe/kafka-4.1.2/libs}"
if ! ls "$KAFKA_LIBS"/kafka_2.13-*.jar >/dev/null 2>&1; then
  say "resolving Kafka jars from Maven Central into $KAFKA_LIBS"
  mkdir -p "$(dirname "$KAFKA_LIBS")"
  partial="$KAFKA_LIBS.partial.$$"
  trap 'rm -rf "$partial" "$partial.log"' EXIT
  if ! mvn -q -B -f infra/pom.xml dependency:copy-dependencies -Dkafka.libs="$partial" >"$partial.log" 2>&1; then
    cat "$partial.log" >&2
    die "Maven could not resolve the Kafka jars (is Maven Central reachable?)"
  fi
  ls "$partial"/kafka_2.13-*.jar >/dev/null 2>&1 || die "Maven finished but no kafka_2.13 jar arrived in $partial"
  rm -rf "$KAFKA_LIBS"
  mv "$partial" "$KAFKA_LIBS"
fi
# Apicurio Registry, the external registry of the second test lane (infra/apicurio_lane.py)
bash infra/apicurio.sh
say "ready"
