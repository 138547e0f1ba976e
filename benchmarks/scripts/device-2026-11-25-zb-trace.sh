# one device call: where the last pp=2 GPT-3 1.3B stage's memory goes under a zero-bubble order
# (allocation trace at the peak), against the same stage under 1F1B; memory only (runs side by side)
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch,sys;print('torch',torch.__version__,'cuda',torch.version.cuda,'python',sys.version.split()[0])"; } > $R/env.txt
timeout 300 python tools/stage_memory.py --stages 1 --order zb --variants eager,default --seq-len 2048 --steps 6 --steady-from 3 --trace --timeout 280 --out $R/zb-trace-s1-seq2048.json > $R/zb.txt 2>&1 &
timeout 300 python tools/stage_memory.py --stages 1 --variants default --seq-len 2048 --steps 6 --steady-from 3 --trace --timeout 280 --out $R/1f1b-trace-s1-seq2048.json > $R/1f1b.txt 2>&1 &
wait
cat $R/zb.txt $R/1f1b.txt | cut -c1-400
cat $R/env.txt
tar czf $OUT/run.tgz -C $R .
