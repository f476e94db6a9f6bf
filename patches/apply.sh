#!/usr/bin/env bash
# Add LoCo to a Megatron-LM checkout's pretrain_gpt.py (the --loco-* flags and the install call).
#
#   bash patches/apply.sh CHECKOUT [--check] [--tag TAG]
#
# Picks patches/<TAG>.patch for the checkout's release tag: `git describe --tags --exact-match`
# in the checkout, else the version in megatron/core/package_info.py (core_vX.Y.Z); --tag
# overrides both. Without a patch for that tag it tries the patches newest first and takes the
# first that applies cleanly (saying which). --check only runs `git apply --check`.
# Afterwards run the checkout's pretrain_gpt.py as usual, with loco-megatron installed in the
# same Python environment, and add --loco-bits 4.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
usage="usage: bash patches/apply.sh CHECKOUT [--check] [--tag TAG]"
checkout="" check=0 tag=""
while [ $# -gt 0 ]; do
  case "$1" in
    --check) check=1 ;;
    --tag) tag=${2:?--tag needs a value, e.g. core_v0.19.0}; shift ;;
    --tag=*) tag=${1#--tag=} ;;
    -h|--help) echo "$usage"; exit 0 ;;
    -*) echo "apply.sh: unknown option $1; $usage" >&2; exit 2 ;;
    *) checkout=$1 ;;
  esac
  shift
done
[ -n "$checkout" ] || { echo "apply.sh: no CHECKOUT given; $usage" >&2; exit 2; }
[ -f "$checkout/pretrain_gpt.py" ] || {
  echo "apply.sh: $checkout/pretrain_gpt.py not found: CHECKOUT must be the root of a Megatron-LM clone" >&2
  exit 2; }

if [ -z "$tag" ]; then
  tag=$(git -C "$checkout" describe --tags --exact-match 2>/dev/null || true)
fi
if [ -z "$tag" ] && [ -f "$checkout/megatron/core/package_info.py" ]; then
  tag=$(cd "$checkout/megatron/core" && python3 -c \
    'import package_info as p; print(f"core_v{p.MAJOR}.{p.MINOR}.{p.PATCH}")' 2>/dev/null || true)
fi

apply() {  # apply PATCH [--check], from inside the checkout: never relative to an enclosing
  # repository (git apply there would silently skip the file), GIT_CEILING_DIRECTORIES stops the
  # search above the checkout; a checkout that is a repository itself is still used as one.
  (cd "$checkout" && GIT_CEILING_DIRECTORIES="$(dirname "$(pwd -P)")" git apply "$@")
}
patched() { grep -q "loco_megatron.enable_megatron_lm()" "$checkout/pretrain_gpt.py"; }
if patched; then
  echo "apply.sh: $checkout/pretrain_gpt.py is already patched (it calls loco_megatron.enable_megatron_lm()); nothing to do" >&2
  exit 0
fi
patch=""
if [ -n "$tag" ] && [ -f "$here/$tag.patch" ]; then
  patch="$here/$tag.patch"
else
  echo "apply.sh: no patch for tag '${tag:-unknown}'; trying the others, newest first" >&2
  for p in $(ls "$here"/*.patch | sort -V -r); do
    if apply --check "$p" 2>/dev/null; then patch=$p; break; fi
  done
  [ -n "$patch" ] || {
    echo "apply.sh: no patch in $here applies to $checkout (tag '${tag:-unknown}'); supported tags:" \
      "$(cd "$here" && ls *.patch | sed 's/\.patch$//' | tr '\n' ' ')" >&2
    exit 1; }
fi

if [ "$check" = 1 ]; then
  apply --check "$patch"
  echo "apply.sh: $(basename "$patch") applies cleanly to $checkout"
else
  apply "$patch"
  patched || { echo "apply.sh: git apply reported success but $checkout/pretrain_gpt.py is unchanged" >&2; exit 1; }
  echo "apply.sh: applied $(basename "$patch") to $checkout/pretrain_gpt.py"
fi
