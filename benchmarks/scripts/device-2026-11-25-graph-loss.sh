# one device call: the last pipeline stage's memory with the loss graphed (graph_loss) against
# eager and the default, the engine GPU tests (graph_loss parity among them), uncontended step times
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch,sys;print('torch',torch.__version__,'cuda',torch.version.cuda,'python',sys.version.split()[0])"; git rev-parse HEAD; } > $R/env.txt
for q in 512 2048; do
  timeout 400 python tools/stage_memory.py --stages 1 --variants eager,default,graphed_loss --seq-len $q --steps 8 --steady-from 3 --trace --timeout 150 --out $R/s1-seq$q.json > $R/s1-seq$q.txt 2>&1 &
done
timeout 300 python -m pytest -q -p no:cacheprovider unittests/gpu/test_engine_gpu.py > $R/test_engine_gpu.txt 2>&1; echo "engine tests rc=$? $(tail -1 $R/test_engine_gpu.txt)" | tee $R/tests.txt
wait
grep -h "^stage\|optimizer steps" $R/s1-*.txt | cut -c1-200
timeout 170 python tools/stage_memory.py --stages 1 --variants eager,default,graphed_loss,eager,default,graphed_loss --seq-len 512 --steps 12 --steady-from 4 --timeout 60 --out $R/time-s1-seq512.json > $R/time-s1-seq512.txt 2>&1
grep "^stage" $R/time-s1-seq512.txt
grep -E "passed|failed|Error" $R/test_engine_gpu.txt | tail -5
cat $R/env.txt
tar czf $OUT/run.tgz -C $R .
