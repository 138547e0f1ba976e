# one device call: every GPU test file on one GPU (two-GPU cases skip), after graph_loss copies
# each call's loss out of the graph and the split-backward contract change
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch,sys;print('torch',torch.__version__,'cuda',torch.version.cuda,'python',sys.version.split()[0])"; } > $R/env.txt
for f in unittests/gpu/test_*.py; do
  timeout 240 python -m pytest -q -p no:cacheprovider $f > $R/$(basename $f .py).txt 2>&1; echo "$f rc=$? $(tail -1 $R/$(basename $f .py).txt)" | tee -a $R/tests.txt
done
grep -h "FAILED\|Error" $R/test_*.txt | head -20
cat $R/env.txt
tar czf $OUT/run.tgz -C $R .
