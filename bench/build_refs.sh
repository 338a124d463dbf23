#!/usr/bin/env bash
# build_refs.sh — libraries of other commits, for gpu_session.sh ab's REF list (and the
# mok command, for ep-ab's; the GPU tests, for test-refs'): each NAME=REV builds REV's
# build/libmok.so, build/mok and build/mok_gpu_tests in a temporary git worktree (on this
# machine, where compiling costs no device time) and copies them, with REV's bench/ and python/
# as tree.tar (gpu_session.sh ab runs a build with its own binding), to build-NAME/, which
# the device tool then carries (about 9 MB a build).
#
#   bench/build_refs.sh main=main lo=leftovers-only   # -> build-main/, build-lo/
#
# NVFLAGS and other make variables pass through the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
for spec in "$@"; do
  name=${spec%%=*} rev=${spec#*=}
  [ -n "$name" ] && [ "$name" != "$spec" ] || { echo "build_refs.sh: want NAME=REV, got '$spec'" >&2; exit 2; }
  dir=$(mktemp -d /tmp/mok-ref-XXXXXX)
  git worktree add -q --detach "$dir" "$rev"
  if make -C "$dir" -j"$(nproc)" build/libmok.so build/mok build/mok_gpu_tests > "$dir.log" 2>&1; then
    mkdir -p "build-$name"
    cp "$dir/build/libmok.so" "$dir/build/mok" "$dir/build/mok_gpu_tests" "build-$name/"
    git archive "$rev" bench python > "build-$name/tree.tar"  # (its own bench and binding: gpu_session.sh ab)
    strip --strip-debug "build-$name/libmok.so" "build-$name/mok" "build-$name/mok_gpu_tests"  # (the host code's DWARF: 10% of the carry; not tree.tar, which stopped the script under set -e)
    echo "build-$name/{libmok.so,mok,mok_gpu_tests}: $(git rev-parse --short "$rev")"
    rm -f "$dir.log"
  else
    tail -20 "$dir.log" >&2
    echo "build_refs.sh: $rev did not build (log $dir.log)" >&2
  fi
  git worktree remove --force "$dir"
done
