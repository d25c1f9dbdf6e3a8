#!/usr/bin/env bash
# Sets up everything on a fresh machine, idempotently: Python venv and pinned dependencies,
# the Kafka jars from Maven Central, Debian's redis-server. Java 17 and Maven must exist.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

command -v java >/dev/null || { echo "setup: Java 17+ is required (apt-get install -y openjdk-17-jre-headless)" >&2; exit 1; }
command -v mvn >/dev/null || { echo "setup: Maven is required to fetch the Kafka jars (apt-get install -y maven)" >&2; exit 1; }

if ! command -v redis-server >/dev/null; then
  say "installing redis-server from Debian"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq redis-server >/dev/null
  # Debian's package starts a system Redis on 6379; the project runs its own
  (systemctl stop redis-server 2>/dev/null || service redis-server stop 2>/dev/null || pkill -x redis-server || true) >/dev/null 2>&1
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  "$PYTHON" -m venv .venv
fi
stamp=".venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  say "installing Python dependencies (pinned in pyproject.toml)"
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q -e ".[test]"
  rm -f .venv/.installed-*; touch "$stamp"
fi

KAFKA_LIBS="${KAFKA_LIBS:-$HOME/.cache/dronepipe/kafka-4.1.2/libs}"
if ! ls "$KAFKA_LIBS"/kafka_2.13-*.jar >/dev/null 2>&1; then
  say "resolving Kafka jars from Maven Central into $KAFKA_LIBS"
  mvn -q -B -f infra/pom.xml dependency:copy-dependencies -Dkafka.libs="$KAFKA_LIBS"
fi
say "ready"
