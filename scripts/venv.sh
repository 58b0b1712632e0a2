# Sourced by the scripts: create a venv and install prefixattn into it with torch pinned first.
PYTHON=${PYTHON:-python3}

setup_venv() {  # $1 = venv dir, $2 = extras (comma-separated)
  [ -x "$1/bin/python" ] || "$PYTHON" -m venv "$1"
  "$1/bin/python" -m pip install -q --upgrade pip >/dev/null
  # torch first and pinned: a bare "torch" requirement would pull a multi-GB CUDA build.
  "$1/bin/python" -m pip install -q torch==2.13.0
  install_editable "$1" "$2"
}

# An editable install writes prefixattn.egg-info into the checkout, and scripts/test.sh runs suites side by side:
# the installs take turns (flock, where the system has it) so that none reads the folder while another writes it.
install_editable() {  # $1 = venv dir, $2 = extras (comma-separated); further arguments: more pip requirements
  local venv=$1 extras=$2
  shift 2
  if command -v flock >/dev/null; then
    ( flock 9 && "$venv/bin/python" -m pip install -q "$@" -e ".[$extras]" ) 9>"${TMPDIR:-/tmp}/prefixattn-install.lock"
  else
    "$venv/bin/python" -m pip install -q "$@" -e ".[$extras]"
  fi
}
