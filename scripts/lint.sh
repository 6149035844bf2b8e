#!/usr/bin/env bash
# The static half of the README's test command: layering (import-linter), lint and format (ruff), types (mypy).
set -euo pipefail
cd "$(dirname "$0")/.."
lint-imports --no-cache
ruff check .
ruff format --check .
mypy
