# Sourced by launch/demo and launch/test: make (or reuse) the virtualenv with mpickpt installed.
# Sets VENV. Skips pip when everything is already importable, so a second run starts in seconds.
mpickpt_venv() {
    local extras="$1"
    VENV="${MPICKPT_VENV:-$PWD/.venv}"
    local py="${PYTHON:-python3}"
    if [ ! -x "$VENV/bin/python" ]; then
        echo "== creating virtualenv $VENV"
        "$py" -m venv "$VENV"
    fi
    local stamp="$VENV/.mpickpt-installed-$extras"
    if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] \
        && "$VENV/bin/python" -c "import mpickpt, torch, mpi4py, h5py" 2>/dev/null; then
        return 0
    fi
    echo "== installing torch (${MPICKPT_TORCH:-torch==2.13.0}) and mpickpt[$extras] into $VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${MPICKPT_TORCH:-torch==2.13.0}"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[$extras]"
    touch "$stamp"
}
