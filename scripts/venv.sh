# shellcheck shell=bash
# Picks the Python interpreter that scripts/install.sh, train.sh and test.sh install into and
# run with; sourced by them (and by tests/integration/test_first_run.py on its own).
#
# After `hora_select_python`, HORA_PY is that interpreter and, when it is the project's virtual
# environment, its bin/ is first on PATH and VIRTUAL_ENV is exported, so `hora`, `python` and
# the processes they start are the environment's. In this order:
#   1. PYTHON=/path/to/python        that interpreter, as it is (no environment is made);
#   2. an active environment         VIRTUAL_ENV or CONDA_PREFIX set, or python3 runs inside a
#                                    venv (sys.prefix != sys.base_prefix): python3, as it is;
#   3. HORA_NO_VENV=1                python3 from PATH, as it is (refused with a clear message
#                                    when it is "externally managed", PEP 668);
#   4. otherwise                     the project's virtual environment, HORA_VENV (default:
#                                    .venv in the repository), made with `python3 -m venv` on
#                                    the first run and reused after. It sees the packages of
#                                    the python3 it was made from (--system-site-packages) when
#                                    that python3 is one pip may install into (pyenv, a
#                                    container's own Python: what is installed there is reused),
#                                    and is isolated from a distribution's python3 (Debian,
#                                    Ubuntu: externally managed). HORA_VENV_SYSTEM_SITE=1 or 0
#                                    decides instead.
# Without the venv module or ensurepip (Debian and Ubuntu ship them as python3-venv), root with
# apt-get installs python3-venv; anyone else is told the command.
#
# HORA_INSTALL_DRY_RUN=1: `hora_do` prints each command that would change the system (apt-get,
# pip) instead of running it; the virtual environment itself is still made, since choosing and
# making it is what this file does.

hora_log() { echo "hora: $*" >&2; }
hora_die() {
  echo "hora: error: $*" >&2
  exit 1
}

hora_dry_run() { [ "${HORA_INSTALL_DRY_RUN:-0}" = 1 ]; }

# Runs a command, or prints it under HORA_INSTALL_DRY_RUN=1.
hora_do() {
  if hora_dry_run; then
    echo "+ $*"
  else
    "$@"
  fi
}

# What an interpreter is, as "version in_env managed has_pip has_venv" (1 or 0 each after the
# version), for the decisions below.
_hora_probe() {
  "$1" - <<'EOF' 2>/dev/null
import importlib.util, os, sys, sysconfig
scheme = sysconfig.get_default_scheme() if hasattr(sysconfig, "get_default_scheme") else None
stdlib = sysconfig.get_path("stdlib", scheme) if scheme else sysconfig.get_path("stdlib")
in_env = sys.prefix != sys.base_prefix
managed = not in_env and os.path.isfile(os.path.join(stdlib, "EXTERNALLY-MANAGED"))
def found(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
print("%d.%d" % sys.version_info[:2], *(int(x) for x in (
    in_env, managed, found("pip"), found("venv") and found("ensurepip"))))
EOF
}

_hora_install_python3_venv() {
  local minor=$1
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    hora_log "python3 has no venv/ensurepip module: installing python3-venv (apt-get)"
    hora_do apt-get update -qq
    hora_do env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "python3-venv" \
      "python${minor}-venv"
    return 0
  fi
  hora_die "python3 cannot make a virtual environment: its venv/ensurepip module is missing.
  On Debian or Ubuntu install it with:  sudo apt-get install python3-venv python${minor}-venv
  then run this command again. Or choose an interpreter: PYTHON=/path/to/python (used as it is),
  or activate a virtual environment or conda environment first."
}

hora_select_python() {
  local repo=${1:-.}
  if [ -n "${_HORA_PY_CHOSEN:-}" ]; then  # chosen by the script that runs this one
    HORA_PY=$_HORA_PY_CHOSEN
    return 0
  fi
  if [ -n "${PYTHON:-}" ]; then
    HORA_PY=$PYTHON
    hora_log "using PYTHON=$PYTHON as it is (no virtual environment is made)"
    return 0
  fi
  local base
  base=$(command -v python3) || hora_die "no python3 on PATH: install Python 3.10 or newer
  (Debian/Ubuntu: apt-get install python3 python3-venv)"
  local version in_env managed has_pip has_venv
  read -r version in_env managed has_pip has_venv <<<"$(_hora_probe "$base")" ||
    hora_die "$base does not run"
  [ -n "$has_venv" ] || hora_die "$base does not run"
  case $version in 3.[0-9]) hora_die "$base is Python $version; hora needs 3.10 or newer" ;; esac

  if [ -n "${VIRTUAL_ENV:-}" ] || [ -n "${CONDA_PREFIX:-}" ] || [ "$in_env" = 1 ]; then
    HORA_PY=$base
    hora_log "using the active environment's python3 ($base) as it is"
    return 0
  fi
  if [ "${HORA_NO_VENV:-0}" = 1 ]; then
    if [ "$managed" = 1 ] && [ -z "${PIP_BREAK_SYSTEM_PACKAGES:-}" ]; then
      hora_die "HORA_NO_VENV=1, but $base is externally managed (PEP 668):
  pip may not install into it. Unset HORA_NO_VENV to use the project's virtual environment,
  or set PYTHON to an interpreter you own."
    fi
    [ "$has_pip" = 1 ] || hora_die "HORA_NO_VENV=1, but $base has no pip: install pip for it
  (Debian/Ubuntu: apt-get install python3-pip), or unset HORA_NO_VENV"
    HORA_PY=$base
    hora_log "HORA_NO_VENV=1: installing into $base"
    return 0
  fi

  local venv=${HORA_VENV:-$repo/.venv}
  if [ -e "$venv" ] && [ ! -f "$venv/pyvenv.cfg" ]; then
    hora_die "$venv exists and is not a virtual environment: move it away, or set HORA_VENV"
  fi
  if [ -f "$venv/pyvenv.cfg" ]; then  # made earlier (by this script or by hand): kept as it is
    "$venv/bin/python" -c "" 2>/dev/null || hora_die "the python of $venv does not run (was
  the Python it was made from removed or upgraded?): remove it (rm -r $venv) and run this
  again, or set HORA_VENV to another folder"
    if "$venv/bin/python" -c "import pip" 2>/dev/null; then
      hora_log "using the project's virtual environment $venv (made earlier)"
    else
      hora_log "$venv has no pip: adding it ($venv/bin/python -m ensurepip)"
      "$venv/bin/python" -m ensurepip >&2 || hora_die "could not add pip to $venv: on
  Debian or Ubuntu install python3-venv (apt-get install python3-venv), or remove $venv"
    fi
  else
    if [ "$has_venv" != 1 ]; then
      _hora_install_python3_venv "$version"
      if hora_dry_run; then
        HORA_PY=$venv/bin/python
        hora_log "dry run: would make the virtual environment $venv after that"
        return 0
      fi
    fi
    local site=${HORA_VENV_SYSTEM_SITE:-}
    [ -n "$site" ] || { [ "$managed" = 1 ] && site=0 || site=1; }
    local flags=()
    [ "$site" = 1 ] && flags+=(--system-site-packages)
    hora_log "making the project's virtual environment $venv from $base" \
      "($([ "$site" = 1 ] && echo "it sees that python3's packages" || echo isolated))"
    if ! "$base" -m venv "${flags[@]}" "$venv"; then
      rm -rf "$venv"  # made just now, without pip
      _hora_install_python3_venv "$version"
      "$base" -m venv "${flags[@]}" "$venv" || hora_die "could not make $venv with $base -m venv"
    fi
  fi
  venv=$(cd "$venv" && pwd)
  HORA_PY=$venv/bin/python
  export VIRTUAL_ENV=$venv
  export PATH="$venv/bin:$PATH"
  HORA_VENV_USED=$venv
  return 0
}

# The closing note of a command that used the project's environment.
hora_venv_note() {
  [ -n "${HORA_VENV_USED:-}" ] || return 0
  hora_log "hora's virtual environment is $HORA_VENV_USED; to use it in your shell:" \
    "source $HORA_VENV_USED/bin/activate"
}
