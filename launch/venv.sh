# shellcheck shell=bash
# The one virtualenv setup of launch/demo and launch/test (both source this file and call
# mpickpt_venv with the extras they need).
#
# Environment (the same for both scripts):
#   MPICKPT_VENV      virtualenv to create and use (default: .venv at the repository root; a
#                     relative path is taken from the repository root). Shared by both scripts.
#   MPICKPT_TORCH     pip requirement for PyTorch (default: torch==2.13.0); for example
#                     "torch>=2.1" to accept whatever is installable here
#   MPICKPT_MPIEXEC   a system mpiexec to use instead of the one of the 'mpich' wheel in the venv
#                     (Open MPI gets --oversubscribe); mpi4py must then be built for that MPI
#   PYTHON            the Python (3.10 or newer) that creates the venv (default: the first of
#                     python3, python3.13 ... python3.10, python that is 3.10 or newer)
#
# mpickpt_venv EXTRAS   (EXTRAS: comma-separated extras of pyproject.toml, e.g. "mpich" or
#                       "mpich,test,bench")
#   Makes (or reuses) the virtualenv with $MPICKPT_TORCH and mpickpt[EXTRAS] installed editable
#   from this checkout, and sets REPO (the checkout), VENV and VPY (the venv's python).
#   The stamp file $VENV/.mpickpt-installed holds a hash of pyproject.toml, the checkout's path
#   and the torch requirement, then the extras installed. pip runs only when that hash differs,
#   an extra asked for is not installed yet, or a module is missing; so a venv set up with more
#   extras (launch/test's) serves launch/demo as it is, and one set up by launch/demo gets the
#   test extras added by launch/test. A reinstall keeps the extras installed before.

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MPICKPT_VENV:-$REPO/.venv}"
case "$VENV" in /*) ;; *) VENV="$REPO/$VENV" ;; esac
VPY="$VENV/bin/python"
MPICKPT_TORCH_SPEC="${MPICKPT_TORCH:-torch==2.13.0}"
MPICKPT_STAMP="$VENV/.mpickpt-installed"

_mpickpt_say() { printf '%s\n' "$*"; }
_mpickpt_die() { printf '%s: %s\n' "${0##*/}" "$*" >&2; exit 1; }

# The Python that creates the venv: $PYTHON if set (it must be 3.10+), else the first 3.10+ found.
_mpickpt_find_python() {
    local c
    local -a cands=(python3 python3.13 python3.12 python3.11 python3.10 python)
    [ -n "${PYTHON:-}" ] && cands=("$PYTHON")
    for c in "${cands[@]}"; do
        if command -v "$c" >/dev/null 2>&1 &&
            "$c" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
            command -v "$c"
            return 0
        fi
    done
    return 1
}

# "b,a,,b" -> "a,b": the extras as a sorted list without repeats.
_mpickpt_norm_extras() {
    printf '%s\n' "${1//,/$'\n'}" | sed '/^[[:space:]]*$/d' | sort -u | paste -sd, -
}

# The first line of the stamp: what an installed venv must match.
_mpickpt_stamp_hash() {
    local h
    h="$( (cat "$REPO/pyproject.toml"; printf '%s\n%s\n' "$REPO" "$MPICKPT_TORCH_SPEC") | sha256sum)"
    printf '%s\n' "${h%% *}"
}

# The extras the stamp says are installed, if the stamp is current; else nothing.
_mpickpt_stamped_extras() {
    [ -f "$MPICKPT_STAMP" ] && [ "$(sed -n 1p "$MPICKPT_STAMP")" = "$(_mpickpt_stamp_hash)" ] &&
        sed -n 2p "$MPICKPT_STAMP"
    return 0
}

# True when the venv has everything that the extras $1 need, so nothing is installed (no MPI
# started, no torch imported: this takes a fraction of a second).
_mpickpt_ready() {
    local want="$1" have e
    [ -x "$VPY" ] || return 1
    have="$(_mpickpt_stamped_extras)"
    [ -n "$have" ] || return 1
    for e in ${want//,/ }; do
        case ",$have," in *",$e,"*) ;; *) return 1 ;; esac
    done
    case ",$want," in
        *,mpich,*) [ -n "${MPICKPT_MPIEXEC:-}" ] || [ -x "$VENV/bin/mpiexec" ] || return 1 ;;
    esac
    "$VPY" - "$REPO" "$want" <<'EOF' 2>/dev/null
import importlib.util
import os
import sys

repo, extras = sys.argv[1], sys.argv[2].split(",")
mods = ["torch", "numpy", "h5py", "mpi4py", "xxhash"]
per_extra = {
    "test": ["pytest", "pytest_mpi", "pytest_timeout", "ruff", "psutil"],
    "bench": ["matplotlib"],
    "plot": ["matplotlib"],
    "export": ["safetensors"],
}
for extra in extras:
    mods += per_extra.get(extra, [])
for mod in mods:
    if importlib.util.find_spec(mod) is None:
        sys.exit(1)
spec = importlib.util.find_spec("mpickpt")  # must be the editable install of this very checkout
if spec is None or not os.path.realpath(spec.origin).startswith(os.path.realpath(repo) + os.sep):
    sys.exit(1)
EOF
}

_mpickpt_make_venv() {
    local py
    py="$(_mpickpt_find_python)" ||
        _mpickpt_die "no Python 3.10 or newer found${PYTHON:+ (PYTHON=$PYTHON)}; install one, or set PYTHON=/path/to/python3"
    _mpickpt_say "Creating the virtualenv $VENV with $py ($("$py" -c 'import platform; print(platform.python_version())'))"
    if [ -e "$VENV" ] && [ -n "$(ls -A "$VENV" 2>/dev/null)" ]; then
        [ -f "$VENV/pyvenv.cfg" ] || _mpickpt_die "$VENV exists and is not a virtualenv; remove it or set MPICKPT_VENV"
        rm -rf "$VENV"  # a broken venv (its Python is gone): make it anew
    fi
    if ! "$py" -m venv "$VENV"; then
        # Debian and Ubuntu ship venv without ensurepip (package python3-venv): make the venv
        # without pip, then let the system's pip install pip into it.
        _mpickpt_say "  'python -m venv' could not install pip into the venv; trying the system's pip instead"
        rm -rf "$VENV"
        "$py" -m venv --without-pip "$VENV"
        "$py" -m pip --python "$VPY" install pip ||
            _mpickpt_die "could not put pip into $VENV: install python3-venv (Debian/Ubuntu) or a newer pip"
    fi
}

mpickpt_venv() {
    local want extras
    want="$(_mpickpt_norm_extras "$1")"
    if [ -n "${MPICKPT_MPIEXEC:-}" ]; then
        command -v "$MPICKPT_MPIEXEC" >/dev/null 2>&1 ||
            _mpickpt_die "MPICKPT_MPIEXEC=$MPICKPT_MPIEXEC is not an executable"
    fi
    if _mpickpt_ready "$want"; then
        _mpickpt_say "Setup: $VENV already has mpickpt[$want] and $MPICKPT_TORCH_SPEC (delete it to reinstall)."
        return 0
    fi
    [ -x "$VPY" ] || _mpickpt_make_venv
    # Keep what an earlier setup of this checkout installed (launch/test's extras, for launch/demo).
    extras="$(_mpickpt_norm_extras "$want,$(_mpickpt_stamped_extras)")"
    _mpickpt_say "Installing mpickpt[$extras] (editable) and $MPICKPT_TORCH_SPEC into $VENV"
    if ! "$VPY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)' 2>/dev/null; then
        _mpickpt_say "  (this downloads PyTorch and can take a few minutes; set MPICKPT_TORCH to choose"
        _mpickpt_say "  another PyTorch, or PIP_INDEX_URL to get it from a CPU-only index)"
    fi
    rm -f "$MPICKPT_STAMP"
    (cd "$REPO" && "$VPY" -m pip install --disable-pip-version-check -e ".[$extras]" "$MPICKPT_TORCH_SPEC")
    printf '%s\n%s\n' "$(_mpickpt_stamp_hash)" "$extras" >"$MPICKPT_STAMP"
    if ! _mpickpt_ready "$want"; then
        rm -f "$MPICKPT_STAMP"
        _mpickpt_die "the install in $VENV finished but something of mpickpt[$want] (torch, mpi4py, mpiexec, ...) is still missing"
    fi
    _mpickpt_say "Setup done."
}
