#!/bin/bash
# Seconds from `mfs up --model default --workers 2` with empty caches (MFS_CACHE, the inductor cache) until
# /health lists 2 workers, run from the checkout TREE with this repo's .venv; TAG names its folder,
# /tmp/cold-up-TAG (logs kept). Also prints how many workers converted the GGUF themselves (logged
# `"cached": false`) rather than reading another's cache. usage: cold_up_workers.sh TREE TAG
set -u
[ $# -eq 2 ] || { sed -n 2,5p "$0"; exit 2; }
tree=$1; tag=$2; port=$((18000 + RANDOM % 1000))
py="$(dirname "$(readlink -f "$0")")/../../.venv/bin/python"
c=/tmp/cold-up-$tag; rm -rf "$c"; mkdir -p "$c"
cd "$tree" || exit 2
t0=$(date +%s.%N)
MFS_CACHE=$c/mfs TORCHINDUCTOR_CACHE_DIR=$c/inductor "$py" -m mfs.cli up --model default --workers 2 \
  --port $port --log-dir "$c/logs" > "$c/out" 2>&1 &
pid=$!
until [ "$(curl -s http://127.0.0.1:$port/health | "$py" -c 'import json,sys; print(json.load(sys.stdin).get("workers", 0))' 2>/dev/null)" = 2 ]; do
  kill -0 $pid 2>/dev/null || { echo "mfs up exited; see $c/out"; exit 1; }
  [ "$("$py" -c "import time; print(int(time.time() - $t0 > 600))")" = 1 ] && { echo "not ready in 600 s"; kill -INT $pid; exit 1; }
  sleep 0.5
done
t1=$(date +%s.%N)
echo "$tag ready_s $("$py" -c "print(round($t1 - $t0, 1))") converted_by $(grep -h '"cached": false' "$c"/logs/worker-*.log | wc -l) of 2 workers"
kill -INT $pid; wait $pid 2>/dev/null
