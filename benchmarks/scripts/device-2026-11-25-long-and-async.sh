# one device call: memory over 1000 steady steps at the 1.3B stage shape (seq 512, both pp=2
# ranks, the default with the loss graphed), and the stream-ordered allocator variants at seq 2048
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch,sys;print('torch',torch.__version__,'cuda',torch.version.cuda,'python',sys.version.split()[0])"; } > $R/env.txt
timeout 500 python tools/stage_memory.py --stages 0 --variants default --seq-len 512 --steps 1003 --steady-from 3 --timeout 480 --out $R/long-s0-seq512.json > $R/long-s0-seq512.txt 2>&1 &
timeout 500 python tools/stage_memory.py --stages 1 --variants graphed_loss --seq-len 512 --steps 1003 --steady-from 3 --timeout 480 --out $R/long-s1-seq512.json > $R/long-s1-seq512.txt 2>&1 &
for s in 0 1; do
  timeout 480 python tools/stage_memory.py --stages $s --variants eager,eager_async,async,per_graph,per_graph_async --seq-len 2048 --steps 8 --steady-from 3 --timeout 150 --out $R/async-s$s-seq2048.json > $R/async-s$s-seq2048.txt 2>&1 &
done
wait
grep -h "^stage\|optimizer steps\|ERROR" $R/*.txt | cut -c1-400
cat $R/env.txt
tar czf $OUT/run.tgz -C $R .
