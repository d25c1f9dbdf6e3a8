#!/usr/bin/env bash
# Installs Apicurio Registry (the all-in-one Quarkus app, io.apicurio:apicurio-registry-app,
# classifier all, type tar.gz) from Maven Central into $APICURIO_HOME, idempotently. The test
# lane that runs the pipeline against an external registry starts it (infra/apicurio.py).
# Resolved into a temporary directory and moved into place whole, so an interrupted
# download never leaves a half-filled directory that later looks complete.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=3.3.3
APICURIO_HOME="${APICURIO_HOME:-$HOME/.cache/dronepipe/apicurio-registry-$VERSION}"
# it runs on Java 21+, which may not be the machine's default java (Kafka's 17): say so here
.venv/bin/python -c 'from infra.apicurio import java_home; java_home()' \
  || { echo "setup: Apicurio Registry needs a Java 21+ JDK under /usr/lib/jvm (or APICURIO_JAVA_HOME)" >&2; exit 1; }
[ -f "$APICURIO_HOME/quarkus-run.jar" ] && exit 0

printf '\033[1m[setup]\033[0m %s\n' "installing Apicurio Registry $VERSION from Maven Central into $APICURIO_HOME" >&2
mkdir -p "$(dirname "$APICURIO_HOME")"
partial="$APICURIO_HOME.partial.$$"
trap 'rm -rf "$partial"' EXIT
mkdir -p "$partial/download"
if ! mvn -q -B org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy \
    -Dartifact="io.apicurio:apicurio-registry-app:$VERSION:tar.gz:all" \
    -DoutputDirectory="$partial/download" >"$partial/mvn.log" 2>&1; then
  cat "$partial/mvn.log" >&2
  echo "setup: Maven could not fetch Apicurio Registry $VERSION (is Maven Central reachable?)" >&2
  exit 1
fi
tar -xzf "$partial/download/apicurio-registry-app-$VERSION-all.tar.gz" -C "$partial"
rm -rf "$partial/download" "$partial/mvn.log"
[ -f "$partial/quarkus-run.jar" ] || { echo "setup: no quarkus-run.jar in the Apicurio archive" >&2; exit 1; }
rm -rf "$APICURIO_HOME"
mv "$partial" "$APICURIO_HOME"
