#!/usr/bin/env bash
# One entry point for a fresh Debian 12 machine (run as root):
#   ./dev.sh demo   install what is missing, build the guest image, run the demo
#   ./dev.sh test   install what is missing, build the guest image, run every test
# Everything it installs is idempotent and cached: a second run starts at once.
set -euo pipefail
cd "$(dirname "$0")"

APT_PACKAGES=(qemu-system-x86 qemu-utils busybox-static mmdebstrap squashfs-tools squashfs-tools-ng cpio kmod e2fsprogs
              ca-certificates nftables docker-registry docker.io
              chromium curl)  # tests/integration/test_ports.py: a preview URL in a real browser
# For the suite only: musl-gcc links the musl program a container image test runs.
TEST_APT_PACKAGES=(musl-tools)
VENV=${FORKD_VENV:-.venv}
# The interpreter forkd's venv is made with: Debian 12's own Python (3.11.2, the
# oldest forkd supports) wherever it is, so that the suite runs on the floor;
# FORKD_PYTHON picks another.
if [ -n "${FORKD_PYTHON:-}" ]; then
    PYTHON=$FORKD_PYTHON
elif /usr/bin/python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    PYTHON=/usr/bin/python3
else
    PYTHON=python3
fi

log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

install_apt() {  # the packages every command needs, and "$@"
    local missing=()
    for p in "${APT_PACKAGES[@]}" "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" \
            || missing+=("$p")
    done
    "$PYTHON" -c 'import ensurepip' 2>/dev/null || missing+=(python3-venv)
    # The image builder asks apt for the kernel package: the lists must exist.
    if [ ${#missing[@]} -gt 0 ] || ! ls /var/lib/apt/lists/*Packages* >/dev/null 2>&1; then
        log "apt-get update"
        as_root apt-get update -qq
    fi
    if [ ${#missing[@]} -gt 0 ]; then
        log "installing Debian packages: ${missing[*]}"
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            --no-install-recommends "${missing[@]}" >/dev/null
        # The tests start their own registries on loopback; the package's service
        # (every address, port 5000) is not wanted running on a systemd host.
        if [[ " ${missing[*]} " == *" docker-registry "* ]] && [ -d /run/systemd/system ]; then
            as_root systemctl disable --now docker-registry >/dev/null 2>&1 || true
        fi
        # Nor the Docker Engine's (root's socket, /var/lib/docker): tests/docker_daemon.py
        # starts a dockerd of its own on a private socket and data root.
        if [[ " ${missing[*]} " == *" docker.io "* ]] && [ -d /run/systemd/system ]; then
            as_root systemctl disable --now docker.socket docker.service >/dev/null 2>&1 || true
        fi
    fi
}

install_python() {
    if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        echo "forkd needs Python 3.11 or newer (found $("$PYTHON" --version))" >&2
        exit 1
    fi
    local stamp="$VENV/.forkd-installed" want version
    version=$("$PYTHON" -c 'import sys; print(sys.version)')
    want=$( (cat pyproject.toml; echo "$version") | sha256sum | cut -d' ' -f1)
    if [ -x "$VENV/bin/python" ] && [ "$("$VENV/bin/python" -c 'import sys; print(sys.version)')" != "$version" ]; then
        log "$VENV was made with another Python: making it anew with $PYTHON"
        rm -rf "$VENV"
    fi
    if [ ! -x "$VENV/bin/python" ]; then
        log "creating $VENV with $PYTHON ($("$PYTHON" --version))"
        "$PYTHON" -m venv "$VENV"
    fi
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        log "installing forkd and its Python dependencies into $VENV"
        "$VENV/bin/python" -m pip install -q --upgrade pip
        "$VENV/bin/python" -m pip install -q -e '.[dev]'
        echo "$want" >"$stamp"
    fi
}

install_node() {
    # tests/integration/test_typescript_sdk.py builds and tests sdk/typescript: node 20+.
    # Debian 12 ships node 18; the npm registry's "node" package carries node 20.
    local major
    major=$(node --version 2>/dev/null | sed -E 's/^v([0-9]+).*/\1/') || major=0
    [ "${major:-0}" -ge 20 ] && return
    if ! command -v npm >/dev/null; then
        log "installing nodejs and npm (Debian)"
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            --no-install-recommends nodejs npm >/dev/null
    fi
    log "installing node 20 from the npm registry"
    if ! as_root npm install -g --no-audit --no-fund node@20 >/dev/null; then
        # Not fatal: the TypeScript SDK's tests then skip, saying node 20 is missing.
        log "could not install node 20: the TypeScript SDK tests will be skipped"
    fi
    hash -r
}

newest_python() {
    # The newest CPython on this machine newer than the venv's (PATH, then pyenv's), if any.
    local candidate best="" best_version=0 version
    for candidate in python3.14 python3.13 python3.12 \
        "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python3; do
        command -v "$candidate" >/dev/null 2>&1 || continue
        version=$("$candidate" -c 'import sys; print(sys.version_info[0] * 100 + sys.version_info[1])' \
            2>/dev/null) || continue
        if [ "$version" -gt "$best_version" ]; then best=$candidate; best_version=$version; fi
    done
    echo "$best"
}

test_archives_on_newest_python() {
    # The untrusted-archive suite (standard library only) on the newest Python too: the
    # extractor must hold on the oldest supported (the venv's) and the newest alike.
    local newest venv=.venv-newest
    newest=$(newest_python)
    if [ -z "$newest" ]; then
        log "no Python newer than $("$PYTHON" --version) here: tests/archive ran on it alone"
        return
    fi
    if [ ! -x "$venv/bin/python" ] || [ "$("$venv/bin/python" -c 'import sys; print(sys.version)')" \
            != "$("$newest" -c 'import sys; print(sys.version)')" ]; then
        rm -rf "$venv"
        "$newest" -m venv "$venv"
        "$venv/bin/python" -m pip install -q 'pytest>=8.0' 'pytest-timeout>=2.3' 'hypothesis>=6.100'
    fi
    log "tests/archive on $("$venv/bin/python" --version)"
    PYTHONPATH=src "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/archive
}

run_suite() {
    # The tests that boot no VM spend most of their time waiting (timeouts, sockets,
    # subprocesses): four workers on two cores, one test file each at a time, take 5
    # minutes where one took 15 (six began to miss their timing bounds). The
    # VM tests then run one at a time: each guest wants a core under TCG, and some
    # measure the daemon's latency beside a busy guest.
    local unit=0 vms=0
    log "tests without VMs, on 4 workers"
    "$VENV/bin/python" -m pytest -ra -n 4 --dist loadfile tests/unit tests/fuzz tests/archive \
        || unit=$?
    log "tests with real VMs"
    "$VENV/bin/python" -m pytest -ra tests/integration || vms=$?
    [ "$unit" -eq 0 ] || { log "tests without VMs failed (exit $unit)"; exit "$unit"; }
    exit "$vms"
}

build_image() {
    log "guest image (cached after the first build)"
    "$VENV/bin/forkd" image build python
}

cmd=${1:-}
case "$cmd" in
    demo)
        install_apt; install_python; build_image
        shift
        exec "$VENV/bin/python" -m forkd.demo "$@"
        ;;
    test)
        install_apt "${TEST_APT_PACKAGES[@]}"; install_node; install_python; build_image
        shift
        log "ruff"
        "$VENV/bin/ruff" check src tests bench
        "$VENV/bin/ruff" format --check src tests bench
        log "mypy (strict on src/, every test's body checked: [tool.mypy] in pyproject.toml)"
        "$VENV/bin/mypy" --cache-dir "$VENV/.mypy_cache"
        test_archives_on_newest_python
        log "pytest on $("$VENV/bin/python" --version)"
        [ $# -gt 0 ] && exec "$VENV/bin/python" -m pytest -ra "$@"
        run_suite
        ;;
    *)
        echo "usage: $0 demo|test [args...]" >&2
        exit 2
        ;;
esac
