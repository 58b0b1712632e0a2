# Sourced by the scripts: create a venv and install prefixattn into it with torch pinned first.
PYTHON=${PYTHON:-python3}

# Downloads from the package index break off now and then on CI machines (one run: a 7.1 MB wheel stopped at 5.0 MB
# through all six of pip's resumes, failing three suites): every install is retried whole, after a pause, before a
# suite fails for it. pip's own --retries covers connection errors within one attempt.
PIP_INSTALL_ATTEMPTS=${PIP_INSTALL_ATTEMPTS:-4}
PIP_INSTALL_PAUSE_S=${PIP_INSTALL_PAUSE_S:-20}

pip_install() {  # $1 = venv dir; further arguments go to `pip install -q`
  local venv=$1 attempt
  shift
  for ((attempt = 1; ; attempt++)); do
    if "$venv/bin/python" -m pip install -q --retries 10 --timeout 60 "$@"; then return 0; fi
    if [ "$attempt" -ge "$PIP_INSTALL_ATTEMPTS" ]; then
      echo "pip install $*: failed $attempt times" >&2
      return 1
    fi
    echo "pip install $*: attempt $attempt of $PIP_INSTALL_ATTEMPTS failed; again in $((attempt * PIP_INSTALL_PAUSE_S)) s" >&2
    sleep $((attempt * PIP_INSTALL_PAUSE_S))
  done
}

setup_venv() {  # $1 = venv dir, $2 = extras (comma-separated)
  [ -x "$1/bin/python" ] || "$PYTHON" -m venv "$1"
  pip_install "$1" --upgrade pip >/dev/null
  # torch first and pinned: a bare "torch" requirement would pull a multi-GB CUDA build.
  pip_install "$1" torch==2.13.0
  install_editable "$1" "$2"
}

# An editable install writes prefixattn.egg-info into the checkout, and scripts/test.sh runs suites side by side:
# the installs take turns (flock, where the system has it) so that none reads the folder while another writes it.
install_editable() {  # $1 = venv dir, $2 = extras (comma-separated); further arguments: more pip requirements
  local venv=$1 extras=$2
  shift 2
  if command -v flock >/dev/null; then
    ( flock 9 && pip_install "$venv" "$@" -e ".[$extras]" ) 9>"${TMPDIR:-/tmp}/prefixattn-install.lock"
  else
    pip_install "$venv" "$@" -e ".[$extras]"
  fi
  # numba caches the compiled planner beside its sources (this checkout's __pycache__), one index per function, and
  # a numba of another version rewrites that index: the venvs here pin different numbas (vLLM's its own), so every
  # switch between them compiled the planner again (~70 s on 2 cores, in each vLLM engine process the suites start).
  # Each venv keeps its own cache; the scripts run a venv's suite right after its install.
  export NUMBA_CACHE_DIR="$(cd "$venv" && pwd)/numba-cache"
}
