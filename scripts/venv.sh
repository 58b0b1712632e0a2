# Sourced by the scripts: create a venv and install prefixattn into it with torch pinned first.
PYTHON=${PYTHON:-python3}

setup_venv() {  # $1 = venv dir, $2 = extras (comma-separated)
  [ -x "$1/bin/python" ] || "$PYTHON" -m venv "$1"
  "$1/bin/python" -m pip install -q --upgrade pip >/dev/null
  # torch first and pinned: a bare "torch" requirement would pull a multi-GB CUDA build.
  "$1/bin/python" -m pip install -q torch==2.13.0
  "$1/bin/python" -m pip install -q -e ".[$2]"
}
