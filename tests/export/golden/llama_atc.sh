#!/bin/sh
# Compile llama.onnx into an Ascend offline model, llama.om, with ATC (CANN's model compiler).
# On the Ascend machine: source /usr/local/Ascend/ascend-toolkit/set_env.sh (or your CANN install's), then run this script.
set -e
cd "$(dirname "$0")"
atc \
    --model=llama.onnx \
    --framework=5 \
    --output=llama \
    --soc_version=Ascend310P3 \
    '--input_shape=input_ids:-1,12;attention_mask:-1,12' \
    --dynamic_batch_size=1,4,8 \
    --precision_mode=force_fp16
