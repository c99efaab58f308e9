#!/bin/sh
# Regenerates the container image's lock files from pyproject.toml, with hashes, for the image's
# platform (CPython 3.11, x86_64 glibc). Run from the repository root; needs uv (pip install uv).
#   deploy/image/lock.sh
# torch comes from PyTorch's CPU index. Where that index cannot be reached, point TORCH_SOURCE at
# a folder holding the same wheel, e.g. TORCH_SOURCE="--find-links /path/to/wheels".
set -eu
UV=${UV:-uv}
TORCH_SOURCE=${TORCH_SOURCE:-"--extra-index-url https://download.pytorch.org/whl/cpu"}
here=deploy/image
# TORCH_SOURCE and common are lists of options, split on purpose where they are used
common="--generate-hashes --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
  --no-config --index-url https://pypi.org/simple --custom-compile-command $here/lock.sh"
# shellcheck disable=SC2086
"$UV" pip compile pyproject.toml "$here/build.in" --extra k8s \
  --override "$here/overrides.txt" $TORCH_SOURCE --index-strategy unsafe-best-match \
  $common -o "$here/requirements.lock"
# shellcheck disable=SC2086
"$UV" pip compile "$here/model.in" --no-deps $common -o "$here/model.lock"
