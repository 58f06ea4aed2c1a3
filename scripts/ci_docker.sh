#!/usr/bin/env bash
# Make a Docker engine and a local Python image available for the Docker sandbox backend's live tests.
#
#   scripts/ci_docker.sh            # idempotent: each step is skipped when its result is already there
#
# 1. Installs Debian's `docker.io` if `dockerd` is missing (apt; no registry needed).
# 2. Starts `dockerd --storage-driver=vfs --iptables=false --bridge=none` in the background if no engine answers
#    (log: $AGENTENV_DOCKERD_LOG), and waits for it (at most $AGENTENV_DOCKERD_WAIT_S seconds).
# 3. Builds the image $AGENTENV_DOCKER_IMAGE (default agentenv-python:3.11) if it is missing. No registry is
#    reachable, so the image is imported from a rootfs staged from the host: /usr/bin/python3.11, its stdlib
#    compiled into /usr/lib/python311.zip, lib-dynload, /usr/bin/sleep and every library `ldd` lists for them,
#    every directory a+rx, a `python3` symlink.
# Exit status 0 when the engine answers and the image runs `python3 -c 'print(1)'`; non-zero with a message otherwise.
set -euo pipefail

IMAGE="${AGENTENV_DOCKER_IMAGE:-agentenv-python:3.11}"
LOG="${AGENTENV_DOCKERD_LOG:-/tmp/agentenv-dockerd.log}"
WAIT_S="${AGENTENV_DOCKERD_WAIT_S:-60}"
PY="${AGENTENV_DOCKER_HOST_PYTHON:-/usr/bin/python3.11}"

say() { echo "ci_docker: $*" >&2; }

engine_up() { docker info >/dev/null 2>&1; }

if ! command -v dockerd >/dev/null 2>&1; then
    say "installing docker.io (Debian)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y --no-install-recommends docker.io >/dev/null 2>&1 || {
        apt-get update >/dev/null && apt-get install -y --no-install-recommends docker.io >/dev/null; }
fi

if ! engine_up; then
    say "starting dockerd (vfs storage, no iptables, no bridge); log in $LOG"
    setsid nohup dockerd --storage-driver=vfs --iptables=false --bridge=none >"$LOG" 2>&1 < /dev/null &
    for _ in $(seq "$WAIT_S"); do
        engine_up && break
        sleep 1
    done
    engine_up || { say "dockerd did not answer within ${WAIT_S}s; last log lines:"; tail -20 "$LOG" >&2; exit 1; }
fi

if ! docker image inspect "$IMAGE" >/dev/null 2>&1; then
    say "building $IMAGE from the host's $PY"
    [ -x "$PY" ] || { say "no $PY on this host (apt-get install python3.11)"; exit 1; }
    ROOT="$(mktemp -d /tmp/agentenv-rootfs.XXXXXX)"
    trap 'rm -rf "$ROOT"' EXIT
    pylib="/usr/lib/$(basename "$PY")"
    mkdir -p "$ROOT/usr/bin" "$ROOT/usr/lib" "$ROOT/tmp" "$ROOT/dev" "$ROOT/proc" "$ROOT/etc"
    cp -a "$PY" "$ROOT/usr/bin/"
    cp -a "$(readlink -f /usr/bin/sleep)" "$ROOT/usr/bin/sleep"
    # The stdlib as one compiled zip (on the interpreter's default sys.path): the vfs storage driver copies the
    # image file by file for every container, so a few files start far faster than thousands.
    mkdir -p "$ROOT$pylib"
    cp -a "$pylib/lib-dynload" "$ROOT$pylib/"
    cp "$pylib/os.py" "$ROOT$pylib/"  # the landmark getpath looks for; the zip comes first on sys.path
    "$PY" -S -I - "$pylib" "$ROOT/usr/lib/python$("$PY" -S -I -c 'import sys; print("%d%d" % sys.version_info[:2])').zip" <<'PYEOF'
import os, sys, zipfile
src, out = sys.argv[1], sys.argv[2]
skip = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "pydoc_data", "lib2to3", "distutils", "lib-dynload",
        "site-packages", "dist-packages", "__pycache__"}
with zipfile.PyZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if name in skip or name.startswith("config-"):
            continue
        if os.path.isdir(path) and os.path.isfile(os.path.join(path, "__init__.py")):
            z.writepy(path)
        elif name.endswith(".py"):
            z.writepy(path)
PYEOF
    # Every shared library the interpreter, its extension modules and sleep need, at the same paths.
    { ldd "$PY"; ldd /usr/bin/sleep; find "$pylib/lib-dynload" -name '*.so' -exec ldd {} \; ; } 2>/dev/null \
        | grep -o '/[^ ]*' | sort -u | while read -r lib; do
            [ -e "$lib" ] || continue
            mkdir -p "$ROOT$(dirname "$lib")"
            cp -L "$lib" "$ROOT$lib"
        done
    for top in bin lib lib64; do  # merged-usr links as on the host
        if [ -L "/$top" ]; then ln -sfn "$(readlink "/$top")" "$ROOT/$top"; fi
    done
    ln -sfn "$(basename "$PY")" "$ROOT/usr/bin/python3"
    chmod 1777 "$ROOT/tmp"
    find "$ROOT" -type d -exec chmod a+rx {} +
    find "$ROOT" -type f -exec chmod a+r {} +
    tar -C "$ROOT" -c . | docker import --change 'ENV PATH=/usr/local/bin:/usr/bin:/bin' - "$IMAGE" >/dev/null
fi

out="$(docker run --rm --network none --read-only --user 65534:65534 "$IMAGE" python3 -S -I -c 'print(1)')"
[ "$out" = "1" ] || { say "the image $IMAGE does not run python3 (got: $out)"; exit 1; }
say "engine up, image $IMAGE runs python3"
