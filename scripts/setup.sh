#!/usr/bin/env bash
# Install what parwatch needs on a fresh machine.
#   scripts/setup.sh          the package (torch CPU build first where there is no GPU)
#   scripts/setup.sh test     + test extras, Prometheus, promtool, Alertmanager, VictoriaMetrics, vmalert, helm, Slurm
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install --quiet torch
  else
    # A CPU build that is already on disk here; an open `torch` requirement would pull
    # a multi-GB CUDA build.
    "$PY" -m pip install --quiet torch==2.13.0
  fi
fi

if [ "${1:-}" = "test" ]; then
  # Schemathesis (tests/integration/test_schemathesis.py) in a venv of its own: its pins clash with ours.
  # Made beside the steps below (11 s from a fresh clone, most of it waiting on PyPI), waited for at the end.
  mkdir -p .tools
  schemathesis_venv() {
    if [ ! -x .tools/schemathesis/bin/python ] || ! .tools/schemathesis/bin/python -c "import schemathesis" 2>/dev/null; then
      "$PY" -m venv .tools/schemathesis && .tools/schemathesis/bin/python -m pip install --quiet "schemathesis==4.32.5"
    fi
  }
  schemathesis_venv > .tools/schemathesis.log 2>&1 &
  schemathesis_pid=$!
  "$PY" -m pip install --quiet -e '.[test]'
  # DeepSpeed's CPU comm op, built once into .tools/torch_extensions (the tests' TORCH_EXTENSIONS_DIR),
  # not by the first DeepSpeed test (tests/deepspeed_op.py): 27-29 s from a fresh clone, 44 s of CPU,
  # setup's longest step. It runs in the background while the steps below and the lint that follows
  # run; a DeepSpeed start meanwhile waits on the build's lock, then loads what it built. In a session
  # of its own (setsid), so neither a failing step here nor a Ctrl-C kills it midway: a build killed
  # midway leaves the lock every later start waits on (tests/conftest.py names one older than a build).
  setsid "$PY" -m tests.deepspeed_op > .tools/deepspeed_op.log 2>&1 < /dev/null &
  echo "DeepSpeed's CPU comm op: building in the background (log: .tools/deepspeed_op.log)"
  # victoria-metrics brings victoria-metrics and vmalert: the agent -> VictoriaMetrics path
  # (tests/integration/test_victoriametrics.py). Its packaged service is not used.
  if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus-alertmanager >/dev/null 2>&1 \
     || ! command -v victoria-metrics >/dev/null 2>&1 || ! command -v vmalert >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq prometheus prometheus-alertmanager \
      victoria-metrics >/dev/null
  fi
  bash scripts/install_helm.sh .tools/bin
  # --- Slurm (tests/integration/test_slurm.py starts its own slurmctld + slurmd with scripts/slurm_local.sh) ---
  bash scripts/slurm_local.sh install
  # --- end Slurm ---
  if ! wait "$schemathesis_pid"; then
    cat .tools/schemathesis.log >&2
    echo "setup: the schemathesis venv (.tools/schemathesis) failed; its log is above" >&2
    exit 1
  fi
else
  "$PY" -m pip install --quiet -e .
fi
# Bytecode for the package, as a regular (not editable) install writes it: every rank, sidecar and CLI
# process would otherwise compile the modules it imports, where PYTHONDONTWRITEBYTECODE is set.
"$PY" -m compileall -q parwatch trainer >/dev/null
