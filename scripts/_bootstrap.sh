# Sourced by scripts/demo and scripts/test: make a fresh Debian machine ready.
#   ensure_debian BINARY PACKAGE ...   install PACKAGE when BINARY is not on PATH
#   ensure_venv                        .venv with this package and its test extra
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

ensure_debian() {
  local missing=()
  while [ $# -gt 1 ]; do
    command -v "$1" >/dev/null 2>&1 || missing+=("$2")
    shift 2
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -ne 0 ] && ! command -v sudo >/dev/null 2>&1; then
    echo "missing: ${missing[*]} (install them with apt-get as root)" >&2
    exit 1
  fi
  local as_root=()
  [ "$(id -u)" -ne 0 ] && as_root=(sudo)
  echo "installing Debian packages: ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  "${as_root[@]}" apt-get update -qq
  "${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

ensure_venv() {
  if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
  fi
  # Reinstall only when pyproject.toml changed since the last install.
  local stamp=.venv/.otel-lock-installed
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e '.[test]'
    touch "$stamp"
  fi
}
