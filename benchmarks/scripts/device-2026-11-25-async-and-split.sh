# one device call: the stream-ordered allocator at the 1.3B stage shape, counting the driver's graph
# memory (torch's counters leave it out), and the one-GPU GPU tests of the split backward and engine
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch,sys;print('torch',torch.__version__,'cuda',torch.version.cuda,'python',sys.version.split()[0])"; } > $R/env.txt
for s in 0 1; do
  timeout 420 python tools/stage_memory.py --stages $s --variants eager,eager_async,async,per_graph,per_graph_async --seq-len 2048 --steps 8 --steady-from 3 --timeout 150 --out $R/async-s$s-seq2048.json > $R/async-s$s-seq2048.txt 2>&1 &
done
for f in unittests/gpu/test_zero_bubble_gpu.py unittests/gpu/test_engine_gpu.py; do
  timeout 240 python -m pytest -q -p no:cacheprovider $f > $R/$(basename $f .py).txt 2>&1; echo "$f rc=$? $(tail -1 $R/$(basename $f .py).txt)" | tee -a $R/tests.txt
done
wait
grep -h "^stage\|optimizer steps\|ERROR" $R/async-*.txt | cut -c1-300
cat $R/tests.txt $R/env.txt
tar czf $OUT/run.tgz -C $R .
