#!/usr/bin/env bash
# Fill .whl/ (ignored) with the wheels a lent GPU machine needs beyond its image (Python 3.12,
# torch 2.11, transformers, tokenizers, msgpack, uvloop, psutil, scipy, matplotlib present; no network
# there). Pins: our venv's versions (constraints.txt for hivemind and numpy). numpy < 2.4 shadows the
# image's 2.5 (hivemind 1.1.12's 8-bit codecs break silently on numpy >= 2.4). Not carried:
# bitsandbytes (~100 MB; only bench.codecs's optional nf4 row uses it), datasets (records sources only),
# grpcio(-tools) (hivemind's build needs them, its runtime does not).
#   bench/fetch_device_wheels.sh            # then: du -sh .whl (the carried tree must stay < 64 MiB)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PKGS=(
  hivemind==1.1.12 numpy==2.3.5 multiaddr==0.2.0 base58==2.1.1 ConfigArgParse==1.9.0
  cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 protobuf==7.36.2 netaddr==1.3.0 prefetch_generator==1.0.3
  py-cid==0.5.0 py-multihash==3.0.0 py-multibase==2.0.0 py-multicodec==1.0.0 python-baseconv==1.2.2 morphys==1.0
  varint==1.0.2 blake3==1.0.11 mmh3==5.3.1 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 dnspython==2.9.2 trio==0.35.0 outcome==1.3.0.post0 sniffio==1.3.1
  trio-typing==0.10.0 async-generator==1.10 typing_extensions==4.16.0
)
mkdir -p .whl
EXCLUDE="$(git rev-parse --git-common-dir 2>/dev/null)/info/exclude" && mkdir -p "$(dirname "$EXCLUDE")" \
  && { grep -qx '/.whl/' "$EXCLUDE" 2>/dev/null || echo /.whl/ >> "$EXCLUDE"; } || true
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_35_x86_64)
#: published as source only, pure Python: built here into py3-none-any wheels
SDIST_ONLY=(prefetch_generator==1.0.3 python-baseconv==1.2.2 varint==1.0.2)
BIN=()
for p in "${PKGS[@]}"; do [[ " ${SDIST_ONLY[*]} " == *" $p "* ]] || BIN+=("$p"); done
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
    -d .whl "${BIN[@]}"
$PY -m pip wheel -q --no-deps -w .whl "${SDIST_ONLY[@]}"
# ip and tc (iproute2) of this machine, for a device image without them (bench.syncwan's emulated WAN
# needs both; bench/device_run.sh puts them on the PATH only then). x86-64 binaries linked against this
# machine's glibc (2.36 on Debian 12): the device's glibc must be as new; libc and libm are not copied.
rm -rf .whl/iproute2 && mkdir -p .whl/iproute2/bin .whl/iproute2/lib .whl/iproute2/libexec
for t in ip tc; do
  src=$(command -v $t) || { echo "no $t on this machine: .whl/iproute2 left incomplete"; continue; }
  cp "$src" .whl/iproute2/libexec/
  ldd "$src" | awk '$3 ~ /^\// {print $3}' | grep -v -E '/lib(c|m)\.so' | xargs -r cp -L -t .whl/iproute2/lib/
  printf '#!/bin/sh\nd=$(dirname "$(readlink -f "$0")")/..\nLD_LIBRARY_PATH=$d/lib exec "$d/libexec/%s" "$@"\n' $t \
    > .whl/iproute2/bin/$t
  chmod +x .whl/iproute2/bin/$t
done
ls .whl/*.whl | wc -l
du -sh .whl
