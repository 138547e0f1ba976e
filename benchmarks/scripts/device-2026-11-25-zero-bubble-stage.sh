# one device call: the zero-bubble GPU tests, then the last pp=2 GPT-3 1.3B stage under a zero-bubble order (each backward split
# into an input pass and a weight pass one slot later), eager against graphed, memory and speed
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch,sys;print('torch',torch.__version__,'cuda',torch.version.cuda,'python',sys.version.split()[0])"; } > $R/env.txt
timeout 200 python -m pytest -q -p no:cacheprovider unittests/gpu/test_zero_bubble_gpu.py > $R/test_zero_bubble_gpu.txt 2>&1; echo "zero-bubble GPU tests rc=$? $(tail -1 $R/test_zero_bubble_gpu.txt)" | tee $R/tests.txt
for q in 512 2048; do
  timeout 400 python tools/stage_memory.py --stages 1 --order zb --variants eager,default,graphed_loss,no_accumulate --seq-len $q --steps 8 --steady-from 3 --timeout 150 --out $R/zb-s1-seq$q.json > $R/zb-s1-seq$q.txt 2>&1 &
done
wait
grep -h "^stage\|ERROR" $R/zb-*.txt | cut -c1-200
timeout 170 python tools/stage_memory.py --stages 1 --order zb --variants eager,graphed_loss,eager,graphed_loss --seq-len 512 --steps 12 --steady-from 4 --timeout 60 --out $R/time-zb-s1-seq512.json > $R/time-zb-s1-seq512.txt 2>&1
grep "^stage\|ERROR" $R/time-zb-s1-seq512.txt
cat $R/env.txt
tar czf $OUT/run.tgz -C $R .
