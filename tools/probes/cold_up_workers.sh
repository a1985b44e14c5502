#!/bin/bash
# Seconds from `mfs up --model default --workers 2` with empty caches (MFS_CACHE, the inductor cache) until
# /health lists 2 workers, run from the checkout TREE with this repo's .venv; TAG names its folder under
# /tmp/cold-up-TAG (logs kept: each worker says whether it read the GGUF cached). usage: cold_up_workers.sh TREE TAG
tree=$1; tag=$2; port=$((18000 + RANDOM % 1000))
c=/tmp/cold-up-$tag; rm -rf $c; mkdir -p $c
cd $tree
t0=$(date +%s.%N)
MFS_CACHE=$c/mfs TORCHINDUCTOR_CACHE_DIR=$c/inductor "$(dirname "$(readlink -f "$0")")"/../../.venv/bin/python -m mfs.cli up --model default --workers 2 --port $port --log-dir $c/logs > $c/out 2>&1 &
pid=$!
while true; do
  n=$(curl -s http://127.0.0.1:$port/health | python3 -c "import json,sys; print(json.load(sys.stdin).get('workers',0))" 2>/dev/null)
  [ "$n" = "2" ] && break
  sleep 0.5
done
t1=$(date +%s.%N)
echo "$tag ready_s $(python3 -c "print(round($t1-$t0,1))") conversions $(grep -l 'dequantiz\|convert' $c/logs/worker-*.log 2>/dev/null | wc -l)"
kill -INT $pid; wait $pid 2>/dev/null
