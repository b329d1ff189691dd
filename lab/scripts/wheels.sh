#!/usr/bin/env bash
# Pinned wheels to the GPU machine, which has no network, in parts small enough for device calls (a
# call carries at most 64 MiB with the tree).
#
#   here:  lab/scripts/wheels.sh prepare SET PART_MB pkg==ver ...   download (no deps: list them all),
#          check, tar, split into parts of PART_MB MiB in .whl/SET/call1, call2, ... (git-ignored)
#   there: lab/scripts/wheels.sh stage SET          copy the carried .whl/SET/call* into /tmp/wheels-SET
#   there: lab/scripts/wheels.sh install SET SITE   once every part is staged: join, check the parts'
#          and the wheels' SHA-256, pip install --no-index --no-deps --target SITE, touch
#          SITE/.ready-SET (a second install of the set returns at once); exit 1 (nothing installed)
#          while a part is missing
set -euo pipefail
cd "$(dirname "$0")/../.."
cmd=${1:?usage: wheels.sh prepare|stage|install SET ...}
set_=${2:?SET}
stage=/tmp/wheels-$set_

case "$cmd" in
prepare)
  part_mb=${3:?PART_MB}; shift 3
  dl=$(mktemp -d); trap 'rm -rf "$dl"' EXIT
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$dl/w" "$@"
  (cd "$dl/w" && sha256sum -- *.whl > SHA256SUMS && tar cf "$dl/$set_.tar" -- *)
  rm -rf ".whl/$set_" && mkdir -p ".whl/$set_"
  split -b "${part_mb}M" -d -a 2 "$dl/$set_.tar" "$dl/$set_.tar.part"
  (cd "$dl" && sha256sum "$set_.tar" > "$set_.tar.sha256" && sha256sum "$set_".tar.part* > parts.sha256)
  i=0
  for p in "$dl/$set_".tar.part*; do
    i=$((i + 1)); mkdir -p ".whl/$set_/call$i"
    mv "$p" ".whl/$set_/call$i/"
    cp "$dl/$set_.tar.sha256" "$dl/parts.sha256" ".whl/$set_/call$i/"
  done
  du -sh .whl/"$set_"/call*
  ;;
stage)
  mkdir -p "$stage"; shopt -s nullglob
  for d in .whl/"$set_"/call*; do cp "$d"/* "$stage"/; done
  ls -la "$stage"
  ;;
install)
  site=${3:?SITE}
  [ -f "$site/.ready-$set_" ] && exit 0
  cd "$stage" 2>/dev/null || { echo "wheels.sh: $set_: nothing staged"; exit 1; }
  while read -r _ p; do [ -f "$p" ] || { echo "wheels.sh: $set_: $p not staged yet"; exit 1; }; done < parts.sha256
  sha256sum -c --quiet parts.sha256
  cat "$set_".tar.part* > "$set_.tar" && sha256sum -c --quiet "$set_.tar.sha256"
  rm -rf w && mkdir w && tar xf "$set_.tar" -C w && (cd w && sha256sum -c --quiet SHA256SUMS)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" w/*.whl
  touch "$site/.ready-$set_"
  echo "wheels.sh: $set_ installed into $site: $(ls w/*.whl | wc -l) wheels"
  ;;
*)
  echo "usage: wheels.sh prepare|stage|install SET ..." >&2; exit 2
  ;;
esac
