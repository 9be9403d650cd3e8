#!/usr/bin/env bash
# The CUDA checks of docs/results.md section 5, on a machine with one GPU (python3 there holds PyTorch with CUDA):
#   bash benchmarks/cuda_runs.sh OUT DATA
# OUT: a folder for the results; DATA: tinyshakespeare.txt. Runs from the repository root, gradsift from src/.
# 1. tests/test_cuda.py: kernels and every compressor on the GPU against the CPU, the DDP hook over NCCL at world
#    size 1 against the CPU simulator, torchrun on the GPU with a checkpoint and a resume;
# 2. the selection bench on CUDA;
# 3. wordlm, one rank over NCCL: the step of plain DDP, PyTorch's hooks and gradsift's compressors (at world size 1
#    nothing crosses a wire: this is each method's own cost beside the GPU's forward/backward).
set -euo pipefail
out=${1:?usage: cuda_runs.sh OUT DATA}
data=${2:?usage: cuda_runs.sh OUT DATA}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 GRADSIFT_DEVICE=cuda
python3 -m pytest tests/test_cuda.py -q -s -p no:cacheprovider -W ignore::DeprecationWarning 2>&1 | tee "$out/test_cuda.log" | tail -3
python3 -m gradsift bench select --device cuda --compressors topk rtopk regtopk sidco sidco:dist=gp dgc gaussiank \
    redsync --sizes 262144 2621440 26214400 --ratios 0.01 0.001 --calls 12 --out "$out/bench" --quiet --overwrite
run() {  # name, then gradsift train options
    local name=$1; shift
    python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m gradsift train --runtime ddp --task wordlm \
        --data "$data" --steps 60 --eval-every 1000 --quiet --overwrite --out "$out/wordlm/$name" "$@" > /dev/null
    python3 - "$out/wordlm/$name/metrics.jsonl" "$name" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
steps = [r["step_s"] for r in rows[13:] if "step_s" in r]  # after the measured plan's probe steps, as the cluster bench
print(f"| {sys.argv[2]} | {1e3 * statistics.median(steps):.1f} | {1e3 * min(steps):.1f}-{1e3 * max(steps):.1f} |")
PY
}
echo "| method (wordlm, 1 rank, NCCL) | median step ms (steps 14-60) | range |"
echo "|---|---|---|"
run ddp --torch-hook ddp
run fp16 --torch-hook fp16
run powersgd-r2 --torch-hook powersgd:rank=2
run topk --compressor topk --ratio 0.01
run topk-0.1pct --compressor topk --ratio 0.001
run sidco --compressor sidco --ratio 0.01
run regtopk --compressor regtopk --ratio 0.01
run dgc --compressor dgc --ratio 0.01
run gsb --compressor gsb --ratio 0.01
