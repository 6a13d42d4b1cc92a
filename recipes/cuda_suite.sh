#!/usr/bin/env bash
# The CUDA checks and the one-GPU benchmark, in one go (for a lent GPU machine; a few minutes on an H100):
#   bash recipes/cuda_suite.sh OUT_DIR [PART...]      PART: env tests bench-small bench-gpu-fp32 bench-gpu-bf16
# Runs from the repository root without installing (PYTHONPATH); every log and table lands in OUT_DIR.
set -u
out=${1:?usage: bash recipes/cuda_suite.sh OUT_DIR [PART...]}
shift
parts=${*:-env tests bench-small bench-gpu-fp32 bench-gpu-bf16}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
engines=plain,yashard,ddp,fsdp2,fsdp1
bench() {  # name, then benchmark.py arguments
    local name=$1
    shift
    echo "== benchmark $name: $*"
    timeout 420 torchrun --nproc_per_node 1 recipes/benchmark.py --engines "$engines" --out "$out/$name.md" \
        --json "$out/$name.json" "$@" 2>&1 | grep -v "^\[W" | tail -40
}
for part in $parts; do
    case $part in
    env)
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
        python3 -c "import sys, torch, transformers, triton; print(sys.version.split()[0], torch.__version__, \
torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'transformers', transformers.__version__, 'triton', \
triton.__version__, torch.cuda.get_device_name())";;
    tests)
        timeout 300 python3 -m pytest -q -s -p no:cacheprovider tests/test_cuda.py tests/test_quant.py 2>&1 \
            | tee "$out/tests.log" | grep -v "^\[W" | tail -30;;
    bench-small) bench small_fp32 --model small --dtype fp32;;
    bench-gpu-fp32) bench gpu_fp32 --model gpu --dtype fp32;;
    bench-gpu-bf16) bench gpu_bf16 --model gpu --dtype bf16;;
    *) echo "unknown part $part"; exit 2;;
    esac
done
