#!/usr/bin/env bash
# One-time set-up of a fresh machine: system libraries for offscreen MuJoCo (EGL via Mesa) and
# OpenCV, the CPU build of torch first (so the project's torch range is already satisfied), then
# Lensemble with its dev extra.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=0
for lib in libEGL.so.1 libOpenGL.so.0 libGL.so.1 libglib-2.0.so.0; do
  ldconfig -p | grep -q "$lib" || need_apt=1
done
if [ "$need_apt" = 1 ] && command -v apt-get >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends libegl1 libopengl0 libgl1-mesa-dri libgl1 libglib2.0-0 >/dev/null
fi

python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
