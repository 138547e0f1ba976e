# one device call: the last pp=2 GPT-3 1.3B stage under a zero-bubble order after the recorded
# step's weight passes go into .grad group by group (memory; the two commands side by side), then
# every GPU test file on one GPU (two-GPU cases skip)
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch,sys;print('torch',torch.__version__,'cuda',torch.version.cuda,'python',sys.version.split()[0])"; } > $R/env.txt
S="python tools/stage_memory.py --stages 1 --steps 8 --steady-from 3 --timeout 200"
for q in 512 2048; do
  timeout 300 $S --order zb --keep-outputs --variants eager,default,graphed_loss --seq-len $q --out $R/zb-keep-s1-seq$q.json > $R/zb-keep-s1-seq$q.txt 2>&1 &
done
wait
grep -h "^stage\|ERROR\|Error" $R/zb-keep-*.txt | cut -c1-200
for f in unittests/gpu/test_*.py; do
  timeout 240 python -m pytest -q -p no:cacheprovider $f > $R/$(basename $f .py).txt 2>&1; echo "$f rc=$? $(tail -1 $R/$(basename $f .py).txt)" | tee -a $R/tests.txt
done
grep -h "FAILED\|Error" $R/test_*.txt | head -20
cat $R/env.txt
tar czf $OUT/run.tgz -C $R .
