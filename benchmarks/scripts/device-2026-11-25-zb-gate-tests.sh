# one device call: the GPU test files the weight-pass hand-over and held-output moves touch, after
# the hand-over was limited to torch.distributed.pipelining's weight pass (one GPU; two-GPU cases skip),
# then the zero-bubble last stage's memory once more (seq 512, outputs kept as PipelineStage keeps them)
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch,sys;print('torch',torch.__version__,'cuda',torch.version.cuda,'python',sys.version.split()[0])"; } > $R/env.txt
for f in unittests/gpu/test_zero_bubble_gpu.py unittests/gpu/test_engine_gpu.py unittests/gpu/test_hf_gpu.py unittests/gpu/test_faults_gpu.py; do
  timeout 240 python -m pytest -q -p no:cacheprovider $f > $R/$(basename $f .py).txt 2>&1; echo "$f rc=$? $(tail -1 $R/$(basename $f .py).txt)" | tee -a $R/tests.txt
done
grep -h "FAILED\|Error" $R/test_*.txt | head -20
timeout 200 python tools/stage_memory.py --stages 1 --order zb --keep-outputs --variants eager,default,no_accumulate --seq-len 512 --steps 8 --steady-from 3 --timeout 60 --out $R/zb-keep-s1-seq512.json > $R/zb.txt 2>&1
grep "^stage\|ERROR" $R/zb.txt
cat $R/env.txt
tar czf $OUT/run.tgz -C $R .
