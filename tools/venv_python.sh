# Sourced by dist_train.sh / dist_test.sh: sets PYTHON, the interpreter that runs the tools.
# $PYTHON when set; else the environment tools/setup_env.sh builds ($LINVIT_VENV, default
# <repo>/.venv), so the scripts work without an activated environment; else `python` on PATH.
if [[ -z "${PYTHON:-}" ]]; then
    _venv="${LINVIT_VENV:-"$(dirname "${BASH_SOURCE[0]}")/../.venv"}"
    if [[ -x "$_venv/bin/python" ]]; then
        PYTHON="$_venv/bin/python"
    elif [[ -n "${LINVIT_VENV:-}" ]]; then
        echo "$(basename "$0"): LINVIT_VENV=$LINVIT_VENV has no bin/python; build it with" \
             "tools/setup_env.sh or set PYTHON to an interpreter" >&2
        exit 1
    else
        PYTHON=python
    fi
    unset _venv
fi
