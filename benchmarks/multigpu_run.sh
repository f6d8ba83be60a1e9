#!/usr/bin/env bash
# Multi-GPU run (issue 9), on an nvidia-h200-x2 or larger device machine:
#   run(command="bash benchmarks/multigpu_run.sh", carry=[".whl"], kind="nvidia-h200-x2")
# The demo training job (FSDP2 over NCCL, process group "cpu:gloo,cuda:nccl") at the reference
# model size on 1..N GPUs, saving with nvdcp and with stock FileSystemWriter (--compare-stock),
# then a resharded resume of the N-GPU checkpoint on N/2 GPUs, and an async_save run on N GPUs.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=4 PYTHONWARNINGS=ignore
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
MODEL="--d-model 768 --layers 12 --heads 12 --context 512 --global-batch 32"
STEPS=${STEPS:-20}
run() { python3 -m torch.distributed.run --standalone --nproc-per-node "$@" 2>&1 | grep -v "^\*\|OMP_NUM\|Warn"; }
n=1
while [ "$n" -le "$NGPU" ]; do
  echo "== $n GPU(s): train $STEPS steps, save every 10 (nvdcp vs stock)"
  run "$n" -m nvdcp.demo.train --ckpt-root /tmp/mg_$n --steps "$STEPS" --save-every 10 $MODEL \
      --compare-stock --digest-log "$OUT/mg_$n.jsonl"
  n=$((n * 2))
done
half=$(( NGPU > 1 ? NGPU / 2 : 1 ))
echo "== resharded resume: the $NGPU-GPU checkpoint on $half GPU(s)"
run "$half" -m nvdcp.demo.train --ckpt-root /tmp/mg_$NGPU --steps $((STEPS + 10)) --save-every 10 $MODEL \
    --digest-log "$OUT/mg_$NGPU.jsonl"
echo "== async_save on $NGPU GPU(s)"
run "$NGPU" -m nvdcp.demo.train --ckpt-root /tmp/mg_async --steps "$STEPS" --save-every 10 $MODEL --async-save \
    --digest-log "$OUT/mg_async.jsonl"
python3 -m benchmarks.multigpu_summary "$OUT" | tee "$OUT/multigpu_summary.txt"
