# Sourced by scripts/demo, scripts/test and scripts/test-lowest: make a fresh Debian machine ready.
#   ensure_debian BINARY PACKAGE ...   install PACKAGE when BINARY is not on PATH
#   ensure_python                      python3 that can make venvs
#   ensure_venv [DIR PIP-ARGS...]      DIR (default .venv) with PIP-ARGS installed (default: this
#                                      package with its test extra, editable); rebuilt from scratch
#                                      when pyproject.toml or constraints/ changed since; made with
#                                      $VENV_PYTHON when set (default python3)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

ensure_debian() {
  local missing=()
  while [ $# -gt 1 ]; do
    command -v "$1" >/dev/null 2>&1 || missing+=("$2")
    shift 2
  done
  [ ${#missing[@]} -eq 0 ] || apt_install "${missing[@]}"
}

apt_install() {
  if [ "$(id -u)" -ne 0 ] && ! command -v sudo >/dev/null 2>&1; then
    echo "missing: $* (install them with apt-get as root)" >&2
    exit 1
  fi
  local as_root=()
  [ "$(id -u)" -ne 0 ] && as_root=(sudo)
  echo "installing Debian packages: $*" >&2
  export DEBIAN_FRONTEND=noninteractive
  "${as_root[@]}" apt-get update -qq
  "${as_root[@]}" apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

ensure_python() {
  ensure_debian python3 python3
  # Debian's python3 makes venvs only with python3-venv (ensurepip) installed.
  python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || apt_install python3-venv
}

ensure_venv() {
  local dir="${1:-.venv}"
  shift || true
  local args=("$@")
  [ ${#args[@]} -eq 0 ] && args=(-e '.[test]')
  local stamp="$dir/.otel-lock-installed"
  if [ -f "$stamp" ] && [ -z "$(find pyproject.toml constraints -newer "$stamp" -print -quit)" ]; then
    return 0
  fi
  [ -n "${VENV_PYTHON:-}" ] || ensure_python
  if [ "$dir" != .venv ] || [ ! -x "$dir/bin/python" ]; then
    rm -rf "$dir"
    "${VENV_PYTHON:-python3}" -m venv "$dir"
  fi
  echo "installing into $dir: ${args[*]}" >&2
  "$dir/bin/python" -m pip install -q --upgrade pip
  "$dir/bin/python" -m pip install -q "${args[@]}"
  touch "$stamp"
}
