#!/bin/sh
# Compile cnn.onnx into an Ascend offline model, cnn.om, with ATC (CANN's model compiler).
# On the Ascend machine: source /usr/local/Ascend/ascend-toolkit/set_env.sh (or your CANN install's), then run this script.
set -e
cd "$(dirname "$0")"
atc \
    --model=cnn.onnx \
    --framework=5 \
    --output=cnn \
    --soc_version=Ascend910B1 \
    --input_shape=input:-1,3,16,16 \
    --dynamic_batch_size=1,2,4,8 \
    --precision_mode=allow_fp32_to_fp16
